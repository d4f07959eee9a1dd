"""Tracing jitted programs: counted and logged once per trace, and cheap (no garbage-collection passes).

:data:`TRACE_COUNTS` counts the traces of each jitted program torchlike builds (each trace is a new XLA
program), so tests and debugging can check that shapes stay fixed; :func:`record_trace`, called inside the
traced function, adds one and logs the shapes that caused it on this module's logger at INFO level
(``logging.getLogger("torchlike").setLevel(logging.INFO)`` shows them).

Tracing a step allocates many short-lived Python objects, which triggers CPython's cyclic garbage
collector again and again, each pass walking every object of a process that has imported torch,
transformers and a model. :func:`fast_tracing` pauses the collector while a jitted function is called
(tracing happens inside the call; a call on a cached trace only dispatches, so the pause is short).

``getattr(tracer, name, default)`` on a JAX tracer raises ``AttributeError`` internally, and the
message of that error includes the tracer's "origin", which walks every equation traced so far.
Flax probes ``value.sharding`` on variables while it builds a model, so building an N-layer model
under ``eval_shape`` costs O(N^2). Within :func:`fast_tracing` only that message
text is dropped; errors are still raised, and tracer errors outside the block keep their full
messages (``adapters.upstream`` lists the JAX internals this reads).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jax._src import core as jax_core
from jax._src.interpreters import partial_eval

logger = logging.getLogger(__name__)

PROGRAMS: dict[str, str] = {
    "train_step": "train_step",
    "eval_step": "eval_step",
    "generate": "the generation program",
    "weight_transform": "a weight's HF -> NNX layout transform",
}
"""The jitted programs whose traces are counted, each with the name its log lines give it: the train and eval
steps (``adapters.training.train_step``), the generation program (``adapters.rollout.sampling``) and the layout
transforms that place checkpoint weights (``adapters.model.weight_plan``, one per weight shape, layout, dtype and
sharding)."""

TRACE_COUNTS: dict[str, int] = dict.fromkeys(PROGRAMS, 0)
"""How many times each program of :data:`PROGRAMS` was traced."""


def record_trace(name: str, details: Mapping[str, Any]) -> None:
    """Counts one trace of the program ``name`` (a key of :data:`PROGRAMS`) and logs ``details`` at INFO level.

    Call it inside the traced function, so it runs at trace time only. Each detail is shown as ``key value``;
    arrays (anything with a shape and a dtype) as ``key (shape) dtype``.
    """
    TRACE_COUNTS[name] += 1
    if logger.isEnabledFor(logging.INFO):
        shown = ", ".join(f"{key} {_describe(value)}" for key, value in details.items())
        logger.info("tracing %s: %s (new XLA program %d)", PROGRAMS[name], shown, TRACE_COUNTS[name])


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{tuple(value.shape)} {value.dtype}"
    return str(value)


_FAST_TRACING_LOCK = threading.Lock()
_fast_tracing_depth = 0
_patched_origins: dict[type, Any] = {}
_gc_was_enabled = True


@contextlib.contextmanager
def fast_tracing() -> Iterator[None]:
    """Within the block the cyclic garbage collector is paused (reference counting still frees objects;
    the collector resumes after the block) and tracer attribute errors are cheap.

    Blocks may overlap across threads (a rollout sampled in the background while the trainer traces): the first
    to enter pauses and patches, the last to leave restores."""
    global _fast_tracing_depth, _gc_was_enabled
    with _FAST_TRACING_LOCK:
        if _fast_tracing_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
            classes = [cls for cls in (getattr(jax_core, "Tracer", None),
                                       getattr(partial_eval, "DynamicJaxprTracer", None))
                       if cls is not None and "_origin_msg" in vars(cls)]
            for cls in classes:
                _patched_origins[cls] = vars(cls)["_origin_msg"]
                cls._origin_msg = lambda self: ""
        _fast_tracing_depth += 1
    try:
        yield
    finally:
        with _FAST_TRACING_LOCK:
            _fast_tracing_depth -= 1
            if _fast_tracing_depth == 0:
                for cls, original in _patched_origins.items():
                    cls._origin_msg = original
                _patched_origins.clear()
                if _gc_was_enabled:
                    gc.enable()


def traced_cheaply(function: Callable) -> Callable:
    """``function`` (a jitted callable) called under :func:`fast_tracing`: its traces (only the first call
    of each shape traces) run without garbage-collection passes; calls on cached traces pay only the context
    switch."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with fast_tracing():
            return function(*args, **kwargs)

    return call
