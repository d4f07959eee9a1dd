"""Tunix NNX models in and out: built from HF weights (tensor by tensor, sharded on a mesh), read back out, run.

The family table says which HF tensor each parameter is, and ``weight_plan`` routes and places each one. The forward
helpers give Tunix's decoders what they take for a padded batch: positions that count real tokens and a causal mask
that hides padding.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from ..checkpoint.hf_checkpoint import TensorSpec
from ..distributed.multihost import gather_to_host
from ..families import Family
from ..lora.runtime import lora_mode
from ..runtime import abstract_models
from ..runtime.tracing import fast_tracing
from .nnx_state import flat_variables
from .weight_plan import Source, Target, apply


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape disagrees with what config.json implies."""


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs."""


ABSTRACT_MODELS_KEPT = 8
_abstract_models: dict[tuple, tuple[nnx.GraphDef, nnx.State, dict]] = {}
"""Built abstract models by (family, config, dtype): ``(graphdef, state, partition specs)``, newest last."""


def _config_key(hf_config) -> str:
    fields = hf_config.to_dict()
    fields.pop("_name_or_path", None)  # where the config was read from does not change the model
    return json.dumps(fields, sort_keys=True, default=str)


def _builder_name(builder) -> str | None:
    """A name that tells ``builder`` from every other model builder: a module-level function's dotted name, or a
    ``functools.partial`` of named parts; ``None`` for anything else (a closure or lambda may build differently under
    one name, so its models are not kept on disk)."""
    if isinstance(builder, functools.partial):
        parts = [_builder_name(builder.func)]
        for value in (*builder.args, *builder.keywords.values()):
            plain = isinstance(value, (str, int, float, bool, type(None)))
            parts.append(repr(value) if plain else _builder_name(value))
        named = None not in parts
        return f"partial({', '.join(parts)}, {sorted(builder.keywords)})" if named else None
    qualname, module = getattr(builder, "__qualname__", None), getattr(builder, "__module__", None)
    if not qualname or not module or "<" in qualname:  # <lambda>, <locals>
        return None
    return f"{module}.{qualname}"


def stored_abstract_model(family: Family, hf_config, dtype) -> Path | None:
    """Where :func:`abstract_model_parts` keeps the abstract model of ``hf_config`` on disk (``None``: nowhere, also
    for a family whose builder has no stable name)."""
    builder = _builder_name(family.build_model)
    if builder is None:
        return None
    return abstract_models.entry_path((family.name, builder, _config_key(hf_config), np.dtype(dtype).name))


def abstract_model_parts(family: Family, hf_config, dtype) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """``(graphdef, state, partition specs)`` of the Tunix module for ``hf_config``, shapes only.

    Tracing the constructor under ``nnx.eval_shape`` and splitting the module cost time linear in the
    layer count, so the result is kept per process for the last few (family, config, dtype)
    (:data:`ABSTRACT_MODELS_KEPT`), and on disk for the next process (:mod:`.runtime.abstract_models`).
    Each call returns fresh variables (``set_value`` on one changes no other model); the graphdef is
    shared, as it is immutable.
    """
    key = (family.name, family.build_model, _config_key(hf_config), np.dtype(dtype).name)
    parts = _abstract_models.pop(key, None)
    if parts is None:
        stored = stored_abstract_model(family, hf_config, dtype)
        parts = abstract_models.load(stored)
        if parts is None:
            with fast_tracing():
                abstract = nnx.eval_shape(lambda: family.build_model(hf_config, dtype, nnx.Rngs(0)))
            graphdef, state = nnx.split(abstract)
            specs = {name: spec.get_value() if isinstance(spec, nnx.Variable) else spec
                     for name, spec in flat_variables(nnx.get_partition_spec(state), ...).items()}
            parts = (graphdef, state, specs)
            abstract_models.store(stored, parts)
    _abstract_models[key] = parts
    while len(_abstract_models) > ABSTRACT_MODELS_KEPT:
        del _abstract_models[next(iter(_abstract_models))]
    graphdef, state, specs = parts
    return graphdef, jax.tree.map(lambda leaf: leaf, state), specs


def build_abstract_model(family: Family, hf_config, dtype) -> nnx.Module:
    """The Tunix module for ``hf_config`` with shapes only (no memory allocated); a new module each call."""
    graphdef, state, _ = abstract_model_parts(family, hf_config, dtype)
    return nnx.merge(graphdef, state)


def _sharding_for(spec, mesh: Mesh | None):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, spec if spec is not None else jax.sharding.PartitionSpec())


def _config_hint(nnx_path: str) -> str:
    if "embed" in nnx_path or "lm_head" in nnx_path:
        return "vocab_size/hidden_size"
    if "attn" in nnx_path:
        return "hidden_size/num_attention_heads/num_key_value_heads/head_dim"
    if "mlp" in nnx_path:
        return "hidden_size/intermediate_size"
    return "hidden_size"


def load_weights(
    family: Family,
    hf_config,
    tensors: Iterable[tuple[str, np.ndarray, Path | str]],
    dtype,
    mesh: Mesh | None = None,
    source: str = "checkpoint",
    kept: dict[str, np.ndarray] | None = None,
) -> nnx.Module:
    """Creates the Tunix module and fills it from HF tensors, one tensor at a time.

    Each tensor is routed through the weight plan (:mod:`adapters.model.weight_plan`), transformed to the NNX layout,
    cast to ``dtype`` and placed straight on its device(s) (``NamedSharding`` from the Tunix partition specs when
    ``mesh`` is given) before the next is read, so the host holds one tensor at a time.

    Args:
        family: the family table.
        hf_config: the ``transformers`` config.
        tensors: ``(hf_name, array, file)`` triples, e.g. from ``iter_checkpoint_tensors``.
        dtype: parameter dtype (a numpy/jax dtype).
        mesh: optional device mesh with axes ``fsdp``/``tp``.
        source: the checkpoint's location, for messages.
        kept: filled with the tensors the family passes through (``Family.kept_hf_keys``: a tower the Tunix model
            lacks), by HF name, as host copies in their own dtype; ``None``: they are reported unused.

    Returns:
        The loaded ``nnx.Module``.

    Raises:
        WeightShapeError: a tensor's shape disagrees with config.json (names key, file, shapes).
        MissingWeightsError: parameters with no tensor in the checkpoint.
    """
    graphdef, state, specs = abstract_model_parts(family, hf_config, dtype)
    variables = flat_variables(state, ...)
    targets = {path: Target(tuple(variable.get_value().shape), np.dtype(dtype), _sharding_for(specs.get(path), mesh))
               for path, variable in variables.items()}

    def check(routed: Source, found: tuple[int, ...], wanted: tuple[int, ...], file: Path | str) -> bool:
        if found != wanted:
            raise WeightShapeError(
                f"{file}: tensor {routed.name!r} has shape {found} but config.json implies {wanted} (for "
                f"{routed.target}, NNX shape {targets[routed.target].shape}). Check {_config_hint(routed.target)} in "
                "config.json against the weights, or pass the matching config."
            )
        return True

    if family.import_tensors is not None:
        tensors = family.import_tensors(tensors, hf_config)
    if kept is not None and family.kept_hf_keys:
        tensors = KeptTensors(family, tensors, kept)
    applied = apply(family, targets, stream=tensors, check=check)
    for path, value in applied.values.items():
        variables[path].set_value(value)
    filled = set(applied.values)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    unexpected = [name for name in applied.unexpected
                  if not (family.is_ignored(name) or (tied and name == "lm_head.weight"))]

    missing = [name for name in variables if name not in filled]
    if missing:
        hf_names = [hf for name in missing for hf, _ in family.nnx_to_hf(name)] or missing
        raise MissingWeightsError(
            f"{source} is missing {len(missing)} tensor(s) the {family.name} model needs: "
            f"{hf_names[:8]}{' ...' if len(hf_names) > 8 else ''}. The checkpoint is incomplete or "
            "config.json does not describe it (e.g. num_hidden_layers, tie_word_embeddings)."
        )
    prediction_layers = [name for name in unexpected if _is_prediction_layer(name, hf_config)]
    if prediction_layers:
        unexpected = [name for name in unexpected if name not in prediction_layers]
        layers = sorted({int(name.split(".")[2]) for name in prediction_layers})
        warnings.warn(
            f"{source}: the {len(layers)} multi-token-prediction layer(s) after the last decoder layer "
            f"(model.layers.{', '.join(map(str, layers))}.*, num_nextn_predict_layers="
            f"{hf_config.num_nextn_predict_layers}) are not loaded: the model predicts the next token, as the "
            "transformers model does.",
            stacklevel=3,
        )
    if unexpected:
        warnings.warn(
            f"Some weights of {source} were not used by the {family.name} model: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}.",
            stacklevel=3,
        )
    return nnx.merge(graphdef, state)


_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_prediction_layer(name: str, hf_config) -> bool:
    """Whether ``name`` belongs to a multi-token-prediction layer a checkpoint publishes after its decoder layers
    (DeepSeek-V3's and GLM-4 MoE's ``num_nextn_predict_layers``), which ``transformers`` does not build."""
    extra = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
    match = _DECODER_LAYER.match(name)
    layers = hf_config.num_hidden_layers
    return bool(extra and match and layers <= int(match[1]) < layers + extra)


class KeptTensors:
    """A tensor stream less the tensors its family passes through (``Family.kept_hf_keys``), which are copied into
    ``kept`` as they go by; a stream's ``recycle`` is handed on."""

    def __init__(self, family: Family, tensors: Iterable[tuple[str, np.ndarray, Path | str]],
                 kept: dict[str, np.ndarray]):
        self.family, self.tensors, self.kept = family, tensors, kept
        if hasattr(tensors, "recycle"):
            self.recycle = tensors.recycle

    def __iter__(self):
        for name, array, origin in self.tensors:
            if self.family.is_kept(name):
                # Under the published name (export writes the checkpoint's layout); the stream may reuse its buffer.
                self.kept[self.family.published_name(name)] = np.array(array, copy=True)
                if hasattr(self, "recycle"):
                    self.recycle(array)
                continue
            yield name, array, origin


