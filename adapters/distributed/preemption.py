"""Preemption notices: SIGTERM (and JAX's preemption sync point, where the backend has one) turned into a request to
checkpoint and stop at the next step boundary, agreed by every process of the run.

Cloud TPU queued resources, GKE and spot VMs send SIGTERM and allow a grace period before killing the job. While a
:class:`PreemptionWatch` is active, SIGTERM only records the notice (a second one changes nothing, so a save in
progress finishes); the training loop asks :meth:`PreemptionWatch.due` after each optimizer step, and every process
gets the same answer: the notice of any one process (all-gathered), or JAX's ``reached_preemption_sync_point`` when
``jax.distributed`` runs its preemption service. The loop then writes a checkpoint of that step and stops, so the job
exits normally and resumes from it.

The platform kills the job a grace period after its notice (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by
default); what has to fit in it is the rest of the step in progress and the checkpoint. The watch is told the grace
period (``jit_checkpoint_grace_period``) and what steps and saves take, warns once when they would not fit, and says
after a preemption checkpoint how long it took from the notice.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
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

    def __init__(self, grace_period: float = 30.0) -> None:
        self.notified = False
        self.grace_period = grace_period
        self.notified_at: float | None = None  # time.monotonic() of the first notice
        self.step_seconds = 0.0  # the longest step measured (compilation excluded)
        self.save_seconds = 0.0  # the longest checkpoint save measured
        self._warned = False
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
            self.notified_at = time.monotonic()
            logger.warning("SIGTERM received: a checkpoint will be written at the end of the current step, then "
                           "training stops (grace period %g s).", self.grace_period)
        self.notified = True

    def record(self, step_seconds: float = 0.0, save_seconds: float = 0.0) -> None:
        """Takes the duration of a step or of a checkpoint save; warns once when the longest step and the longest
        save together exceed the grace period (a notice could then be followed by the kill before the checkpoint is
        complete; the previous checkpoint survives, as every save is staged)."""
        self.step_seconds = max(self.step_seconds, step_seconds)
        self.save_seconds = max(self.save_seconds, save_seconds)
        needed = self.step_seconds + self.save_seconds
        if needed > self.grace_period and not self._warned:
            self._warned = True
            logger.warning(
                "enable_jit_checkpoint: a step takes up to %.1f s and a checkpoint %.1f s, so a preemption checkpoint "
                "needs up to %.1f s after the notice, more than jit_checkpoint_grace_period=%g s: the platform would "
                "kill the job before it is complete and the run would resume from the previous checkpoint. Give the "
                "job a longer grace period (Kubernetes' terminationGracePeriodSeconds, a queued resource's or spot "
                "VM's shutdown time) of at least %d s and set jit_checkpoint_grace_period to it.",
                self.step_seconds, self.save_seconds, needed, self.grace_period, int(needed) + 1)

    def report(self, step: int, folder: str) -> None:
        """Logs the preemption checkpoint of ``step`` in ``folder`` with the time it took from the notice, as a
        warning that names the overrun when it took longer than the grace period."""
        elapsed = None if self.notified_at is None else time.monotonic() - self.notified_at
        timing = "" if elapsed is None else f" {elapsed:.1f} s after the notice"
        if elapsed is not None and elapsed > self.grace_period:
            timing += (f", longer than jit_checkpoint_grace_period={self.grace_period:g} s (a platform that kills at "
                       "the end of its grace period would have cut it off)")
        logger.warning("Preempted: stopped after step %d with its checkpoint in %s%s; resume with "
                       "resume_from_checkpoint=True.", step, folder, timing)

    def due(self, step: int) -> bool:
        """Whether the run must checkpoint and stop after optimizer step ``step`` (the same answer on every
        process: a collective when there are several, so every process must call this at every step)."""
        notified = self.notified
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            notified = bool(np.asarray(multihost_utils.process_allgather(np.int32(notified))).any())
            if not notified and _preemption_service_running():
                notified = bool(multihost_utils.reached_preemption_sync_point(step))
        if notified and self.notified_at is None:  # another process's notice: this one learns of it now
            self.notified_at = time.monotonic()
        return notified
