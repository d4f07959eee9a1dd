"""Nemotron-H's Mamba-2 mixer against ``transformers``' torch implementation (the chunked form, continued from a state,
and the cached one-token step), what the family refuses, and the features the logits parity test would catch if they
were wrong. The family's logits, engines, export and adapter are checked with the other hybrid families
(``tests/test_hybrid_families.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.nemotron_h import modeling_nemotron_h as reference

import torchlike
from tests import tiny
from tests.helpers.models import valid_max_diff
from torchlike.adapters.families import UnsupportedConfigError, nemotron_h
from torchlike.adapters.model import mamba2
from torchlike.adapters.rollout.sampling import init_cache
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_config

LENGTH = 75  # two full chunks of 32 and a partial third
ONE_CHUNK = 27  # a partial first chunk
#: The mixer against transformers' and its two scans against each other (float32, unit-normal inputs, states that
#: grow over the sequence): the scans sum in other orders. The largest difference was 1.3e-5 on this project's CPU,
#: 0.66 of the 2e-5 it was compared at before; atol 5e-5 allows for another CPU's rounding (tests/TIMING.md), and a
#: D skip 0.1% off still fails three tests.
MIXER_TOLERANCE = dict(rtol=1e-5, atol=5e-5)


def mixer_pair(seed: int = 0) -> tuple[reference.NemotronHMamba2Mixer, mamba2.Mamba2Mixer]:
    """``transformers``' Mamba-2 mixer of the tiny config with every parameter random, and torchlike's holding the same
    weights."""
    config = tiny_config("nemotron_h")
    torch.manual_seed(seed)
    theirs = reference.NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.copy_(1.0 + 0.2 * torch.randn(parameter.shape) if "norm" in name
                            else 0.3 * torch.randn(parameter.shape))
    settings = nemotron_h.mamba2_spec(config)
    ours = settings(nemotron_h.spec_from_config(config, jnp.float32), 0, nnx.Rngs(0))
    weights = {name: parameter.detach().numpy() for name, parameter in theirs.named_parameters()}
    ours.in_proj.kernel.set_value(jnp.asarray(weights["in_proj.weight"].T))
    ours.out_proj.kernel.set_value(jnp.asarray(weights["out_proj.weight"].T))
    ours.conv1d.weight.set_value(jnp.asarray(weights["conv1d.weight"][:, 0]))
    ours.conv1d.bias.set_value(jnp.asarray(weights["conv1d.bias"]))
    for name in ("dt_bias", "A_log", "D"):
        getattr(ours, name).set_value(jnp.asarray(weights[name]))
    ours.norm.weight.set_value(jnp.asarray(weights["norm.weight"]))
    return theirs, ours


def empty_state(mixer: mamba2.Mamba2Mixer, batch: int) -> dict:
    return {**{name: jnp.zeros((batch, *shape), dtype) for name, (shape, dtype) in
               mixer.state_shapes(jnp.float32).items()}, "end_index": jnp.zeros((batch,), jnp.int32)}


def random_hidden(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, length, 64)).astype(np.float32)


def their_steps(mixer: reference.NemotronHMamba2Mixer, x: np.ndarray, prompt: int) -> tuple[np.ndarray, torch.Tensor]:
    """``transformers``' outputs for ``x [B, T, H]``: its chunked form on the first ``prompt`` tokens (filling its
    cache), then its cached step token by token; and its final SSM state."""
    cache = transformers.DynamicCache(config=mixer.config)
    with torch.no_grad():
        outputs = [mixer.torch_forward(torch.tensor(x[:, :prompt]), cache_params=cache).numpy()]
        for step in range(prompt, x.shape[1]):
            outputs.append(mixer.torch_forward(torch.tensor(x[:, step:step + 1]), cache_params=cache).numpy())
    return np.concatenate(outputs, axis=1), cache.layers[0].recurrent_states


def test_the_chunked_form_equals_transformers_chunked_torch_mixer_on_a_partial_chunk():
    theirs, ours = mixer_pair()
    x = random_hidden(ONE_CHUNK)
    with torch.no_grad():
        expected = theirs.torch_forward(torch.tensor(x)).numpy()
    out, _ = ours(jnp.asarray(x), jnp.ones((2, ONE_CHUNK), bool), None)
    np.testing.assert_allclose(np.asarray(out), expected, **MIXER_TOLERANCE)


def test_the_chunked_form_equals_transformers_step_by_step_across_chunks_and_from_a_state():
    """Across chunks the reference is transformers' cached step: its chunked torch path (NemotronH's, as Zamba2's)
    sums the chunk-to-chunk decays over the wrong axis, so a state crossing a chunk boundary comes out wrong there
    (its CUDA kernels and Mamba2's torch path carry it right)."""
    theirs, ours = mixer_pair()
    x = random_hidden(LENGTH)
    expected, _ = their_steps(theirs, x, prompt=1)
    valid = jnp.ones((2, LENGTH), bool)
    whole, _ = ours(jnp.asarray(x), valid, None)
    np.testing.assert_allclose(np.asarray(whole), expected, **MIXER_TOLERANCE)
    # The first 40 tokens, then the other 35 from the state they left (convolution and SSM): the same outputs.
    first, state = ours(jnp.asarray(x[:, :40]), valid[:, :40], empty_state(ours, 2))
    second, state = ours(jnp.asarray(x[:, 40:]), valid[:, 40:], state)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), expected, **MIXER_TOLERANCE)
    assert state["end_index"].tolist() == [LENGTH, LENGTH]


