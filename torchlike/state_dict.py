"""``state_dict()`` / ``load_state_dict()`` with PyTorch's semantics and the tree surgery done for you.

``load_state_dict`` accepts a torchlike state dict, a lazy checkpoint from :func:`torchlike.load`
(only the needed arrays are read, straight into the model's sharding), a ``transformers``
torch ``state_dict()`` or a safetensors dict (translated through the family table), nested
dicts and int key parts, ``model.``/``base_model.model.`` prefixes, ``key_map`` regex renames,
LoRA factors the model lacks (reported, or folded in with ``merge_lora=True``) and dtype casts.
"""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .adapters import hf_checkpoint, tunix_model
from .adapters.lora.merge import merge_factors
from .adapters.nnx_state import ParameterSlot, dotted_path, parameter_slots

__all__ = ["IncompatibleKeys", "StateDict", "load_state_dict", "state_dict"]

_PREFIXES = ("base_model.model.", "model.", "module.")
_LORA_KEY = re.compile(r"^(?P<weight>.+)_lora_(?P<factor>[ab])$")


class IncompatibleKeys(namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])):
    """torch's two-field result (``missing, unexpected = model.load_state_dict(...)``), plus
    ``mismatched_keys``: the keys skipped for shape with ``ignore_mismatched_sizes=True``."""

    def __new__(cls, missing_keys, unexpected_keys, mismatched_keys=()):
        self = super().__new__(cls, list(missing_keys), list(unexpected_keys))
        self.mismatched_keys = list(mismatched_keys)
        return self

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return super().__repr__()

    __str__ = __repr__


