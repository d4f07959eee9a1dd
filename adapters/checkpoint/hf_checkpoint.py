"""Hugging Face checkpoint directories: find the weight files, stream their tensors, write them back.

Reading handles ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, and ``pytorch_model.bin`` (single or sharded, loaded
only through ``torch.load(weights_only=True)``). Writing produces the layout
``transformers`` and vLLM load: ``model.safetensors`` when everything fits in one shard,
otherwise ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``,
each file carrying ``{"format": "pt"}`` metadata.

Publishing is atomic, by the rename protocol of ``directory_swap``: a save to ``DIR``
(a model or a PEFT adapter, with its config and tokenizer files) writes everything into the
sibling ``DIR.torchlike-new-TOKEN``, fsyncs it, then renames ``DIR`` to
``DIR.torchlike-old-TOKEN`` and the new folder to ``DIR`` (``TOKEN`` is ``model-<random hex>``
or ``adapter-<random hex>``: the kind of weights the save writes). A process killed at any moment
leaves at ``DIR`` the complete old checkpoint or the complete new one, never a mix; only the
window between the two renames leaves ``DIR`` missing until torchlike finishes the swap. The
crash points, in order (``EXPORT_STAGES``; each is tested by killing the process there):

- ``shard-written``: the new folder is being written beside the untouched old ``DIR`` (the
  same holds until the first rename). The next save deletes the leftover.
- ``old-moved``: ``DIR`` is missing; the old and the new folder sit beside it under the same
  token, which proves the new one complete. ``finish_interrupted_save`` (called by
  torchlike's ``from_pretrained`` and ``save_pretrained``) renames the new one into place.
- ``swapped``: the new checkpoint is in place; the backup still holds the user's files.
- ``carried-over``: the user's files are in the new ``DIR``; the backup is left to delete
  (it is renamed to ``DIR.torchlike-trash-TOKEN``, then deleted).

Files the user keeps in ``DIR`` that this save does not write (a ``README.md``, logs,
``checkpoint-*`` folders, tokenizer files of an earlier save) are moved from the backup into
the new ``DIR`` after the swap, as ``transformers`` keeps them; weight files of an earlier save
(``model*.safetensors``, ``pytorch_model*.bin`` and their indexes for a model,
``adapter_model.*`` for an adapter, as the token says) are dropped, so no stale shard sits
beside the new ones; an adapter saved into a model's folder keeps the model.
A crash before they are moved leaves them in the backup, and the next ``from_pretrained`` or
``save_pretrained`` moves them. One writer per directory at a time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..distributed import multihost
from . import directory_swap
from .safetensors_io import CheckpointFileError, ReadBuffers, SafetensorsReader, write_safetensors

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"
TORCH_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_SHARD_NAME = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")

# Called with a stage name at each crash point of a save (see ``EXPORT_STAGES``). Only the crash
# tests set it: they kill the process there to check that what is left loads.
_crash_test_hook: Callable[[str], None] | None = None
EXPORT_STAGES = ("shard-written", "old-moved", "swapped", "carried-over")


def _stage(name: str) -> None:
    if _crash_test_hook is not None:
        _crash_test_hook(name)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor to be written."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def find_weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """Lists the weight files of an HF checkpoint directory, validating any index.

    Args:
        model_dir: a directory written by ``save_pretrained``.

    Returns:
        The files to read, in order.

    Raises:
        CheckpointFileError: no weights found, or an index names a shard that is missing.
    """
    model_dir = Path(model_dir)
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, TORCH_WEIGHTS_INDEX_NAME):
        index_path = model_dir / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise CheckpointFileError(
                    f"{index_path} is not a valid index (expected JSON with a 'weight_map'): {error}"
                ) from None
            shards = list(dict.fromkeys(weight_map.values()))
            missing = [name for name in shards if not (model_dir / name).is_file()]
            if missing:
                raise CheckpointFileError(
                    f"{index_path} names shard(s) {missing} that are not in {model_dir}. "
                    "Download the missing files again (or re-save the checkpoint)."
                )
            return [model_dir / name for name in shards]
    for single_name in (SAFE_WEIGHTS_NAME, TORCH_WEIGHTS_NAME):
        if (model_dir / single_name).is_file():
            return [model_dir / single_name]
    raise CheckpointFileError(
        f"No model weights found in {model_dir}: expected {SAFE_WEIGHTS_NAME}, "
        f"{SAFE_WEIGHTS_INDEX_NAME} with its shards, or {TORCH_WEIGHTS_NAME}."
    )


def check_weight_files(directory: str | os.PathLike) -> None:
    """Checks, reading no tensor, the weight files a Hugging Face folder holds: every shard its index names is there,
    and each safetensors file (model or PEFT adapter) is as long as its header says. A folder without weight files
    passes.

    Raises:
        CheckpointFileError: a shard is missing, or a safetensors file is truncated or has a bad header (the message
            names the file).
    """
    directory = Path(directory)
    names = sorted(name for name in os.listdir(directory) if _weight_kind(name) is not None)
    files = {directory / name for name in names if name.endswith(".safetensors")}
    if any(_weight_kind(name) == "model" for name in names):
        files.update(find_weight_files(directory))
    for path in sorted(files):
        if path.suffix == ".safetensors":
            SafetensorsReader(path).close()


def torch_to_numpy(tensor) -> np.ndarray:
    """A torch tensor as a numpy array (bfloat16 kept as ``ml_dtypes.bfloat16``)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def iter_torch_state_dict(state_dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(name, numpy array)`` from a torch state dict (bf16 kept as bf16)."""
    for name, tensor in state_dict.items():
        yield name, torch_to_numpy(tensor)


class CheckpointTensors:
    """The tensors of checkpoint files, streamed as ``(name, array, file)`` one at a time (iterate it).

    Safetensors tensors are read one at a time into fresh arrays, or into the buffer of a tensor
    given back with :meth:`recycle`; ``.bin`` files are loaded with
    ``torch.load(weights_only=True, mmap=True)``, never with pickle's full power.

    Args:
        files: the weight files, in order.
    """

    def __init__(self, files: list[Path]):
        self.files = list(files)
        self._buffers = ReadBuffers()

    def recycle(self, array: np.ndarray) -> None:
        """Lets a later read reuse ``array``'s memory: call it once nothing reads ``array`` any more (its
        contents were copied elsewhere and the copy has finished)."""
        self._buffers.give_back(array)

    def __iter__(self) -> Iterator[tuple[str, np.ndarray, Path]]:
        return _stream_tensors(self.files, self._buffers)


def iter_checkpoint_tensors(files: list[Path]) -> CheckpointTensors:
    """Streams ``(name, array, file)`` from each file, one tensor at a time (:class:`CheckpointTensors`)."""
    return CheckpointTensors(files)


def _stream_tensors(files: list[Path], buffers: ReadBuffers) -> Iterator[tuple[str, np.ndarray, Path]]:
    for path in files:
        if path.suffix == ".safetensors":
            with SafetensorsReader(path) as reader:
                for name in reader.keys():
                    yield name, reader.get(name, buffers), path
        else:
            import torch

            try:
                state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # torch raises several types for damaged files
                raise CheckpointFileError(
                    f"Could not read {path} with torch.load(weights_only=True): {error}. "
                    "Only plain tensor state dicts are accepted; convert the file to safetensors."
                ) from None
            for name, array in iter_torch_state_dict(state_dict):
                yield name, array, path
            del state_dict


def parse_size(size: int | str) -> int:
    """Parses ``max_shard_size`` the way transformers does (``"5GB"``, ``"500MB"``, ``"10KiB"``, int bytes)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size: use an int (bytes) or e.g. '5GB', '200MB'.")
    number, unit = float(match.group(1)), match.group(2)
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(number * powers[unit])


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Groups tensors, in order, into shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def check_output_dir(save_directory: str | os.PathLike) -> Path:
    """Raises a clear error when ``save_directory`` is an existing file."""
    path = Path(save_directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"save_pretrained: {path} is an existing file, not a directory. "
            "Pass a directory path (it is created if missing)."
        )
    return path


