"""Page faults per XLA:CPU call with and without torchlike's host-memory tuning (``adapters/runtime/host_memory.py``).

What it measures
----------------
A jitted ``(x @ w) @ w.T`` whose ``x @ w`` is a ``[4096, 4096]`` float32 temporary (64 MiB: a train step's
activations in small), called ``--calls`` times after three warm-up calls, in two fresh processes that import
torchlike before JAX starts: ``tuned`` (the default) and ``untuned`` (``TORCHLIKE_HOST_MALLOC=0``). Reported: minor
page faults per call (``getrusage``) and seconds per call for each, and the ratio tuned / untuned. Untuned, glibc
maps the temporary fresh every call (about 16,400 faults of 4 KiB pages); tuned, the freed buffer is mostly reused.
How many faults remain tuned depends on which buffers a call frees before the next allocates and on the machine's
memory state (0 to 8,500 seen), which is why the test suite checks the allocator's bookkeeping
(``tests/test_host_memory.py``) and this script the faults.

Run (from the repository root; seconds)::

    .venv/bin/python benchmarks/host_memory.py
    .venv/bin/python benchmarks/host_memory.py --calls 50

This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(calls: int) -> dict:
    """One side, in this process: faults and seconds per call."""
    import resource
    import time

    import jax
    import jax.numpy as jnp

    import torchlike  # noqa: F401  (before JAX starts, as a user's script does)
    from torchlike.adapters.runtime import host_memory

    step = jax.jit(lambda x, w: (x @ w) @ w.T)
    x, w = jnp.ones((4096, 64), jnp.float32), jnp.ones((64, 4096), jnp.float32) / 64
    for _ in range(3):
        step(x, w).block_until_ready()
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(calls):
        step(x, w).block_until_ready()
    seconds = (time.perf_counter() - start) / calls
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    return {"status": host_memory.status, "faults_per_call": faults, "seconds_per_call": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--child", action="store_true", help="measure one side in this process")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.calls)))
        return
    base = {key: value for key, value in os.environ.items()
            if not key.startswith("MALLOC_") and key not in ("TORCHLIKE_HOST_MALLOC", "LD_PRELOAD")}
    sides = {}
    for side, extra in (("tuned", {}), ("untuned", {"TORCHLIKE_HOST_MALLOC": "0"})):
        done = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)], capture_output=True,
                              text=True, env={**base, "JAX_PLATFORMS": "cpu", **extra}, check=True)
        sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{side:8s} {sides[side]['status']:40s} faults/call {sides[side]['faults_per_call']:9.0f}   "
              f"s/call {sides[side]['seconds_per_call']:.4f}")
    print(f"faults tuned / untuned = {sides['tuned']['faults_per_call'] / sides['untuned']['faults_per_call']:.3f}; "
          f"seconds tuned / untuned = {sides['tuned']['seconds_per_call'] / sides['untuned']['seconds_per_call']:.3f}")


if __name__ == "__main__":
    main()
