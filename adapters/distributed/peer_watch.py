"""A dead peer: every process of a multi-process run keeps a heartbeat in the coordinator's key-value store, and a
process that sees another's heartbeat stop (or loses the coordinator) stops the job with a named error.

Without this, when one process of a ``jax.distributed`` run dies, the others block in their next collective until
JAX's coordination service gives up on the missing heartbeats (``heartbeat_timeout_seconds``, 100 s by default) and
aborts the process with a C++ stack trace that names neither the process nor what to do. :class:`PeerWatch` runs a
daemon thread beside the training loop: each process bumps a counter under ``torchlike/heartbeat/<process>`` every
``interval`` seconds and reads the others'; a counter that has not moved for ``timeout`` seconds of this process's own
clock (no clock is compared across hosts), or a key-value store that stops answering (the coordinator, process 0,
is gone), makes the thread print a :class:`PeerLostError` message, naming the silent process and the last complete
checkpoint, and end the process with exit status :data:`EXIT_PEER_LOST`: the main thread is blocked inside a
collective that will never return, so the thread cannot raise there. When the collective fails instead (gloo's
"connection reset by peer" on CPU), the error reaching the end of the watched block waits until every peer's
heartbeat has moved since (the error was the job's own: it propagates) or one has stayed still for the timeout (the
peer is gone: the same message and exit, as leaving normally would hang in ``jax.distributed``'s shutdown barrier).
The timeout is ``TORCHLIKE_PEER_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT`), shorter than the coordination
service's own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import jax

__all__ = ["DEFAULT_TIMEOUT", "EXIT_PEER_LOST", "PeerLostError", "PeerWatch", "peer_timeout"]

logger = logging.getLogger(__name__)

#: Seconds a peer's heartbeat may stay still before the job stops (``TORCHLIKE_PEER_TIMEOUT`` overrides it).
DEFAULT_TIMEOUT = 60.0
#: The exit status of a process stopped because a peer was lost (``EX_TEMPFAIL``: restart the job).
EXIT_PEER_LOST = 75
_KEY = "torchlike/heartbeat/{}"


class PeerLostError(RuntimeError):
    """A process of a multi-process run stopped answering (its message is printed by :class:`PeerWatch`)."""


def peer_timeout() -> float:
    """The heartbeat timeout in seconds: ``TORCHLIKE_PEER_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    Raises:
        ValueError: ``TORCHLIKE_PEER_TIMEOUT`` is not a positive number.
    """
    text = os.environ.get("TORCHLIKE_PEER_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"TORCHLIKE_PEER_TIMEOUT={text!r}: give the seconds a peer may stay silent, a positive "
                         "number (e.g. 60).")
    return value


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class PeerWatch:
    """Watches the other processes' heartbeats while active (a context manager; nothing on one process).

    Args:
        last_checkpoint: returns the last complete checkpoint folder in words (read only when a peer is lost).
        timeout: seconds a peer may stay silent (default :func:`peer_timeout`).
        on_lost: what ends the process (tests replace it); by default ``os._exit(EXIT_PEER_LOST)`` after the message.
    """

    def __init__(self, last_checkpoint: Callable[[], str], timeout: float | None = None,
                 on_lost: Callable[[PeerLostError], None] | None = None):
        self.timeout = peer_timeout() if timeout is None else timeout
        self.interval = min(5.0, self.timeout / 4)
        self._last_checkpoint = last_checkpoint
        self._on_lost = on_lost or self._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatch:
        if jax.process_count() > 1 and _client() is not None:
            self._thread = threading.Thread(target=self._run, name="torchlike-peer-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is not None and self._thread is not None and isinstance(error, Exception):
            self._settle()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
            self._thread = None

    def _settle(self) -> None:
        """After an error in the watched block: returns once every peer's heartbeat has moved past what the store
        holds now (the error is the job's own), or reports a peer whose heartbeat stays still for the timeout as
        lost. The store is read afresh: a peer killed just after its last beat has written all it ever will."""
        client, count, me = _client(), jax.process_count(), jax.process_index()
        peers = [peer for peer in range(count) if peer != me]
        try:
            at_error = {peer: _heartbeat(client, peer) for peer in peers}
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                still = [peer for peer in peers if _heartbeat(client, peer) == at_error[peer]]
                if not still:
                    return
                time.sleep(min(0.2, self.interval))
        except Exception as error:  # the key-value store lives in process 0: it is gone
            self._lost(0, count, f"the coordinator's key-value store stopped answering ({error})")
            return
        self._lost(still[0], count, f"its heartbeat has not moved for {self.timeout:g} s since a collective failed")

    def _run(self) -> None:
        client, me, count = _client(), jax.process_index(), jax.process_count()
        beat = 0
        seen: dict[int, tuple[str | None, float]] = {peer: (None, time.monotonic()) for peer in range(count)
                                                     if peer != me}
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(_KEY.format(me), str(beat), allow_overwrite=True)
                for peer, (value, since) in seen.items():
                    current = _heartbeat(client, peer)
                    if current != value:
                        seen[peer] = (current, now)
                    elif now - since > self.timeout:
                        self._lost(peer, count, f"its heartbeat has not moved for {now - since:.0f} s")
                        return
            except Exception as error:  # the key-value store lives in process 0: it is gone
                if self._stop.is_set():
                    return
                self._lost(0, count, f"the coordinator's key-value store stopped answering ({error})")
                return
            self._stop.wait(self.interval)

    def _lost(self, peer: int, count: int, why: str) -> None:
        error = PeerLostError(
            f"process {peer} of {count} stopped answering: {why} (TORCHLIKE_PEER_TIMEOUT={self.timeout:g} s). "
            f"Process {jax.process_index()} stops the job. The last complete checkpoint is "
            f"{self._last_checkpoint()}; restart every process with resume_from_checkpoint=True.")
        self._on_lost(error)

    @staticmethod
    def _exit(error: PeerLostError) -> None:
        sys.stderr.write(f"\n{type(error).__name__}: {error}\n")
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)


def _heartbeat(client, peer: int) -> str | None:
    """``peer``'s heartbeat counter, ``None`` before its first one (``key_value_try_get`` raises for a missing key;
    any other failure is the store's and propagates)."""
    try:
        return client.key_value_try_get(_KEY.format(peer))
    except Exception as error:
        if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
            return None
        raise
