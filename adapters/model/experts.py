"""Mixture-of-experts pieces the decoders share: the chosen experts run as grouped matmuls, and the router logits
recorded for the load-balancing loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def softmax_top_k(router_logits: jax.Array, top_k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Qwen's routing (transformers' ``Qwen3MoeTopKRouter`` and its Qwen3-Next / Qwen3.5 twins): a float32 softmax over
    the router logits, the ``top_k`` largest probabilities, renormalised to sum to 1 when ``renormalise``.

    Returns:
        ``(float32 weights [..., top_k], chosen experts [..., top_k])``.
    """
    probabilities = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probabilities, top_k)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


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


def run_recording_router_logits(run: Callable[[nnx.Module], Any], module: nnx.Module,
                                block_type: type) -> tuple[Any, list[jax.Array]]:
    """``run(module)``, and the router logits ``[B, T, E]`` of the forward passes it ran, mixture layer by mixture
    layer: each ``layer.mlp`` of ``block_type`` sows them as ``nnx.Intermediate`` ``router_logits`` while its
    ``records_router_logits`` is on. They are captured by ``nnx.capture``, so they come out of ``nnx.remat`` under
    ``gradient_checkpointing`` too; the module is left as it was."""
    blocks = [layer.mlp for layer in module.layers if isinstance(layer.mlp, block_type)]

    def recording(module):
        for block in blocks:
            block.records_router_logits = True
        try:
            return run(module)
        finally:
            for block in blocks:
                block.records_router_logits = False

    result, sown = nnx.capture(recording, nnx.Intermediate)(module)
    logits = []
    for _, variable in sorted(nnx.to_flat_state(sown), key=lambda item: item[0]):
        logits.extend(variable.get_value())
    return result, logits
