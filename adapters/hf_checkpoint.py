"""Hugging Face checkpoint directories: find the weight files, stream their tensors, write them back.

Reading handles ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, and ``pytorch_model.bin`` (single or sharded, loaded
only through ``torch.load(weights_only=True)``). Writing produces the layout
``transformers`` and vLLM load: ``model.safetensors`` when everything fits in one shard,
otherwise ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``,
each file carrying ``{"format": "pt"}`` metadata, staged and moved into place so a crash
never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .safetensors_io import CheckpointFileError, SafetensorsReader, write_safetensors

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"
TORCH_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_SHARD_NAME = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


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


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray, Path]]:
    """Streams ``(name, array, file)`` from each file, one tensor at a time.

    Safetensors tensors are read one at a time into fresh arrays; ``.bin`` files are loaded with
    ``torch.load(weights_only=True, mmap=True)``, never with pickle's full power.
    """
    for path in files:
        if path.suffix == ".safetensors":
            with SafetensorsReader(path) as reader:
                for name in reader.keys():
                    yield name, reader.get(name), path
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
    """Writes an HF safetensors checkpoint shard by shard, atomically.

    Files are written into a staging folder first. If ``save_directory`` did not exist the
    folder is renamed into place in one step; otherwise each file is moved in with the
    weights first and ``config.json`` last, and stale weight files from an earlier save
    are removed, as ``transformers`` does.

    Args:
        save_directory: destination directory.
        specs: the HF name, dtype and shape of every tensor, in file order.
        materialize: returns the numpy array for one spec (called once per tensor, just
            before it is written, so at most one tensor is held on the host at a time).
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
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in specs)},
                "weight_map": {s.name: name for name, shard in zip(names, shards, strict=True) for s in shard},
            }
            (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if extra_files is not None:
            extra_files(staging)

    return write_directory(save_directory, fill)


def write_directory(save_directory: str | os.PathLike, fill: Callable[[Path], None]) -> list[Path]:
    """Runs ``fill(staging_folder)`` and moves what it wrote into ``save_directory`` atomically.

    A new directory appears in one rename. Into an existing directory, weight files move first
    and ``config.json``/``adapter_config.json`` last (so a reader that finds the config finds
    its weights); weight files of an earlier save that this one did not write are removed.
    On any error the staging folder is deleted and ``save_directory`` is untouched.

    Returns:
        The paths written, inside ``save_directory``.
    """
    target = check_output_dir(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(staging)
        return _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, target: Path) -> list[Path]:
    written = sorted(p.name for p in staging.iterdir())
    if not target.exists():
        os.replace(staging, target)
        return [target / name for name in written]
    written_kinds = {match[1] for match in map(_SHARD_NAME.match, written) if match}
    for old in target.iterdir():
        match = _SHARD_NAME.match(old.name)
        if old.is_file() and match and match[1] in written_kinds and old.name not in written:
            old.unlink()
    # Weights first, then the index, then the other files, config.json last: a reader that
    # finds config.json finds the weights it points to.
    def publish_order(name: str) -> tuple[int, str]:
        if name.endswith(".safetensors"):
            return (0, name)
        if name == SAFE_WEIGHTS_INDEX_NAME:
            return (1, name)
        return (3 if name in ("config.json", "adapter_config.json") else 2, name)

    for name in sorted(written, key=publish_order):
        destination = target / name
        if destination.is_dir():
            shutil.rmtree(destination)
        os.replace(staging / name, destination)
    staging.rmdir()
    return [target / name for name in written]


