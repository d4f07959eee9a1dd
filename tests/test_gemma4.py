"""Gemma 4 text: tiny HF checkpoints (dense; MoE with keys-as-values; per-layer inputs with KV sharing) load and match
transformers in fp32, save back bit for bit, export PEFT adapters, generate token for token and train with the SFT
defaults."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tunix.models.gemma4 import model as tunix_gemma4
from tunix.models.gemma4 import moe as tunix_moe

import torchlike
from tests import tiny
from tests.helpers.models import (
    lora_export_differences,
    max_diff_on_real_tokens,
    reference_logits,
    reference_model,
    torchlike_logits,
    with_config,
)
from tests.helpers.training import sft_losses_with_the_default_config
from torchlike.adapters.families import UnsupportedConfigError
from torchlike.adapters.families.gemma4 import kv_sharing_pattern
from torchlike.adapters.model import tunix_model
from torchlike.adapters.model.rope import UnsupportedRopeScalingError
from torchlike.adapters.training import train_step
from torchlike.peft import LoraConfig, get_peft_model

TOLERANCE = 1e-4
CASES = ["gemma4", "gemma4_moe", "gemma4_ple"]


# Rows of up to 24 real tokens against a window of 8; full layers with head size 32 and a quarter of it rotated.
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_on_left_and_right_padded_batch(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    assert max_diff_on_real_tokens(torchlike_logits(path), reference_logits(path)) <= TOLERANCE


# Each setting changes the logits (so the tiny config exercises it) and both sides agree after the change.
@pytest.mark.parametrize("change", [
    {"sliding_window": 64},
    {"final_logit_softcapping": None},
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                                            "rope_theta": 10000.0, "factor": 2.0}}},
], ids=lambda change: next(iter(change)))
def test_each_gemma4_setting_is_honoured(change, tiny_checkpoints):
    path = tiny_checkpoints.path("gemma4")
    changed = torchlike_logits(path, **change)
    assert max_diff_on_real_tokens(changed, torchlike_logits(path)) > 1e-2
    assert max_diff_on_real_tokens(changed, reference_logits(path, **change)) <= TOLERANCE


def test_each_layers_scalar_scales_its_output_as_in_transformers(tiny_checkpoints):
    # layer_scalar is a buffer, which random test models leave at one.
    reference = reference_model(tiny_checkpoints.path("gemma4"))
    with torch.no_grad():
        for index, layer in enumerate(reference.model.layers):
            layer.layer_scalar.fill_(0.5 + index)
    model = torchlike.AutoModelForCausalLM.from_pretrained(reference, dtype="float32")
    ids, mask, positions = tiny.padded_batch()
    ours = model(ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(ours, tiny.hf_logits(reference, ids, mask, positions)) <= TOLERANCE
    assert max_diff_on_real_tokens(ours, torchlike_logits(tiny_checkpoints.path("gemma4"))) > 1e-2


def test_stock_tunix_moe_routing_differs_from_transformers(tiny_checkpoints):
    # Tunix routes on the input after pre_feedforward_layernorm_2; transformers on the residual itself.
    path = tiny_checkpoints.path("gemma4_moe")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    for layer in model.module.layers:
        layer.moe_pre_ffw_norm = layer.moe.pre_norm
        del layer.moe.pre_norm
        layer.moe.__class__ = tunix_moe.MoERagged
    stock = tunix_model.forward_logits(model.family, model.module, *tiny.padded_batch()[:2])
    assert max_diff_on_real_tokens(stock, reference_logits(path)) > 1e-2


def test_kv_sharing_follows_layer_types_where_tunix_assumes_a_pattern():
    # Tunix shares the last unshared layer with global layers and the one before with sliding ones; here those
    # are [full, sliding], so transformers' origins are the other way round.
    config = tiny.CASES["gemma4_ple"]()
    types = tuple({"full_attention": tunix_gemma4.AttentionType.GLOBAL,
                   "sliding_attention": tunix_gemma4.AttentionType.LOCAL_SLIDING}[kind] for kind in config.layer_types)
    assert kv_sharing_pattern(config) == [0, 1, 1, 0]
    assert tunix_gemma4.create_kv_cache_sharing_patterns(4, 0.5, True, True, types) == [0, 1, 0, 1]


def test_trunk_then_head_gives_the_soft_capped_logits(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma4"), dtype="float32")
    family, inputs = model.family, tunix_model.causal_inputs(*tiny.padded_batch()[:2])
    split = family.logits_from_hidden(model.module, family.hidden_states(model.module, *inputs))
    np.testing.assert_allclose(np.asarray(split), np.asarray(family.forward(model.module, *inputs)),
                               rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(split).max()) < model.config.final_logit_softcapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_save_pretrained_round_trips_bit_for_bit(case, dtype, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(case, dtype=dtype)
    torchlike.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "out")

    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype, name
        assert torch.equal(saved[name], tensor), name


def test_sharded_checkpoints_load_and_save_sharded(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints.path("gemma4_ple", max_shard_size="40KB")
    assert (source / "model.safetensors.index.json").exists()
    model = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    ids, mask, positions = tiny.padded_batch()
    assert max_diff_on_real_tokens(model(ids, mask).logits, reference_logits(source)) <= TOLERANCE

    model.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    np.testing.assert_array_equal(reference_logits(tmp_path / "out"), reference_logits(source))


def test_state_dict_and_a_safetensors_file_dict_load_through_the_table(tiny_checkpoints):
    path = tiny_checkpoints.path("gemma4_moe")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    state = model.state_dict()
    assert {"layers.1.attn.key_einsum.w", "layers.0.attn.value_einsum.w", "layers.0.moe.gating_einsum",
            "layers.0.moe.pre_norm.scale"} <= set(state)
    assert "layers.1.attn.value_einsum.w" not in state  # keys are values on full layers

    fresh = torchlike.AutoModelForCausalLM.from_config(model.config)
    assert fresh.load_state_dict(state) == ([], [])
    ids, mask, _ = tiny.padded_batch()
    np.testing.assert_array_equal(fresh(ids, mask).logits, model(ids, mask).logits)

    fresh = torchlike.AutoModelForCausalLM.from_config(model.config)
    assert fresh.load_state_dict(load_file(path / "model.safetensors")) == ([], [])
    np.testing.assert_array_equal(fresh(ids, mask).logits, model(ids, mask).logits)


# The per-layer-input case: LoRA on the per-layer gates and projections too, and KV-shared layers without k/v.
def test_peft_adapter_and_merged_export_load_in_peft_and_transformers(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma4_ple")
    adapter_difference, merged_difference = lora_export_differences(path, tmp_path)
    assert adapter_difference <= TOLERANCE
    assert merged_difference <= TOLERANCE


def test_qlora_keeps_the_einsum_projections_in_full_precision(tiny_checkpoints):
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma4_ple"))
    with pytest.warns(UserWarning, match=r"keep full-precision base weights \(\['k_proj', 'o_proj', "
                                         r"'per_layer_input_gate', 'per_layer_projection', 'q_proj', 'v_proj'\]\)"):
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", quantize_base="int8"))
    names = list(model.state_dict())
    assert any(name.startswith("layers.0.mlp.down_proj.kernel.") for name in names)
    assert "layers.0.attn.q_einsum.w" in names and "layers.0.attn.q_einsum.w_lora_a" in names
    ids, mask, _ = tiny.padded_batch()
    assert np.isfinite(np.asarray(model(ids, mask).logits)).all()


# Weights scaled up (std 0.16) so greedy decoding wanders instead of repeating one token; 12-token prompts and
# 12 new tokens against a window of 8, so the cached decode steps slide too (and read shared layers' caches).
@pytest.mark.parametrize("case", ["gemma4_moe", "gemma4_ple"])
def test_greedy_generate_matches_transformers_past_the_window(case, tmp_path):
    reference, model = tiny.wandering_model(case, tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, tiny.VOCAB, size=(3, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = mask[2, :2] = 0  # left padding
    ids[mask == 0] = 0
    with torch.no_grad():
        expected = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), pad_token_id=0,
                                      eos_token_id=None, max_new_tokens=12, do_sample=False).numpy()
    ours = model.generate(ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    np.testing.assert_array_equal(ours, expected)


def test_gradient_checkpointing_finds_the_gemma4_layers(tiny_checkpoints):
    module = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma4")).module
    with train_step.rematerialised(module):
        assert all(layer.config.remat_config == tunix_gemma4.RematConfig.DECODER for layer in module.layers)
    assert all(layer.config.remat_config == tunix_gemma4.RematConfig.NONE for layer in module.layers)


def test_sft_with_the_default_config_trains_the_moe_model(tiny_checkpoints, tokenizer_dir, tmp_path):
    losses = sft_losses_with_the_default_config(tiny_checkpoints.path("gemma4_moe"), tokenizer_dir, tmp_path / "out")
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"rms_norm_eps": 1e-5}, UnsupportedConfigError, "rms_norm_eps=1e-05"),
    ({"hidden_activation": "gelu"}, UnsupportedConfigError, "hidden_activation='gelu'"),
    ({"tie_word_embeddings": False}, UnsupportedConfigError, "tie_word_embeddings=False"),
    ({"attention_bias": True}, UnsupportedConfigError, "attention_bias=True"),
    ({"use_bidirectional_attention": "all"}, UnsupportedConfigError, "use_bidirectional_attention='all'"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, UnsupportedConfigError, "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     UnsupportedRopeScalingError, "sliding_attention layers use rope_parameters rope_type='linear'"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_unsupported_config_is_refused(changes, error, message, tiny_checkpoints, tmp_path):
    path = with_config(tiny_checkpoints.path("gemma4"), tmp_path / "changed", **changes)
    with pytest.raises(error, match=message):
        torchlike.AutoModelForCausalLM.from_pretrained(path)


class _PerLayerConfig:
    """A config as transformers from 5.2x writes Gemma 4's (``per_layer_config`` overrides), by its ``to_dict``."""

    def __init__(self, overrides, layer_types=("sliding_attention", "full_attention", "full_attention"),
                 attention_k_eq_v=True):
        self.fields = {"head_dim": 16, "num_key_value_heads": 2, "layer_types": list(layer_types),
                       "attention_k_eq_v": attention_k_eq_v, "per_layer_config": overrides}

    def to_dict(self):
        return dict(self.fields)