def kept_specs(kept: dict[str, np.ndarray]) -> list[TensorSpec]:
    """Export specs of the tensors a model passes through, as they were read."""
    return [TensorSpec(name, np.dtype(array.dtype), tuple(array.shape)) for name, array in kept.items()]


@functools.cache
def _to_hf_on_device(layout, stacked: bool):
    """A jitted NNX -> HF layout transform; a stacked parameter's part index is an argument, so the parts (a
    mixture-of-experts layer's experts) share one program."""
    def to_hf(array, index):
        return layout.to_hf(array[index] if stacked else array)

    return jax.jit(to_hf)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def export_plan(family: Family, module: nnx.Module) -> tuple[list[TensorSpec], dict[str, tuple]]:
    """HF tensor specs for every parameter of ``module``, plus how to fetch each one.

    Returns:
        ``(specs, sources)`` where ``specs`` are in natural HF-name order and
        ``sources[hf_name] = (array, rule)``.
    """
    sources: dict[str, tuple] = {}
    specs: list[TensorSpec] = []
    for nnx_path, variable in flat_variables(module).items():
        targets = family.nnx_to_hf(nnx_path)
        if not targets:
            raise ValueError(f"parameter {nnx_path!r} has no Hugging Face name in the {family.name} table.")
        array = variable.get_value()
        for hf_name, rule in targets:
            part_shape = tuple(array.shape[1:]) if rule.stack else tuple(array.shape)
            specs.append(TensorSpec(hf_name, np.dtype(array.dtype), rule.layout.hf_shape(part_shape)))
            sources[hf_name] = (array, rule)
    specs.sort(key=lambda spec: _natural_key(spec.name))
    return specs, sources


