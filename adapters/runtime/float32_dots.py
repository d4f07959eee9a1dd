"""Low-precision matmuls that accumulate in float32 on XLA:CPU, for the programs that only run a model forward.

XLA:CPU runs a ``dot_general`` whose operands and result are bfloat16 (what ``jnp.einsum`` and ``jnp.dot`` emit for
bfloat16 weights and activations) on a slow path, while the same product asked for a float32 result
(``preferred_element_type=float32``) runs on its fast matmul kernels. Both accumulate in float32, so rounding the
float32 result to bfloat16 gives the same values: on 32 rows at the Qwen2.5-0.5B width the LM head
``[32, 896] x [896, 151936]`` and the MLP projections run four to seven times faster, the same values up to the
last bit of a rare element. GPUs and TPUs accumulate bfloat16 products in float32 whatever the requested
result, so they are left as they are.

:func:`float32_dots` traces a function to a jaxpr and evaluates it with every ``dot_general`` whose operands are
both bfloat16 or both float16 and whose result is that type asked for a float32 result, then cast back to the type
it had: the function's outputs keep their shapes and dtypes. Calls to nested ``jit``, ``remat`` and custom
derivative rules are evaluated inline (their forward pass), so it is for programs that are not differentiated:
the rollout engines' prefill and decode steps. Other primitives with inner programs (``while``, ``scan``,
``cond``) run as they were traced.

XLA:CPU also gathers rows of a bfloat16 table by converting the whole table to float32 first, and in a decode loop
it hoists that conversion out of the loop: the embedding table converted once per program call (64 ms at the
Qwen2.5-0.5B width with a 32,000-token vocabulary). A gather from a table of integers is not converted, and a
bitcast made inside the program is copied the same way, so :func:`gather_tables` makes the tables' bits (``uint16``)
once, outside the jitted programs, and :func:`float32_dots` given them gathers rows from the bits.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core

ENV = "TORCHLIKE_CPU_FLOAT32_DOTS"
"""Set to ``0`` to keep XLA:CPU's low-precision dots as traced (to measure what the rewrite gains)."""

FILL_OR_DROP = jax.lax.GatherScatterMode.FILL_OR_DROP  # its fill value is the dtype's: not gathered from bits
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Call-like primitives whose inner program is evaluated inline, by the parameter holding it.
_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "remat": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


def enabled() -> bool:
    """Whether :func:`float32_dots` rewrites: the default backend is XLA:CPU and ``TORCHLIKE_CPU_FLOAT32_DOTS``
    is not ``0``. Read at trace time."""
    return os.environ.get(ENV, "1").strip() != "0" and jax.default_backend() == "cpu"


TableKey = tuple[str, ...]
"""A module parameter's path in ``nnx.state(module)``, e.g. ``("embedder", "input_embedding")``."""


def gather_tables(module: nnx.Module) -> dict[TableKey, jax.Array]:
    """The bits (``uint16``) of ``module``'s low-precision embedding tables, for :func:`float32_dots`'s ``tables``.

    The tables are the bfloat16/float16 parameters whose name ends in ``embedding`` (Tunix's ``input_embedding``,
    Gemma 4's ``per_layer_input_embedding``). Make them outside the jitted program, once for as many program calls
    as the weights stay the same: each is a copy of its table. A table left out is only gathered from more slowly.

    Args:
        module: the model the rollout programs run.

    Returns:
        ``{parameter path: bits}``; empty when :func:`enabled` is false (not on XLA:CPU, or switched off).
    """
    if not enabled():
        return {}
    tables = {}
    for path, value in jax.tree_util.tree_flatten_with_path(nnx.state(module, nnx.Param))[0]:
        key = _path_key(path)
        if key and key[-1].endswith("embedding") and value.dtype in _LOW_PRECISION:
            tables[key] = jax.lax.bitcast_convert_type(value, jnp.uint16)
    return tables


def _path_key(path: Sequence[Any]) -> TableKey:
    """A key path of ``nnx.state`` as names, without a trailing ``value`` entry (older Flax keeps one)."""
    names = tuple(str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))) for entry in path)
    return names[:-1] if names and names[-1] == "value" else names


