"""Attention masks shared by the decoders: ``transformers``' sliding window, on cache slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sliding_window_mask(query_count: int, key_count: int, first_query_index: jax.Array | int,
                        window: int) -> jax.Array:
    """``[1, T, S]`` bool: key slot ``k`` is inside query ``t``'s window when ``k > first_query_index + t - window``.

    transformers' ``sliding_window_overlay`` on cache slots (array indices, padding included): a query sees itself
    and the ``window - 1`` slots before it; the causal and padding masks do the rest.
    """
    query_index = first_query_index + jnp.arange(query_count)
    return (jnp.arange(key_count)[None, :] > query_index[:, None] - window)[None]
