"""Gemma 2: tiny HF checkpoints load and match transformers in fp32 (sliding window, both soft-caps, query scaling),
save back bit for bit, export PEFT adapters, generate token for token and train with the SFT defaults."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tunix.models.gemma import model as tunix_gemma

import torchlike
from tests import tiny
from tests.helpers.models import (
    lora_export_differences,
    max_diff_on_real_tokens,
    reference_logits,
    torchlike_logits,
    with_config,
)
from tests.helpers.training import sft_losses_with_the_default_config
from torchlike.adapters.families import UnsupportedConfigError
from torchlike.adapters.model import tunix_model
from torchlike.adapters.training import train_step

TOLERANCE = 1e-4


# Layers [sliding, full] with a window of 4 against rows of up to 24 real tokens. "gemma2_mha"
# (num_kv_heads == heads) is the case Tunix builds a fused qkv_einsum for.
@pytest.mark.parametrize("case", ["gemma2", "gemma2_mha"])
def test_logits_match_transformers_on_left_and_right_padded_batch(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    assert max_diff_on_real_tokens(torchlike_logits(path), reference_logits(path)) <= TOLERANCE


# Each setting changes the logits (so the tiny config exercises it) and both sides agree after the change.
@pytest.mark.parametrize("change", [
    {"sliding_window": 64},
    {"attn_logit_softcapping": None},
    {"final_logit_softcapping": None},
    {"query_pre_attn_scalar": 16},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
], ids=lambda change: next(iter(change)))
def test_each_gemma2_setting_is_honoured(change, tiny_checkpoints):
    path = tiny_checkpoints.path("gemma2")
    changed = torchlike_logits(path, **change)
    assert max_diff_on_real_tokens(changed, torchlike_logits(path)) > 1e-2
    assert max_diff_on_real_tokens(changed, reference_logits(path, **change)) <= TOLERANCE


def test_stock_tunix_window_is_wrong_on_left_padded_rows(tiny_checkpoints):
    # Tunix's own sliding window compares cache slots with token positions: right-padded and full rows agree with
    # transformers, the left-padded row (positions lag its slots by 9) does not. Query scaling is Tunix's here.
    path = tiny_checkpoints.path("gemma2")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32", query_pre_attn_scalar=16)
    for layer, layer_type in zip(model.module.layers, model.config.layer_types, strict=True):
        layer.attn.__class__ = tunix_gemma.Attention
        if layer_type == "sliding_attention":
            layer.attn.attn_type = tunix_gemma.AttentionType.LOCAL_SLIDING
            layer.attn.sliding_window_size = model.config.sliding_window
    ids, mask, _ = tiny.padded_batch()
    stock = model.family.forward(model.module, *tunix_model.causal_inputs(ids, mask))
    expected = reference_logits(path, query_pre_attn_scalar=16)
    assert max_diff_on_real_tokens(stock, expected, rows=[0, 2]) <= TOLERANCE
    assert max_diff_on_real_tokens(stock, expected, rows=[1]) > 1e-2


def test_trunk_then_head_gives_the_soft_capped_logits(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma2"), dtype="float32")
    family, inputs = model.family, tunix_model.causal_inputs(*tiny.padded_batch()[:2])
    split = family.logits_from_hidden(model.module, family.hidden_states(model.module, *inputs))
    np.testing.assert_allclose(np.asarray(split), np.asarray(family.forward(model.module, *inputs)),
                               rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(split).max()) < model.config.final_logit_softcapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_pretrained_round_trips_bit_for_bit(dtype, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma2", dtype=dtype)
    torchlike.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "out")

    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype, name
        assert torch.equal(saved[name], tensor), name
    if dtype == torch.float32:
        np.testing.assert_array_equal(reference_logits(tmp_path / "out"), reference_logits(path))


def test_peft_adapter_and_merged_export_load_in_peft_and_transformers(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma2")
    adapter_difference, merged_difference = lora_export_differences(path, tmp_path)
    assert adapter_difference <= TOLERANCE
    assert merged_difference <= TOLERANCE


def test_greedy_generate_matches_transformers_past_the_window(tmp_path):
    # Weights scaled up (std 0.16) so greedy decoding wanders instead of repeating one token; 12-token prompts and
    # 12 new tokens against a window of 4, so the cached decode steps slide too.
    reference, model = tiny.wandering_model("gemma2", tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, tiny.VOCAB, size=(3, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = mask[2, :2] = 0  # left padding
    ids[mask == 0] = 0
    for penalty in (1.0, 1.3):
        with torch.no_grad():
            expected = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), pad_token_id=0,
                                          eos_token_id=None, max_new_tokens=12, do_sample=False,
                                          repetition_penalty=penalty).numpy()
        ours = model.generate(ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              repetition_penalty=penalty)
        np.testing.assert_array_equal(ours, expected)


def test_gradient_checkpointing_finds_the_gemma_layers(tiny_checkpoints):
    module = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma2")).module
    with train_step.rematerialised(module):
        assert all(layer.config.remat_config == tunix_gemma.RematConfig.DECODER for layer in module.layers)
        assert all(layer.attn.remat_config == tunix_gemma.RematConfig.BLOCK for layer in module.layers)
    assert all(layer.config.remat_config == tunix_gemma.RematConfig.NONE for layer in module.layers)


def test_sft_with_the_default_config_trains(tiny_checkpoints, tokenizer_dir, tmp_path):
    losses = sft_losses_with_the_default_config(tiny_checkpoints.path("gemma2"), tokenizer_dir, tmp_path / "out")
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize(("changes", "message"), [
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
])
def test_unsupported_config_is_refused(changes, message, tiny_checkpoints, tmp_path):
    path = with_config(tiny_checkpoints.path("gemma2"), tmp_path / "changed", **changes)
    with pytest.raises(UnsupportedConfigError, match=message):
        torchlike.AutoModelForCausalLM.from_pretrained(path)
