"""Training checkpoints: ``output_dir/checkpoint-<step>`` folders written, rotated, found and restored.

A folder holds ``model`` (the model's ``state_dict()``: every parameter, or the LoRA factors with the base) and,
unless ``save_only_model``, ``optimizer`` (the optimizer state by dotted path), both written by ``torchlike.save``,
plus transformers' ``trainer_state.json``. The step in the state fixes the data position and the dropout RNG, so a
resumed run continues exactly where the saved one was. As in transformers, rotation by ``save_total_limit`` never
deletes the newest folder nor ``state.best_model_checkpoint``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp

from .. import serialization
from ..adapters.distributed import mesh as mesh_lib
from ..adapters.model import nnx_state

if TYPE_CHECKING:
    from flax import nnx
    from transformers import TrainerState


class StateDictModel(Protocol):
    """What a checkpoint reads and fills: a model with torch's ``state_dict()`` / ``load_state_dict()`` (a
    ``CausalLM``, or the loop's wrapper of a plain ``flax.nnx.Module``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any: ...


__all__ = ["StateDictModel", "checkpoint_folders", "delete_all_but", "find_checkpoint", "restore_checkpoint",
           "restore_model", "restore_variables", "rotate_checkpoints", "write_checkpoint"]

PREFIX = "checkpoint-"


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Writes ``path`` whole or not at all: ``write`` fills ``<path>.partial``, which then replaces ``path``.

    Args:
        path: the file to (re)write.
        write: writes the file it is given.
    """
    import os

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, oldest step first."""
    return sorted(Path(output_dir).glob(f"{PREFIX}*"), key=lambda folder: int(folder.name.split("-")[-1]))


def write_checkpoint(output_dir: str | Path, step: int, model: StateDictModel, optimizer: nnx.Optimizer,
                     state: TrainerState,
                     save_only_model: bool, save_total_limit: int | None,
                     export: Callable[[Path], None] | None = None) -> Path:
    """Writes ``output_dir/checkpoint-<step>`` and deletes the oldest folders beyond ``save_total_limit``.

    As transformers' ``Trainer._save_checkpoint``: once the model is written, ``state.best_model_checkpoint`` becomes
    the folder of ``state.best_global_step`` when that folder exists (this one, when this step is the best), before
    ``trainer_state.json`` is written; rotation keeps that folder. Every process writes its shards of the arrays;
    process 0 alone writes ``trainer_state.json`` and rotates, and all of them meet at a barrier before returning,
    so the folder is complete everywhere when this returns.

    Args:
        output_dir: the trainer's ``output_dir``.
        step: the global step, which names the folder.
        model: the trained model (its ``state_dict()`` is stored).
        optimizer: the ``nnx.Optimizer`` whose ``nnx.OptState`` is stored.
        state: transformers' ``TrainerState``.
        save_only_model: store no optimizer state (a resumed run then restarts the moments from zero).
        save_total_limit: how many checkpoint folders to keep (``None`` or ``0``: all).
        export: writes the model in Hugging Face format into the folder (as transformers' Trainer writes
            ``model.safetensors`` and ``config.json``, or the PEFT adapter, into each checkpoint), first, before the
            Orbax state is added beside it.

    Returns:
        The folder written.
    """
    from flax import nnx

    folder = Path(output_dir) / f"{PREFIX}{step}"
    if export is not None:
        export(folder)
    folder.mkdir(parents=True, exist_ok=True)
    serialization.save(model.state_dict(), folder / "model")
    if not save_only_model:
        optimizer_state = {name: variable.get_value()
                           for name, variable in nnx_state.flat_variables(optimizer, nnx.OptState).items()}
        serialization.save(optimizer_state, folder / "optimizer")
    if state.best_global_step:
        mesh_lib.barrier(f"{PREFIX}{step}-model")  # every process has written its shards before the folder counts
        best = Path(output_dir) / f"{PREFIX}{state.best_global_step}"
        if best.exists():
            state.best_model_checkpoint = str(best)
    if state.is_world_process_zero:
        state.save_to_json(str(folder / "trainer_state.json"))
        rotate_checkpoints(output_dir, save_total_limit, state.best_model_checkpoint)
    mesh_lib.barrier(f"{PREFIX}{step}")
    return folder


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Deletes the oldest ``checkpoint-<step>`` folders until ``save_total_limit`` remain, never the newest one (to
    resume from) nor ``best_model_checkpoint``, as transformers' ``rotate_checkpoints`` (which orders the folders by
    modification time where the file system keeps it; torchlike orders them by step).

    Args:
        output_dir: the trainer's ``output_dir``.
        save_total_limit: how many folders to keep (``None`` or ``<= 0``: all).
        best_model_checkpoint: ``state.best_model_checkpoint``, or ``None``.
    """
    if not save_total_limit or save_total_limit <= 0:
        return
    folders = checkpoint_folders(output_dir)
    if len(folders) <= save_total_limit:
        return
    protected = {folders[-1].resolve()}
    if best_model_checkpoint is not None:
        protected.add(Path(best_model_checkpoint).resolve())
    remaining = len(folders)
    for folder in folders:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if folder.resolve() not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1


def delete_all_but(output_dir: str | Path, kept: str | Path) -> None:
    """Deletes every ``checkpoint-<step>`` folder of ``output_dir`` except ``kept``: what transformers does with the
    checkpoints other than the best one when training ends with ``save_total_limit=1``."""
    for folder in checkpoint_folders(output_dir):
        if folder.resolve() != Path(kept).resolve():
            shutil.rmtree(folder, ignore_errors=True)


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


def restore_checkpoint(folder: Path, model: StateDictModel, optimizer: nnx.Optimizer) -> dict[str, Any]:
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
    restore_model(folder, model)
    if (folder / "optimizer").exists():
        restore_variables(nnx_state.flat_variables(optimizer, nnx.OptState), serialization.load(folder / "optimizer"))
    else:
        warnings.warn(f"{folder} holds no optimizer state (saved with save_only_model=True): the optimizer "
                      "restarts from zero moments.", UserWarning, stacklevel=4)
    return saved


def restore_model(folder: str | Path, model: StateDictModel) -> None:
    """Loads the model entry of checkpoint ``folder`` into ``model`` (``load_best_model_at_end``): the weights become
    exactly the stored ones; the optimizer state is left alone, as transformers' ``_load_best_model`` does."""
    model.load_state_dict(serialization.load(Path(folder) / "model"))


def restore_variables(variables: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    """Writes ``stored[name]`` into ``variables[name]`` for each name both have, in the variable's dtype and sharding.

    Args:
        variables: ``{dotted path: nnx.Variable}`` (:func:`~torchlike.adapters.model.nnx_state.flat_variables`).
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
