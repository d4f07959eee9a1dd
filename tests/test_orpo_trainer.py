"""ORPOTrainer (``trl.experimental.orpo``): TRL's numbers step for step, its tokenisation, checks and messages."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import trl.experimental.orpo as trl_orpo
from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

from tests import tiny
from tests.helpers.data import PREFERENCES, message
from tests.helpers.logs import logged
from tests.helpers.tokenizers import CHAT_TEMPLATE
from torchlike.trl.experimental.orpo import ORPOConfig, ORPOTrainer
from torchlike.trl.experimental.pairwise_data import prepare_pairwise_examples

METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio",
           "log_odds_chosen")


# Each layout TRL accepts; "the quick bro" + "wn" merges across the prompt boundary; long responses are cut.
FORMATS = {
    "standard, explicit prompt": [{"prompt": "the quick brown", "chosen": " fox jumps</s>", "rejected": " dog"},
                                  {"prompt": "the quick bro", "chosen": "wn fox", "rejected": " dog"},
                                  {"prompt": "one two", "chosen": " three four five six seven eight nine ten",
                                   "rejected": " four five"}],
    "standard, implicit prompt": [{"chosen": "the quick brown fox jumps", "rejected": "the quick brown dog"},
                                  {"chosen": "one two three", "rejected": "one two four five"}],
    "conversational, explicit prompt": [{"prompt": [message("user", "the quick brown")],
                                         "chosen": [message("assistant", "fox")],
                                         "rejected": [message("assistant", "dog")]}],
    "conversational, implicit prompt": [{"chosen": [message("user", "one two"), message("assistant", "three")],
                                         "rejected": [message("user", "one two"), message("assistant", "four")]}],
}


def comparison_settings(**overrides) -> dict:
    """Both trainers' settings: gradient accumulation, max_length=12 (several responses are cut), a warmup, weight
    decay and clipping (max_grad_norm below every step's norm); float32 on both sides (bf16 off)."""
    values = dict(max_length=12, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                  learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.05, adam_epsilon=1e-4,
                  logging_steps=1, seed=0, bf16=False, beta=0.2, report_to="none", save_strategy="no",
                  per_device_eval_batch_size=4)
    return {**values, **overrides}


def tokenizer_with_pad(tokenizer_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = "<pad>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_orpo_losses_metrics_evaluation_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir,
                                                                             tmp_path):
    path = tiny_checkpoints.path("qwen2")
    settings = comparison_settings()
    eval_data = PREFERENCES[1:7]  # a partial last batch: TRL's is shorter, torchlike's is padded with empty pairs
    tiny.assert_pairwise_trainer_matches_trl((trl_orpo.ORPOTrainer, trl_orpo.ORPOConfig), (ORPOTrainer, ORPOConfig),
                                             path, tokenizer_dir, tmp_path, PREFERENCES, settings, eval_data, METRICS)


def test_a_moe_model_that_outputs_router_logits_adds_its_router_loss_as_trl(tiny_checkpoints, tokenizer_dir,
                                                                             tmp_path):
    import json
    import shutil

    # These trainers add the router loss when the model config sets output_router_logits (their only switch).
    path = tmp_path / "moe"
    shutil.copytree(tiny_checkpoints.path("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "output_router_logits": True,
                                                  "router_aux_loss_coef": 0.5}))
    settings = comparison_settings()
    theirs, their_params, _ = tiny.run_trl_pairwise(trl_orpo.ORPOTrainer, trl_orpo.ORPOConfig, path, tokenizer_dir,
                                                    tmp_path / "trl", PREFERENCES, settings)
    ours, params, _ = tiny.run_torchlike_pairwise(ORPOTrainer, ORPOConfig, path, tokenizer_dir, tmp_path / "ours",
                                                  PREFERENCES, settings)
    tiny.compare_pairwise_logs(ours, theirs, METRICS, settings["max_grad_norm"])
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_preference_format_is_tokenised_as_trl_tokenize_row(tokenizer_dir, name):
    from accelerate import PartialState

    PartialState()  # TRL's tokenize_row logs through accelerate, which its trainer has set up by then
    tokenizer = tokenizer_with_pad(tokenizer_dir)
    # TRL's own preparation: its map steps, then tokenize_row, which reads only these trainer attributes.
    max_length = 32 if name.startswith("conversational") else 12  # the rendered prompts alone have 20 tokens
    trainer = types.SimpleNamespace(processing_class=tokenizer, is_encoder_decoder=False, max_length=max_length)
    trainer.build_tokenized_answer = functools.partial(trl_orpo.ORPOTrainer.build_tokenized_answer, trainer)
    theirs = [trl_orpo.ORPOTrainer.tokenize_row(trainer, maybe_apply_chat_template(maybe_extract_prompt(row),
                                                                                    tokenizer))
              for row in FORMATS[name]]
    ours = prepare_pairwise_examples(FORMATS[name], tokenizer, max_length=max_length)
    assert all(example["chosen_ids"] and example["rejected_ids"] for example in ours)
    for mine, row in zip(ours, theirs, strict=True):
        assert mine["prompt_ids"] == row["prompt_input_ids"]
        for key in ("chosen", "rejected"):
            assert mine[f"{key}_prompt_ids"] + mine[f"{key}_ids"] == row[f"{key}_input_ids"]
            assert row[f"{key}_labels"].count(-100) == len(mine[f"{key}_prompt_ids"])


