"""Attributes TRL's trainers expose and users' callbacks and scripts read (``ref_model``, ``eval_dataset``), held
against the real ``trl`` trainers built on the same tiny model, data and settings."""

from __future__ import annotations

import warnings

import datasets
import numpy as np
import peft
import pytest
import torch
import transformers
import trl
import trl.experimental.tpo as trl_tpo

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
)
from torchlike.trl.experimental.tpo import TPOConfig, TPOTrainer

PROMPTS = [{"prompt": "the quick brown"}, {"prompt": "one two"}, {"prompt": "hello world"}, {"prompt": "six"}]
PAIRS = [{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog"},
         {"prompt": "one two", "chosen": " three four", "rejected": " five"}] * 2
TRIPLES = [{**pair, "reference": pair["chosen"] + " over"} for pair in PAIRS]
UNPAIRED = [{"prompt": "the quick brown", "completion": " fox jumps", "label": True},
            {"prompt": "one two", "completion": " five", "label": False}] * 2


def length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


# name: (TRL trainer, TRL config, torchlike trainer, torchlike config, data, settings, trainer keywords)
TRAINERS = {
    "grpo": (trl.GRPOTrainer, trl.GRPOConfig, GRPOTrainer, GRPOConfig, PROMPTS,
             dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4),
             dict(reward_funcs=length_reward)),
    "rloo": (trl.RLOOTrainer, trl.RLOOConfig, RLOOTrainer, RLOOConfig, PROMPTS,
             dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4),
             dict(reward_funcs=length_reward)),
    "dpo": (trl.DPOTrainer, trl.DPOConfig, DPOTrainer, DPOConfig, PAIRS, dict(max_length=16), {}),
    "kto": (trl.KTOTrainer, trl.KTOConfig, KTOTrainer, KTOConfig, UNPAIRED,
            dict(max_length=16, per_device_train_batch_size=2), {}),
    "tpo": (trl_tpo.TPOTrainer, trl_tpo.TPOConfig, TPOTrainer, TPOConfig, TRIPLES, dict(max_length=16), {}),
}

# (trainer, config changes, LoRA): TRL keeps a separate reference model in some of these and not in others.
REFERENCE_CASES = [
    ("grpo", {}, False),  # beta=0.0 (TRL's default): no reference at all
    ("grpo", {"beta": 0.04}, False),  # full fine-tuning: a frozen model
    ("grpo", {"beta": 0.04}, True),  # the adapter switched off is the reference
    ("rloo", {}, False),  # beta=0.05 (TRL's default)
    ("dpo", {}, False),  # precompute_ref_log_probs=False: a frozen model, kept for evaluate()
    ("dpo", {"precompute_ref_log_probs": True}, False),  # the initial weights serve once, before training
    ("dpo", {}, True),
    ("kto", {}, False),
]


def build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, changes=None, lora=False, theirs=None, ours=None,
               model="qwen2"):
    """``(TRL's trainer, torchlike's trainer)`` of ``name`` on a tiny ``model`` (Qwen2 by default) with the same data
    and settings (``theirs``/``ours``: further keywords for one side)."""
    trl_class, trl_config, our_class, our_config, data, settings, extra = TRAINERS[name]
    path = tiny_checkpoints.path(model)
    settings = dict(settings, report_to="none", save_strategy="no", **(changes or {}))
    their_keywords = dict(extra, **(theirs or {}))
    our_keywords = dict(extra, **(ours or {}))
    if lora:
        their_keywords["peft_config"] = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        our_keywords["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    their_trainer = trl_class(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                              args=trl_config(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
                              train_dataset=datasets.Dataset.from_list(data),
                              processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
                              **their_keywords)
    our_trainer = our_class(model=str(path), args=our_config(output_dir=str(tmp_path / "ours"), **settings),
                            train_dataset=data, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                            **our_keywords)
    return their_trainer, our_trainer


@pytest.mark.parametrize(("name", "changes", "lora"), REFERENCE_CASES,
                         ids=[f"{name}-{changes or 'defaults'}-{'lora' if lora else 'full'}"
                              for name, changes, lora in REFERENCE_CASES])
def test_ref_model_is_a_frozen_model_exactly_where_trl_keeps_one(name, changes, lora, tiny_checkpoints,
                                                                 tokenizer_dir, tmp_path):
    theirs, ours = build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, changes, lora)
    if theirs.ref_model is None:
        assert ours.ref_model is None
        return
    assert isinstance(theirs.ref_model, transformers.PreTrainedModel) and not theirs.ref_model.training
    reference = ours.ref_model
    assert isinstance(reference, torchlike.CausalLM) and not reference.training
    assert reference.module is not ours.model.module  # a copy: training the policy leaves it alone
    initial = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")).state_dict()
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(initial[key]), err_msg=key)


def test_an_explicit_ref_model_is_the_object_the_user_passed(tiny_checkpoints, tokenizer_dir, tmp_path):
    path = tiny_checkpoints.path("qwen2")
    theirs_reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours_reference = torchlike.AutoModelForCausalLM.from_pretrained(path)
    theirs, ours = build_pair("dpo", tiny_checkpoints, tokenizer_dir, tmp_path, theirs={"ref_model": theirs_reference},
                              ours={"ref_model": ours_reference})
    assert theirs.ref_model is theirs_reference
    assert ours.ref_model is ours_reference