def test_per_layer_config_of_newer_transformers_reads_as_the_global_head_size_and_key_heads():
    from torchlike.adapters.families.gemma4 import per_layer_config_flattened

    full = {"head_dim": 32, "num_key_value_heads": 1}
    flat = per_layer_config_flattened(_PerLayerConfig({"1": full, "2": full}))
    assert (flat.head_dim, flat.global_head_dim, flat.num_key_value_heads, flat.num_global_key_value_heads) == \
        (16, 32, 2, 1)


@pytest.mark.parametrize(("overrides", "k_eq_v", "message"), [
    ({"0": {"head_dim": 32}}, True, r"per_layer_config\[0\] sets \['head_dim'\] for a sliding_attention layer"),
    ({"1": {"intermediate_size": 8}, "2": {"intermediate_size": 8}}, True, r"sets \['intermediate_size'\]"),
    ({"1": {"head_dim": 32}, "2": {"head_dim": 64}}, True, "different shapes"),
    ({"1": {"num_key_value_heads": 1}, "2": {"num_key_value_heads": 1}}, False, "without attention_k_eq_v"),
])
def test_per_layer_config_the_tunix_model_cannot_build_is_refused(overrides, k_eq_v, message):
    from torchlike.adapters.families.gemma4 import per_layer_config_flattened

    with pytest.raises(UnsupportedConfigError, match=message):
        per_layer_config_flattened(_PerLayerConfig(overrides, attention_k_eq_v=k_eq_v))