def trl_error(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_missing_train_dataset_is_trls_error(tiny_checkpoints, tmp_path):
    import transformers

    path = tiny_checkpoints.path("qwen2")
    theirs = trl_error(lambda: trl_orpo.ORPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path), train_dataset=None,
        args=trl_orpo.ORPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")))
    ours = trl_error(lambda: ORPOTrainer(model=str(path), train_dataset=None,
                                         args=ORPOConfig(output_dir=str(tmp_path), report_to="none")))
    assert ours == theirs == "`train_dataset` is required"


def test_model_init_kwargs_with_a_loaded_model_is_trls_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    import transformers

    import torchlike

    path = tiny_checkpoints.path("qwen2")
    theirs = trl_error(lambda: trl_orpo.ORPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path), train_dataset=PREFERENCES,
        args=trl_orpo.ORPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 model_init_kwargs={"dtype": "float32"})))
    ours = trl_error(lambda: ORPOTrainer(
        model=torchlike.AutoModelForCausalLM.from_pretrained(path), train_dataset=PREFERENCES,
        args=ORPOConfig(output_dir=str(tmp_path), report_to="none", model_init_kwargs={"dtype": "float32"})))
    assert ours == theirs


def test_unset_max_length_means_512_with_trls_warning(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.warns(UserWarning, match="`max_length` is not set in the ORPOConfig's init it will default to `512`"):
        trainer = ORPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES[:4],
                              processing_class=tokenizer_with_pad(tokenizer_dir),
                              args=ORPOConfig(output_dir=str(tmp_path), report_to="none", max_length=None))
    assert trainer.max_length == 512


def test_model_init_is_refused_by_name(tiny_checkpoints, tmp_path):
    with pytest.raises(NotImplementedError, match="model_init"):
        ORPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES, model_init=lambda: None,
                    args=ORPOConfig(output_dir=str(tmp_path), report_to="none"))


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_compute_metrics_gets_what_trls_prediction_step_gives(name, tiny_checkpoints, tokenizer_dir, tmp_path):
    """TRL's ORPO and CPO hand ``compute_metrics`` each eval batch's ``[logits/chosen, logits/rejected]`` as the
    "logits" (the two values of a short last batch of one example cut to one) and zeros as labels, after
    ``preprocess_logits_for_metrics``."""
    import datasets
    import torch
    import transformers
    import trl.experimental.cpo as trl_cpo
    import trl.experimental.orpo as trl_orpo

    from torchlike.trl.experimental.cpo import CPOConfig, CPOTrainer

    classes = {"orpo": ((trl_orpo.ORPOTrainer, trl_orpo.ORPOConfig), (ORPOTrainer, ORPOConfig)),
               "cpo": ((trl_cpo.CPOTrainer, trl_cpo.CPOConfig), (CPOTrainer, CPOConfig))}[name]
    data = PREFERENCES[:5]  # batches of 2: the last holds one example
    seen = {}

    def recorder(side):
        def compute_metrics(prediction):
            seen[side] = (np.asarray(prediction.predictions), np.asarray(prediction.label_ids))
            return {"chosen_minus_rejected": float(np.sum(prediction.predictions[::2]))}

        return compute_metrics

    settings = dict(report_to="none", max_length=12, per_device_eval_batch_size=2, bf16=False)
    path = tiny_checkpoints.path("qwen2")
    (trl_trainer, trl_config), (our_trainer, our_config) = classes
    theirs = trl_trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                         args=trl_config(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
                         train_dataset=datasets.Dataset.from_list(data),
                         eval_dataset=datasets.Dataset.from_list(data),
                         processing_class=tokenizer_with_pad(tokenizer_dir), compute_metrics=recorder("theirs"),
                         preprocess_logits_for_metrics=lambda logits, labels: logits * 2)
    ours = our_trainer(model=str(path), args=our_config(output_dir=str(tmp_path / "ours"), **settings),
                       train_dataset=data, eval_dataset=data, processing_class=tokenizer_with_pad(tokenizer_dir),
                       compute_metrics=recorder("ours"),
                       preprocess_logits_for_metrics=lambda logits, labels: logits * 2)
    expected, found = theirs.evaluate(), ours.evaluate()
    assert seen["ours"][0].shape == seen["theirs"][0].shape == (5,)
    np.testing.assert_allclose(seen["ours"][0], seen["theirs"][0], rtol=1e-4)
    np.testing.assert_array_equal(seen["ours"][1], seen["theirs"][1])
    np.testing.assert_allclose(found["eval_chosen_minus_rejected"], expected["eval_chosen_minus_rejected"], rtol=1e-4)


def test_peft_config_trains_only_the_new_adapter_and_evaluate_scores_new_data(tiny_checkpoints, tokenizer_dir,
                                                                               tmp_path):
    from torchlike.peft import LoraConfig

    trainer = ORPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES,
                          processing_class=tokenizer_with_pad(tokenizer_dir),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                          args=ORPOConfig(output_dir=str(tmp_path), report_to="none", max_length=12, max_steps=6,
                                          per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1))
    before = {key: np.asarray(value) for key, value in trainer.model.state_dict().items()}
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert losses[-1] < losses[0]
    changed = {key for key, value in trainer.model.state_dict().items()
               if not np.array_equal(np.asarray(value), before[key])}
    assert changed and all("_lora_" in key for key in changed)
    metrics = trainer.evaluate(PREFERENCES[:4])  # raw data passed to evaluate() is tokenised as the training data
    assert {"eval_loss", "eval_nll_loss", "eval_log_odds_ratio", "eval_rewards/margins"} <= set(metrics)
