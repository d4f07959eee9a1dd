"""``adapters.runtime.float32_dots``: on XLA:CPU a bfloat16 model's forward, as the rollout engines run it, asks
every bfloat16 matmul for a float32 result (XLA:CPU's fast path) and casts it back, with the same logits and cache;
float32 models, ``TORCHLIKE_CPU_FLOAT32_DOTS=0`` and differentiated code are left as traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core

import torchlike
from torchlike.adapters.rollout.sampling import init_cache
from torchlike.adapters.runtime import float32_dots as f32


def dots(closed: core.ClosedJaxpr) -> list[tuple[str, str, str]]:
    """``(lhs, rhs, result)`` dtypes of every ``dot_general`` in the program and the programs it calls."""
    found = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(var.aval.dtype) for var in (*eqn.invars, *eqn.outvars)))
        for inner in core.jaxprs_in_params(eqn.params):
            found += dots(core.ClosedJaxpr(inner, ()))
    return found


@pytest.fixture(scope="module")
def bf16_forward(tiny_checkpoints):
    """A bfloat16 tiny Qwen2's one-token cached step: ``(call(module, ...), inputs)``."""
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="bfloat16")
    module = model.module
    cache = init_cache(module, 2, 16)
    tokens = jnp.array([[5], [9]], jnp.int32)
    positions = jnp.array([[0], [0]], jnp.int32)
    mask = jnp.zeros((2, 1, 16), bool).at[:, :, 0].set(True)
    return module, (tokens, positions, cache, mask)


def test_bf16_matmuls_get_a_float32_result_and_the_same_values(bf16_forward, monkeypatch):
    module, inputs = bf16_forward
    plain = jax.make_jaxpr(lambda *a: module(*a))(*inputs)
    rewritten = jax.make_jaxpr(lambda *a: f32.float32_dots(module)(*a))(*inputs)
    assert ("bfloat16", "bfloat16", "bfloat16") in dots(plain)  # what the rewrite is for
    assert dots(rewritten) and all(result == "float32" for *_, result in dots(rewritten))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), rewritten.out_avals) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), plain.out_avals)
    (want_logits, want_cache) = jax.jit(lambda *a: module(*a))(*inputs)
    (logits, cache) = jax.jit(lambda *a: f32.float32_dots(module)(*a))(*inputs)
    assert logits.dtype == want_logits.dtype
    # Both accumulate in float32: at most a rare last-bit difference of the rounding.
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(want_logits, np.float32), rtol=1e-2,
                               atol=1e-2)
    assert np.mean(np.asarray(logits) == np.asarray(want_logits)) > 0.99
    for name in cache:
        np.testing.assert_allclose(np.asarray(cache[name]["k"], np.float32),
                                   np.asarray(want_cache[name]["k"], np.float32), rtol=1e-2, atol=1e-2)

    monkeypatch.setenv(f32.ENV, "0")
    assert not f32.enabled()
    assert dots(jax.make_jaxpr(lambda *a: f32.float32_dots(module)(*a))(*inputs)) == dots(plain)


def test_float32_dots_and_nested_programs():
    w = jnp.ones((8, 4), jnp.bfloat16)

    def body(x, y):
        inner = jax.jit(lambda a: jnp.einsum("bd,dv->bv", a, w))(x)  # a nested jit is evaluated inline
        kept = jax.checkpoint(lambda a: a @ w)(x)  # so is a remat
        return inner + kept, y @ jnp.ones((8, 2), jnp.float32)  # a float32 dot stays as it is

    x, y = jnp.ones((2, 8), jnp.bfloat16), jnp.ones((3, 8), jnp.float32)
    found = dots(jax.make_jaxpr(f32.float32_dots(body))(x, y))
    assert sorted(found) == [("bfloat16", "bfloat16", "float32")] * 2 + [("float32", "float32", "float32")]
    got = f32.float32_dots(body)(x, y)
    want = body(x, y)
    assert [a.dtype for a in got] == [a.dtype for a in want]
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(got[1], want[1])


def table_conversions(hlo: str, table_shape: tuple[int, ...]) -> int:
    """Instructions of an optimized XLA program that convert a bfloat16 ``table_shape`` array to float32."""
    dims = ",".join(str(size) for size in table_shape)
    return sum(1 for line in hlo.splitlines() if f" = f32[{dims}]" in line and "convert" in line)


def test_embedding_rows_are_gathered_from_the_tables_bits(bf16_forward, monkeypatch):
    """XLA:CPU converts a whole bfloat16 table to float32 before gathering rows from it, and hoists that out of a
    decode loop: once per program call. With ``gather_tables`` the rows come from the table's bits (same values),
    and the compiled loop converts no table."""
    module, (tokens, positions, cache, mask) = bf16_forward
    tables = f32.gather_tables(module)
    table = module.embedder.input_embedding.get_value()
    assert list(tables) == [("embedder", "input_embedding")]
    assert tables[("embedder", "input_embedding")].dtype == jnp.uint16

    graphdef, state = nnx.split(module)

    def loop(state, tables, tokens):  # the weights are arguments, as in the engines' programs
        def step(_, carry):
            tokens, total = carry
            logits, _ = f32.float32_dots(nnx.merge(graphdef, state), tables)(tokens, positions, cache, mask)
            return jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32), total + logits.sum()
        return jax.lax.fori_loop(0, 4, step, (tokens, jnp.float32(0)))

    with_bits = jax.jit(loop).lower(state, tables, tokens).compile()
    without = jax.jit(loop).lower(state, {}, tokens).compile()
    assert table_conversions(without.as_text(), table.shape) >= 1  # what the bits are for
    assert table_conversions(with_bits.as_text(), table.shape) == 0
    got, want = with_bits(state, tables, tokens), without(state, {}, tokens)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert float(got[1]) == float(want[1])

    monkeypatch.setenv(f32.ENV, "0")
    assert f32.gather_tables(module) == {}
