"""The one weight plan: which model slot each source tensor fills, and how it gets there.

Checkpoint files (``tunix_model.load_weights``), state dicts (``torchlike``'s ``load_state_dict``) and PEFT
adapters (``lora.peft_format.load_peft_state``) all load through :func:`apply`: it routes each source key to the slot
parts it fills (:func:`routes`, a :class:`Source`; :func:`plan` routes every key of a source at once and refuses two
for one place), checks each tensor's shape against the slot's :class:`Target` through the caller's ``check``, and
makes the slot values with an :class:`Assembly` (shaped, cast and placed as the :class:`Target` says) as the tensors
arrive. How several tensors make one slot is data on the family table's row (``WeightRule.stack``), so a family that
stacks more tensors into one parameter (per-expert weights) needs only its rows.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..families.base import AS_IS, INPUT_PROJECTION, OUTPUT_PROJECTION, Family, Layout
from ..runtime.tracing import record_trace
from .nnx_state import ParameterSlot

PREFIXES = ("base_model.model.", "model.", "module.")
"""Prefixes a source key may carry that the model's names lack (PEFT's wrapper, a wrapping module, DDP)."""

LORA_FACTOR = re.compile(r"^(?P<weight>.+)_lora_(?P<factor>[ab])$")
PEFT_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")
PEFT_LAYOUTS = {"A": OUTPUT_PROJECTION, "B": INPUT_PROJECTION}
"""PEFT's ``A (r, in)`` is Qwix's ``a (contract..., r)`` flattened and transposed: the output-projection layout;
``B (out, r)`` is ``b (r, remain...)`` likewise: the input-projection layout."""


class Target(NamedTuple):
    """What a slot's value must be: ``shape``, ``dtype`` (``None``: the source's own) and ``sharding``."""

    shape: tuple[int, ...]
    dtype: Any = None
    sharding: Any = None


@dataclass(frozen=True)
class Source:
    """One source tensor and the slot part it fills.

    Args:
        key: the source's own key (a state dict's may be a tuple).
        name: the key as a string, for messages.
        target: the slot's dotted NNX path.
        layout: how the tensor's axes become the slot's.
        stack: ``(index, count)`` when ``count`` tensors make the slot, stacked on ``axis``.
        axis: the slot's stacking axis; ``None`` when each part is the whole slot (the one ``lora_A`` that the two
            projections Tunix fuses into one einsum share).
        route: how the key reached the slot, for messages (``"prefix 'model.' stripped then HF name translated"``).
    """

    key: Any
    name: str
    target: str
    layout: Layout = AS_IS
    stack: tuple[int, int] | None = None
    axis: int | None = 0
    route: str = "as is"

    @property
    def stacked(self) -> bool:
        return self.stack is not None and self.axis is not None

    def part_shape(self, target_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The NNX shape this tensor becomes: the slot's, less the stacking axis."""
        shape = tuple(target_shape)
        return shape[:self.axis] + shape[self.axis + 1:] if self.stacked else shape

    def shape(self, target_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this tensor must have to fill its part of a slot shaped ``target_shape``."""
        return tuple(self.layout.hf_shape(self.part_shape(target_shape)))


def routes(family: Family, slots: Container[str], key: Hashable, name: str | None = None,
           key_map: Mapping[str, str] | None = None) -> list[Source]:
    """The slot parts that source key ``key`` (shown as ``name``) fills: one, or several for a tensor that fills
    several parameters (a ``load_only`` row's fused tensor); empty when it fills none.

    ``key_map`` (``{regex: replacement}``) renames ``name`` first; then the key, and the key with a :data:`PREFIXES`
    entry stripped, is tried as a slot's own name, the NNX LoRA factor of a slot's weight (whose target the model
    may lack), an HF name in the family table, and a PEFT LoRA factor of a slot.
    """
    name = str(key) if name is None else name
    renamed = name
    for pattern, replacement in (key_map or {}).items():
        renamed = re.sub(pattern, replacement, renamed)
    for candidate in [renamed] + [renamed[len(prefix):] for prefix in PREFIXES if renamed.startswith(prefix)]:
        found = _translate(family, slots, candidate)
        if found:
            steps = ["key_map"] if renamed != name else []
            if candidate != renamed:
                steps.append(f"prefix {renamed[:len(renamed) - len(candidate)]!r} stripped")
            return [Source(key, name, target, route=" then ".join(steps + how) or "as is", **fields)
                    for target, how, fields in found]
    return []


def route(family: Family, slots: Container[str], key: Hashable, name: str | None = None,
          key_map: Mapping[str, str] | None = None) -> Source | None:
    """The first of :func:`routes`, or ``None`` (a key that fills one slot, as every on-disk HF name does)."""
    found = routes(family, slots, key, name, key_map)
    return found[0] if found else None


def _translate(family: Family, slots: Container[str], name: str) -> list[tuple[str, list[str], dict]]:
    """``(target, how it was translated, Source fields)`` of each slot a key without prefix fills."""
    lora = LORA_FACTOR.match(name)
    if name in slots or (lora and lora["weight"] in slots):
        return [(name, [], {})]
    peft = PEFT_FACTOR.match(name)
    if not peft:
        return [(path, ["HF name translated"], {"layout": rule.layout, "stack": rule.stack})
                for path, rule in family.hf_to_nnx_all(name) if path in slots]
    found = family.hf_to_nnx(f"{peft['module']}.weight")
    if found is None:
        return []
    path, rule = found
    target = f"{path}_lora_{peft['factor'].lower()}"
    # b (r, remain...) has the weight's stacking axis 0 after the rank; the parts of a fused weight share one a.
    fields = {"layout": PEFT_LAYOUTS[peft["factor"]], "stack": rule.stack, "axis": 1 if peft["factor"] == "B" else None}
    return [(target, ["PEFT name translated"], fields)] if target in slots else []


@dataclass
class LoadPlan:
    """A source's routed keys by the slot they fill (in the source's order), and the names of those that fill none."""

    targets: dict[str, list[Source]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)


def plan(family: Family, slots: Container[str], keys: Iterable[tuple[Any, str]],
         key_map: Mapping[str, str] | None = None) -> LoadPlan:
    """Routes every ``(key, name)`` of a source (:func:`routes`).

    Raises:
        ValueError: two keys fill one place (the same part of a stacked slot, or any of a whole one), so one would
            silently overwrite the other.
    """
    result = LoadPlan()
    for key, name in keys:
        found = routes(family, slots, key, name, key_map)
        if not found:
            result.unexpected.append(name)
        for source in found:
            sources = result.targets.setdefault(source.target, [])
            clash = next((other for other in sources
                          if None in (other.stack, source.stack) or other.stack == source.stack), None)
            if clash:
                raise ValueError(f"checkpoint keys {clash.name!r} ({clash.route}) and {name!r} ({source.route}) both "
                                 f"map to {source.target!r}, so one would silently overwrite the other. Drop one of "
                                 "them from the state dict, or change key_map so each model parameter has a single "
                                 "source.")
            sources.append(source)
    return result


class Assembly:
    """Slot values made from source tensors as they arrive, so the host holds one tensor at a time.

    A tensor is moved to the NNX layout and cast on the device (XLA moves bf16 data several times faster than
    numpy). A slot one tensor fills is placed straight in its sharding. The parts of a stacked slot (a
    mixture-of-experts layer's experts) are copied as they arrive into one host buffer in their own layout, stacked
    on the leading axis; once the last arrives, one compiled program per slot shape moves the whole stack to the NNX
    layout in the slot's sharding. (Parts that are device arrays, or stack on another axis, wait on the default
    device instead and are stacked there.)
    """

    def __init__(self):
        self._pending: dict[str, tuple[Source, Target, dict[int, Any]]] = {}
        self._staged: dict[str, tuple[Source, Target, np.ndarray, set[int]]] = {}

    def add(self, source: Source, array, target: Target) -> jax.Array | None:
        """Takes ``source``'s tensor (already checked against :meth:`Source.shape`); returns the slot's value once
        it is complete, else ``None``."""
        if not source.stacked:
            return place(source.layout, array, target.shape, target.dtype, target.sharding)
        index, count = source.stack
        if source.target in self._staged or (source.axis == 0 and isinstance(array, np.ndarray)
                                              and source.target not in self._pending):
            if source.target not in self._staged:
                from ..checkpoint.safetensors_io import aligned_empty

                self._staged[source.target] = (source, target, aligned_empty((count, *array.shape), array.dtype),
                                               set())
            _, _, buffer, arrived = self._staged[source.target]
            buffer[index] = array
            arrived.add(index)
            return self.finish(source.target) if len(arrived) == count else None
        _, _, parts = self._pending.setdefault(source.target, (source, target, {}))
        parts[index] = place(source.layout, array, source.part_shape(target.shape), target.dtype, None)
        return self.finish(source.target) if len(parts) == count else None

    def waiting(self) -> list[str]:
        """The stacked slots some of whose parts arrived and others not yet."""
        return [*self._pending, *self._staged]

    def holds(self, array) -> bool:
        """Whether a slot still waiting for parts keeps ``array`` (its memory must not be reused yet)."""
        return any(reads_host(part, array) for _, _, parts in self._pending.values() for part in parts.values())

    def finish(self, path: str) -> jax.Array:
        """The stacked slot ``path`` from the parts that arrived; a missing part is zeros (a fused partner that a
        LoRA adapter does not adapt)."""
        if path in self._staged:
            source, target, buffer, arrived = self._staged.pop(path)
            for index in set(range(source.stack[1])) - arrived:
                buffer[index] = 0
            dtype = np.dtype(buffer.dtype if target.dtype is None else target.dtype)
            return _stack_to_nnx_on_device(source.layout, source.part_shape(target.shape), dtype,
                                           target.sharding)(jax.device_put(buffer))
        source, target, parts = self._pending.pop(path)
        first = next(iter(parts.values()))
        arrays = [parts[index] if index in parts else jnp.zeros(first.shape, first.dtype)
                  for index in range(source.stack[1])]
        return _stack_on_device(source.axis, target.sharding)(*arrays)


def reads_host(value, array) -> bool:
    """Whether device array ``value`` (any of its shards) lives in host array ``array``'s memory, as a zero-copy
    ``jax.device_put`` of it on the CPU backend does; ``False`` when ``array`` is no numpy array."""
    if not isinstance(array, np.ndarray) or not isinstance(value, jax.Array):
        return False
    start = array.__array_interface__["data"][0]
    end = start + array.nbytes
    try:
        pointers = [shard.data.unsafe_buffer_pointer() for shard in value.addressable_shards]
    except Exception:  # a backend without host pointers (GPU/TPU memory never aliases host memory)
        return value.sharding.device_set.pop().platform == "cpu"
    return any(start <= pointer < end for pointer in pointers)


def place(layout: Layout, array, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """``array`` in the NNX layout of ``shape``, cast to ``dtype`` (``None``: its own), placed in ``sharding``."""
    dtype = np.dtype(array.dtype if dtype is None else dtype)
    if not layout.moves_axes and array.dtype == dtype:
        return jax.device_put(array, sharding)
    if not layout.moves_axes and isinstance(array, jax.Array):
        return jax.device_put(array.astype(dtype), sharding)  # a model's own array: cast where it lives
    return _to_nnx_on_device(layout, tuple(shape), dtype, sharding)(jax.device_put(array))


@functools.cache
def _to_nnx_on_device(layout: Layout, nnx_shape: tuple[int, ...], dtype: np.dtype, sharding):
    """A jitted HF -> NNX layout transform and cast, compiled once per (layout, shape, dtype, sharding) in a
    process (and found in the persistent compilation cache by the next process)."""

    def to_nnx(hf):
        record_trace("weight_transform", {"layout": type(layout).__name__, "hf": hf, "dtype": dtype})
        return layout.to_nnx(hf, nnx_shape).astype(dtype)

    return jax.jit(to_nnx, out_shardings=sharding)


@functools.cache
def _stack_to_nnx_on_device(layout: Layout, part_shape: tuple[int, ...], dtype: np.dtype, sharding):
    """A jitted transform of parts stacked on axis 0 in their source layout to the NNX layout of each part
    (``part_shape``), cast to ``dtype``, in ``sharding``: one program per stacked slot shape."""

    def to_nnx(stack):
        record_trace("weight_transform", {"layout": f"stacked {type(layout).__name__}", "hf": stack, "dtype": dtype})
        return jax.vmap(lambda part: layout.to_nnx(part, part_shape))(stack).astype(dtype)

    return jax.jit(to_nnx, out_shardings=sharding)


@functools.cache
def _stack_on_device(axis: int, sharding):
    def stack(*parts):
        record_trace("weight_transform", {"layout": "stack", "axis": axis, "parts": len(parts), "part": parts[0]})
        return jnp.stack(parts, axis=axis)

    return jax.jit(stack, out_shardings=sharding)


def slot_targets(slots: Mapping[str, ParameterSlot], cast: bool = True) -> dict[str, Target]:
    """Each parameter slot's :class:`Target` from its current value: its shape and sharding, and its dtype when
    ``cast`` (else ``None``: a tensor keeps its own dtype, as ``load_state_dict(assign=True)``)."""
    targets = {}
    for path, slot in slots.items():
        current = slot.get()
        targets[path] = Target(tuple(current.shape), current.dtype if cast else None, current.sharding)
    return targets


ShapeCheck = Callable[[Source, tuple[int, ...], tuple[int, ...], Any], bool]
"""``check(source, shape found, shape the slot needs, origin)``: ``True`` places the tensor, ``False`` skips its slot
(reported in :attr:`AppliedWeights.skipped`); it may raise instead. ``origin`` is the tensor's file for a stream,
``None`` for keyed tensors."""


@dataclass
class AppliedWeights:
    """What :func:`apply` made of a source.

    Args:
        values: each complete slot's new value, by slot path (not yet set on the module).
        unexpected: the names of the source keys that fill no slot, in the source's order.
        outside: routed slots the model lacks (LoRA factors of a weight it does not adapt), by slot path, with the
            first source that names each.
        skipped: slots whose tensors ``check`` refused.
        deferred: slots ``defer`` kept for the caller to read, with their source.
        incomplete: stacked slots only some of whose parts arrived, with those parts' sources.
        plan: the routed keys (keyed sources only).
    """

    values: dict[str, jax.Array] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    outside: dict[str, Source] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    deferred: dict[str, Source] = field(default_factory=dict)
    incomplete: dict[str, list[Source]] = field(default_factory=dict)
    plan: LoadPlan | None = None


def apply(
    family: Family,
    targets: Mapping[str, Target],
    *,
    stream: Iterable[tuple[str, Any, Any]] | None = None,
    keys: Iterable[tuple[Any, str]] | None = None,
    read: Callable[[Source], Any] | None = None,
    shape_of: Callable[[Source], tuple[int, ...]] | None = None,
    check: ShapeCheck | None = None,
    defer: Callable[[Source], bool] | None = None,
    key_map: Mapping[str, str] | None = None,
    fill_missing_parts: bool = False,
) -> AppliedWeights:
    """Routes a source's tensors to the slots of ``targets`` and makes each slot's value (an :class:`Assembly`).

    A source is either a ``stream`` of ``(name, array, origin)`` triples, routed one at a time as they arrive (the
    host holds one tensor at a time; a stream with a ``recycle(array)`` method, like
    :class:`~..checkpoint.hf_checkpoint.CheckpointTensors`, gets each array back once its copy to the device is
    done), or ``keys`` ``(key, name)`` read on demand with ``read``, routed all at once first (:func:`plan`: two keys
    for one place are refused before anything is read).

    Args:
        family: the family table that names the HF tensors.
        targets: each slot's shape, dtype and sharding, by dotted NNX path.
        stream: the tensors of a streamed source.
        keys: the keys of a keyed source.
        read: a keyed source's tensor for a :class:`Source`.
        shape_of: a keyed source's tensor shape without reading it (default: the shape of ``read``'s array).
        check: decides on each tensor before it is placed (:data:`ShapeCheck`); default: place every tensor.
        defer: a keyed slot (given its first source, once checked) that the caller reads itself
            (:attr:`AppliedWeights.deferred`).
        key_map: ``{regex: replacement}`` renames of the source's names (:func:`routes`).
        fill_missing_parts: a stacked slot only some of whose parts arrived is finished with zeros
            (:meth:`Assembly.finish`) rather than reported in :attr:`AppliedWeights.incomplete`.

    Returns:
        The :class:`AppliedWeights`.

    Raises:
        ValueError: two keys of a keyed source fill one place (:func:`plan`).
    """
    applied = AppliedWeights()
    assembly = Assembly()
    if stream is not None:
        _apply_stream(family, targets, stream, check, key_map, assembly, applied)
    else:
        applied.plan = plan(family, targets, keys, key_map)
        _apply_keyed(targets, applied, read, shape_of or (lambda source: tuple(read(source).shape)), check, defer,
                     assembly)
    for path in assembly.waiting():
        if fill_missing_parts:
            applied.values[path] = assembly.finish(path)
            applied.incomplete.pop(path, None)
        else:
            applied.incomplete.setdefault(path, [])
    return applied


def _apply_stream(family: Family, targets: Mapping[str, Target], stream: Iterable[tuple[str, Any, Any]],
                  check: ShapeCheck | None, key_map: Mapping[str, str] | None, assembly: Assembly,
                  applied: AppliedWeights) -> None:
    """:func:`apply` of a streamed source: each tensor routed and placed as it arrives."""
    recycle = getattr(stream, "recycle", None)
    for name, array, origin in stream:
        found = [routed for routed in routes(family, targets, name, key_map=key_map) if routed.target in targets]
        if not found:
            applied.unexpected.append(name)
            continue
        placed = []
        for routed in found:
            target = targets[routed.target]
            if check is not None and not check(routed, tuple(array.shape), routed.shape(target.shape), origin):
                applied.skipped.append(routed.target)
                continue
            value = assembly.add(routed, array, target)
            if value is not None:
                applied.values[routed.target] = value
                placed.append(value)
        if recycle is not None and not assembly.holds(array) and not any(reads_host(value, array) for value in placed):
            jax.block_until_ready(placed)  # the copies out of the read buffer are done: the next read may reuse it
            recycle(array)
        value = None
        del array, value, placed  # release this tensor's host buffer before the next one is read


def _apply_keyed(targets: Mapping[str, Target], applied: AppliedWeights, read: Callable[[Source], Any],
                 shape_of: Callable[[Source], tuple[int, ...]], check: ShapeCheck | None,
                 defer: Callable[[Source], bool] | None, assembly: Assembly) -> None:
    """:func:`apply` of a keyed source: each planned slot checked, then read and placed, in the source's order."""
    applied.unexpected.extend(applied.plan.unexpected)
    for path, sources in applied.plan.targets.items():
        if path not in targets:
            applied.outside[path] = sources[0]
            continue
        target = targets[path]
        if check is not None and not all(check(source, shape_of(source), source.shape(target.shape), None)
                                         for source in sources):
            applied.skipped.append(path)
            continue
        if defer is not None and defer(sources[0]):
            applied.deferred[path] = sources[0]
            continue
        value = None
        for source in sources:
            value = assembly.add(source, read(source), target)
        if value is not None:
            applied.values[path] = value
        else:
            applied.incomplete[path] = sources
