"""Training checkpoints: ``output_dir/checkpoint-<step>`` folders written whole or not at all, rotated, checked, found
and restored.

A folder holds ``model`` (the model's ``state_dict()``: every parameter, or the LoRA factors with the base) and,
unless ``save_only_model``, ``optimizer`` (the optimizer state by dotted path), both written by ``torchlike.save``,
plus transformers' ``trainer_state.json``. The step in the state fixes the data position and the dropout RNG, so a
resumed run continues exactly where the saved one was. As in transformers, rotation by ``save_total_limit`` never
deletes the newest folder nor ``state.best_model_checkpoint``.

A save writes everything into the staging folder ``checkpoint-<step>.torchlike-new-save`` and renames it into place
once ``trainer_state.json`` is written, by the protocol of ``adapters/checkpoint/directory_swap.py``; only then does
rotation delete older folders. A save that fails (a full disk) raises :class:`CheckpointSaveError` and leaves the
earlier checkpoints as they were and nothing of itself. :func:`check_checkpoint` finds, without reading a tensor, a
folder that a crash or a copy left incomplete or damaged; ``resume_from_checkpoint=True`` skips such a folder, with a
warning, for the latest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp

from .. import serialization
from ..adapters.checkpoint import directory_swap, hf_checkpoint, orbax_store
from ..adapters.checkpoint.orbax_store import CheckpointCorruptedError
from ..adapters.checkpoint.safetensors_io import CheckpointFileError
from ..adapters.distributed import mesh as mesh_lib
from ..adapters.distributed import multihost
from ..adapters.model import nnx_state

if TYPE_CHECKING:
    from flax import nnx
    from transformers import TrainerState


class StateDictModel(Protocol):
    """What a checkpoint reads and fills: a model with torch's ``state_dict()`` / ``load_state_dict()`` (a
    ``CausalLM``, or the loop's wrapper of a plain ``flax.nnx.Module``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any: ...


__all__ = ["CheckpointSaveError", "StateDictModel", "check_checkpoint", "checkpoint_folders", "delete_all_but",
           "find_checkpoint", "latest_complete_checkpoint", "restore_checkpoint", "restore_model",
           "restore_variables", "rotate_checkpoints", "write_checkpoint"]

PREFIX = "checkpoint-"
_FOLDER_NAME = re.compile(rf"{PREFIX}(\d+)")
TRAINER_STATE_NAME = "trainer_state.json"
# The token of a save's staging folder ``checkpoint-<step>.torchlike-new-save``: the same on every process, and never
# met by an older folder of that name, which each save deletes first.
_STAGING_TOKEN = "save"


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount...): the message names the folder, the file, the
    free space and what to do. Nothing of the failed save is left, and the earlier checkpoints are intact. ``errno`` is
    that of the underlying error (``errno.ENOSPC`` for a full disk)."""


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Writes ``path`` whole or not at all: ``write`` fills ``<path>.partial``, which then replaces ``path``.

    Args:
        path: the file to (re)write.
        write: writes the file it is given.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, oldest step first (the staging folders and backups of
    saves beside them are not checkpoints)."""
    folders = [folder for folder in Path(output_dir).glob(f"{PREFIX}*") if _FOLDER_NAME.fullmatch(folder.name)]
    return sorted(folders, key=lambda folder: int(folder.name.removeprefix(PREFIX)))


