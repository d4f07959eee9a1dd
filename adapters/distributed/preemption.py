"""Preemption notices: SIGTERM (and JAX's preemption sync point, where the backend has one) turned into a request to
checkpoint and stop at the next step boundary, agreed by every process of the run.

Cloud TPU queued resources, GKE and spot VMs send SIGTERM and allow a grace period before killing the job. While a
:class:`PreemptionWatch` is active, SIGTERM only records the notice (a second one changes nothing, so a save in
progress finishes); the training loop asks :meth:`PreemptionWatch.due` after each optimizer step, and every process
gets the same answer: the notice of any one process (all-gathered), or JAX's ``reached_preemption_sync_point`` when
``jax.distributed`` runs its preemption service. The loop then writes a checkpoint of that step and stops, so the job
exits normally and resumes from it.
"""

from __future__ import annotations

import logging
import signal
import threading
import types

import jax
import numpy as np

__all__ = ["PreemptionWatch"]

logger = logging.getLogger(__name__)


def _preemption_service_running() -> bool:
    """Whether ``jax.distributed`` runs a preemption sync manager (the coordination service's SIGTERM notice)."""
    try:
        from jax._src import distributed
    except ImportError:
        return False
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


class PreemptionWatch:
    """Records SIGTERM while active (a context manager) and answers, at a step boundary, whether the run must
    checkpoint and stop.

    The handler is installed on entry and the previous one restored on exit; outside the main thread (where Python
    cannot install signal handlers) only JAX's preemption service is watched, with a warning.
    """

    def __init__(self) -> None:
        self.notified = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        else:
            logger.warning("enable_jit_checkpoint: train() runs outside the main thread, where SIGTERM cannot be "
                           "caught; only JAX's preemption service (if any) is watched.")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        if not self.notified:
            logger.warning("SIGTERM received: a checkpoint will be written at the end of the current step, then "
                           "training stops.")
        self.notified = True

    def due(self, step: int) -> bool:
        """Whether the run must checkpoint and stop after optimizer step ``step`` (the same answer on every
        process: a collective when there are several, so every process must call this at every step)."""
        notified = self.notified
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            notified = bool(np.asarray(multihost_utils.process_allgather(np.int32(notified))).any())
            if not notified and _preemption_service_running():
                notified = bool(multihost_utils.reached_preemption_sync_point(step))
        return notified
