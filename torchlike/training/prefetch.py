"""Batches prepared ahead of the training loop in a background thread, so the device never waits on Python."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["prefetched"]

Item = TypeVar("Item")


def prefetched(batches: Iterator[Item], depth: int) -> Iterator[Item]:
    """Runs ``batches`` (collation and device placement) ``depth`` items ahead in a thread.

    An error raised while preparing a batch is re-raised in the consuming thread when it reaches that batch. When the
    consumer stops early (``max_steps``, ``should_training_stop``, an error), the worker finishes the batch it is
    placing and exits before this generator closes, so no thread is inside JAX when the interpreter exits (that aborts
    the process).

    Args:
        batches: the batches, prepared lazily as the iterator is advanced.
        depth: how many batches may wait ready; ``depth <= 0`` prepares each one inline, in the consuming thread.

    Yields:
        The items of ``batches``, in order.
    """
    if depth <= 0:
        yield from batches
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    finished = object()

    def offer(item) -> bool:
        """Queues ``item`` unless the consumer stopped; returns whether it was queued."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in batches:
                if not offer(item):
                    return
            offer(finished)
        except BaseException as error:  # handed to the training thread, which re-raises it
            offer(error)

    worker = threading.Thread(target=produce, name="torchlike-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if item is finished:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join(timeout=60)