def float32_dots(fn: Callable[..., Any], tables: dict[TableKey, jax.Array] | None = None) -> Callable[..., Any]:
    """``fn`` with its bfloat16/float16 matmuls accumulating to a float32 result on XLA:CPU (see the module
    docstring); ``fn`` itself on other backends.

    Args:
        fn: an ``nnx.Module`` or a function of arrays (pytrees of them as positional and keyword arguments)
            returning a pytree of arrays; it may close over arrays (traced values of an enclosing ``jit``
            included) and read modules. What a module's call writes to the module is dropped. The result must
            not be differentiated.
        tables: :func:`gather_tables` of the module ``fn`` (passed into the jitted program as an argument): rows
            gathered from those parameters are gathered from their bits.

    Returns:
        A function with ``fn``'s signature and outputs.
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not enabled():
            return fn(*args, **kwargs)
        # A module is split and merged inside the trace, so what its call writes to itself (Qwix's LoRA does)
        # stays in that trace; a function closing over a module must not write to it.
        graphdef, state = nnx.split(fn) if isinstance(fn, nnx.Module) else (None, None)
        leaves, tree = jax.tree.flatten((state, args, kwargs))

        def traced(*flat):
            state, args, kwargs = jax.tree.unflatten(tree, flat)
            call = fn if graphdef is None else nnx.merge(graphdef, state)
            return call(*args, **kwargs)

        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*leaves)
        bits = {}
        if tables and graphdef is not None:
            for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
                table = tables.get(_path_key(path))
                if table is not None and table.shape == value.shape:
                    bits[id(value)] = table
        outs = _evaluate(closed.jaxpr, closed.consts, leaves, bits)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def _rewritten_dot(primitive: core.Primitive, operands: Sequence[Any], params: dict) -> Any | None:
    """The dot with a float32 result cast back, or ``None`` when it is not a low-precision dot."""
    lhs, rhs = operands
    result = jnp.dtype(params.get("preferred_element_type") or lhs.dtype)
    if not (lhs.dtype == rhs.dtype == result and result in _LOW_PRECISION):
        return None
    out = primitive.bind(lhs, rhs, **{**params, "preferred_element_type": jnp.dtype(jnp.float32)})
    return out.astype(result)


def _bind(eqn: core.JaxprEqn, operands: Sequence[Any]) -> list[Any]:
    """The equation's primitive applied as traced (``jax.core.eval_jaxpr``'s step; ``get_bind_params`` returns
    ``(subfuns, params)`` in older JAX and the params alone in newer)."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    context = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    with context:
        outs = eqn.primitive.bind(*subfuns, *operands, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def _evaluate(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any], bits: dict[int, Any]) -> list[Any]:
    """``jaxpr`` evaluated with the rewrites of the module docstring; ``bits`` maps ``id`` of a table's value (an
    argument) to the table's ``uint16`` bits."""
    env: dict[core.Var, Any] = {}

    def read(var):
        return var.val if isinstance(var, core.Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        operands = [read(var) for var in eqn.invars]
        name = eqn.primitive.name
        outs = None
        if name == "dot_general":
            out = _rewritten_dot(eqn.primitive, operands, eqn.params)
            outs = None if out is None else [out]
        elif name == "gather" and id(operands[0]) in bits and eqn.params.get("mode") != FILL_OR_DROP:
            table = operands[0]
            rows = _bind(eqn, [bits[id(table)], *operands[1:]])[0]
            outs = [jax.lax.bitcast_convert_type(rows, table.dtype)]
        elif name in _INLINED and _INLINED[name] in eqn.params:
            inner = eqn.params[_INLINED[name]]
            if isinstance(inner, core.ClosedJaxpr):
                outs = _evaluate(inner.jaxpr, inner.consts, operands, bits)
            elif isinstance(inner, core.Jaxpr) and not inner.constvars:
                outs = _evaluate(inner, (), operands, bits)
        if outs is None:
            outs = _bind(eqn, operands)
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, core.DropVar):
                env[var] = value
    return [read(var) for var in jaxpr.outvars]


__all__ = ["ENV", "TableKey", "enabled", "float32_dots", "gather_tables"]
