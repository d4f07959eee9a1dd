"""Training checkpoints: ``output_dir/checkpoint-<step>`` folders written, rotated, found and restored.

A folder holds ``model`` (the model's ``state_dict()``: every parameter, or the LoRA factors with the base) and,
unless ``save_only_model``, ``optimizer`` (the optimizer state by dotted path), both written by ``torchlike.save``,
plus transformers' ``trainer_state.json``. The step in the state fixes the data position and the dropout RNG, so a
resumed run continues exactly where the saved one was.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .. import serialization
from ..adapters import mesh as mesh_lib
from ..adapters import nnx_state

__all__ = ["checkpoint_folders", "find_checkpoint", "restore_checkpoint", "restore_variables", "write_checkpoint"]

PREFIX = "checkpoint-"


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, oldest step first."""
    return sorted(Path(output_dir).glob(f"{PREFIX}*"), key=lambda folder: int(folder.name.split("-")[-1]))


def write_checkpoint(output_dir: str | Path, step: int, model: Any, optimizer: Any, state: Any,
                     save_only_model: bool, save_total_limit: int | None) -> Path:
    """Writes ``output_dir/checkpoint-<step>`` and deletes the oldest folders beyond ``save_total_limit``.

    Every process writes its shards of the arrays; process 0 alone writes ``trainer_state.json`` and rotates, and
    all of them meet at a barrier before returning, so the folder is complete everywhere when this returns.

    Args:
        output_dir: the trainer's ``output_dir``.
        step: the global step, which names the folder.
        model: the trained model (its ``state_dict()`` is stored).
        optimizer: the ``nnx.Optimizer`` whose ``nnx.OptState`` is stored.
        state: transformers' ``TrainerState``.
        save_only_model: store no optimizer state (a resumed run then restarts the moments from zero).
        save_total_limit: how many checkpoint folders to keep (``None`` or ``0``: all).

    Returns:
        The folder written.
    """
    from flax import nnx

    folder = Path(output_dir) / f"{PREFIX}{step}"
    folder.mkdir(parents=True, exist_ok=True)
    serialization.save(model.state_dict(), folder / "model")
    if not save_only_model:
        optimizer_state = {name: variable.get_value()
                           for name, variable in nnx_state.flat_variables(optimizer, nnx.OptState).items()}
        serialization.save(optimizer_state, folder / "optimizer")
    if state.is_world_process_zero:
        state.save_to_json(str(folder / "trainer_state.json"))
        if save_total_limit:
            for old in checkpoint_folders(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    mesh_lib.barrier(f"{PREFIX}{step}")
    return folder


def find_checkpoint(output_dir: str | Path, checkpoint: str | Path | bool) -> Path:
    """The folder ``resume_from_checkpoint`` names: the latest of ``output_dir`` for ``True``, else the path given.

    Raises:
        FileNotFoundError: ``True`` and ``output_dir`` holds no checkpoint, or the path is not a checkpoint folder.
    """
    if checkpoint is True:
        folders = checkpoint_folders(output_dir)
        if not folders:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} has no {PREFIX}* folder; train "
                                    "without it or pass a checkpoint path.")
        checkpoint = folders[-1]
    folder = Path(checkpoint)
    if not (folder / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{folder} is not a torchlike checkpoint (no trainer_state.json); pass an "
                                f"output_dir/{PREFIX}<step> folder written by Trainer.")
    return folder


def restore_checkpoint(folder: Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Loads the model's parameters and the optimizer state of ``folder`` in place.

    Args:
        folder: a checkpoint folder (:func:`find_checkpoint`).
        model: the trained model (``load_state_dict`` receives the lazily loaded ``model`` entry).
        optimizer: the ``nnx.Optimizer`` to fill; without an ``optimizer`` entry (``save_only_model``) it keeps its
            fresh state, with a warning.

    Returns:
        The saved ``trainer_state.json`` as a dict (``global_step``, ``log_history``, ...).
    """
    from flax import nnx

    saved = json.loads((folder / "trainer_state.json").read_text())
    model.load_state_dict(serialization.load(folder / "model"))
    if (folder / "optimizer").exists():
        restore_variables(nnx_state.flat_variables(optimizer, nnx.OptState), serialization.load(folder / "optimizer"))
    else:
        warnings.warn(f"{folder} holds no optimizer state (saved with save_only_model=True): the optimizer "
                      "restarts from zero moments.", UserWarning, stacklevel=4)
    return saved


def restore_variables(variables: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    """Writes ``stored[name]`` into ``variables[name]`` for each name both have, in the variable's dtype and sharding.

    Args:
        variables: ``{dotted path: nnx.Variable}`` (:func:`~torchlike.adapters.nnx_state.flat_variables`).
        stored: ``{dotted path: array}``; a lazy ``torchlike.load`` checkpoint reads only these names, each straight
            into its target sharding.
    """
    targets = {name: variable.get_value() for name, variable in variables.items() if name in stored}
    if isinstance(stored, serialization.LazyCheckpoint):
        values = stored.restore(targets)
    else:
        values = {name: jax.device_put(jnp.asarray(stored[name], target.dtype), target.sharding)
                  for name, target in targets.items()}
    for name, value in values.items():
        variables[name].set_value(value)
