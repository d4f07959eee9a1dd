"""Flat, dotted, all-string views of an NNX module's parameters, and writing values back into them.

A parameter whose value is a pytree (Qwix's quantised ``WithAux[QArray]`` under QLoRA) appears as
one key per array leaf (``...kernel.array.qvalue``), so every key maps to exactly one array.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jax
from flax import nnx


@dataclass
class ParameterSlot:
    """Where one array of a module lives: the variable and, for pytree values, the leaf index."""

    variable: nnx.Variable
    leaf: int | None = None

    def get(self) -> jax.Array:
        value = self.variable.get_value()
        return value if self.leaf is None else jax.tree_util.tree_leaves(value)[self.leaf]

    def set(self, array) -> None:
        if self.leaf is None:
            self.variable.set_value(array)
            return
        leaves, treedef = jax.tree_util.tree_flatten(self.variable.get_value())
        leaves[self.leaf] = array
        self.variable.set_value(jax.tree_util.tree_unflatten(treedef, leaves))

    @property
    def is_lora(self) -> bool:
        return isinstance(self.variable, nnx.LoRAParam)


def _key_name(entry) -> str:
    for attribute in ("name", "key", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def parameter_slots(module: nnx.Module) -> dict[str, ParameterSlot]:
    """``{"layers.0.attn.q_proj.w": slot, ...}`` for every ``nnx.Param`` (LoRA factors included)."""
    slots: dict[str, ParameterSlot] = {}
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = ".".join(str(part) for part in path)
        value = variable.get_value()
        if isinstance(value, jax.Array | jax.ShapeDtypeStruct) or hasattr(value, "shape") and hasattr(value, "dtype"):
            slots[name] = ParameterSlot(variable)
            continue
        for index, (leaf_path, _) in enumerate(jax.tree_util.tree_flatten_with_path(value)[0]):
            slots[".".join([name, *(_key_name(entry) for entry in leaf_path)])] = ParameterSlot(variable, index)
    return slots


def iter_parameters(module: nnx.Module) -> Iterator[tuple[str, jax.Array]]:
    for name, slot in parameter_slots(module).items():
        yield name, slot.get()
