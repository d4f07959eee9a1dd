"""Gemma 2, Gemma 4 (MoE) and Qwen3 MoE through what every family gets: each state-dict surgery rule, and the DPO and
GRPO trainers with their default configs and a LoRA adapter (the SFT trainer runs in each family's own file)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchlike
from tests import tiny
from tests.helpers.data import PROMPT_ROWS, SHORT_PREFERENCES, length_reward
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

NEW_FAMILIES = ["gemma2", "gemma4_moe", "qwen3_moe"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def logits(model) -> np.ndarray:
    ids, mask, _ = tiny.padded_batch()
    valid = mask.astype(bool)
    return np.asarray(model(ids, attention_mask=mask).logits)[valid]


@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_every_state_dict_surgery_rule_holds_for_the_family(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    state = model.state_dict()
    assert all(isinstance(key, str) for key in state)
    expected = logits(model)

    # int/str key parts and the prefixes torch and PEFT add
    target = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=1)
    assert np.abs(logits(target) - expected).max() > 1e-3
    tuple_keys = {tuple(int(p) if p.isdigit() else p for p in ("base_model.model." + name).split(".")): value
                  for name, value in state.items()}
    assert target.load_state_dict(tuple_keys) == ([], [])
    np.testing.assert_array_equal(logits(target), expected)

    # transformers' own names, as torch tensors, from the model and from the file; bf16 values cast to fp32
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    named = {name: tensor for name, tensor in reference.state_dict().items() if name != "lm_head.weight"
             or not reference.config.tie_word_embeddings}
    target = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=2)
    assert target.load_state_dict(named) == ([], [])
    np.testing.assert_array_equal(logits(target), expected)
    target = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=3)
    assert target.load_state_dict(load_file(path / "model.safetensors")) == ([], [])
    np.testing.assert_array_equal(logits(target), expected)
    bf16 = {name: np.asarray(value).astype(ml_dtypes.bfloat16) for name, value in state.items()}
    target.load_state_dict(bf16)
    assert {str(value.dtype) for value in target.state_dict().values()} == {"float32"}
    rounded = {name: np.asarray(value).astype(np.float32) for name, value in bf16.items()}
    assert all(np.array_equal(np.asarray(target.state_dict()[name]), rounded[name]) for name in rounded)

    # a renamed key (key_map), and a LoRA adapter added since the save: its factors are missing, the base loads
    some_key = next(name for name in state if name.endswith("q_proj.w") or name.endswith("q_einsum.w"))
    renamed = {("old." + name if name == some_key else name): value for name, value in state.items()}
    lora = get_peft_model(torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=4),
                          LoraConfig(r=4, target_modules=ATTENTION))
    result = lora.load_state_dict(renamed, strict=False, key_map={"old." + some_key: some_key})
    assert result.unexpected_keys == [] and result.missing_keys
    assert all("lora" in key for key in result.missing_keys)
    np.testing.assert_array_equal(logits(lora), expected)  # LoRA B starts at zero

    # a shape that does not fit is named, strict or not
    wrong = {some_key: np.zeros((3, *state[some_key].shape[1:]), np.float32)}
    with pytest.raises(RuntimeError, match=some_key.replace(".", "[.]")):
        lora.load_state_dict(wrong, strict=False)


def _adapter(trainer) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in trainer.model.state_dict().items() if "lora" in name}


@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_dpo_with_the_default_config_starts_at_ln2_and_trains_the_adapter(case, tiny_checkpoints, tokenizer_dir,
                                                                         tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, learning_rate=1e-2, report_to="none",
                     save_strategy="no", per_device_train_batch_size=4)
    assert args.bf16 and args.gradient_checkpointing
    trainer = DPOTrainer(model=str(tiny_checkpoints.path(case)), args=args, train_dataset=SHORT_PREFERENCES,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
    before = _adapter(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in logs]
    # the adapter-off base is the reference: policy == reference at the first step, so the loss is ln 2 (plus, for a
    # mixture-of-experts model, the router loss TRL adds with the config's coefficient)
    assert ("aux_loss" in logs[0]) == (case == "qwen3_moe")
    preference_loss = losses[0] - trainer.router_aux_loss_coef * logs[0].get("aux_loss", 0.0)
    assert preference_loss == pytest.approx(math.log(2), abs=1e-3)
    assert losses[1] != pytest.approx(losses[0], abs=1e-4)
    after = _adapter(trainer)
    assert any(not np.array_equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_grpo_with_the_default_config_samples_scores_and_trains_the_adapter(case, tiny_checkpoints, tokenizer_dir,
                                                                           tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, learning_rate=1e-2, report_to="none",
                      save_strategy="no", max_completion_length=8, num_generations=4, per_device_train_batch_size=4,
                      beta=0.04)
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path(case)), reward_funcs=length_reward, args=args,
                          train_dataset=PROMPT_ROWS, processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION))
    before = _adapter(trainer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 1
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference before the first update
    assert np.isfinite(logged[0]["loss"]) and logged[0]["completions/mean_length"] > 0
    assert logged[0]["reward_std"] > 0  # the completions differ, so the advantages move the adapter
    after = _adapter(trainer)
    assert any(not np.array_equal(before[name], after[name]) for name in before)


def test_a_gemma_reference_state_dict_with_its_tied_head_loads_strictly(tiny_checkpoints):
    # transformers' state_dict() lists lm_head.weight even when it is the embedding; torch loads it strictly.
    path = tiny_checkpoints.path("gemma2")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    assert "lm_head.weight" in reference.state_dict() and reference.config.tie_word_embeddings
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    target = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=5)
    assert target.load_state_dict({name: torch.clone(value) for name, value in reference.state_dict().items()}) \
        == ([], [])
    np.testing.assert_array_equal(logits(target), logits(model))
    different = {**reference.state_dict(), "lm_head.weight": torch.zeros_like(reference.lm_head.weight)}
    assert target.load_state_dict(different, strict=False).unexpected_keys == ["lm_head.weight"]  # it would be lost
