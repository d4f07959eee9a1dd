"""``state_dict()`` / ``load_state_dict()`` with PyTorch's semantics and the tree surgery done for you.

``load_state_dict`` accepts a torchlike state dict, a lazy checkpoint from :func:`torchlike.load`
(only the needed arrays are read, straight into the model's sharding), a ``transformers`` torch
``state_dict()``, a safetensors dict or a PEFT adapter's tensors (translated through the family
table), nested dicts and int key parts, ``model.``/``base_model.model.`` prefixes, ``key_map`` regex
renames, LoRA factors the model lacks (reported, or folded in with ``merge_lora=True``) and dtype
casts. Which key fills which parameter, and how, is ``adapters.model.weight_plan``'s (one ``weight_plan.apply`` call);
this module keeps torch's semantics: ``strict``, the ``IncompatibleKeys`` report and torch's message layout.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .adapters.checkpoint import hf_checkpoint
from .adapters.families import all_families
from .adapters.lora.merge import merge_factors
from .adapters.model import weight_plan
from .adapters.model.nnx_state import dotted_path, parameter_slots

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["IncompatibleKeys", "StateDict", "load_state_dict", "state_dict"]


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
    if lora is not None and lora.peft_type == "LORA":
        metadata["lora"] = {"r": lora.r, "lora_alpha": lora.lora_alpha, "use_rslora": lora.use_rslora,
                            "scale": lora.scale, "target_modules": lora.target_modules}
    return StateDict({name: slot.get() for name, slot in parameter_slots(model.module).items()}, metadata=metadata)


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


def _as_array(value: ArrayLike, key: str):
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = hf_checkpoint.torch_to_numpy(value)
    if isinstance(value, jax.Array | np.ndarray) and value.dtype != object:
        return value
    raise RuntimeError(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                       f"from checkpoint but received {type(value)}"
                       + (" (dtype object: pass numeric arrays)" if isinstance(value, np.ndarray) else ""))


def _shape_hint(name: str, checkpoint_shape: tuple, model_shape: tuple) -> str:
    lora = weight_plan.LORA_FACTOR.match(name)
    if lora:
        rank_axis = -1 if lora["factor"] == "a" else 0
        return (f" Likely cause: LoRA rank {checkpoint_shape[rank_axis]} in checkpoint, {model_shape[rank_axis]} in "
                f"model; use LoraConfig(r={checkpoint_shape[rank_axis]}).")
    if "embed" in name or "lm_head" in name:
        return " Likely cause: a different vocabulary size (resized embeddings?)."
    return " Likely cause: the checkpoint comes from a model of another size (compare config.json)."


def _is_tied_head_copy(model, name: str, read_name, embedding_at) -> bool:
    """Whether ``name`` is the ``lm_head.weight`` that transformers' ``state_dict()`` lists for a model whose head is
    its input embedding (torch loads it into the tied module), equal to the embedding (``embedding_at(path)``: the
    state dict's, else the model's). A different head is reported unexpected, as it would be lost."""
    stripped = next((name[len(prefix):] for prefix in weight_plan.PREFIXES if name.startswith(prefix)), name)
    found = model.family.hf_to_nnx("model.embed_tokens.weight")
    if stripped != "lm_head.weight" or not getattr(model.config, "tie_word_embeddings", False) or found is None:
        return False
    embedding = embedding_at(found[0])
    if embedding is None:
        return False
    head = read_name(name)
    return tuple(head.shape) == tuple(embedding.shape) and bool(
        np.array_equal(np.asarray(head).astype(embedding.dtype), np.asarray(embedding)))


def _decoder(family_name: str) -> str:
    """The text family a family's model is built around (``Family.decoder``; a text family's own name)."""
    return next((family.decoder or family.name for family in all_families() if family.name == family_name),
                family_name)


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
    if metadata.get("family") not in (None, family.name) and _decoder(metadata["family"]) != _decoder(family.name):
        raise ValueError(f"the checkpoint holds a {metadata['family']} model but this model is {family.name}; "
                         "load it into a model of the same family (and size).")
    lazy = hasattr(state_dict, "restore") and hasattr(state_dict, "shape_dtype")
    slots = parameter_slots(model.module)
    entries = _flatten(state_dict, lazy)
    values = {key: value for key, _, value in entries}

    def read(source: weight_plan.Source):
        return _as_array(state_dict[source.key] if lazy else values[source.key], source.name)

    def shape(source: weight_plan.Source) -> tuple:
        return tuple(state_dict.shape_dtype(source.key)[0] if lazy else read(source).shape)

    error_msgs: list[str] = []
    mismatched: list[str] = []

    def check(source: weight_plan.Source, found: tuple, wanted: tuple, origin: None) -> bool:
        if found == wanted:
            return True
        if ignore_mismatched_sizes:
            mismatched.append(source.target)
        else:
            error_msgs.append(f"size mismatch for {source.target}: copying a param with shape {found} from checkpoint, "
                              f"the shape in current model is {wanted}." + _shape_hint(source.target, found, wanted))
        return False

    def restore_later(source: weight_plan.Source) -> bool:  # read all at once, straight into the model's sharding
        return lazy and not (source.layout.moves_axes or source.stacked)

    applied = weight_plan.apply(family, weight_plan.slot_targets(slots, cast=not assign),
                                keys=[(key, name) for key, name, _ in entries], key_map=key_map, read=read,
                                shape_of=shape, check=check, defer=restore_later)
    load_plan = applied.plan
    if state_dict and not load_plan.targets:
        raise ValueError(f"none of the checkpoint's {len(load_plan.unexpected)} keys match this {family.name} model "
                         f"(checkpoint keys look like {load_plan.unexpected[:2]}, the model's like "
                         f"{next(iter(slots))!r}). It may come from another model family; rename keys with "
                         "key_map={regex: replacement}.")
    loaded: dict[str, Any] = dict(applied.values)
    error_msgs.extend(f"{target} is stacked from {sources[0].stack[1]} checkpoint tensors but only "
                      f"{[source.name for source in sources]} were given."
                      for target, sources in applied.incomplete.items())
    restore = {source.key: target for target, source in applied.deferred.items()}
    lora_factors = applied.outside  # LoRA factors of weights this model does not adapt
    if restore:
        shardings = {key: slots[target].get().sharding for key, target in restore.items()}
        dtypes = None if assign else {key: slots[target].get().dtype for key, target in restore.items()}
        restored = state_dict.restore(shardings, dtypes)
        loaded.update({target: restored[key] for key, target in restore.items()})

    unused_lora = [source.name for source in lora_factors.values()]
    if lora_factors and merge_lora and not error_msgs:
        scale = (metadata.get("lora") or {}).get("scale")
        if scale is None:
            raise ValueError("merge_lora=True needs the adapter's scale (LoRA r and lora_alpha) in the checkpoint "
                             "metadata, and this checkpoint has none. Save it with "
                             "torchlike.save(peft_model.state_dict(), path), which records them.")
        for weight_path in dict.fromkeys(weight_plan.LORA_FACTOR.match(name)["weight"] for name in lora_factors):
            a, b = (lora_factors.get(f"{weight_path}_lora_{factor}") for factor in "ab")
            if a is None or b is None:
                raise ValueError(f"merge_lora=True: {weight_path} has only lora_{'a' if a else 'b'} in the checkpoint.")
            base = loaded.get(weight_path, slots[weight_path].get())
            loaded[weight_path] = merge_factors(family, weight_path, base, read(a), read(b), scale)
        unused_lora = []
    keys_by_name = {name: key for key, name, _ in entries}

    def read_name(name: str):
        key = keys_by_name[name]
        return _as_array(state_dict[key] if lazy else values[key], name)

    def embedding_at(path: str):
        if path in load_plan.targets:
            return read(load_plan.targets[path][0])
        return slots[path].get() if path in slots else None

    unexpected = [name for name in load_plan.unexpected
                  if not _is_tied_head_copy(model, name, read_name, embedding_at)] + unused_lora

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
