"""Host-side work split over the JAX processes of a multi-host run, and the collectives that join it again.

Under ``jax.distributed`` every process runs the same script over the same data. Work that happens on the host
(scoring completions with reward functions, calling a user's rollout function, writing files) is split by rows:
each process takes its own contiguous slice (:func:`process_rows`), and :func:`allgather_objects` hands every
process the pieces of all of them in process order, so each ends up with the same whole. Arrays that live on a
mesh spanning several processes come to the host with :func:`gather_to_host`. On one process every function
here is the identity, and no collective runs.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

__all__ = ["allgather_objects", "gather_to_host", "is_primary", "on_primary", "process_rows"]


def is_primary() -> bool:
    """Whether this process writes what only one process may write (files, Hub uploads): process 0."""
    return jax.process_index() == 0


def on_primary(work: Callable[[], T], what: str, take_part: Callable[[], None] | None = None) -> T | None:
    """Runs ``work()`` on process 0 only, while the others run ``take_part()`` (their share of the collectives
    ``work`` makes, e.g. gathering each tensor it writes) and then wait; every process learns whether it worked.

    Args:
        work: what one process does (write a checkpoint, upload a folder); its result is returned there.
        what: the work in words, for the error the other processes raise.
        take_part: run by the other processes instead; it must make the same collectives in the same order.

    Returns:
        ``work()``'s result on process 0, ``None`` on the others (``work()`` itself on one process).

    Raises:
        RuntimeError: on the other processes, when ``work`` failed on process 0 (which raises its own error).
    """
    if jax.process_count() == 1:
        return work()
    from jax.experimental import multihost_utils

    result, failure = None, None
    if is_primary():
        try:
            result = work()
        except BaseException as error:  # every process must reach the broadcast below, or the others hang
            failure = error
    elif take_part is not None:
        take_part()
    status = _SUCCEEDED if failure is None else _FAILED_OS if isinstance(failure, OSError) else _FAILED
    status = int(multihost_utils.broadcast_one_to_all(np.int32(status)))
    if failure is not None:
        raise failure
    if status != _SUCCEEDED:
        raise PrimaryFailedError(f"process 0 failed to {what}; its log has the error.", status == _FAILED_OS)
    return result


_SUCCEEDED, _FAILED, _FAILED_OS = 1, 0, 2


class PrimaryFailedError(RuntimeError):
    """Raised on the other processes when work that process 0 did for all of them (:func:`on_primary`) failed there.
    ``os_error`` says whether process 0's error was an ``OSError`` (a full disk...), so every process can handle it
    the same way."""

    def __init__(self, message: str, os_error: bool = False):
        super().__init__(message)
        self.os_error = os_error


def agree(succeeded: bool) -> bool:
    """Whether ``succeeded`` is true on every process (a collective: every process must call it); ``succeeded``
    itself on one process. A step that can fail on one process alone (its share of a save) ends with it, so that the
    others learn of the failure instead of waiting for it in the next collective."""
    if jax.process_count() == 1:
        return succeeded
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(succeeded))).all())


def process_count() -> int:
    """The JAX processes taking part (1 without ``jax.distributed``)."""
    return jax.process_count()


def process_rows(count: int) -> slice:
    """The rows of ``count`` that this process handles: contiguous slices in process order, as even as possible
    (the first ``count % processes`` processes take one more row)."""
    processes, index = jax.process_count(), jax.process_index()
    base, extra = divmod(count, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def allgather_objects(value: Any) -> list[Any]:
    """Every process's ``value``, in process order, on every process (``[value]`` on one process).

    ``value`` is any picklable object (lists of token ids, reward tables, dicts of dataset columns); it travels as
    bytes through one JAX all-gather, padded to the longest process's payload.
    """
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:payload.size] = payload
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(gathered[index, :int(size)].tobytes()) for index, size in enumerate(sizes)]


def gather_to_host(array) -> np.ndarray:
    """A numpy copy of the whole of ``array`` on this process, whatever its sharding.

    A value sharded over devices of other processes is all-gathered (every process must call this, in the same
    order); a value this process holds whole (fully addressable or replicated) is read locally.
    """
    if isinstance(array, jax.Array) and not array.is_fully_addressable and not array.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.asarray(array.addressable_data(0))
    return np.asarray(jax.device_get(array))
