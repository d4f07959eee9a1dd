"""XLA:CPU's scheduler set to save memory, so gradient checkpointing saves memory on CPU too.

XLA:CPU orders a program's operations with a scheduler that favours running independent operations in parallel
(``xla_cpu_enable_concurrency_optimized_scheduler``, on by default). In a rematerialised train step that hoists the
recomputed forward of many decoder layers ahead of the backward passes that need them, so their activations are
live together and gradient checkpointing saves almost nothing: at the Qwen2.5-0.5B shape (seq 1024), each layer
added about 280 MB of XLA temporaries with rematerialisation on and 300 MB with it off. With the memory-minimising
scheduler each layer adds about 8 MB, and the step is no slower (``benchmarks/memory.py`` measures the step).
That was XLA in jaxlib 0.10; the scheduler of jaxlib 0.12 no longer keeps the layers live together, and there the
setting changes nothing measurable.

:func:`prefer_memory_scheduler` adds ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` to ``XLA_FLAGS``
when ``torchlike`` is imported, only where it takes effect and is safe: a CPU-only JAX whose backend has not
started (as for :mod:`.host_memory`), a ``jaxlib`` whose XLA knows the flag (XLA aborts the process on an unknown
one; the checked versions are a row of ``adapters.upstream``), no setting of that flag in ``XLA_FLAGS`` already, and
``TORCHLIKE_CPU_SCHEDULER`` not ``concurrency``.
"""

from __future__ import annotations

import os
import re

from .host_memory import cpu_only_reason

FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
CHECKED_FROM, CHECKED_BELOW = (0, 10, 2), (0, 13)
JAXLIB_VERSIONS = f">={'.'.join(map(str, CHECKED_FROM))},<{'.'.join(map(str, CHECKED_BELOW))}"
"""The ``jaxlib`` versions whose XLA was checked to know :data:`FLAG` (``adapters.upstream`` lists them)."""

status: str = "not checked"
"""What :func:`prefer_memory_scheduler` did (``"applied"``) or why it did nothing."""


def _reason_to_skip() -> str | None:
    if os.environ.get("TORCHLIKE_CPU_SCHEDULER", "").strip().lower() == "concurrency":
        return "turned off by TORCHLIKE_CPU_SCHEDULER=concurrency"
    if FLAG in os.environ.get("XLA_FLAGS", ""):
        return f"XLA_FLAGS already sets {FLAG}"
    reason = cpu_only_reason()
    if reason is not None:
        return reason
    from importlib import metadata

    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return "jaxlib is not installed"
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if not CHECKED_FROM <= release < CHECKED_BELOW:
        return f"jaxlib {version} is outside the checked versions {JAXLIB_VERSIONS}"
    return None


def prefer_memory_scheduler() -> str:
    """Makes XLA:CPU schedule for memory (see the module docstring); idempotent.

    Returns:
        ``"applied"``, or the reason nothing was changed.
    """
    global status
    if status != "applied":
        status = _reason_to_skip() or "applied"
        if status == "applied":
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{FLAG}=false".strip()
    return status
