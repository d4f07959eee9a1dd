"""Store dicts of arrays with Orbax: atomic overwrite, recovery from interrupted saves, lazy partial restore.

On-disk layout of a checkpoint directory ``PATH``::

    PATH/
        arrays/          an Orbax PyTree checkpoint (OCDBT) of a *flat* dict
                         {"leaf_000000": array, "leaf_000001": array, ...}; absent when
                         there are no arrays
        manifest.json    written last, atomically: the commit marker. It holds the format
                         tag, the user metadata, the original tree (keys with their types,
                         lists, tuples, Python scalars inline), per leaf its key path,
                         shape and dtype, and the size of every file under arrays/ (so a
                         missing or truncated file is found without reading an array).

Orbax joins nested key paths with ``"."``, so a flat key ``"a.b"`` and a nested
``{"a": {"b": ...}}`` would land on the same name; the opaque leaf names make that
impossible and the manifest gives the original keys (``int`` or ``str``) back.

Overwriting is atomic, by the rename protocol of ``directory_swap``. ``save`` writes the new
checkpoint into the sibling ``PATH.torchlike-new-TOKEN``, then renames ``PATH`` to
``PATH.torchlike-old-TOKEN``, the new one to ``PATH``, and deletes the backup (its manifest
first, so a half-deleted backup never looks complete). ``load`` accepts any state a crash can
leave: when ``PATH`` is missing it finishes the swap from the complete sibling (the new one
first, else the backup), and it drops a backup whose swap is known to have finished. A
directory counts as complete only when its manifest is there. One writer per path at a time
(concurrent readers are fine).

One protocol in one file (the layout, its crash points and the recovery that reads them), which is why it is longer
than most modules.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..distributed.mesh import barrier
from ..distributed.multihost import agree
from .directory_swap import NEW_TAG, OLD_TAG, fsync_dir, sibling, siblings, swap_into_place
from .hf_checkpoint import torch_to_numpy
from .safetensors_io import CheckpointFileError

FORMAT = "torchlike-orbax-1"
MANIFEST_NAME = "manifest.json"
ARRAYS_DIR = "arrays"
_LEAF_PREFIX = "leaf_"
_FIX = "re-save it or restore it from a backup"
# TensorStore reports a failed file operation as a ValueError ending in "[os_error_code='28']" (28: a full disk).
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")

# Called with a stage name at each step of ``save_tree`` (see ``SAVE_STAGES``). Only the
# crash tests set it: they kill the process there to check that ``load`` recovers.
_crash_test_hook: Callable[[str], None] | None = None
SAVE_STAGES = ("orbax-written", "staged", "old-moved", "swapped", "backup-unmarked", "done")

Key = str | int


class CheckpointCorruptedError(CheckpointFileError):
    """A torchlike checkpoint directory is damaged or is not a torchlike checkpoint (the message names it)."""


def _stage(name: str) -> None:
    if _crash_test_hook is not None:
        _crash_test_hook(name)


# ----------------------------------------------------------------------------- encoding


def _format_key_path(keys: tuple[Key, ...]) -> str:
    return "".join(f"[{key!r}]" for key in keys) or "<top level>"


def _as_array(value: Any, keys: tuple[Key, ...]) -> jax.Array | np.ndarray | None:
    """The value as something Orbax can write (jax.Array kept as is: sharded arrays stay sharded), else None."""
    if isinstance(value, jax.Array):
        array = value
    elif isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
    elif type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        array = torch_to_numpy(value)
    else:
        return None
    dtype = np.dtype(array.dtype)
    if dtype.kind in "OSUMm" or dtype.fields is not None:
        raise TypeError(
            f"Cannot save the array at {_format_key_path(keys)}: dtype {dtype} is not numeric. "
            "Store numbers only (strings and objects belong in `metadata`)."
        )
    return array


class _Encoder:
    """Turns the user's tree into a JSON-able description plus a flat {leaf name: array} dict."""

    def __init__(self) -> None:
        self.arrays: dict[str, jax.Array | np.ndarray] = {}
        self.leaves: dict[str, dict[str, Any]] = {}

    def items(self, mapping: Mapping, keys: tuple[Key, ...]) -> list[list[Any]]:
        items = []
        for key, value in mapping.items():
            # bool is an int subclass, but JSON would give it back as true/false: refuse it.
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"Cannot save key {key!r} ({type(key).__name__}) at {_format_key_path(keys)}: "
                    "keys must be str or int."
                )
            items.append([key, self.node(value, (*keys, key))])
        return items

    def node(self, value: Any, keys: tuple[Key, ...]) -> dict[str, Any]:
        if isinstance(value, Mapping):
            return {"type": "dict", "items": self.items(value, keys)}
        if isinstance(value, (list, tuple)):
            # Named tuples (optax states) are stored as plain tuples.
            kind = "list" if isinstance(value, list) else "tuple"
            return {"type": kind, "items": [self.node(item, (*keys, i)) for i, item in enumerate(value)]}
        if value is None:
            return {"type": "none"}
        array = _as_array(value, keys)
        if array is not None:
            name = f"{_LEAF_PREFIX}{len(self.arrays):06d}"
            self.arrays[name] = array
            self.leaves[name] = {"path": list(keys), "shape": list(array.shape), "dtype": np.dtype(array.dtype).name}
            return {"type": "array", "leaf": name}
        if isinstance(value, (bool, int, float)):
            # Python scalars live in the manifest itself: JSON keeps bool/int/float apart.
            return {"type": "scalar", "value": value}
        raise TypeError(
            f"Cannot save the value at {_format_key_path(keys)}: expected a jax.Array, numpy array, torch "
            f"tensor, Python int/float/bool, None, or a dict/list/tuple of those; got {type(value).__qualname__}."
        )


