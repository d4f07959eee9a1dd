"""What is LFM2's own beside the hybrid tests (``tests/test_hybrid_families.py`` checks its logits, greedy tokens,
export and PEFT adapter against ``transformers``): the short convolution's biases, its state across calls, the MLP
width adjustment, the refusals, and that the parity tests would see a wrong convolution or gate."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.models import valid_max_diff
from torchlike.adapters.families import UnsupportedConfigError
from torchlike.adapters.families.lfm2 import spec_from_config
from torchlike.adapters.rollout.sampling import init_cache
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_config

REFUSED = [
    (dict(layer_types=["conv", "sliding_attention", "conv"]), "layer_types ['sliding_attention']"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope_type='dynamic'"),
]


@pytest.mark.parametrize(("change", "field"), REFUSED, ids=[field for _, field in REFUSED])
def test_a_config_feature_lfm2_does_not_compute_is_refused_by_name(change, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
        torchlike.AutoModelForCausalLM.from_config(tiny_config("lfm2", **change), dtype="float32")


@pytest.mark.parametrize("change", [dict(), dict(block_auto_adjust_ff_dim=False),
                                    dict(intermediate_size=200, block_ffn_dim_multiplier=1.3, block_multiple_of=48)],
                         ids=["adjusted", "not_adjusted", "multiplied"])
def test_the_mlp_width_is_the_one_transformers_builds(change):
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    config = tiny_config("lfm2", **change)
    assert spec_from_config(config, "float32").intermediate_size == Lfm2MLP(config).w1.out_features


def test_logits_with_convolution_biases_equal_transformers_on_padded_rows(tmp_path):
    """``conv_bias`` adds biases to ``in_proj``, the convolution and ``out_proj``; a padding token is zeroed before
    ``in_proj``, so its ``B * x`` is the product of two biases, which ``transformers`` convolves as well."""
    reference = tiny.build_hf_model(tiny_config("lfm2", conv_bias=True))
    reference.save_pretrained(tmp_path)
    model = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32")
    ids, mask, positions = tiny.padded_batch()
    ours = np.asarray(model(ids, attention_mask=mask).logits)
    assert valid_max_diff(ours, tiny.hf_logits(reference.eval(), ids, mask, positions), mask) <= 1e-4


def _decode_last_token(module, ids: np.ndarray, zero_conv_states: bool = False) -> np.ndarray:
    """The last token's logits when ``ids [1, T]`` but the last are prefilled into a cache and the last decoded with it
    (``zero_conv_states``: the short convolutions' states reset before decoding)."""
    length, size = ids.shape[1], 32
    cache = init_cache(module, 1, size)
    slots = jnp.arange(size)
    prefill_mask = (slots[None, :] <= jnp.arange(length - 1)[:, None])[None]
    _, cache = module(jnp.asarray(ids[:, :-1]), jnp.arange(length - 1)[None], cache, prefill_mask)
    if zero_conv_states:
        cache = {name: {**entry, "conv": jnp.zeros_like(entry["conv"])} if "conv" in entry else entry
                 for name, entry in cache.items()}
    logits, _ = module(jnp.asarray(ids[:, -1:]), jnp.full((1, 1), length - 1), cache,
                       (slots <= length - 1)[None, None])
    return np.asarray(logits[0, -1])


def test_decoding_with_the_cache_continues_the_convolution_state(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("lfm2"), dtype="float32")
    ids = np.random.default_rng(0).integers(3, tiny.VOCAB, size=(1, 12))
    whole = np.asarray(model(ids, attention_mask=np.ones_like(ids)).logits)[0, -1]
    np.testing.assert_allclose(_decode_last_token(model.module, ids), whole, atol=1e-5)
    assert np.abs(_decode_last_token(model.module, ids, zero_conv_states=True) - whole).max() > 1e-2


def test_the_convolution_history_and_the_gates_change_the_logits_the_parity_test_checks(tiny_checkpoints):
    """The parity tests would fail if the convolution saw only the current token or ``B`` and ``C`` were swapped."""
    path = tiny_checkpoints.path("lfm2")
    ids, mask, _ = tiny.padded_batch()
    honoured = np.asarray(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")(
        ids, attention_mask=mask).logits)

    def logits_after(change) -> np.ndarray:
        model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        for layer in model.module.layers:
            if hasattr(layer, "conv"):
                change(layer.conv)
        return np.asarray(model(ids, attention_mask=mask).logits)

    def current_token_only(mixer):
        weight = mixer.conv.weight
        weight.set_value(weight.get_value().at[:, :-1].set(0.0))

    def swapped_gates(mixer):
        kernel = mixer.in_proj.kernel
        gate_in, gate_out, values = jnp.split(kernel.get_value(), 3, axis=-1)
        kernel.set_value(jnp.concatenate([gate_out, gate_in, values], axis=-1))

    for change in (current_token_only, swapped_gates):
        assert valid_max_diff(logits_after(change), honoured, mask) > 1e-2, change.__name__


def test_lora_needs_named_targets_and_refuses_the_depthwise_convolution(tiny_checkpoints):
    """PEFT has no default ``target_modules`` for ``lfm2``; the depthwise ``conv`` is an ``nn.Conv1d``, not a linear
    module LoRA adapts here."""
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("lfm2"), dtype="float32")
    with pytest.raises(ValueError, match="no default LoRA target_modules.*in_proj.*w1"):
        get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=r"\['conv'\] match no module"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["conv", "in_proj"], task_type="CAUSAL_LM"))