def write_checkpoint(
    save_directory: str | os.PathLike,
    specs: list[TensorSpec],
    materialize: Callable[[TensorSpec], np.ndarray],
    max_shard_size: int | str = "5GB",
    extra_files: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Writes an HF safetensors checkpoint shard by shard and publishes it atomically (``write_directory``).

    Args:
        save_directory: destination directory.
        specs: the HF name, dtype and shape of every tensor, in file order.
        materialize: returns the numpy array for one spec (called once per tensor, just
            before it is written, so at most one tensor is held on the host at a time). With several
            JAX processes every process calls ``write_checkpoint`` and ``materialize`` (which may gather
            a sharded tensor); process 0 alone writes, the others wait (:func:`multihost.on_primary`).
        max_shard_size: largest shard in bytes or as a string (``"5GB"``).
        extra_files: writes the non-weight files (config, tokenizer...) into the staging folder.

    Returns:
        The paths written, inside ``save_directory``.
    """
    def fill(staging: Path) -> None:
        shards = plan_shards(specs, parse_size(max_shard_size))
        metadata = {"format": "pt"}
        if len(shards) == 1:
            names = [SAFE_WEIGHTS_NAME]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards, strict=True):
            write_safetensors(
                staging / name,
                [(s.name, s.dtype, s.shape) for s in shard],
                ((s.name, materialize(s)) for s in shard),
                metadata,
            )
            _stage("shard-written")
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in specs)},
                "weight_map": {s.name: name for name, shard in zip(names, shards, strict=True) for s in shard},
            }
            (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if extra_files is not None:
            extra_files(staging)

    def take_part() -> None:  # the other processes: the same gathers, in the order process 0 writes them
        for shard in plan_shards(specs, parse_size(max_shard_size)):
            for spec in shard:
                materialize(spec)

    return multihost.on_primary(lambda: _write_directory(save_directory, fill, weights="model"),
                                f"write the checkpoint {save_directory}", take_part) or []


def write_directory(save_directory: str | os.PathLike, fill: Callable[[Path], None], *, weights: str) -> list[Path]:
    """Runs ``fill(staging_folder)`` and swaps the folder into place at ``save_directory``; with several JAX
    processes, process 0 does so while the others wait, and all return once it is published (``[]`` on the others).

    See the module docstring for the protocol: ``save_directory`` holds the old checkpoint or the
    new one at every moment; the user's other files in it are carried over, stale weight files
    are not. A symlinked ``save_directory`` stays a link: its target is replaced. On any error
    before the swap the staging folder is deleted and ``save_directory`` is untouched.

    Args:
        save_directory: destination directory (created with its parents if missing).
        fill: writes the new checkpoint's files into the folder it is given.
        weights: what ``fill`` writes, ``"model"`` or ``"adapter"``: an earlier save's weight files
            of that kind are stale. It is part of the save's token, so a crash cannot lose it.

    Returns:
        The paths written, inside ``save_directory``.

    Raises:
        NotADirectoryError: ``save_directory`` is a file.
        OSError: ``save_directory`` is a mount point, or a rename failed; the message says what to do.
    """
    return multihost.on_primary(lambda: _write_directory(save_directory, fill, weights=weights),
                                f"write {save_directory}") or []


def _write_directory(save_directory: str | os.PathLike, fill: Callable[[Path], None], *, weights: str) -> list[Path]:
    """:func:`write_directory` on the process that writes."""
    target = Path(os.path.realpath(check_output_dir(Path(save_directory).expanduser())))
    if os.path.ismount(target):
        raise OSError(
            f"save_pretrained: {target} is a mount point, which cannot be renamed; torchlike replaces a "
            "checkpoint by renaming its folder. Save into a subdirectory of it instead, e.g. "
            f"{target / 'model'}."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    finish_interrupted_save(target)
    if weights not in ("model", "adapter"):
        raise ValueError(f"weights={weights!r}: expected 'model' or 'adapter'.")
    token = f"{weights}-{secrets.token_hex(8)}"
    staging = directory_swap.sibling(target, directory_swap.NEW_TAG, token)
    staging.mkdir()
    try:
        fill(staging)
        _fsync_files(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = sorted(os.listdir(staging))
    # A process's working directory follows the folder, which becomes the backup: bring it to the new one.
    working_here = os.getcwd() == str(target)
    try:
        backup = directory_swap.swap_into_place(staging, target, token, _stage)
    except OSError as error:
        raise OSError(f"save_pretrained could not move the new checkpoint into {target}: {error}. {target} is "
                      f"unchanged (or, if it is missing, complete beside it and restored by the next "
                      f"from_pretrained). Check that {target.parent} is writable.") from error
    if working_here:
        os.chdir(target)
    if backup is not None:
        _finish_backup(backup, target)
    # Staging folders of earlier interrupted saves: this save supersedes them.
    for kind, leftover in directory_swap.siblings(target):
        if kind == "new":
            _discard(leftover, target)
    return [target / name for name in written]


def finish_interrupted_save(save_directory: str | os.PathLike) -> None:
    """Completes a ``write_directory`` that a crash interrupted (see the module docstring).

    When ``save_directory`` is missing and a complete new checkpoint sits beside it (a crash
    between the two renames), it is moved into place; the user's files are moved out of any
    backup and the backup deleted. Staging folders without a backup are left alone (a save may
    still be writing them). Cheap when there is nothing to do: one listing of the parent folder.

    Raises:
        OSError: the checkpoint could not be moved into place; the message says how to do it by hand.
    """
    target = Path(os.path.realpath(Path(save_directory).expanduser()))
    directory_swap.finish_interrupted_swap(target, _finish_backup)


def _weight_kind(name: str) -> str | None:
    """``"model"`` or ``"adapter"`` for a weight file or index name, else None."""
    match = _SHARD_NAME.match(name)
    if match is None:
        return None
    return "adapter" if match[1] == "adapter_model" else "model"


def _finish_backup(backup: Path, target: Path) -> None:
    """Moves the user's files from the backup of a swap into the new checkpoint ``target``, then deletes the backup.

    Every entry the new checkpoint lacks is moved, except weight files of the kind (model or
    adapter) the save wrote, named in the backup's token: those are stale.
    """
    written = backup.name.removeprefix(target.name + directory_swap.OLD_TAG).split("-", 1)[0]
    present = set(os.listdir(target))
    for entry in sorted(os.listdir(backup)):
        if entry not in present and _weight_kind(entry) != written:
            os.rename(backup / entry, target / entry)
    _stage("carried-over")
    _discard(backup, target)


def _discard(directory: Path, target: Path) -> None:
    """Deletes a staging folder or backup of ``target``, first renaming it to trash so that no
    half-deleted one is ever taken for a checkpoint."""
    trash = directory_swap.sibling(target, directory_swap.TRASH_TAG, secrets.token_hex(8))
    try:
        os.rename(directory, trash)
    except OSError:
        return  # already gone, or not ours to delete; the next save tries again
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_files(folder: Path) -> None:
    """Flushes every file of the staging folder to disk, so the swap never publishes data still in flight."""
    for child in folder.iterdir():
        if child.is_file():
            with open(child, "rb") as file:
                os.fsync(file.fileno())
    directory_swap.fsync_dir(folder)
