"""A second import of a config reuses its abstract model and transform programs (a new process reads the abstract
model from disk); another config builds its own."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file

import torchlike
from tests import tiny
from torchlike.adapters.checkpoint import hf_checkpoint, safetensors_io
from torchlike.adapters.families import family_for_config
from torchlike.adapters.model import tunix_model
from torchlike.adapters.runtime import abstract_models, compilation, tracing


@pytest.fixture(autouse=True)
def abstract_model_folder(tmp_path_factory, monkeypatch):
    """The abstract models' disk entries live in the compilation cache's folder. These tests give torchlike a folder
    of their own (the session's, tests/conftest.py, holds every other test's entries), without moving JAX's cache."""
    folder = tmp_path_factory.getbasetemp() / "compilation-cache"
    folder.mkdir(exist_ok=True)
    monkeypatch.setattr(compilation, "_decided", True)
    monkeypatch.setattr(compilation, "_enabled", folder)
    return folder


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


def _built_fresh(family, config, dtype):
    """The abstract model parts built by ``nnx.eval_shape``, with neither cache consulted."""
    tunix_model._abstract_models.clear()
    stored = tunix_model.stored_abstract_model(family, config, dtype)
    stored.unlink(missing_ok=True)
    return tunix_model.abstract_model_parts(family, config, dtype), stored


@pytest.mark.parametrize("case", ["qwen2", "llama3", "gemma2", "gemma4_moe", "qwen3_moe"])
def test_a_new_process_reads_the_abstract_model_from_disk_equal_to_a_build(case, abstract_builds):
    """What a new process reads (the in-memory cache cleared) is the built model: the same graph, with the same
    rope-patched Tunix classes (by identity), shapes, dtypes and partition specs; nothing is built."""
    config = tiny.CASES[case]()
    family = family_for_config(config)
    (graphdef, state, specs), stored = _built_fresh(family, config, np.float32)
    assert stored.is_file() and len(abstract_builds) == 1
    tunix_model._abstract_models.clear()
    read_graphdef, read_state, read_specs = tunix_model.abstract_model_parts(family, config, np.float32)
    assert len(abstract_builds) == 1
    assert read_graphdef == graphdef
    assert read_specs == specs
    shapes = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), nnx.to_pure_dict(state))
    assert jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), nnx.to_pure_dict(read_state)) == shapes


def test_a_model_imported_through_the_disk_entry_computes_the_same_logits(tiny_checkpoints, padded_batch,
                                                                          abstract_builds):
    path = tiny_checkpoints.path("llama3")
    ids, mask, _ = padded_batch
    config = transformers.AutoConfig.from_pretrained(path)
    _built_fresh(family_for_config(config), config, np.float32)
    built = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    builds = len(abstract_builds)
    tunix_model._abstract_models.clear()
    read = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    assert len(abstract_builds) == builds
    np.testing.assert_array_equal(np.asarray(read(ids, attention_mask=mask).logits),
                                  np.asarray(built(ids, attention_mask=mask).logits))


def test_a_damaged_disk_entry_is_rebuilt_and_replaced(abstract_builds):
    config = tiny.tiny_config("qwen2", intermediate_size=80)  # a config no other test (or worker) loads
    family = family_for_config(config)
    (graphdef, _, _), stored = _built_fresh(family, config, np.float32)
    stored.write_bytes(stored.read_bytes()[:100])  # a truncated entry
    tunix_model._abstract_models.clear()
    assert tunix_model.abstract_model_parts(family, config, np.float32)[0] == graphdef
    assert len(abstract_builds) == 2
    assert abstract_models.load(stored)[0] == graphdef


def test_the_disk_entry_follows_config_dtype_and_code(monkeypatch):
    config = tiny.CASES["qwen2"]()
    family = family_for_config(config)
    entry = tunix_model.stored_abstract_model(family, config, np.float32)
    assert tunix_model.stored_abstract_model(family, config, np.float32) == entry
    assert tunix_model.stored_abstract_model(family, config, ml_dtypes.bfloat16) != entry
    assert tunix_model.stored_abstract_model(family, tiny.tiny_config("qwen2", hidden_size=32), np.float32) != entry
    monkeypatch.setattr(abstract_models, "_fingerprint", "other code")
    assert tunix_model.stored_abstract_model(family, config, np.float32) != entry


def test_no_disk_entry_when_the_compilation_cache_is_off(monkeypatch, abstract_builds):
    monkeypatch.setenv("TORCHLIKE_COMPILATION_CACHE", "off")
    monkeypatch.setattr(compilation, "_decided", False)
    monkeypatch.setattr(compilation, "_enabled", None)
    config = tiny.CASES["qwen2"]()
    family = family_for_config(config)
    assert tunix_model.stored_abstract_model(family, config, np.float32) is None
    tunix_model._abstract_models.clear()
    tunix_model.abstract_model_parts(family, config, np.float32)
    assert len(abstract_builds) == 1


def test_a_model_with_a_class_made_at_run_time_and_not_registered_is_not_stored(tmp_path):
    derived = type("Qwen2", (object,), {"__module__": "tunix.models.qwen2.model"})
    assert not abstract_models.store(tmp_path / "entry.pkl", {"graph": derived})
    assert not (tmp_path / "entry.pkl").exists() and not list(tmp_path.iterdir())
    assert abstract_models.store(tmp_path / "entry.pkl", {"graph": int})
    assert abstract_models.load(tmp_path / "entry.pkl") == {"graph": int}


def test_an_import_reuses_read_buffers_and_every_weight_arrives_exact(tiny_checkpoints, tmp_path, monkeypatch):
    """Tensors moved to the NNX layout hand their read buffer to later reads; the ones the model adopts as they are
    (embeddings, norms) never do, so every weight is exact (a reused adopted buffer would be overwritten)."""
    recycled, reused = [], []
    recycle, take = hf_checkpoint.CheckpointTensors.recycle, safetensors_io.ReadBuffers.take

    def counted_recycle(self, array):
        recycled.append(array.shape)
        recycle(self, array)

    def counted_take(self, shape, dtype):
        free = len(self._free)
        array = take(self, shape, dtype)
        reused.extend([shape] * (free - len(self._free)))
        return array

    monkeypatch.setattr(hf_checkpoint.CheckpointTensors, "recycle", counted_recycle)
    monkeypatch.setattr(safetensors_io.ReadBuffers, "take", counted_take)
    path = tiny_checkpoints.path("qwen2")
    torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32").save_pretrained(tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(path)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    assert (hidden, hidden) in recycled and (hidden,) not in recycled  # q_proj yes; norms and biases stay
    assert len(recycled) >= 5 * layers and len(reused) >= 4 * layers
    expected, saved = load_file(path / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name


def test_only_builders_with_a_stable_name_keep_models_on_disk():
    import dataclasses
    import functools

    from torchlike.adapters.model import sequence_classification

    config = tiny.CASES["qwen2"]()
    family = family_for_config(config)
    classifier = sequence_classification.classifier_family(family)
    assert tunix_model.stored_abstract_model(classifier, config, np.float32) not in (
        None, tunix_model.stored_abstract_model(family, config, np.float32))

    def local_builder(hf_config, dtype, rngs):  # a closure may build differently under one name
        return family.build_model(hf_config, dtype, rngs)

    for builder in (local_builder, lambda *args: family.build_model(*args),
                    functools.partial(family.build_model, local_builder)):
        changed = dataclasses.replace(family, build_model=builder)
        assert tunix_model.stored_abstract_model(changed, config, np.float32) is None