class StateDict(dict):
    """A flat ``{dotted name: jax.Array}`` dict whose ``metadata`` (family, dtype, LoRA rank/alpha)
    travels into :func:`torchlike.save`, as torch's ``state_dict()._metadata`` does."""

    def __init__(self, *args, metadata: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.metadata = dict(metadata or {})


def state_dict(model) -> StateDict:
    """The model's parameters as ``{"layers.0.attn.q_proj.w": array, ...}``: NNX paths joined by dots,
    every part a string, native layout, the arrays themselves (no copies)."""
    metadata: dict[str, Any] = {"family": model.family.name, "dtype": np.dtype(model.dtype).name}
    lora = getattr(model, "active_peft_config", None)
    if lora is not None:
        metadata["lora"] = {"r": lora.r, "lora_alpha": lora.lora_alpha, "use_rslora": lora.use_rslora,
                            "scale": lora.scale, "target_modules": lora.target_modules}
    return StateDict({name: slot.get() for name, slot in parameter_slots(model.module).items()}, metadata=metadata)


@dataclass
class _Source:
    """Where a model parameter's value comes from in the checkpoint."""

    keys: list[Any]
    names: list[str]
    rule: Any = None  # a family WeightRule when the keys are HF names
    parts: list[Any] = field(default_factory=list)


def _flatten(mapping: Mapping, lazy: bool) -> list[tuple[Any, str, Any]]:
    """``(original key, dotted string name, value or None when lazy)``, recursing into nested dicts."""
    entries = []
    for key in mapping.keys():
        name = dotted_path(key) if isinstance(key, tuple) else str(key)
        value = None if lazy else mapping[key]
        if isinstance(value, Mapping):
            entries.extend((f"{key}.{sub_key}", f"{name}.{sub_name}", sub_value)
                           for sub_key, sub_name, sub_value in _flatten(value, False))
        else:
            entries.append((key, name, value))
    return entries


def _apply_key_map(name: str, key_map: Mapping[str, str] | None) -> str:
    for pattern, replacement in (key_map or {}).items():
        name = re.sub(pattern, replacement, name)
    return name


def _route(original_name: str, renamed: str, matched: str, translated: bool = False) -> str:
    """How a checkpoint key reached the model: ``key_map``, a stripped prefix, the family's HF-name table, or as is."""
    steps = ["key_map"] if renamed != original_name else []
    if matched != renamed:
        steps.append(f"prefix {renamed[:len(renamed) - len(matched)]!r} stripped")
    if translated:
        steps.append("HF name translated")
    return " then ".join(steps) or "as is"


def _as_array(value: Any, key: str):
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = hf_checkpoint.torch_to_numpy(value)
    if isinstance(value, jax.Array | np.ndarray) and value.dtype != object:
        return value
    raise RuntimeError(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                       f"from checkpoint but received {type(value)}"
                       + (" (dtype object: pass numeric arrays)" if isinstance(value, np.ndarray) else ""))


def _shape_hint(name: str, checkpoint_shape: tuple, model_shape: tuple) -> str:
    lora = _LORA_KEY.match(name)
    if lora:
        rank_axis = -1 if lora["factor"] == "a" else 0
        return (f" Likely cause: LoRA rank {checkpoint_shape[rank_axis]} in checkpoint, {model_shape[rank_axis]} in "
                f"model; use LoraConfig(r={checkpoint_shape[rank_axis]}).")
    if "embed" in name or "lm_head" in name:
        return " Likely cause: a different vocabulary size (resized embeddings?)."
    return " Likely cause: the checkpoint comes from a model of another size (compare config.json)."


def load_state_dict(
    model,
    state_dict: Mapping,
    strict: bool = True,
    assign: bool = False,
    key_map: Mapping[str, str] | None = None,
    merge_lora: bool = False,
    ignore_mismatched_sizes: bool = False,
) -> IncompatibleKeys:
    """Copies parameters from ``state_dict`` into ``model`` (see :meth:`CausalLM.load_state_dict`)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}. Pass model.state_dict(), "
                        "torchlike.load(path) or a dict of arrays.")
    family = model.family
    metadata = dict(getattr(state_dict, "metadata", None) or {})
    if metadata.get("family") not in (None, family.name):
        raise ValueError(f"the checkpoint holds a {metadata['family']} model but this model is {family.name}; "
                         "load it into a model of the same family (and size).")
    lazy = hasattr(state_dict, "restore") and hasattr(state_dict, "shape_dtype")
    slots = parameter_slots(model.module)
    sources: dict[str, _Source] = {}
    lora_factors: dict[str, dict[str, tuple[Any, str]]] = {}
    unexpected: list[str] = []
    claimed: dict[str, dict[Any, tuple[str, str]]] = {}

    def claim(target: str, part: Any, original_name: str, route: str) -> None:
        """Records that ``original_name`` (reached by ``route``) loads into ``part`` of ``target`` (``None``: all
        of it, a stack index: one of the tensors stacked into it); two sources for one place are refused."""
        parts = claimed.setdefault(target, {})
        clash = parts.get(part) or parts.get(None) or (next(iter(parts.values())) if part is None and parts else None)
        if clash:
            raise ValueError(f"checkpoint keys {clash[0]!r} ({clash[1]}) and {original_name!r} ({route}) both map to "
                             f"{target!r}, so one would silently overwrite the other. Drop one of them from the "
                             "state dict, or change key_map so each model parameter has a single source.")
        parts[part] = (original_name, route)

    for key, original_name, value in _flatten(state_dict, lazy):
        name = _apply_key_map(original_name, key_map)
        candidates = [name] + [name[len(p):] for p in _PREFIXES if name.startswith(p)]
        direct = next((c for c in candidates if c in slots), None)
        if direct is not None:
            claim(direct, None, original_name, _route(original_name, name, direct))
            sources[direct] = _Source([key], [original_name], parts=[value])
            continue
        from_hf = next(((c, *found) for c in candidates if (found := family.hf_to_nnx(c)) and found[0] in slots), None)
        if from_hf is not None:
            hf_name, target, rule = from_hf
            claim(target, rule.stack, original_name, _route(original_name, name, hf_name, translated=True))
            source = sources.setdefault(target, _Source([], [], rule=rule))
            source.keys.append(key)
            source.names.append(original_name)
            source.parts.append((rule, value))
            continue
        lora = _LORA_KEY.match(name) and next((c for c in candidates if _LORA_KEY.match(c)
                                               and _LORA_KEY.match(c)["weight"] in slots), None)
        if lora:
            factor = _LORA_KEY.match(lora)
            claim(lora, None, original_name, _route(original_name, name, lora))
            lora_factors.setdefault(factor["weight"], {})[factor["factor"]] = (key, value, original_name)
            continue
        unexpected.append(original_name)

    if state_dict and not sources and not lora_factors:
        example_model = next(iter(slots))
        raise ValueError(f"none of the checkpoint's {len(unexpected)} keys match this {family.name} model (checkpoint "
                         f"keys look like {unexpected[:2]}, the model's like {example_model!r}). It may come from "
                         "another model family; rename keys with key_map={regex: replacement}.")

    error_msgs: list[str] = []
    mismatched: list[str] = []
    loaded: dict[str, Any] = {}
    lazy_targets: dict[Any, tuple[str, ParameterSlot]] = {}
    for target, source in sources.items():
        slot = slots[target]
        current = slot.get()
        model_shape = tuple(current.shape)
        if source.rule is None:
            key = source.keys[0]
            checkpoint_shape = (tuple(state_dict.shape_dtype(key)[0]) if lazy
                                else tuple(_as_array(source.parts[0], target).shape))
        else:
            part_shape = model_shape[1:] if source.rule.stack else model_shape
            checkpoint_shape = tuple(_as_array(source.parts[0][1] if not lazy else state_dict[source.keys[0]],
                                               source.names[0]).shape)
            model_shape = source.rule.layout.hf_shape(part_shape)
        if checkpoint_shape != model_shape:
            if ignore_mismatched_sizes:
                mismatched.append(target)
                continue
            error_msgs.append(f"size mismatch for {target}: copying a param with shape {checkpoint_shape} from "
                              f"checkpoint, the shape in current model is {model_shape}."
                              + _shape_hint(target, checkpoint_shape, model_shape))
            continue
        dtype = None if assign else current.dtype
        sharding = current.sharding
        if source.rule is None and lazy:
            lazy_targets[source.keys[0]] = (target, slot)
        elif source.rule is None:
            array = _as_array(source.parts[0], target)
            loaded[target] = jax.device_put(array.astype(dtype) if dtype is not None else array, sharding)
        else:
            arrays = [(rule, _as_array(state_dict[key] if lazy else value, name))
                      for key, name, (rule, value) in zip(source.keys, source.names, source.parts, strict=True)]
            if source.rule.stack:
                count = source.rule.stack[1]
                if len(arrays) != count:
                    error_msgs.append(f"{target} is stacked from {count} checkpoint tensors but only "
                                      f"{source.names} were given.")
                    continue
                ordered = sorted(arrays, key=lambda item: item[0].stack[0])
                parts = [tunix_model.place_hf_tensor(rule, array, tuple(current.shape[1:]), dtype or array.dtype, None)
                         for rule, array in ordered]
                loaded[target] = tunix_model.stack_on_device(parts, sharding)
            else:
                rule, array = arrays[0]
                loaded[target] = tunix_model.place_hf_tensor(rule, array, tuple(current.shape),
                                                             dtype or array.dtype, sharding)
    if lazy_targets:
        shardings = {key: slot.get().sharding for key, (_, slot) in lazy_targets.items()}
        dtypes = None if assign else {key: slot.get().dtype for key, (_, slot) in lazy_targets.items()}
        restored = state_dict.restore(shardings, dtypes)
        for key, (target, _) in lazy_targets.items():
            loaded[target] = restored[key]

    merged_into: list[str] = []
    unused_lora = [name for factors in lora_factors.values() for (_, _, name) in factors.values()]
    if lora_factors and merge_lora and not error_msgs:
        scale = (metadata.get("lora") or {}).get("scale")
        if scale is None:
            raise ValueError("merge_lora=True needs the adapter's scale (LoRA r and lora_alpha) in the checkpoint "
                             "metadata, and this checkpoint has none. Save it with "
                             "torchlike.save(peft_model.state_dict(), path), which records them.")
        for weight_path, factors in lora_factors.items():
            if set(factors) != {"a", "b"}:
                raise ValueError(f"merge_lora=True: {weight_path} has only lora_{''.join(factors)} in the checkpoint.")
            values = {factor: _as_array(state_dict[key] if lazy else value, name)
                      for factor, (key, value, name) in factors.items()}
            base = loaded.get(weight_path, slots[weight_path].get())
            loaded[weight_path] = merge_factors(family, weight_path, base, values["a"], values["b"], scale)
            merged_into.append(weight_path)
        unused_lora = []
    unexpected.extend(unused_lora)

    if not error_msgs:
        for target, array in loaded.items():
            slots[target].set(array)
    missing = [name for name in slots if name not in loaded and name not in mismatched]
    if strict:
        if unexpected:
            quoted = ", ".join(f'"{k}"' for k in unexpected)
            error_msgs.insert(0, f"Unexpected key(s) in state_dict: {quoted}. ")
        if missing:
            error_msgs.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if error_msgs:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(type(model).__name__,
                                                                               "\n\t".join(error_msgs)))
    return IncompatibleKeys(missing, unexpected, mismatched)
