"""Every text family's decoder holds the model contract (``torchlike.adapters.model.decoder_contract``): Tunix's
modules and the native decoder alike have its members, write the KV cache its spec describes, and the family's
hidden states through its head give the family's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torchlike
from tests import tiny
from torchlike.adapters.model import decoder_contract
from torchlike.adapters.model.native_decoder import NativeDecoder
from torchlike.adapters.model.tunix_model import causal_attention, positions_from_mask
from torchlike.adapters.rollout.sampling import init_cache

TUNIX_CASES = ["qwen2", "qwen3", "llama3", "gemma2", "gemma3", "gemma4", "qwen3_moe"]
# The last three are hybrids: recurrent layers beside attention (and Nemotron-H's MLP layers, which cache nothing).
NATIVE_CASES = ["mistral", "phi3", "smollm3", "olmo2", "gpt_neox", "granite", "cohere2", "gpt_oss", "glm4_moe",
                "deepseek_v3", "qwen3_5", "lfm2", "nemotron_h"]


@pytest.fixture(scope="module", params=TUNIX_CASES + NATIVE_CASES)
def model(request):
    return request.param, torchlike.AutoModelForCausalLM.from_config(tiny.CASES[request.param](), dtype="float32")


def test_the_module_has_every_member_of_the_contract(model):
    case, loaded = model
    assert decoder_contract.missing_members(loaded.module) == []
    assert isinstance(loaded.module, decoder_contract.Decoder)
    assert isinstance(loaded.module, NativeDecoder) == (case in NATIVE_CASES)


def test_one_decode_step_writes_the_cache_the_spec_describes(model):
    _, loaded = model
    module = loaded.module
    cache = init_cache(module, 2, 8)
    attention, recurrent = decoder_contract.kv_cache_shapes(module), decoder_contract.recurrent_state_shapes(module)
    assert set(cache) == set(attention) | set(recurrent) and not set(attention) & set(recurrent)
    tokens = jnp.asarray([[5], [9]], jnp.int32)
    mask = jnp.zeros((2, 1, 8), bool).at[:, :, 0].set(True)
    logits, written = module(tokens, jnp.zeros((2, 1), jnp.int32), cache, mask)
    assert logits.shape == (2, 1, decoder_contract.vocab_size(module))
    assert jax.tree.map(jnp.shape, written) == jax.tree.map(jnp.shape, cache)
    for name, layer in written.items():
        np.testing.assert_array_equal(layer["end_index"], [1, 1], err_msg=name)
        if name in recurrent:  # a fixed-size state, advanced by the token
            assert set(layer) == {*recurrent[name], "end_index"}, name
            assert any(np.abs(np.asarray(layer[part])).max() > 0 for part in recurrent[name]), name
            continue
        assert np.abs(np.asarray(layer["k"][:, 0])).max() > 0, name  # the new key went to slot end_index = 0
        assert np.abs(np.asarray(layer["k"][:, 1:])).max() == 0, name


def test_the_head_on_the_hidden_states_gives_the_forward_logits(model):
    _, loaded = model
    ids, mask, _ = tiny.padded_batch()
    mask = jnp.asarray(mask, bool)
    tokens, positions = jnp.asarray(ids, jnp.int32), positions_from_mask(mask)
    attention = causal_attention(mask)
    family, module = loaded.family, loaded.module
    expected = family.forward(module, tokens, positions, attention)
    hidden = family.hidden_states(module, tokens, positions, attention)
    assert hidden.shape == (*ids.shape, loaded.config.hidden_size)
    np.testing.assert_allclose(np.asarray(family.logits_from_hidden(module, hidden)), np.asarray(expected),
                               atol=1e-5, rtol=0)