def write_checkpoint(output_dir: str | Path, step: int, model: StateDictModel, optimizer: nnx.Optimizer,
                     state: TrainerState,
                     save_only_model: bool, save_total_limit: int | None,
                     export: Callable[[Path], None] | None = None) -> Path:
    """Writes ``output_dir/checkpoint-<step>`` whole or not at all, then deletes the oldest folders beyond
    ``save_total_limit``.

    What interrupted saves left beside the checkpoints is dealt with first (:func:`_clear_interrupted_saves`). Then
    everything goes into the staging folder ``checkpoint-<step>.torchlike-new-save``: the Hugging Face export, the
    ``model`` and ``optimizer`` stores, ``trainer_state.json`` last; one rename publishes it (an older folder of the
    same step is replaced by ``directory_swap``'s protocol), and only then are old folders rotated out. As
    transformers' ``Trainer._save_checkpoint``: once the model is written, ``state.best_model_checkpoint`` becomes the
    folder of ``state.best_global_step`` when that is this step or its folder exists, before ``trainer_state.json`` is
    written; rotation keeps that folder. Every process writes its shards of the arrays; process 0 alone writes
    ``trainer_state.json``, publishes and rotates, and all of them learn whether that worked before returning.

    Args:
        output_dir: the trainer's ``output_dir``.
        step: the global step, which names the folder.
        model: the trained model (its ``state_dict()`` is stored).
        optimizer: the ``nnx.Optimizer`` whose ``nnx.OptState`` is stored.
        state: transformers' ``TrainerState``.
        save_only_model: store no optimizer state (a resumed run then restarts the moments from zero).
        save_total_limit: how many checkpoint folders to keep (``None`` or ``0``: all).
        export: writes the model in Hugging Face format into the folder it is given (as transformers' Trainer writes
            ``model.safetensors`` and ``config.json``, or the PEFT adapter, into each checkpoint), first, before the
            Orbax state is added beside it.

    Returns:
        The folder written.

    Raises:
        CheckpointSaveError: a file could not be written (a full disk...); the staging folder is deleted and
            ``state.best_model_checkpoint`` keeps its value.
    """
    from flax import nnx

    output_dir = Path(output_dir)
    folder = output_dir / f"{PREFIX}{step}"
    staging = directory_swap.sibling(folder, directory_swap.NEW_TAG, _STAGING_TOKEN)
    previous_best = state.best_model_checkpoint
    writing = f"the leftovers of interrupted saves in {output_dir}"
    try:
        multihost.on_primary(lambda: _clear_interrupted_saves(output_dir), f"clear {output_dir}")
        writing = f"the Hugging Face export into {staging}"
        if export is not None:
            export(staging)
        staging.mkdir(parents=True, exist_ok=True)
        writing = f"the model state {staging / 'model'}"
        serialization.save(model.state_dict(), staging / "model")
        if not save_only_model:
            writing = f"the optimizer state {staging / 'optimizer'}"
            optimizer_state = {name: variable.get_value()
                               for name, variable in nnx_state.flat_variables(optimizer, nnx.OptState).items()}
            serialization.save(optimizer_state, staging / "optimizer")
        if state.best_global_step:
            mesh_lib.barrier(f"{PREFIX}{step}-model")  # every process has written its shards before the folder counts
            best = output_dir / f"{PREFIX}{state.best_global_step}"
            if state.best_global_step == step or best.exists():
                state.best_model_checkpoint = str(best)
        writing = f"{staging / TRAINER_STATE_NAME} and the rename of {staging.name} to {folder.name}"
        multihost.on_primary(lambda: _publish(staging, folder, state), f"publish {folder}")
    except BaseException as error:
        state.best_model_checkpoint = previous_best
        if multihost.is_primary():
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) or getattr(error, "os_error", False):  # process 0's OSError, on the others
            raise _save_error(error, folder, writing, save_total_limit) from error
        raise
    multihost.on_primary(lambda: rotate_checkpoints(output_dir, save_total_limit, state.best_model_checkpoint,
                                                    written=folder), f"rotate the checkpoints of {output_dir}")
    return folder


def _publish(staging: Path, folder: Path, state: TrainerState) -> None:
    """Writes ``trainer_state.json`` into the complete ``staging`` folder and renames it to ``folder``; an older
    folder of that step, the backup of the swap, is then deleted."""
    state.save_to_json(str(staging / TRAINER_STATE_NAME))
    backup = directory_swap.swap_into_place(staging, folder, _STAGING_TOKEN, stage=lambda name: None)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _clear_interrupted_saves(output_dir: Path) -> None:
    """Deals with what saves that a crash interrupted left beside the checkpoints of ``output_dir``: a checkpoint
    missing between the two renames of its swap is moved into place (``directory_swap.finish_interrupted_swap``),
    then every staging folder, backup and trash is deleted. They hold unfinished or superseded checkpoints, and on a
    full disk their space is what the next save needs."""
    if not output_dir.is_dir():
        return
    interrupted = {name.partition(".torchlike-")[0] for name in os.listdir(output_dir)
                   if ".torchlike-" in name and _FOLDER_NAME.fullmatch(name.partition(".torchlike-")[0])}
    for name in sorted(interrupted):
        directory_swap.finish_interrupted_swap(output_dir / name, lambda backup, _: shutil.rmtree(backup))
        for _, leftover in directory_swap.siblings(output_dir / name):
            shutil.rmtree(leftover, ignore_errors=True)


