"""RewardTrainer end to end: TRL's numbers step for step (a margin column with reward centring, conversational
data), TRL's data preparation, a LoRA SEQ_CLS adapter that trains the score head, the config's defaults, and the
inputs TRL refuses."""

from __future__ import annotations

import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import trl
from safetensors.numpy import load_file

import torchlike
from tests import tiny
from tests.helpers.data import message
from tests.helpers.models import hf_classifier, with_config
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for
from torchlike.adapters.losses import reward as reward_loss
from torchlike.peft import LoraConfig
from torchlike.trl import RewardConfig, RewardTrainer
from torchlike.trl.data.reward_data import collate_reward_batch, prepare_reward_examples

# The last pair is longer than max_length=24: both trainers drop it.
STANDARD = [
    {"prompt": "the quick brown", "chosen": " fox jumps over the lazy dog", "rejected": " dog", "margin": 0.5},
    {"prompt": "one two", "chosen": " three four five", "rejected": " hello world, this is a tiny", "margin": 0.0},
    {"prompt": "hello world, this is", "chosen": " a tiny tokenizer", "rejected": " one two three", "margin": 1.0},
    {"prompt": "seven eight", "chosen": " nine ten", "rejected": " the lazy fox", "margin": 0.25},
    {"prompt": "one", "chosen": " two three four five six", "rejected": " seven", "margin": 2.0},
    {"prompt": "the lazy", "chosen": " dog", "rejected": " fox jumps over the quick brown dog", "margin": 0.0},
    {"prompt": "this is", "chosen": " a tiny world", "rejected": " a lazy world", "margin": 0.75},
    {"prompt": "three four", "chosen": " five six seven", "rejected": " eight nine ten</s>", "margin": 1.5},
    {"prompt": "one two three four five six seven eight nine ten one two three four five six seven eight",
     "chosen": " nine ten", "rejected": " one", "margin": 0.0},
]


CONVERSATIONAL = [
    {"prompt": [message("user", "the quick brown")], "chosen": [message("assistant", "fox jumps")],
     "rejected": [message("assistant", "dog")]},
    {"prompt": [message("user", "one two")], "chosen": [message("assistant", "three four five")],
     "rejected": [message("assistant", "hello world")]},
    {"prompt": [message("user", "seven eight")], "chosen": [message("assistant", "nine ten")],
     "rejected": [message("assistant", "the lazy fox")]},
    {"prompt": [message("user", "this is")], "chosen": [message("assistant", "a tiny world")],
     "rejected": [message("assistant", "one")]},
] * 2
IMPLICIT = [{"chosen": "the quick brown fox", "rejected": "the quick brown dog</s>"},
            {"chosen": "one two three", "rejected": "one two four five six seven eight nine ten"}]
