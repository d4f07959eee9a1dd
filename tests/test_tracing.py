"""adapters.runtime.tracing: traces run without garbage-collection passes and the collector comes back after."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import pytest

from torchlike.adapters.runtime import tracing


def test_a_traced_call_runs_with_the_collector_paused_and_restores_it():
    seen = []

    @jax.jit
    def double(x):
        seen.append(gc.isenabled())  # runs while tracing
        return x * 2

    call = tracing.traced_cheaply(double)
    assert gc.isenabled()
    assert float(call(jnp.float32(3.0))) == 6.0
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:  # a collector the caller turned off stays off
        call(jnp.ones(2))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_errors_inside_propagate_and_tracer_errors_outside_keep_their_origin():
    @jax.jit
    def broken(x):
        return x.no_such_attribute

    with pytest.raises(AttributeError):
        tracing.traced_cheaply(broken)(jnp.ones(2))
    assert gc.isenabled()
    with pytest.raises(AttributeError, match="no_such_attribute"):
        broken(jnp.ones(3))
