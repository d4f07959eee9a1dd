"""NNX paths as dotted, all-string names: the one walker of a module's variables and submodules.

Every name torchlike shows or stores for an NNX variable or module is its path joined by dots, every part a
string (``layers.0.attn.q_proj.w``): :func:`dotted_path` makes it, :func:`flat_variables` and
:func:`modules_by_path` walk a module by it, :func:`replace_parameters` writes by it. For ``state_dict``,
a parameter whose value is a pytree (Qwix's quantised ``WithAux[QArray]`` under QLoRA) appears as one key
per array leaf (``...kernel.array.qvalue``) in :func:`parameter_slots`, so every key maps to exactly one array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx


class Buffer(nnx.Param):
    """A parameter loaded from and saved with the weights but never trained: what a PyTorch module keeps in a
    registered buffer (DeepSeek-V3's router ``e_score_correction_bias``). The optimizer's filter
    :data:`TRAINABLE` leaves it out, so full fine-tuning neither steps nor decays it."""


TRAINABLE = nnx.All(nnx.Param, nnx.Not(Buffer))
"""The NNX filter of the parameters full fine-tuning trains: every ``nnx.Param`` but a :class:`Buffer`."""


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


def dotted_path(path: Sequence[Any]) -> str:
    """``("layers", 0, "attn")`` as ``"layers.0.attn"``; JAX key-path entries (``GetAttrKey``, ``DictKey``,
    ``SequenceKey``) count by their name, key or index."""
    return ".".join(_part_name(part) for part in path)


def _part_name(part: Any) -> str:
    for attribute in ("name", "key", "idx"):
        if hasattr(part, attribute):
            return str(getattr(part, attribute))
    return str(part)


def flat_variables(node: Any, filter: Any = nnx.Param) -> dict[str, nnx.Variable]:
    """``{dotted path: variable}`` for the variables of ``node`` (a module, an optimizer or an ``nnx.State``)
    that the NNX ``filter`` selects (``...`` selects all). The variables are the node's own, so ``set_value``
    on one writes into ``node``."""
    state = nnx.filter_state(node, filter) if isinstance(node, nnx.State) else nnx.state(node, filter)
    return {dotted_path(path): variable for path, variable in nnx.to_flat_state(state)}


def modules_by_path(module: nnx.Module) -> dict[str, nnx.Module]:
    """``{dotted path: submodule}`` for ``module`` and every module inside it (``module`` itself at ``""``)."""
    return {dotted_path(path): child for path, child in nnx.iter_modules(module)}


def replace_parameters(module: nnx.Module, values: Mapping[str, Any]) -> nnx.Module:
    """A copy of ``module`` whose parameters named in ``values`` (dotted paths) hold the given arrays; every
    other array is shared with ``module``."""
    graphdef, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    for path, variable in flat.items():
        name = dotted_path(path)
        if name in values:
            flat[path] = variable.replace(values[name])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def parameter_slots(module: nnx.Module) -> dict[str, ParameterSlot]:
    """``{"layers.0.attn.q_proj.w": slot, ...}`` for every ``nnx.Param`` (LoRA factors included)."""
    slots: dict[str, ParameterSlot] = {}
    for name, variable in flat_variables(module).items():
        value = variable.get_value()
        if isinstance(value, jax.Array | jax.ShapeDtypeStruct) or hasattr(value, "shape") and hasattr(value, "dtype"):
            slots[name] = ParameterSlot(variable)
            continue
        for index, (leaf_path, _) in enumerate(jax.tree_util.tree_flatten_with_path(value)[0]):
            slots[dotted_path((name, *leaf_path))] = ParameterSlot(variable, index)
    return slots
