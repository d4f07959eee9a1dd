"""Host memory for XLA on CPU: keep freed buffers mapped, so a train step does not page-fault.

XLA's CPU runtime allocates each execution's temporaries as one large buffer and frees it afterwards.
glibc serves allocations over 32 MiB with ``mmap`` and gives them back with ``munmap``, and threads other
than the main one allocate from arenas whose heaps cannot hold such a buffer, so every step maps fresh
memory and touches it page by page, in kernel time. With big allocations served from one heap
(``M_MMAP_MAX=0``, ``M_ARENA_MAX=1``: every thread allocates from the main arena, which can grow past the
64 MiB of a thread arena) and up to 2 GiB of freed memory kept (``M_TRIM_THRESHOLD``), the step mostly
reuses its buffer (README's "Speed" section gives the measured gain). The costs: one arena, so threads
that allocate at the same moment wait for each other (XLA allocates a few large buffers per step), and up
to 2 GiB of freed host memory stays with the process instead of returning to the system.

The settings must be made before XLA starts its threads, so :func:`keep_freed_host_memory` runs
when ``torchlike`` is imported, and only where it helps and is safe: Linux with glibc, a CPU-only
JAX (``JAX_PLATFORMS`` naming ``cpu`` first, or no GPU/TPU plugin installed), no allocator the user
chose (``LD_PRELOAD`` of jemalloc/tcmalloc/mimalloc, ``MALLOC_*`` or ``GLIBC_TUNABLES`` malloc
settings), JAX's backend not started yet, and ``TORCHLIKE_HOST_MALLOC`` not ``0``/``off``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters
RETAINED_BYTES = 2 * 1024**3 - 1
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
_OFF = {"0", "off", "false", "no", "none"}

status: str = "not checked"
"""What :func:`keep_freed_host_memory` did (``"applied"``) or why it did nothing."""


def _reason_to_skip() -> str | None:
    if os.environ.get("TORCHLIKE_HOST_MALLOC", "").strip().lower() in _OFF:
        return "turned off by TORCHLIKE_HOST_MALLOC"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded"
    if any(key.startswith("MALLOC_") for key in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "glibc malloc is configured by the environment"
    return cpu_only_reason()


def cpu_only_reason() -> str | None:
    """Why JAX may not be a CPU-only JAX whose backend is still to start (``None``: it is): ``JAX_PLATFORMS``
    naming another platform first, a GPU/TPU plugin installed, or the backend already started."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        if platforms.split(",")[0].strip() != "cpu":
            return f"JAX_PLATFORMS={platforms} is not CPU first"
    elif any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS):
        return "a GPU/TPU plugin is installed"
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "JAX's backend started before torchlike was imported"
    return None


def keep_freed_host_memory() -> str:
    """Makes glibc keep freed large buffers for reuse (see the module docstring); idempotent.

    Returns:
        ``"applied"``, or the reason nothing was changed.
    """
    global status
    if status == "applied":
        return status
    reason = _reason_to_skip()
    if reason is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.gnu_get_libc_version  # noqa: B018  (glibc only)
        except (OSError, AttributeError):
            reason = "the C library is not glibc"
    if reason is None:
        done = [libc.mallopt(M_MMAP_MAX, 0), libc.mallopt(M_ARENA_MAX, 1),
                libc.mallopt(M_TRIM_THRESHOLD, RETAINED_BYTES)]
        reason = None if all(done) else "mallopt refused the settings"
    status = reason or "applied"
    return status
