"""Each family loads from a tiny random HF checkpoint and matches the transformers forward in fp32."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import transformers

import torchlike
from tests import tiny

FAMILY_CASES = ["qwen2", "qwen2_tied", "qwen3", "qwen3_tied", "llama3", "llama32"]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_logits_match_transformers_on_left_and_right_padded_batch(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    ids, mask, positions = tiny.padded_batch()
    expected = tiny.hf_logits(reference, ids, mask, positions)

    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    logits = np.asarray(model(ids, attention_mask=mask).logits)

    valid = mask.astype(bool)
    assert np.abs(logits[valid] - expected[valid]).max() <= 1e-4


@pytest.mark.parametrize("case", ["qwen3", "llama3", "llama32"])
def test_stock_tunix_rope_would_miss_the_checkpoint_rope(case, tiny_checkpoints):
    """Proves the adapter's rope fix matters: Tunix 0.1.7's own attention ignores rope_theta/scaling."""
    path = tiny_checkpoints.path(case)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ids, mask, _ = tiny.padded_batch()
    fixed = np.asarray(model(ids, attention_mask=mask).logits)
    for layer in model.module.layers:
        # Back to Tunix's own Attention: torchlike's subclasses keep its name and module.
        layer.attn.__class__ = getattr(sys.modules[type(layer.attn).__module__], type(layer.attn).__name__)
    stock = np.asarray(model(ids, attention_mask=mask).logits)
    valid = mask.astype(bool)
    assert np.abs(stock[valid] - fixed[valid]).max() > 1e-3
