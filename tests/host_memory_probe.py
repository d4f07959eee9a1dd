"""Run as a script: imports torchlike, then counts minor page faults per call of a jitted function with a
64 MiB temporary (a train step's activations in small); prints a JSON line with the allocator status and
faults per call."""

import json
import resource

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import torchlike  # noqa: F401  (before JAX starts, as a user's script does)
from torchlike.adapters.runtime import host_memory

step = jax.jit(lambda x, w: (x @ w) @ w.T)  # x @ w: a [4096, 4096] float32 temporary
x, w = jnp.ones((4096, 64), jnp.float32), jnp.ones((64, 4096), jnp.float32) / 64
for _ in range(3):
    step(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
calls = 10
for _ in range(calls):
    step(x, w).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
print(json.dumps({"status": host_memory.status, "faults_per_call": faults}))