def materialize_hf_tensor(sources: dict[str, tuple], spec: TensorSpec) -> np.ndarray:
    """Copies one parameter to the host and converts it to the HF layout (gathered from every process when it is
    sharded over several: each process must call this for the same tensors in the same order)."""
    array, rule = sources[spec.name]
    if rule.stack or rule.layout.moves_axes:
        array = _to_hf_on_device(rule.layout, rule.stack is not None)(array, rule.stack[0] if rule.stack else 0)
    # ascontiguousarray returns at least one dimension: a 0-d tensor (Gemma 4's clipping bounds) keeps its shape.
    return np.ascontiguousarray(gather_to_host(array)).reshape(spec.shape)


def _array_module(array):
    """numpy for a numpy array (host-side inputs), ``jax.numpy`` otherwise (traced values)."""
    return np if isinstance(array, np.ndarray) else jnp


def positions_from_mask(mask):
    """Position ids ``[B, T]`` int32 of a padded batch: each token's count of real tokens before it
    (``cumsum(mask) - 1``, as ``transformers.generate`` does), 0 before a row's first real token.

    Args:
        mask: ``[B, T]`` bool or 0/1, numpy (the result is numpy) or JAX.
    """
    xp = _array_module(mask)
    return xp.maximum(xp.cumsum(mask, axis=-1) - 1, 0).astype(xp.int32)


def causal_attention(mask, segment_ids=None):
    """The ``[B, T, T]`` bool (query, key) mask of a padded batch: causal, padding keys hidden, and, with
    ``segment_ids``, block-diagonal: a query sees only keys of its own segment (packed sequences).

    Args:
        mask: ``[B, T]`` bool, numpy (the result is numpy) or JAX.
        segment_ids: ``[B, T]`` ints, equal within one packed sequence (:func:`segment_ids_from_positions`), or
            ``None`` for one sequence per row.
    """
    xp = _array_module(mask)
    length = mask.shape[-1]
    attention = xp.tril(xp.ones((length, length), dtype=bool))[None] & mask[:, None, :]
    if segment_ids is not None:
        attention = attention & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return attention


