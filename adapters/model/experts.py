"""Mixture-of-experts pieces the decoders share: the chosen experts run as grouped matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """``sum_k weights[..., k] * expert_{experts[..., k]}(x)``, with
    ``expert_e(x) = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]``.

    Each token is copied once per chosen expert, the copies are sorted by expert and each expert's run is multiplied
    by its own weights (``jax.lax.ragged_dot``: a grouped matmul where the platform has one), so only the chosen
    experts are computed, as transformers' ``Qwen3MoeExperts`` loops over the experts hit.

    Args:
        x: ``[B, T, D]`` in the compute dtype.
        experts, weights: ``[B, T, K]`` chosen experts and their routing weights (the weights in ``x``'s dtype).
        gate, up: ``[E, D, F]``; down: ``[E, F, D]``.
    """
    hidden_size, top_k, count = x.shape[-1], experts.shape[-1], gate.shape[0]
    chosen = experts.reshape(-1)
    order = jnp.argsort(chosen, stable=True)
    rows = jnp.repeat(x.reshape(-1, hidden_size), top_k, axis=0)[order]
    group_sizes = jnp.bincount(chosen, length=count).astype(jnp.int32)
    activations = nnx.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
    outputs = jax.lax.ragged_dot(activations, down, group_sizes)
    outputs = jnp.zeros_like(outputs).at[order].set(outputs).reshape(*experts.shape, hidden_size)
    return jnp.einsum("BTKD,BTK->BTD", outputs, weights)
