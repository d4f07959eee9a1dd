"""Read and write safetensors files tensor by tensor, with errors that name the file and the fix.

The reader validates the header (offsets, sizes, dtypes) so a
truncated or corrupted file is reported before any tensor is used. The writer streams
one tensor at a time so exporting never holds a second copy of the model on the host.
Format: https://github.com/huggingface/safetensors (8-byte little-endian header size,
JSON header, then the raw little-endian tensor bytes).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, truncated or corrupted (the message names the file)."""


HUGE_PAGE_BYTES = 2 * 1024 * 1024


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary.

    On the CPU backend ``jax.device_put`` adopts such a buffer without copying it, so a tensor
    read from disk is not copied again on its way into the model. Arrays of 2 MiB or more get
    their own anonymous mapping marked ``MADV_HUGEPAGE`` (Linux, transparent huge pages in
    ``madvise`` or ``always`` mode): the kernel then fills them 2 MiB at a time instead of
    faulting in 4 KiB pages one by one (``benchmarks/hf_io.py`` measures checkpoint reads). The mapping
    lives as long as the array.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE") and mmap.PAGESIZE % alignment == 0:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # huge pages unavailable: plain pages, still one mapping
            pass
        return np.frombuffer(mapping, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside a safetensors file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class ReadBuffers:
    """Read buffers handed back once their tensor has been copied elsewhere, reused by the next read.

    A fresh buffer costs a page fault per page on first touch (the kernel zeroes it), which on a
    CPU host is most of the cost of reading a tensor from the page cache; a buffer given back is
    already mapped. Loading gives back every tensor it moved to the NNX layout (a transpose writes a
    new buffer), so a checkpoint read costs the page faults of its biggest such tensor once,
    not of every tensor. At most ``kept`` buffers (the biggest) wait for reuse, and a buffer serves a tensor of
    at least half its size.

    Args:
        kept: how many given-back buffers to keep.
    """

    def __init__(self, kept: int = 4):
        self.kept = kept
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised ``shape``/``dtype`` array: a given-back buffer when one is big enough, else a new
        :func:`aligned_empty` one."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        # a buffer over twice the size stays for a bigger tensor (one kept by the model would waste the rest)
        fitting = [buffer for buffer in self._free if nbytes <= buffer.nbytes <= 2 * nbytes]
        if fitting:
            base = min(fitting, key=lambda buffer: buffer.nbytes)
            self._free = [buffer for buffer in self._free if buffer is not base]
            array = base[:nbytes].view(dtype).reshape(shape)
        else:
            array = aligned_empty(shape, dtype)
            base = array.reshape(-1).view(np.uint8)
        self._lent[id(array)] = base
        # an array never given back (kept by the model, or copied to devices and dropped) releases its buffer
        weakref.finalize(array, self._lent.pop, id(array), None)
        return array

    def give_back(self, array: np.ndarray) -> None:
        """Makes the buffer of ``array`` (from :meth:`take`; others are ignored) reusable. The caller must hold no
        other reference to its memory (no array, device buffer or view that still reads it)."""
        base = self._lent.pop(id(array), None)
        if base is None:
            return
        self._free.append(base)
        self._free.sort(key=lambda buffer: buffer.nbytes, reverse=True)
        del self._free[self.kept:]


class SafetensorsReader:
    """Validated, tensor-by-tensor reader of one ``.safetensors`` file.

    Args:
        path: the file to open.

    Raises:
        CheckpointFileError: when the file is missing, truncated or has a bad header.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointFileError(f"Checkpoint file {self.path} does not exist.")
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        fix = "The file is damaged (an interrupted download or copy?): download or save it again."
        if size < 8:
            self.close()
            raise CheckpointFileError(f"{self.path} is {size} bytes, too short to be safetensors. {fix}")
        (header_size,) = struct.unpack("<Q", self._file.read(8))
        if header_size > min(_MAX_HEADER_BYTES, size - 8):
            self.close()
            raise CheckpointFileError(
                f"{self.path} has an invalid safetensors header (declared {header_size} bytes "
                f"in a {size}-byte file). {fix}"
            )
        try:
            header = json.loads(self._file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            self.close()
            raise CheckpointFileError(f"{self.path} has a corrupted safetensors header ({error}). {fix}") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_size
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                self.close()
                raise CheckpointFileError(f"{self.path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}.")
            begin, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or data_start + end > size:
                self.close()
                raise CheckpointFileError(
                    f"{self.path} is truncated or corrupted: tensor {name!r} needs bytes "
                    f"{data_start + begin}..{data_start + end} but the file has {size} bytes. {fix}"
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str, buffers: ReadBuffers | None = None) -> np.ndarray:
        """Reads one tensor into a new array (from ``buffers`` when given).

        A plain read (rather than a memory map) keeps the file's pages out of this process's
        resident set, so streaming a checkpoint costs one tensor of memory beyond the model.
        """
        info = self.tensors[name]
        array = buffers.take(info.shape, info.dtype) if buffers is not None else aligned_empty(info.shape, info.dtype)
        view = memoryview(array.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            read = os.preadv(self._file.fileno(), [view[done:]], info.start + done)
            if read == 0:
                raise CheckpointFileError(f"{self.path} ended while reading tensor {name!r}; the file is truncated. "
                                          "Download or save it again.")
            done += read
        return array

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, by name in file order, each in a fresh array (for a small file read
    whole, such as an adapter's).

    Raises:
        CheckpointFileError: when the file is missing, truncated or has a bad header.
    """
    with SafetensorsReader(path) as reader:
        return {name: reader.get(name) for name in reader.keys()}


def safetensors_dtype_name(dtype: np.dtype) -> str:
    """The safetensors dtype tag (``"BF16"``, ``"F32"``...) for a numpy dtype."""
    try:
        return _DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


def write_safetensors(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes a safetensors file streaming one tensor at a time.

    Args:
        path: destination file.
        specs: ``(name, dtype, shape)`` of every tensor, in the order they will come.
        tensors: yields ``(name, array)`` in the order of ``specs``; each array is written
            and dropped before the next is requested.
        metadata: string-to-string ``__metadata__`` (``{"format": "pt"}`` for transformers).

    Raises:
        OSError: the file could not be written (a full disk...); its ``filename`` names the file.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    order = []
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": safetensors_dtype_name(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        order.append((name, np.dtype(dtype), tuple(shape)))
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    try:
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for (name, dtype, shape), (got_name, array) in zip(order, tensors, strict=True):
                if got_name != name or array.dtype != dtype or tuple(array.shape) != shape:
                    raise RuntimeError(f"tensor stream out of order: expected {name} {dtype}{shape}, "
                                       f"got {got_name} {array.dtype}{tuple(array.shape)}")
                out.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        if error.errno is not None and error.filename is None:
            error.filename = os.fspath(path)  # a failed write (a full disk) names no file; say which one
        raise
