"""Gemma 3 text: tiny HF checkpoints load, match transformers in fp32 and save back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import torchlike
from tests.helpers.models import max_diff_on_real_tokens, reference_logits, torchlike_logits, with_config
from torchlike.adapters.families import UnsupportedConfigError
from torchlike.adapters.model.rope import UnsupportedRopeScalingError

TOLERANCE = 1e-4


# Two layers typed [sliding, full]: Tunix's own 5:1 pattern would make both sliding, so parity
# also shows layer_types is honoured. "gemma3_mha" (num_kv_heads == heads) is Tunix's fused case.
@pytest.mark.parametrize("case", ["gemma3", "gemma3_mha"])
def test_logits_match_transformers_on_left_and_right_padded_batch(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    assert max_diff_on_real_tokens(torchlike_logits(path), reference_logits(path)) <= TOLERANCE


def test_sliding_window_is_applied(tiny_checkpoints):
    # padded_batch rows hold up to 24 real tokens against a window of 8: widening the window must
    # change the logits, and both sides must agree at either width.
    path = tiny_checkpoints.path("gemma3")
    narrow = torchlike_logits(path)
    wide = torchlike_logits(path, sliding_window=64)
    assert max_diff_on_real_tokens(narrow, wide) > 1e-2
    assert max_diff_on_real_tokens(wide, reference_logits(path, sliding_window=64)) <= TOLERANCE


def test_save_pretrained_round_trips_bit_for_bit(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma3")
    torchlike.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "out")

    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype, name
        assert torch.equal(saved[name], tensor), name

    np.testing.assert_array_equal(reference_logits(tmp_path / "out"), reference_logits(path))


def test_unsupported_rope_type_is_refused(tiny_checkpoints, tmp_path):
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "dynamic", "rope_theta": 1000000.0, "factor": 2.0},
    }
    path = with_config(tiny_checkpoints.path("gemma3"), tmp_path / "dynamic", rope_parameters=rope)
    with pytest.raises(UnsupportedRopeScalingError, match=r"'dynamic'.*\['default', 'linear'\]"):
        torchlike.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"query_pre_attn_scalar": 20}, "query_pre_attn_scalar"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ],
)
def test_unsupported_config_is_refused(changes, message, tiny_checkpoints, tmp_path):
    path = with_config(tiny_checkpoints.path("gemma3"), tmp_path / "changed", **changes)
    with pytest.raises(UnsupportedConfigError, match=message):
        torchlike.AutoModelForCausalLM.from_pretrained(path)