@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("as_dict", [False, True], ids=["one", "dict"])
def test_eval_dataset_is_what_trl_keeps(name, as_dict, tiny_checkpoints, tokenizer_dir, tmp_path):
    """GRPO and RLOO keep the user's object; the offline trainers keep a prepared ``datasets.Dataset`` with TRL's
    columns (for a dict of datasets, a dict of them)."""
    data = TRAINERS[name][4]
    given = datasets.Dataset.from_list(data)
    given = {"first": given, "second": given} if as_dict else given
    theirs, ours = build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, theirs={"eval_dataset": given},
                              ours={"eval_dataset": given})
    assert type(ours.eval_dataset) is type(theirs.eval_dataset)
    expected = theirs.eval_dataset if as_dict else {"": theirs.eval_dataset}
    found = ours.eval_dataset if as_dict else {"": ours.eval_dataset}
    assert list(found) == list(expected)
    for key, dataset in expected.items():
        if name in ("grpo", "rloo"):
            assert found[key] is dataset  # TRL does not prepare an online trainer's data
        else:
            assert isinstance(found[key], datasets.Dataset)
            token_columns = [column for column in dataset.column_names if column.endswith("_ids")]
            assert token_columns and set(token_columns) <= set(found[key].column_names)
            for column in token_columns:
                assert found[key][column] == dataset[column], column


def _predictions_recorder(seen: list):
    def compute_metrics(prediction):
        seen.append(prediction)
        return {"rows": float(prediction.label_ids.shape[0])}

    return compute_metrics


@pytest.mark.parametrize("name", ["dpo", "kto", "tpo"])
def test_compute_metrics_gets_trls_logits_and_labels(name, tiny_checkpoints, tokenizer_dir, tmp_path):
    """TRL hands ``compute_metrics`` the logits on each batch's prompt + response rows (DPO: the chosen rows, then the
    rejected ones; TPO: then the gold ones) and those ids as labels, each batch right-padded to its longest row and
    the batches joined with -100 padding (DPO and KTO deprecate it, with a FutureWarning; TPO does not); a short last
    batch checks the row order (of which TRL's DPO and TPO keep only the chosen rows: accelerate cuts the last batch
    to the examples left)."""
    data = TRAINERS[name][4][:3] + TRAINERS[name][4][1:2]
    settings = dict(per_device_eval_batch_size=3, bf16=False)
    expected, found = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs, ours = build_pair(
            name, tiny_checkpoints, tokenizer_dir, tmp_path, settings,
            theirs={"eval_dataset": datasets.Dataset.from_list(data),
                    "compute_metrics": _predictions_recorder(expected)},
            ours={"eval_dataset": data, "compute_metrics": _predictions_recorder(found)})
        metrics = theirs.evaluate()
        ours_metrics = ours.evaluate()
    deprecations = [str(warning.message) for warning in caught if issubclass(warning.category, FutureWarning)
                    and "logits it passes to `compute_metrics`, are deprecated" in str(warning.message)]
    assert bool(deprecations) == (name != "tpo")
    assert ours_metrics["eval_rows"] == metrics["eval_rows"] == {"dpo": 3 * 2 + 1, "kto": 4, "tpo": 3 * 3 + 1}[name]
    (theirs_prediction,), (ours_prediction,) = expected, found
    np.testing.assert_array_equal(ours_prediction.label_ids, theirs_prediction.label_ids)
    assert ours_prediction.predictions.shape == theirs_prediction.predictions.shape
    pad = theirs.processing_class.pad_token_id
    real = (theirs_prediction.label_ids != -100) & (theirs_prediction.label_ids != pad)
    np.testing.assert_allclose(ours_prediction.predictions[real], theirs_prediction.predictions[real], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("name", [name for name in TRAINERS if name != "tpo"])  # TRL's TPO adds no router loss
@pytest.mark.parametrize(("model", "changes"), [("qwen2", {}), ("qwen3_moe", {}),
                                                ("qwen3_moe", {"router_aux_loss_coef": 0.0})],
                         ids=["dense", "moe", "moe-coefficient-0"])
def test_router_loss_attributes_are_trls(name, model, changes, tiny_checkpoints, tokenizer_dir, tmp_path):
    """``aux_loss_enabled`` and ``router_aux_loss_coef``: on for a mixture-of-experts model with the config's
    coefficient unless the config sets 0 (the losses are compared step for step in each trainer's ``*_vs_trl``
    test)."""
    theirs, ours = build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, changes, model=model)
    assert ours.aux_loss_enabled is theirs.aux_loss_enabled
    assert ours.router_aux_loss_coef == theirs.router_aux_loss_coef
    assert ours.aux_loss_enabled == (model == "qwen3_moe" and not changes)


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_evaluate_on_an_iterable_dataset_with_precomputed_reference_raises_trls_error(name, tiny_checkpoints,
                                                                                     tokenizer_dir, tmp_path):
    theirs, ours = build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, {"precompute_ref_log_probs": True},
                              lora=True)
    stream = datasets.Dataset.from_list(TRAINERS[name][4]).to_iterable_dataset()
    with pytest.raises(ValueError) as expected:
        theirs.evaluate(eval_dataset=stream)
    with pytest.raises(ValueError) as found:
        ours.evaluate(eval_dataset=stream)
    assert str(found.value) == str(expected.value)
    assert "not supported with IterableDataset" in str(found.value)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_the_attributes_trl_copies_from_its_config_are_trls(name, tiny_checkpoints, tokenizer_dir, tmp_path):
    theirs, ours = build_pair(name, tiny_checkpoints, tokenizer_dir, tmp_path, changes={"epsilon_high": 0.3})
    names = [*ours._trl_fields, "num_generations_eval", "chat_template_kwargs", "epsilon_low", "epsilon_high",
             "reward_func_names", "generation_kwargs", *(["max_tool_calling_iterations"] if name == "grpo" else [])]
    assert "entropy_coef" in names if name == "grpo" else "reward_clip_range" in names
    for attribute in names:
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert ours.model_wrapped is ours.model and not ours.is_deepspeed_enabled and not ours.is_fsdp_enabled
