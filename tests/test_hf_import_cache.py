"""A second import of a config reuses its abstract model and transform programs; another config builds its own."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

import torchlike
from tests import tiny
from torchlike.adapters import tunix_model
from torchlike.adapters.runtime import tracing


@pytest.fixture
def abstract_builds(monkeypatch):
    """Counts the abstract model builds (``nnx.eval_shape`` of a family's constructor)."""
    calls = []
    original = nnx.eval_shape

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tunix_model.nnx, "eval_shape", counted)
    return calls


def _values(model) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in model.state_dict().items()}


def _same(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> bool:
    return left.keys() == right.keys() and all(
        left[name].dtype == right[name].dtype and np.array_equal(left[name], right[name]) for name in left)


def test_a_second_import_of_the_same_config_builds_and_compiles_nothing_new(tiny_checkpoints, abstract_builds):
    path = tiny_checkpoints.path("qwen2")
    first = _values(torchlike.AutoModelForCausalLM.from_pretrained(path))
    builds, traces = len(abstract_builds), tracing.TRACE_COUNTS["weight_transform"]
    second = torchlike.AutoModelForCausalLM.from_pretrained(path)
    assert len(abstract_builds) == builds
    assert tracing.TRACE_COUNTS["weight_transform"] == traces
    assert _same(_values(second), first)


def test_models_imported_from_one_config_share_no_parameter(tiny_checkpoints):
    path = tiny_checkpoints.path("qwen2")
    first = torchlike.AutoModelForCausalLM.from_pretrained(path)
    second = torchlike.AutoModelForCausalLM.from_pretrained(path)
    before = _values(second)
    for name, value in first.state_dict().items():
        first.load_state_dict({name: np.zeros(value.shape, value.dtype)}, strict=False)
    assert _same(_values(second), before)
    assert all(not np.any(value) for value in _values(first).values())


def test_another_dtype_gets_its_own_model_computing_in_that_dtype(tiny_checkpoints, padded_batch):
    path = tiny_checkpoints.path("qwen2")
    ids, mask, _ = padded_batch
    full = _values(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32"))
    half = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    assert _same(_values(half), {name: value.astype(ml_dtypes.bfloat16) for name, value in full.items()})
    tunix_model._abstract_models.clear()
    built_alone = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(half(ids, attention_mask=mask).logits),
                                  np.asarray(built_alone(ids, attention_mask=mask).logits))


@pytest.mark.parametrize("overrides", [{"hidden_size": 32}, {"num_hidden_layers": 1}, {"intermediate_size": 96}])
def test_another_config_gets_its_own_model_with_its_shapes_and_weights(tiny_checkpoints, tmp_path, overrides):
    torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))  # the tiny config, cached
    source = tmp_path / "other"
    tiny.build_hf_model(tiny.tiny_config("qwen2", **overrides)).save_pretrained(source)
    model = torchlike.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path / "out")
    expected, saved = load_file(source / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name


def test_a_config_override_at_import_is_a_different_config(tiny_checkpoints):
    path = tiny_checkpoints.path("qwen2")
    torchlike.AutoModelForCausalLM.from_pretrained(path)
    with pytest.warns(UserWarning, match="not used"):  # the second layer's tensors are left over
        model = torchlike.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1)
    assert not any(name.startswith("layers.1.") for name in model.state_dict())
