"""The mixture-of-experts load-balancing loss (transformers' ``load_balancing_loss_func``) and the router logits it is
computed from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp


@dataclass
class RouterRecord:
    """The router logits ``[B, T, E]`` of a forward pass's sparse layers, in layer order (``Family.router_logits``
    returns one), and the number of experts, ``top_k``, each token is routed to."""

    top_k: int
    logits: list[jax.Array] = field(default_factory=list)


def load_balancing_loss(router_logits: Sequence[jax.Array], attention_mask: jax.Array, top_k: int) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer, equations 4-6) with an attention mask.

    Over the real tokens of every layer (``L`` layers of ``[B, T, E]`` logits, ``p = softmax(logits)`` in float32):

        ``loss = E * sum_{k, e} f[k, e] * P[e]``

    where ``f[k, e]`` is the fraction of tokens whose ``k``-th choice (``top_k(p)``) is expert ``e`` and ``P[e]`` the
    mean of ``p[e]``.

    Args:
        router_logits: ``L`` arrays ``[B, T, E]``.
        attention_mask: ``[B, T]``, 1 on real tokens (padding does not count).
        top_k: the experts each token is routed to (``num_experts_per_tok``).

    Returns:
        The float32 scalar loss.
    """
    num_experts = router_logits[0].shape[-1]
    logits = jnp.concatenate([layer.reshape(-1, num_experts) for layer in router_logits]).astype(jnp.float32)
    probabilities = jax.nn.softmax(logits, axis=-1)
    _, selected = jax.lax.top_k(probabilities, top_k)
    chosen = jax.nn.one_hot(selected, num_experts, dtype=jnp.float32)  # [L*B*T, K, E]
    real = jnp.tile(attention_mask.reshape(-1).astype(jnp.float32), len(router_logits))
    count = real.sum()
    tokens_per_expert = (chosen * real[:, None, None]).sum(axis=0) / count
    probability_per_expert = (probabilities * real[:, None]).sum(axis=0) / count
    return jnp.sum(tokens_per_expert * probability_per_expert[None, :]) * num_experts


def check_router(family: Any, coefficient: float) -> None:
    """Raises ``ValueError`` when a non-zero router loss ``coefficient`` is given for a ``family`` without a router
    (``Family.router_logits`` is ``None``: a dense model)."""
    if coefficient and family.router_logits is None:
        raise ValueError(f"router_aux_loss_coef={coefficient}: the {family.name} model has no router (it is not a "
                         "mixture-of-experts model), so there is no load-balancing loss to weight; set it to 0.")


def run_with_router_loss(family: Any, run: Callable, module: Any, attention_mask: jax.Array,
                         coefficient: float) -> tuple[Any, jax.Array | None]:
    """``(run(module), aux_loss)``: with a non-zero ``coefficient``, the load-balancing loss of the forward pass
    ``run`` makes over the real tokens of ``attention_mask`` (:func:`load_balancing_loss`, as a mixture-of-experts
    model of ``transformers`` returns ``aux_loss`` with ``output_router_logits``); ``None`` otherwise.

    Args:
        family: the model's ``Family`` (its ``router_logits``; ``None`` for a dense family).
        run: ``module -> result``, one forward pass of the model.
        attention_mask: ``[B, T]`` of the rows ``run`` feeds the model.
        coefficient: the router loss weight (0 leaves the router out).

    Raises:
        ValueError: a coefficient for a family without a router.
    """
    if not coefficient:
        return run(module), None
    check_router(family, coefficient)
    result, routing = family.router_logits(run, module)
    return result, load_balancing_loss(routing.logits, attention_mask, routing.top_k)