CONVERSATIONAL_IMPLICIT = [{"chosen": [message("user", "seven eight"), message("assistant", "nine ten")],
                            "rejected": [message("user", "seven eight"), message("assistant", "the lazy fox")]}]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A saved transformers Qwen2ForSequenceClassification with one label: the same initial weights for both."""
    folder = tmp_path_factory.mktemp("qwen2-reward")
    hf_classifier("qwen2", num_labels=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reward_model_dirs(reward_model_dir, tmp_path_factory):
    """The classifiers the comparison with TRL trains, by family: :func:`reward_model_dir`'s Qwen2 and a transformers
    Qwen3MoeForSequenceClassification (one label) whose config asks for its router loss (``output_router_logits``,
    ``router_aux_loss_coef`` 0.5, the switch of the TRL trainers that add it)."""
    folder = tmp_path_factory.mktemp("qwen3-moe-reward")
    hf_classifier("qwen3_moe", num_labels=1).save_pretrained(folder / "classifier")
    moe = with_config(folder / "classifier", folder / "with-router-logits", output_router_logits=True,
                      router_aux_loss_coef=0.5)
    return {"qwen2": reward_model_dir, "qwen3_moe": moe}


def comparison_settings(**overrides) -> dict:
    """Settings both trainers get: gradient accumulation, a warmup, weight decay and clipping (max_grad_norm below
    every step's norm) are part of what is compared; max_length=24 drops one pair of STANDARD.

    bf16 off: TRL's bf16 is torch autocast (matmuls in bf16, weights and the rest in float32) while torchlike casts the
    weights to bf16 for the step; both are valid mixed precision, but their roundings differ at bf16 precision, far
    above the tolerance compared here, so the comparison is in float32 on both sides (gradient checkpointing stays on,
    its default). Adam's epsilon lies above float noise, so entries whose gradient is ~0 do not take lr-sized steps of
    either sign.
    """
    values = dict(max_length=24, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=10,
                  learning_rate=3e-3, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.02, adam_epsilon=1e-4,
                  logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")
    return {**values, **overrides}


def run_trl(path, tokenizer, data, output_dir, settings):
    """``trl.RewardTrainer`` on ``data`` in order: its log history and final parameters as saved (HF names)."""
    import datasets
    from torch.utils.data import SequentialSampler

    trainer = trl.RewardTrainer(model=str(path), args=trl.RewardConfig(output_dir=str(output_dir), use_cpu=True,
                                                                       **settings),
                                train_dataset=datasets.Dataset.from_list(data), processing_class=tokenizer)
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    return trainer.state.log_history, tiny.saved_hf_params(trainer.model, output_dir / "model")


def run_torchlike(path, tokenizer, data, output_dir, settings):
    """torchlike's RewardTrainer on ``data`` in order: its log history and final parameters as exported."""
    trainer = RewardTrainer(model=str(path), args=RewardConfig(output_dir=str(output_dir),
                                                               train_sampling_strategy="sequential", **settings),
                            train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


#: Each case: its data, whether it is conversational, its settings over comparison_settings, the classifier's family.
COMPARISON_CASES = {
    "standard, margin column, centred rewards": (STANDARD, False, dict(center_rewards_coefficient=0.01), "qwen2"),
    "conversational": (CONVERSATIONAL, True, {}, "qwen2"),
    # TRL's RewardTrainer loss reads the scores alone: it never adds a mixture-of-experts model's router loss, even
    # when the model config asks for it, and neither does torchlike.
    "Qwen3-MoE asking for its router loss, which TRL does not add": (STANDARD, False, dict(max_steps=4),
                                                                     "qwen3_moe"),
}
COMPARED_METRICS = ("loss", "grad_norm", "learning_rate", "min_reward", "mean_reward", "max_reward", "margin")


def compare_with_trl(reward_model_dirs, tokenizer_dir, tmp_path, case) -> tuple[dict, dict, dict, dict]:
    data, chat, overrides, family = COMPARISON_CASES[case]
    settings = comparison_settings(**overrides)
    path, chat_template = reward_model_dirs[family], CHAT_TEMPLATE if chat else None
    expected_history, expected_params = run_trl(path, tokenizer_for(tokenizer_dir, chat_template), data,
                                                tmp_path / "trl", settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*preference pairs were dropped")
        history, params = run_torchlike(path, tokenizer_for(tokenizer_dir, chat_template), data, tmp_path / "ours",
                                        settings)
    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}
    return ours, expected, params, expected_params


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_reward_losses_metrics_and_weights_match_trl_step_for_step(reward_model_dirs, tokenizer_dir, tmp_path,
                                                                   case):
    ours, expected, params, expected_params = compare_with_trl(reward_model_dirs, tokenizer_dir, tmp_path, case)

    steps = comparison_settings(**COMPARISON_CASES[case][2])["max_steps"]
    assert list(ours) == list(expected) == list(range(1, steps + 1))
    assert all(set(ours[step]) == set(expected[step]) for step in ours)  # the same metrics, logged the same steps
    assert all(entry["grad_norm"] > 0.02 for entry in expected.values())  # clipping is on (max_grad_norm=0.02)
    for key in COMPARED_METRICS:
        np.testing.assert_allclose([ours[step][key] for step in ours], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    assert [ours[step]["accuracy"] for step in ours] == [expected[step]["accuracy"] for step in expected]
    assert [entry["num_tokens"] for entry in ours.values()] == [entry["num_tokens"] for entry in expected.values()]
    assert set(params) == set(expected_params)
    # atol for entries near 0 (the float noise of a run is ~1e-6 there); weight decay alone moves entries by ~1e-4.
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


@pytest.mark.parametrize(("data", "chat"), [(STANDARD, False), (IMPLICIT, False), (CONVERSATIONAL, True),
                                             (CONVERSATIONAL_IMPLICIT, True)],
                         ids=["standard, margin", "standard, implicit prompt", "conversational",
                              "conversational, implicit prompt"])
def test_preference_data_is_tokenised_and_filtered_as_trl_does(tokenizer_dir, tmp_path, data, chat):
    import datasets

    tokenizer = tokenizer_for(tokenizer_dir, CHAT_TEMPLATE if chat else None)
    args = trl.RewardConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_length=24)
    # TRL's own preparation; it reads nothing from the trainer.
    theirs = trl.RewardTrainer._prepare_dataset(types.SimpleNamespace(), datasets.Dataset.from_list(data), tokenizer,
                                                args, "train")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*preference pairs were dropped")
        ours = prepare_reward_examples(data, tokenizer, max_length=24)
    columns = [key for key in ("chosen_ids", "rejected_ids", "margin") if key in theirs.column_names]
    assert ours == [{key: row[key] for key in columns} for row in theirs]
    assert prepare_reward_examples(ours, tokenizer, max_length=24) == ours  # prepared pairs pass through


def test_the_collator_pads_every_pair_to_one_length_with_the_margin(tokenizer_dir):
    examples = [{"chosen_ids": [5, 6, 7], "rejected_ids": [8], "margin": 0.5},
                {"chosen_ids": [9], "rejected_ids": [10, 11], "margin": 0.0}]
    batch = collate_reward_batch(examples, pad_token_id=2, length=4)
    assert batch["chosen_input_ids"].tolist() == [[5, 6, 7, 2], [9, 2, 2, 2]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert batch["margin"].tolist() == [0.5, 0.0]


def test_rows_padding_a_partial_batch_leave_the_loss_and_metrics_unchanged(reward_model_dir, tokenizer_dir):
    model = torchlike.AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype="float32")
    examples = prepare_reward_examples(STANDARD[:3], tokenizer_for(tokenizer_dir), max_length=None)
    settings = reward_loss.RewardLossSettings(center_rewards_coefficient=0.01)
    loss = reward_loss.reward_step_loss(model.scores_function, settings)
    exact = collate_reward_batch(examples, 2, 16)
    padded = {key: np.concatenate([value, np.zeros_like(value)]) for key, value in exact.items()}  # as the Trainer
    value, weight, metrics = loss(model.module, {key: jnp.asarray(v) for key, v in exact.items()})
    padded_value, padded_weight, padded_metrics = loss(model.module, {key: jnp.asarray(v) for key, v in padded.items()})
    np.testing.assert_allclose(float(padded_value), float(value), rtol=1e-6)
    assert float(weight) == float(padded_weight) == 1.0
    for key in metrics:
        np.testing.assert_allclose(float(padded_metrics[key]), float(metrics[key]), rtol=1e-6, err_msg=key)


def test_lora_seq_cls_trains_the_adapter_and_the_score_head_only(reward_model_dir, tokenizer_dir, tmp_path):
    trainer = RewardTrainer(model=str(reward_model_dir),
                            args=RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                              learning_rate=1e-2, logging_steps=1, report_to="none",
                                              save_strategy="no"),
                            train_dataset=STANDARD[:8], eval_dataset=STANDARD[:4],
                            processing_class=tokenizer_for(tokenizer_dir),
                            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   task_type="SEQ_CLS"))
    model = trainer.model
    assert model.modules_to_save == ["score"]
    before = {key: np.asarray(value) for key, value in model.state_dict().items()}
    trainer.train()
    changed = {key for key, value in model.state_dict().items() if not np.array_equal(np.asarray(value), before[key])}
    assert "score.kernel" in changed and any("_lora_" in key for key in changed)
    assert changed <= {key for key in before if "_lora_" in key} | {"score.kernel"}
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy", "eval_margin", "eval_min_reward", "eval_mean_reward", "eval_max_reward",
            "eval_num_tokens"} <= set(metrics)
    assert not any("present/" in key for key in metrics)
    trainer.save_model(tmp_path / "adapter")  # PEFT's layout: the trained head is saved with the adapter
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.score.weight" in saved and any(".lora_A." in key for key in saved)


