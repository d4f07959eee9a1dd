"""Modules trained in full beside a LoRA adapter (PEFT's ``modules_to_save``): which parameters they are, and their
tensors to and from PEFT's adapter file.

PEFT wraps each such module in a ``ModulesToSaveWrapper`` and saves the trained copy under the module's own HF
name with the adapter prefix, ``base_model.model.score.weight`` (the ``modules_to_save.default`` part of the
in-memory name is dropped on save and put back on load). The module is a top-level attribute of the Tunix model
(the classifier's ``score``); the family table names its HF tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from ..distributed.multihost import gather_to_host
from ..families import Family
from ..model.nnx_state import flat_variables

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraAndModules:
    """The NNX filter of what a LoRA step trains: the LoRA factors and every parameter of the top-level
    ``modules`` (``("score",)``); hashable, so a jitted step can take it as a static argument."""

    modules: tuple[str, ...]

    def __call__(self, path, value) -> bool:
        return isinstance(value, nnx.LoRAParam) or (isinstance(value, nnx.Param) and str(path[0]) in self.modules)


def trainable_filter(modules: Sequence[str]):
    """``nnx.LoRAParam`` alone when ``modules`` is empty, else a :class:`LoraAndModules` filter."""
    return LoraAndModules(tuple(modules)) if modules else nnx.LoRAParam


def present_modules(module: nnx.Module, names: Sequence[str]) -> list[str]:
    """The entries of ``names`` that are top-level submodules of ``module`` holding parameters (PEFT's
    ``modules_to_save`` may name modules a model lacks: ``classifier`` on a model whose head is ``score``)."""
    tops = {name.split(".", 1)[0] for name in flat_variables(module)}
    return [name for name in names if name in tops]


def module_tensors(family: Family, module: nnx.Module, names: Sequence[str],
                   prefix: str = PEFT_PREFIX) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(prefix + HF name, array in HF layout)`` for every parameter of the top-level modules ``names``
    (gathered from every process when sharded: every process must iterate it)."""
    for path, variable in flat_variables(module).items():
        if path.split(".", 1)[0] not in names:
            continue
        for hf_name, rule in family.nnx_to_hf(path):
            yield prefix + hf_name, np.ascontiguousarray(rule.layout.to_hf(gather_to_host(variable.get_value())))


def load_module_tensors(family: Family, module: nnx.Module, names: Sequence[str], tensors: Mapping[str, np.ndarray],
                        source: str) -> list[str]:
    """Sets the parameters of the top-level modules ``names`` from PEFT adapter tensors
    (``base_model.model.score.weight``, or the in-memory ``...score.modules_to_save.default.weight``), in each
    parameter's dtype and sharding.

    Returns:
        The keys of ``tensors`` it used.

    Raises:
        ValueError: a parameter of those modules has no tensor, or a tensor's shape differs (naming both shapes).
    """
    used = []
    for path, variable in flat_variables(module).items():
        if path.split(".", 1)[0] not in names:
            continue
        for hf_name, rule in family.nnx_to_hf(path):
            head, _, leaf = hf_name.rpartition(".")
            keys = [PEFT_PREFIX + hf_name, f"{PEFT_PREFIX}{head}.modules_to_save.default.{leaf}"]
            key = next((key for key in keys if key in tensors), None)
            if key is None:
                raise ValueError(f"{source}: no {keys[0]} although adapter_config.json lists {path.split('.')[0]!r} in "
                                 "modules_to_save; the adapter file is incomplete.")
            current = variable.get_value()
            array = np.asarray(tensors[key])
            expected = rule.layout.hf_shape(current.shape)
            if tuple(array.shape) != tuple(expected):
                raise ValueError(f"{source}: {key} has shape {tuple(array.shape)}, the model expects {tuple(expected)} "
                                 "(a different num_labels or hidden_size?).")
            value = np.asarray(rule.layout.to_nnx(array, tuple(current.shape)), current.dtype)
            variable.set_value(jax.device_put(value, current.sharding))
            used.append(key)
    return used


def current_values(module: nnx.Module, names: Sequence[str]) -> dict[str, jax.Array]:
    """``{dotted path: array}`` of the parameters of the top-level modules ``names``."""
    return {path: variable.get_value() for path, variable in flat_variables(module).items()
            if path.split(".", 1)[0] in names}