def segment_ids_from_positions(position_ids):
    """Segment ids ``[B, T]`` int32 of packed rows: a new segment starts wherever the position id is 0 (how
    transformers finds packed sequences from ``position_ids``, ``find_packed_sequence_indices``).

    Args:
        position_ids: ``[B, T]`` ints restarting at 0 at each packed sequence; numpy or JAX.
    """
    xp = _array_module(position_ids)
    return xp.cumsum(position_ids == 0, axis=-1).astype(xp.int32)


def batch_positions_and_attention(batch: dict):
    """``(positions [B, T], attention [B, T, T])`` for a batch with ``attention_mask``: positions counted from the
    mask and plain causal attention (:func:`positions_from_mask`, :func:`causal_attention`), or, when the batch has
    ``position_ids`` (packed rows), those positions and attention kept inside each packed sequence
    (:func:`segment_ids_from_positions`), so no token sees another sequence of its row; with ``token_type_ids``
    (a vision-language batch), each image's tokens also see each other both ways (:func:`image_blocks`)."""
    mask = batch["attention_mask"].astype(bool)
    if "position_ids" not in batch:
        positions, attention = positions_from_mask(mask), causal_attention(mask)
    else:
        positions = batch["position_ids"].astype(jnp.int32)
        attention = causal_attention(mask, segment_ids_from_positions(positions))
    if "token_type_ids" in batch:
        attention = attention | image_blocks(batch["token_type_ids"])
    return positions, attention


def image_inputs(batch: dict) -> dict:
    """The keyword inputs a multimodal family's ``forward``/``hidden_states`` take from a batch: its ``images``
    (``Family.images``), when the batch has them."""
    return {"images": batch["images"]} if "images" in batch else {}


def image_blocks(token_type_ids):
    """``[B, T, T]`` bool: query and key in the same run of image tokens (``token_type_ids == 1``), which attend to
    each other both ways in Gemma 3 (``transformers``' ``get_block_sequence_ids_for_mask``).

    Args:
        token_type_ids: ``[B, T]``, 1 on image tokens; numpy or JAX.
    """
    xp = _array_module(token_type_ids)
    is_image = token_type_ids == 1
    previous = xp.concatenate([xp.zeros_like(is_image[:, :1]), is_image[:, :-1]], axis=1)
    block = xp.cumsum(is_image & ~previous, axis=1)
    same = block[:, :, None] == block[:, None, :]
    return same & is_image[:, :, None] & is_image[:, None, :]


def causal_inputs(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tunix inputs ``(tokens, positions, attention)`` for a padded batch, prepared on the host
    (:func:`positions_from_mask`, :func:`causal_attention`)."""
    mask = np.asarray(attention_mask, dtype=bool)
    return (jnp.asarray(input_ids, jnp.int32), jnp.asarray(positions_from_mask(mask)),
            jnp.asarray(causal_attention(mask)))


def causal_lm_logits(family: Family, module: nnx.Module, batch: dict) -> jax.Array:
    """Logits ``[B, T, V]`` of a padded ``input_ids``/``attention_mask`` batch (packed rows when it has
    ``position_ids``: :func:`batch_positions_and_attention`), for use inside a jitted step."""
    positions, attention = batch_positions_and_attention(batch)
    return family.forward(module, batch["input_ids"].astype(jnp.int32), positions, attention, **image_inputs(batch))


@nnx.jit(static_argnums=(0, 1))
def _jitted_forward(forward, lora, module, tokens, positions, attention, inputs):
    with lora_mode(lora):
        return forward(module, tokens, positions, attention, **inputs)


def forward_logits(
    family: Family, module: nnx.Module, input_ids: np.ndarray, attention_mask: np.ndarray, lora: str = "eval",
    images: np.ndarray | None = None, token_type_ids: np.ndarray | None = None,
) -> jax.Array:
    """Float32 logits ``[B, T, V]`` for a (possibly padded) batch, compiled once per shape.

    Args:
        lora: ``"eval"`` (adapter on, no dropout) or ``"disabled"`` (base model only); see
            :func:`adapters.lora.runtime.lora_mode`.
        images: the module's images (``Family.images``), or ``None``.
        token_type_ids: ``[B, T]``, 1 on image tokens: each image's tokens also attend to each other both ways
            (:func:`image_blocks`); ``None``: plain causal attention.
    """
    tokens, positions, attention = causal_inputs(input_ids, attention_mask)
    if token_type_ids is not None:
        attention = attention | jnp.asarray(image_blocks(np.asarray(token_type_ids)))
    inputs = {} if images is None else {"images": jax.tree.map(jnp.asarray, images)}
    with fast_tracing():
        return _jitted_forward(family.forward, lora, module, tokens, positions, attention, inputs)