def test_reward_data_without_rejected_names_the_columns_and_the_formats(reward_model_dir, tokenizer_dir, tmp_path):
    data = [{"prompt": "the quick brown", "chosen": " fox", "score": 1.0}]
    with pytest.raises(ValueError) as error:
        RewardTrainer(model=str(reward_model_dir), args=RewardConfig(output_dir=str(tmp_path)), train_dataset=data,
                      processing_class=tokenizer_for(tokenizer_dir))
    text = str(error.value)
    assert "no 'rejected' column" in text and "['prompt', 'chosen', 'score']" in text
    assert "implicit prompt" in text and "conversational" in text and "chosen_ids" in text


def test_a_loaded_model_with_several_labels_is_refused_as_trl_does(tmp_path, tokenizer_dir):
    hf_classifier("qwen2", num_labels=2).save_pretrained(tmp_path / "two")
    model = torchlike.AutoModelForSequenceClassification.from_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match=r"The model has `num_labels=2`, but reward models require `num_labels=1`"):
        RewardTrainer(model=model, args=RewardConfig(output_dir=str(tmp_path / "out")), train_dataset=STANDARD,
                      processing_class=tokenizer_for(tokenizer_dir))


def test_a_causal_lm_path_gets_a_one_label_head(tiny_checkpoints, tokenizer_dir, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # TRL silences the new-head notice
        trainer = RewardTrainer(model=str(tiny_checkpoints.path("qwen2")),
                                args=RewardConfig(output_dir=str(tmp_path), max_length=None),
                                train_dataset=STANDARD, processing_class=tokenizer_for(tokenizer_dir))
    assert isinstance(trainer.model, torchlike.SequenceClassifier) and trainer.model.num_labels == 1
    assert trainer.model.config.pad_token_id == trainer.processing_class.pad_token_id == 2  # eos, as TRL sets it


# --- RewardConfig (its field walk: test_config_parity.py) ------------------------------------------------------------

def test_trl_default_changes_are_spelled_out():
    config = RewardConfig()
    assert (config.learning_rate, config.logging_steps, config.gradient_checkpointing, config.bf16,
            config.max_length) == (1e-4, 10, True, True, 1024)


def test_pad_token_is_deprecated_as_in_trl():
    with pytest.warns(FutureWarning, match="`pad_token` is deprecated"):
        RewardConfig(pad_token="<pad>")


@pytest.mark.parametrize(("task_type", "targets"), [("SEQ_CLS", "all-linear"), (None, ["q_proj", "v_proj"])])
def test_lora_trains_the_parameters_trl_and_peft_train(reward_model_dir, tokenizer_dir, tmp_path, task_type, targets):
    """``trl.RewardTrainer`` + ``peft``: the parameters that train (``requires_grad``, and changed by training) and
    the tensors of the saved adapter are the same set as torchlike's (in the adapter file's names). ``SEQ_CLS``
    trains the ``score`` head beside the LoRA factors (PEFT's ``modules_to_save``); without a task type the head
    stays frozen (TRL recommends ``modules_to_save=["score"]``, torchlike warns)."""
    import datasets
    import peft

    settings = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2, logging_steps=1,
                    report_to="none", save_strategy="no", bf16=False)
    theirs = trl.RewardTrainer(model=str(reward_model_dir),
                               args=trl.RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
                               train_dataset=datasets.Dataset.from_list(STANDARD[:8]),
                               processing_class=tokenizer_for(tokenizer_dir),
                               peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           task_type=task_type))
    trained = {name.replace(".default", "").replace(".modules_to_save", "")
               for name, parameter in theirs.model.named_parameters() if parameter.requires_grad}
    theirs.save_model(tmp_path / "trl" / "initial")
    theirs.train()
    theirs.save_model(tmp_path / "trl" / "adapter")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The LoRA adapter does not train the score head")
        ours = RewardTrainer(model=str(reward_model_dir),
                             args=RewardConfig(output_dir=str(tmp_path / "ours"), **settings),
                             train_dataset=STANDARD[:8], processing_class=tokenizer_for(tokenizer_dir),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    task_type=task_type))
    ours.save_model(tmp_path / "ours" / "initial")
    ours.train()
    ours.save_model(tmp_path / "ours" / "adapter")

    def changed(folder):
        before, after = (load_file(folder / name / "adapter_model.safetensors") for name in ("initial", "adapter"))
        assert set(before) == set(after)
        return {key for key in after if not np.array_equal(before[key], after[key])}

    expected_saved = set(load_file(tmp_path / "trl" / "adapter" / "adapter_model.safetensors"))
    assert set(load_file(tmp_path / "ours" / "adapter" / "adapter_model.safetensors")) == expected_saved
    assert trained == changed(tmp_path / "trl") == changed(tmp_path / "ours")
    assert ("base_model.model.score.weight" in trained) == (task_type == "SEQ_CLS")