def _save_error(error: Exception, folder: Path, writing: str, save_total_limit: int | None) -> CheckpointSaveError:
    """The :class:`CheckpointSaveError` for ``error``, raised while writing ``writing`` (a part of the checkpoint;
    ``error`` names the file when it knows it)."""
    try:
        free = shutil.disk_usage(folder.parent).free
        space = f"{free / 2**30:.2f} GiB ({free:,} bytes) are free there"
    except OSError:
        space = "The free space there is unknown"
    limit = f"lower save_total_limit (now {save_total_limit})" if save_total_limit else "set save_total_limit"
    saved = CheckpointSaveError(
        f"Could not save {folder}: writing {writing} failed: {error}. {space}. Nothing of this save was kept and "
        f"the earlier checkpoints are untouched. Free space there, {limit} to keep fewer checkpoints, or set "
        "output_dir to a larger disk; TrainingArguments(on_save_error='warn') goes on training to the next save "
        "instead of stopping.")
    saved.errno = getattr(error, "errno", None)
    return saved


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int | None, best_model_checkpoint: str | None,
                       written: str | Path | None = None) -> None:
    """Deletes the oldest ``checkpoint-<step>`` folders until ``save_total_limit`` remain, never the newest one (to
    resume from) nor ``best_model_checkpoint``, as transformers' ``rotate_checkpoints`` (which orders the folders by
    modification time where the file system keeps it; torchlike orders them by step), nor ``written``.

    Args:
        output_dir: the trainer's ``output_dir``.
        save_total_limit: how many folders to keep (``None`` or ``<= 0``: all).
        best_model_checkpoint: ``state.best_model_checkpoint``, or ``None``.
        written: the folder just written, which a resumed run may have written below the step of a damaged folder
            it skipped.
    """
    if not save_total_limit or save_total_limit <= 0:
        return
    folders = checkpoint_folders(output_dir)
    if len(folders) <= save_total_limit:
        return
    protected = {folders[-1].resolve()}
    for kept in (best_model_checkpoint, written):
        if kept is not None:
            protected.add(Path(kept).resolve())
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


def check_checkpoint(folder: str | Path) -> None:
    """Checks, reading no tensor and changing nothing, that ``folder`` is a complete checkpoint: its
    ``trainer_state.json`` (written last) parses, its ``model`` and ``optimizer`` stores have their manifests and array
    files of the recorded sizes, and its Hugging Face export has every shard its index names, each as long as its
    header says.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        CheckpointFileError: a file is missing or damaged (the message names it);
            :class:`~torchlike.serialization.CheckpointCorruptedError` for most.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass an output_dir/{PREFIX}<step> folder written by "
                                "Trainer.")
    state_file = folder / TRAINER_STATE_NAME
    try:
        json.loads(state_file.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptedError(f"{folder} is not a complete checkpoint: {state_file} is missing (a save writes "
                                       "it last, so the save did not finish, or Trainer did not write this "
                                       "folder).") from None
    except (OSError, ValueError) as error:
        raise CheckpointCorruptedError(f"{folder} is damaged: {state_file} cannot be read ({error}).") from None
    orbax_store.check_store(folder / "model")
    if (folder / "optimizer").exists():
        orbax_store.check_store(folder / "optimizer")
    hf_checkpoint.check_weight_files(folder)


def latest_complete_checkpoint(output_dir: str | Path, skip: tuple[type[Exception], ...] = (CheckpointFileError,)
                               ) -> tuple[Path | None, dict[Path, Exception]]:
    """The newest ``checkpoint-<step>`` folder of ``output_dir`` that passes :func:`check_checkpoint` (``None`` when
    none does), and the newer folders it failed on, newest first, with the error each raised (those of ``skip``; any
    other propagates)."""
    damaged: dict[Path, Exception] = {}
    for folder in reversed(checkpoint_folders(output_dir)):
        try:
            check_checkpoint(folder)
        except skip as error:
            damaged[folder] = error
            continue
        return folder, damaged
    return None, damaged


def find_checkpoint(output_dir: str | Path, checkpoint: str | Path | bool) -> Path:
    """The folder ``resume_from_checkpoint`` names, checked by :func:`check_checkpoint`: for ``True`` the latest
    complete one of ``output_dir`` (a newer one that is incomplete or damaged, such as a save that preemption or a full
    disk cut short, is skipped with a warning naming it and why), else the path given, which must be complete.

    Raises:
        FileNotFoundError: ``True`` and ``output_dir`` holds no checkpoint, or the path given does not exist.
        CheckpointCorruptedError: the path given, or with ``True`` every checkpoint, is incomplete or damaged (the
            message names the file).
    """
    if checkpoint is not True:
        folder = Path(checkpoint)
        try:
            check_checkpoint(folder)
        except CheckpointFileError as error:
            raise CheckpointCorruptedError(f"Cannot resume from {folder}: {error} Pass an earlier checkpoint, or "
                                           "resume_from_checkpoint=True for the latest complete one.") from None
        return folder
    if not checkpoint_folders(output_dir):
        raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} has no {PREFIX}* folder; train "
                                "without it or pass a checkpoint path.")
    folder, damaged = latest_complete_checkpoint(output_dir)
    if folder is not None:
        for skipped, error in damaged.items():
            warnings.warn(f"resume_from_checkpoint=True skips {skipped}, which is incomplete or damaged, and resumes "
                          f"from {folder.name}: {error}", UserWarning, stacklevel=4)
        return folder
    reasons = " ".join(f"{folder.name}: {error}" for folder, error in damaged.items())
    raise CheckpointCorruptedError(f"resume_from_checkpoint=True but no checkpoint of {output_dir} is complete. "
                                   f"{reasons} Train without resume_from_checkpoint, or restore a checkpoint from a "
                                   "backup.")


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

    saved = json.loads((folder / TRAINER_STATE_NAME).read_text())
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