# ----------------------------------------------------------------------------- files and directories


def _write_json_atomically(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as file:
        json.dump(data, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)


def _as_os_error(error: ValueError) -> OSError | ValueError:
    """TensorStore's error for a failed file operation as the ``OSError`` it reports (``errno.ENOSPC`` for a full
    disk), so that callers handle it as one; any other error as it is."""
    match = _TENSORSTORE_OS_ERROR.search(str(error))
    if match is None:
        return error
    code = int(match[1])
    # TensorStore appends its whole JSON spec to the message: keep the part a person reads (it names the file).
    return OSError(code, f"{os.strerror(code)}: {str(error).split(' [tensorstore_spec=', 1)[0][:1000]}")


def _local_bytes(arrays: Mapping[str, Any]) -> int:
    """The bytes of ``arrays`` this process writes: its addressable shards that are the first replica (Orbax writes
    each shard once, from the process holding its replica 0), or the whole array on process 0 for host arrays."""
    total = 0
    for value in arrays.values():
        if isinstance(value, jax.Array):
            total += sum(shard.data.nbytes for shard in value.addressable_shards if shard.replica_id == 0)
        elif _is_primary():
            total += int(np.asarray(value).nbytes)
    return total


def _room_for(arrays: Mapping[str, Any], folder: Path) -> OSError | None:
    """``None`` when the disk of ``folder`` has room for this process's share of ``arrays``, else the ``OSError``
    (``ENOSPC``) that says how much is needed and free. A file system that reports no sizes is taken at its word."""
    needed = _local_bytes(arrays)
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return None
    free = usage.free
    if usage.total == 0 or needed <= free:  # a total of 0: a mount (FUSE, object storage) that keeps no count
        return None
    return OSError(errno.ENOSPC, f"No space left on device: process {jax.process_index()}'s arrays of {folder} need "
                                 f"{needed:,} bytes and {free:,} are free")


def _file_sizes(directory: Path) -> dict[str, int]:
    """``{path relative to directory: size in bytes}`` of every file under ``directory`` (none when it is missing)."""
    return {str(file.relative_to(directory)): file.stat().st_size
            for file in sorted(directory.rglob("*")) if file.is_file()}


def _read_manifest(directory: Path) -> dict:
    """The parsed manifest of ``directory``.

    Raises:
        FileNotFoundError: there is no manifest (not a torchlike checkpoint, or not finished).
        CheckpointCorruptedError: the manifest is unreadable or from an unknown format.
    """
    manifest_path = directory / MANIFEST_NAME
    try:
        text = manifest_path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(manifest_path) from None
    except OSError as error:
        raise CheckpointCorruptedError(f"The checkpoint at {directory} is damaged: cannot read {MANIFEST_NAME} "
                                       f"({error}); {_FIX}.") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as error:
        manifest = f"invalid JSON ({error})"
    missing = ["a JSON object"] if not isinstance(manifest, dict) else [
        key for key in ("format", "arrays", "entries", "leaves", "metadata") if key not in manifest
    ]
    if missing:
        found = manifest if isinstance(manifest, str) else f"missing {', '.join(missing)}"
        raise CheckpointCorruptedError(
            f"The checkpoint at {directory} is damaged: {MANIFEST_NAME} is not a valid torchlike manifest "
            f"({found}); {_FIX}."
        )
    tag = manifest["format"]
    if tag != FORMAT:
        raise CheckpointCorruptedError(
            f"The checkpoint at {directory} has format {tag!r}; this torchlike reads {FORMAT!r}. "
            "Load it with the torchlike version that wrote it (see metadata['torchlike_version'] in "
            f"{MANIFEST_NAME}) or upgrade torchlike."
        )
    return manifest


def _complete_manifest(directory: Path) -> dict | None:
    """The manifest when ``directory`` is a complete checkpoint, else None (never raises)."""
    try:
        return _read_manifest(directory)
    except (FileNotFoundError, CheckpointCorruptedError):
        return None


def _discard(directory: Path, stage: str | None = None) -> None:
    """Deletes a checkpoint directory, its manifest first so that a half-deleted one is never complete."""
    try:
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
    except OSError:
        pass
    if stage is not None:
        _stage(stage)
    shutil.rmtree(directory, ignore_errors=True)


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    """Waits for every JAX process (multi-host saves: the primary renames only after all have written,
    and nobody returns before the rename). The directory must be on storage every host sees."""
    barrier(f"torchlike.save:{name}")


def _shared_token() -> str:
    """A random token for this save, the same on every process (chosen by process 0)."""
    token = np.frombuffer(secrets.token_bytes(8), dtype=np.uint8)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = np.asarray(multihost_utils.broadcast_one_to_all(token), dtype=np.uint8)
    return token.tobytes().hex()


def _check_replaceable(path: Path) -> None:
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise FileExistsError(
            f"{path} exists and is not a directory; torchlike checkpoints are directories. "
            "Choose another path, or delete the file first if it is no longer needed."
        )
    if (path / MANIFEST_NAME).exists() or not any(path.iterdir()):
        return  # a torchlike checkpoint (even a damaged one) or an empty directory
    raise FileExistsError(
        f"{path} exists and is not a torchlike checkpoint (no {MANIFEST_NAME}); refusing to replace it. "
        "Choose another path, or delete the directory first if it is no longer needed."
    )


# ----------------------------------------------------------------------------- save


def save_tree(tree: Mapping, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
    """Saves a dict of arrays (flat or nested) to ``path``, replacing any checkpoint there atomically.

    Args:
        tree: a flat state dict (``{"layers.0.attn.q_proj.w": array}``) or nested dicts/lists/tuples
            of arrays (``jax.Array``, possibly sharded; numpy, incl. bfloat16; torch tensors) and
            Python ``int``/``float``/``bool``/``None``. Keys are ``str`` or ``int``.
        path: the checkpoint directory. Its parent is created if needed.
        metadata: JSON-serialisable dict stored with the checkpoint (tuples come back as lists).

    Returns:
        The absolute path of the checkpoint.

    Raises:
        TypeError: ``tree`` is not a mapping, or a key or leaf has an unsupported type (the
            message names its key path), or ``metadata`` is not JSON-serialisable.
        FileExistsError: ``path`` is a file or a non-empty directory that is not a torchlike checkpoint.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"Expected a dict-like object (e.g. model.state_dict()), got {type(tree).__qualname__}.")
    path = Path(os.path.abspath(os.fspath(path)))
    _check_replaceable(path)
    encoder = _Encoder()
    entries = encoder.items(tree, ())
    flat = all(node["type"] in ("array", "scalar", "none") for _, node in entries)
    token = _shared_token()
    manifest = {
        "format": FORMAT,
        "token": token,
        "created_ns": time.time_ns(),
        "flat": flat,
        "arrays": ARRAYS_DIR if encoder.arrays else None,
        "metadata": dict(metadata or {}),
        "entries": entries,
        "leaves": encoder.leaves,
    }
    try:
        json.dumps(manifest["metadata"])
    except (TypeError, ValueError) as error:
        raise TypeError(f"metadata must be JSON-serialisable (str keys; str/int/float/bool/None/list/dict "
                        f"values): {error}") from None

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = sibling(path, NEW_TAG, token)
    if _is_primary():
        staging.mkdir()
    _barrier(f"{token}:staging")
    # A process that fails inside Orbax's save leaves the others in Orbax's own barriers: every process first checks
    # that its share fits on the disk, and all of them fail alike before Orbax starts when one share does not.
    room = _room_for(encoder.arrays, staging)
    if not agree(room is None):
        if _is_primary():
            shutil.rmtree(staging, ignore_errors=True)
        raise room or OSError(errno.ENOSPC, f"another process has no room for its part of {path} (its log has the "
                                            "error); nothing of this save was kept.")
    failure = None
    try:
        if encoder.arrays:
            with ocp.PyTreeCheckpointer() as checkpointer:
                # Synchronous: returns once Orbax has written and committed arrays/ (on every process).
                try:
                    checkpointer.save(staging / ARRAYS_DIR, args=ocp.args.PyTreeSave(item=encoder.arrays))
                except ValueError as error:
                    raise _as_os_error(error) from error
        _stage("orbax-written")
        if _is_primary():
            manifest["files"] = _file_sizes(staging / ARRAYS_DIR)
            _write_json_atomically(staging / MANIFEST_NAME, manifest)  # the commit marker
    except BaseException as error:  # the others must learn of it (below), or they wait for this process
        failure = error
    # Every process says whether its part was written: a failure on any one (its shards, or process 0's manifest)
    # fails the save on all of them alike, instead of leaving the others in the next barrier.
    everyone = agree(failure is None)
    if failure is not None or not everyone:
        if _is_primary():
            shutil.rmtree(staging, ignore_errors=True)
        if failure is not None:
            raise failure
        raise OSError(f"another process failed to write its part of {path} (its log has the error); nothing of this "
                      "save was kept.")
    _stage("staged")
    if not _is_primary():
        _barrier(f"{token}:swapped")
        return path
    try:
        _swap_into_place(staging, path, token)
    finally:
        _barrier(f"{token}:swapped")
    return path


def _swap_into_place(staging: Path, path: Path, token: str) -> None:
    """Moves the complete ``staging`` directory to ``path``; an old checkpoint there is kept beside it
    until the new one is in place."""
    backup = swap_into_place(staging, path, token, _stage)
    if backup is not None:
        _discard(backup, stage="backup-unmarked")
    # Leftovers of earlier interrupted saves are older than what was just written.
    for _, leftover in siblings(path):
        _discard(leftover)
    _stage("done")


# ----------------------------------------------------------------------------- load


def _describe_siblings(path: Path) -> str:
    leftovers = siblings(path)
    if not leftovers:
        return ""
    described = ", ".join(
        f"{directory.name} ({'complete' if _complete_manifest(directory) else 'incomplete'})"
        for _, directory in leftovers
    )
    return f" Leftovers of interrupted saves sit beside it: {described}."


def _resolve(path: Path) -> tuple[Path, dict]:
    """The directory to read for ``path`` and its manifest, finishing an interrupted swap if needed."""
    try:
        manifest = _read_manifest(path)
    except FileNotFoundError:
        manifest = None
        damage = None
    except CheckpointCorruptedError as error:
        manifest = None
        damage = error
    if manifest is not None:
        _check_array_data(path, manifest)
        # The swap of this save finished; only the deletion of its backup may be missing.
        backup = sibling(path, OLD_TAG, str(manifest.get("token")))
        if backup.is_dir():
            _discard(backup)
        return path, manifest

    candidates = []
    for kind, directory in siblings(path):
        sibling_manifest = _complete_manifest(directory)
        if sibling_manifest is not None:
            # A finished new checkpoint beats a backup; among equals, the newest wins.
            candidates.append((kind == "new", sibling_manifest.get("created_ns", 0), directory, sibling_manifest))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)

    if os.path.lexists(path):
        if not candidates:
            if damage is not None:
                raise damage
            if not path.is_dir():
                raise CheckpointCorruptedError(f"{path} is a file, not a torchlike checkpoint directory. "
                                               "Load .pt files with torch.load and HF folders with from_pretrained.")
            raise CheckpointCorruptedError(
                f"{path} is not a torchlike checkpoint: it has no {MANIFEST_NAME} (an unfinished copy, a raw "
                "Orbax checkpoint or another kind of folder?). Point load() at a directory written by "
                f"torchlike.save, or {_FIX}.{_describe_siblings(path)}"
            )
        # Our swap never leaves PATH incomplete, so someone damaged it: read the sibling, touch nothing.
        _, _, directory, sibling_manifest = candidates[0]
        warnings.warn(f"{path} is not a complete checkpoint; reading the complete copy {directory} instead "
                      "(nothing was moved or deleted).", stacklevel=3)
        return directory, sibling_manifest

    if not candidates:
        raise FileNotFoundError(f"No torchlike checkpoint at {path}.{_describe_siblings(path)}")
    _, _, directory, sibling_manifest = candidates[0]
    try:
        os.rename(directory, path)  # finish the interrupted swap
        fsync_dir(path.parent)
    except OSError:
        # Read-only filesystem, or another reader finished the swap first.
        winner = _complete_manifest(path)
        if winner is not None:
            return _resolve(path)
        return directory, sibling_manifest
    return _resolve(path)


def _check_array_data(directory: Path, manifest: dict) -> None:
    """Cheap structural check (no array is read): the Orbax folder the manifest names is there, and every file
    the manifest records (checkpoints written before it recorded them: none) has its recorded size."""
    if manifest["arrays"] is None:
        return
    arrays = directory / manifest["arrays"]
    if not (arrays / "_METADATA").is_file():
        raise CheckpointCorruptedError(
            f"The checkpoint at {directory} is damaged: its array data {arrays} is missing or incomplete "
            f"(no _METADATA file) while {MANIFEST_NAME} lists {len(manifest['leaves'])} arrays; "
            f"{_FIX}.{_describe_siblings(directory)}"
        )
    for name, size in manifest.get("files", {}).items():
        file = arrays / name
        try:
            found = file.stat().st_size
        except FileNotFoundError:
            found = None
        if found != size:
            raise CheckpointCorruptedError(
                f"The checkpoint at {directory} is damaged: its array file {file} "
                f"{'is missing' if found is None else f'is {found} bytes'} where {MANIFEST_NAME} "
                f"records {size} bytes (cut short by a full disk or an interrupted copy, or deleted?); "
                f"{_FIX}.{_describe_siblings(directory)}"
            )


def check_store(path: str | os.PathLike) -> None:
    """Checks, reading no array and changing nothing, that ``path`` holds a complete checkpoint: its manifest (the
    commit marker) is there and valid, the array data it names is there and every array file has the size the
    manifest records.

    Args:
        path: a directory written by ``save_tree``.

    Raises:
        CheckpointCorruptedError: the manifest or an array file is missing, unreadable or of the wrong size (the
            message names the file).
    """
    path = Path(os.path.abspath(os.fspath(path)))
    try:
        manifest = _read_manifest(path)
    except FileNotFoundError:
        if not path.is_dir():
            raise CheckpointCorruptedError(f"No torchlike checkpoint at {path}: expected a directory written by "
                                           "torchlike.save.") from None
        raise CheckpointCorruptedError(
            f"The checkpoint at {path} is incomplete: {path / MANIFEST_NAME} is missing, which a save writes last "
            f"(the commit marker), so its save did not finish; {_FIX}."
        ) from None
    _check_array_data(path, manifest)


def open_checkpoint(path: str | os.PathLike) -> LazyCheckpoint:
    """Opens a checkpoint written by ``save_tree`` reading only its manifest.

    Args:
        path: the checkpoint directory given to ``save_tree``.

    Returns:
        A ``LazyCheckpoint``; arrays are read when asked for.

    Raises:
        FileNotFoundError: nothing complete at ``path`` or beside it (the message lists leftovers).
        CheckpointCorruptedError: the directory is damaged or is not a torchlike checkpoint.
    """
    path = Path(os.path.abspath(os.fspath(path)))
    directory, manifest = _resolve(path)
    _check_array_data(directory, manifest)
    return LazyCheckpoint(directory, manifest)


def _as_numpy_dtype(dtype: Any) -> np.dtype:
    if type(dtype).__module__ == "torch":
        return np.dtype(str(dtype).removeprefix("torch."))
    return np.dtype(dtype)


class LazyCheckpoint(Mapping):
    """A saved checkpoint, read on demand: a read-only mapping over the original top-level keys.

    ``ckpt[key]`` reads that entry (numpy arrays, or the nested structure); ``restore`` reads
    chosen keys straight into device shardings; ``to_dict`` reads everything. Opening reads only
    ``manifest.json``. If the checkpoint is overwritten after opening, reads raise
    ``RuntimeError`` instead of mixing two saves.

    Attributes:
        path: the directory being read.
        metadata: the metadata dict given to ``save`` plus ``torchlike_version`` and ``format``.
        flat: True when every top-level value is an array or scalar (a state dict).
    """

    def __init__(self, directory: Path, manifest: dict):
        self.path = directory
        self._manifest = manifest
        self.flat: bool = manifest["flat"]
        self._entries: dict[Key, dict] = {key: node for key, node in manifest["entries"]}
        self._leaves: dict[str, dict] = manifest["leaves"]
        self._stamp = self._manifest_stamp()

    # -- Mapping

    def __getitem__(self, key: Key) -> Any:
        node = self._entries[key]
        return self._build(node, self._read_numpy(self._leaf_names(node)))

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # Mapping's default would read the entry

    def __repr__(self) -> str:
        return f"LazyCheckpoint({str(self.path)!r}, {len(self)} entries, {len(self._leaves)} arrays)"

    # -- metadata without reading arrays

    @property
    def metadata(self) -> dict[str, Any]:
        return copy.deepcopy(self._manifest["metadata"])

    def shape_dtype(self, key: Key) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of an array entry, from the manifest (no data is read).

        Args:
            key: a top-level key whose value is an array.

        Returns:
            ``(shape, numpy dtype)``.

        Raises:
            KeyError: no such key. TypeError: the entry is not an array.
        """
        node = self._entries[key]
        if node["type"] != "array":
            raise TypeError(
                f"Entry {key!r} of {self.path} is a {node['type']}, not an array; read it with ckpt[{key!r}]."
            )
        leaf = self._leaves[node["leaf"]]
        return tuple(leaf["shape"]), np.dtype(leaf["dtype"])

    # -- reading

    def to_dict(self) -> dict[Key, Any]:
        """Reads every entry (one Orbax call) and returns the original structure with numpy arrays."""
        arrays = self._read_numpy(list(self._leaves))
        return {key: self._build(node, arrays) for key, node in self._entries.items()}

    def restore(
        self,
        targets: Mapping[Key, Any],
        dtypes: Mapping[Key, Any] | None = None,
    ) -> dict[Key, Any]:
        """Reads only the given keys, each straight into its sharding (no other array is read).

        Args:
            targets: ``{key: where}`` with ``where`` a ``jax.sharding.Sharding``, ``None`` (the
                first device), or a ``jax.Array``/``jax.ShapeDtypeStruct`` whose sharding (and dtype,
                unless ``dtypes`` names one) is used and whose shape must match. For a nested entry
                the sharding applies to each of its arrays.
            dtypes: optional ``{key: dtype}`` to cast to while reading.

        Returns:
            ``{key: jax.Array}`` in the order of ``targets`` (nested entries keep their
            structure; Python scalars come back as they were saved).

        Raises:
            KeyError: a key is not in the checkpoint. ValueError: a shape or sharding does not fit.
            CheckpointCorruptedError: the data cannot be read.
        """
        if not isinstance(targets, Mapping):
            raise TypeError(f"targets must be a mapping {{key: Sharding | None}}, got {type(targets).__qualname__}; "
                            "for the default device use {key: None for key in keys}.")
        dtypes = dict(dtypes or {})
        unknown = [key for key in list(targets) + list(dtypes) if key not in self._entries]
        if unknown:
            sample = ", ".join(repr(k) for k in list(self._entries)[:5])
            raise KeyError(f"{unknown[:5]} not in the checkpoint at {self.path} ({len(self)} keys, e.g. {sample}).")
        args: dict[str, ocp.ArrayRestoreArgs] = {}
        for key, where in targets.items():
            node = self._entries[key]
            dtype = dtypes.get(key)
            if where is not None and not isinstance(where, jax.sharding.Sharding):
                if not hasattr(where, "sharding") or not hasattr(where, "shape"):
                    raise TypeError(f"restore target for {key!r} must be a jax.sharding.Sharding, None, or a "
                                    f"jax.Array/ShapeDtypeStruct; got {type(where).__qualname__}.")
                if node["type"] != "array":
                    raise TypeError(f"Entry {key!r} is a {node['type']}: give a Sharding or None, not an array.")
                stored = tuple(self._leaves[node["leaf"]]["shape"])
                if tuple(where.shape) != stored:
                    raise ValueError(f"Shape mismatch for {key!r}: the checkpoint at {self.path} has {stored}, "
                                     f"the target has {tuple(where.shape)}.")
                dtype = where.dtype if dtype is None else dtype
                where = where.sharding
            sharding = where if where is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
            for name in self._leaf_names(node):
                shape = tuple(self._leaves[name]["shape"])
                check = getattr(sharding, "check_compatible_aval", None)
                if check is not None:
                    try:
                        check(shape)
                    except ValueError as error:
                        raise ValueError(f"Cannot restore {key!r} (shape {shape}) into {sharding}: {error}") from None
                args[name] = ocp.ArrayRestoreArgs(
                    restore_type=jax.Array,
                    sharding=sharding,
                    dtype=None if dtype is None else _as_numpy_dtype(dtype),
                    global_shape=shape,
                )
        arrays = self._read(args, cast=True)
        return {key: self._build(self._entries[key], arrays) for key in targets}

    # -- internals

    def _manifest_stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path / MANIFEST_NAME)
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _leaf_names(self, node: dict) -> list[str]:
        if node["type"] == "array":
            return [node["leaf"]]
        if node["type"] == "dict":
            return [name for _, child in node["items"] for name in self._leaf_names(child)]
        if node["type"] in ("list", "tuple"):
            return [name for child in node["items"] for name in self._leaf_names(child)]
        return []

    def _build(self, node: dict, arrays: Mapping[str, Any]) -> Any:
        kind = node["type"]
        if kind == "array":
            return arrays[node["leaf"]]
        if kind == "scalar":
            return node["value"]
        if kind == "none":
            return None
        if kind == "dict":
            return {key: self._build(child, arrays) for key, child in node["items"]}
        children = [self._build(child, arrays) for child in node["items"]]
        return children if kind == "list" else tuple(children)

    def _read_numpy(self, names: list[str]) -> dict[str, np.ndarray]:
        return self._read({name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}, cast=False)

    def _read(self, args: dict[str, ocp.RestoreArgs], cast: bool) -> dict[str, Any]:
        if not args:
            return {}
        if self._manifest_stamp() != self._stamp:
            raise RuntimeError(f"The checkpoint at {self.path} was replaced or removed after load(); "
                               "call torchlike.load() again to read the current one.")
        directory = self.path / self._manifest["arrays"]
        request = ocp.args.PyTreeRestore(
            item={name: 0 for name in args}, restore_args=dict(args), partial_restore=len(args) < len(self._leaves)
        )
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                restored = checkpointer.restore(directory, args=request)
        except Exception as error:  # Orbax/TensorStore raise many types for damaged data
            keys = [_format_key_path(tuple(self._leaves[name]["path"])) for name in list(args)[:3]]
            # TensorStore appends its whole JSON spec to the message: keep the part a person reads.
            reason = str(error).split(" [tensorstore_spec=", 1)[0][:500]
            raise CheckpointCorruptedError(
                f"The checkpoint at {self.path} is damaged: reading {', '.join(keys)}"
                f"{' ...' if len(args) > 3 else ''} from {directory} failed ({type(error).__name__}: "
                f"{reason}); {_FIX}."
            ) from error
        for name in args:
            leaf = self._leaves[name]
            value = restored.get(name) if isinstance(restored, Mapping) else None
            shape = None if value is None else tuple(value.shape)
            if shape != tuple(leaf["shape"]) or (not cast and np.dtype(value.dtype) != np.dtype(leaf["dtype"])):
                found = "nothing" if value is None else f"shape {shape}, dtype {value.dtype}"
                raise CheckpointCorruptedError(
                    f"The checkpoint at {self.path} is damaged: {_format_key_path(tuple(leaf['path']))} should be "
                    f"shape {tuple(leaf['shape'])}, dtype {leaf['dtype']} but the array data has {found}; {_FIX}."
                )
        return restored