def test_the_recurrent_step_equals_transformers_cached_step_and_state():
    theirs, ours = mixer_pair(seed=1)
    x = random_hidden(ONE_CHUNK + 3, seed=1)
    expected, their_state = their_steps(theirs, x, prompt=ONE_CHUNK)
    valid = jnp.ones((2, x.shape[1]), bool)
    outputs, state = [], empty_state(ours, 2)
    out, state = ours(jnp.asarray(x[:, :ONE_CHUNK]), valid[:, :ONE_CHUNK], state)
    outputs.append(np.asarray(out))
    for step in range(ONE_CHUNK, x.shape[1]):
        out, state = ours(jnp.asarray(x[:, step:step + 1]), valid[:, :1], state)
        outputs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, **MIXER_TOLERANCE)
    np.testing.assert_allclose(np.asarray(state["ssm"]), their_state.numpy(), **MIXER_TOLERANCE)


def test_the_chunked_and_recurrent_scans_agree_from_an_initial_state():
    rng = np.random.default_rng(3)
    batch, length, heads, head_dim, size = 2, 45, 4, 3, 5
    x = rng.standard_normal((batch, length, heads, head_dim)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((batch, length, heads)))).astype(np.float32)
    a = -np.exp(rng.standard_normal(heads)).astype(np.float32)
    b, c = (rng.standard_normal((batch, length, heads, size)).astype(np.float32) for _ in range(2))
    state = rng.standard_normal((batch, heads, head_dim, size)).astype(np.float32)
    chunked = mamba2.chunked_state_space_scan(x, dt, a, b, c, state, chunk_size=16)
    recurrent = mamba2.recurrent_state_space_scan(x, dt, a, b, c, state)
    for ours, theirs in zip(chunked, recurrent, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), **MIXER_TOLERANCE)


def test_moe_layers_are_refused_naming_the_field():
    config = tiny_config("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"])
    with pytest.raises(UnsupportedConfigError,
                       match=r"layers_block_type has 'moe' layers at \[1\] \(hybrid_override_pattern 'ME\*-'\)"):
        nemotron_h.spec_from_config(config, jnp.float32)


def test_the_recurrent_layers_cache_a_fixed_size_state_and_mlp_layers_none(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("nemotron_h"), dtype="float32")
    short, long = init_cache(model.module, 2, 16), init_cache(model.module, 2, 4096)
    assert sorted(short) == ["layer_0", "layer_1", "layer_2"]  # layer 3 is an MLP
    for name in ("layer_0", "layer_2"):
        assert set(short[name]) == {"conv", "ssm", "end_index"}
        assert short[name]["ssm"].dtype == jnp.float32
        for part in ("conv", "ssm"):
            assert short[name][part].shape == long[name][part].shape
    assert long["layer_1"]["k"].shape[1] == 4096


@pytest.mark.parametrize("target_modules", [["in_proj", "out_proj"], ["conv1d"], "all-linear"])
def test_lora_on_the_mamba_out_proj_and_convolution_is_refused_as_peft_refuses_it(target_modules, tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("nemotron_h"), dtype="float32")
    with pytest.raises(ValueError, match="PEFT refuses LoRA on the out_proj and conv1d"):
        get_peft_model(model, LoraConfig(r=4, target_modules=target_modules, task_type="CAUSAL_LM"))


def test_the_d_skip_and_the_grouped_gated_norm_change_the_logits_the_parity_test_checks(tiny_checkpoints):
    """The parity test would fail if the D skip were dropped or the gated norm normalised the whole width at once."""
    path = tiny_checkpoints.path("nemotron_h")
    ids, mask, _ = tiny.padded_batch()
    honoured = np.asarray(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")(
        ids, attention_mask=mask).logits)

    def changed(edit) -> float:
        model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        for layer in model.module.layers:
            if hasattr(layer, "mamba"):
                edit(layer.mamba)
        return valid_max_diff(np.asarray(model(ids, attention_mask=mask).logits), honoured, mask)

    assert changed(lambda mixer: mixer.D.set_value(jnp.zeros_like(mixer.D.get_value()))) > 1e-2
    assert changed(lambda mixer: setattr(mixer.norm, "group_size", mixer.settings.inner_size)) > 1e-2