def test_all_linear_lora_on_a_classifier_without_seq_cls_is_refused_naming_the_fix(reward_model_dir, tokenizer_dir,
                                                                                   tmp_path):
    """peft's ``all-linear`` adapts a classifier's ``score`` head with LoRA unless ``task_type="SEQ_CLS"``; torchlike
    cannot, so it refuses instead of training a different set of parameters."""
    import peft
    import transformers

    base = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    assert any(name.startswith("base_model.model.score.lora_A") for name, _ in adapted.named_parameters())
    with pytest.raises(ValueError, match="task_type='SEQ_CLS'"):
        RewardTrainer(model=str(reward_model_dir), args=RewardConfig(output_dir=str(tmp_path)),
                      train_dataset=STANDARD[:8], processing_class=tokenizer_for(tokenizer_dir),
                      peft_config=LoraConfig(r=4, target_modules="all-linear"))


def test_compute_metrics_gets_what_trls_prediction_step_gives(reward_model_dir, tokenizer_dir, tmp_path):
    """TRL's RewardTrainer leaves ``prediction_step`` to transformers, which hands ``compute_metrics`` the model's
    logits on each batch's chosen rows then its rejected ones (a short last batch cut to its examples: its chosen
    rewards), no labels, after ``preprocess_logits_for_metrics``."""
    import datasets

    seen = {}

    def recorder(side):
        def compute_metrics(prediction):
            seen[side] = (np.asarray(prediction.predictions), np.asarray(prediction.label_ids))
            return {"reward_sum": float(np.sum(prediction.predictions))}

        return compute_metrics

    data = STANDARD[:5]  # batches of 2 pairs: the last holds one
    settings = dict(report_to="none", bf16=False, per_device_eval_batch_size=2, max_length=24)
    tokenizer = tokenizer_for(tokenizer_dir)
    theirs = trl.RewardTrainer(model=str(reward_model_dir), processing_class=tokenizer,
                               args=trl.RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
                               train_dataset=datasets.Dataset.from_list(data),
                               eval_dataset=datasets.Dataset.from_list(data), compute_metrics=recorder("theirs"),
                               preprocess_logits_for_metrics=lambda logits, labels: logits * 2)
    ours = RewardTrainer(model=str(reward_model_dir), processing_class=tokenizer_for(tokenizer_dir),
                         args=RewardConfig(output_dir=str(tmp_path / "ours"), **settings), train_dataset=data,
                         eval_dataset=data, compute_metrics=recorder("ours"),
                         preprocess_logits_for_metrics=lambda logits, labels: logits * 2)
    expected, found = theirs.evaluate(), ours.evaluate()
    assert seen["ours"][0].shape == seen["theirs"][0].shape
    np.testing.assert_allclose(seen["ours"][0], seen["theirs"][0], rtol=1e-4, atol=1e-6)
    assert seen["ours"][1].shape == seen["theirs"][1].shape == (0,)
    np.testing.assert_allclose(found["eval_reward_sum"], expected["eval_reward_sum"], rtol=1e-4)
