"""GMPO's loss (TRL 1.16's ``trl.experimental.gmpo.GMPOTrainer._compute_loss``): Geometric-Mean Policy Optimization
(https://huggingface.co/papers/2507.20673), GRPO with the geometric mean of the token ratios, clipped in log space.

GMPO shares GRPO's rollout, rewards, advantages, old and reference log-probabilities (:mod:`.grpo`); only the loss of
a micro-batch differs, and it reads GRPO's settings record (:class:`.grpo.GRPOLossSettings`: ``epsilon``,
``epsilon_high``, ``beta``, ``top_entropy_quantile``, ``temperature``...). Like TRL's, it reads none of GRPO's
``loss_type``, importance-sampling level, off-policy mask, entropy bonus or router loss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..families.base import Family
from . import grpo, logprobs

__all__ = ["gmpo_loss", "gmpo_step_loss"]


def gmpo_loss(per_token_logps: jax.Array, old_per_token_logps: jax.Array | None,
              ref_per_token_logps: jax.Array | None, advantages: jax.Array, completion_mask: jax.Array,
              settings: grpo.GRPOLossSettings, *, per_token_entropy: jax.Array | None = None,
              entropy_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GMPO loss of one micro-batch and TRL's metrics.

    ``log_w = logp - logp_old`` per token is clipped in log space the PPO way for the advantage's sign (``min(log_w,
    clip(log_w, -epsilon, epsilon_high))`` where ``A > 0``, ``max(...)`` otherwise); the sequence weight is the
    geometric mean ``exp(sum_t clipped * m / max(sum_t m, 1))`` over the counted tokens ``m`` (the completion mask times
    ``entropy_mask``); the sequence loss is ``-weight * A``, plus with ``beta != 0`` ``beta`` times the sequence's mean
    ``exp(r - logp) - (r - logp) - 1`` (``r``: the reference's log-probs, over the completion mask); the loss is the
    mean over the sequences.

    Args:
        per_token_logps: ``[B, T]`` under the policy being trained (gradients flow through it only).
        old_per_token_logps: ``[B, T]`` under the sampling policy; ``None``: on-policy (``stop_gradient``).
        ref_per_token_logps: ``[B, T]`` under the reference; required when ``beta != 0``.
        advantages: ``[B]``.
        completion_mask: ``[B, T]``.
        settings: GRPO's loss settings (``epsilon``, ``epsilon_high``, ``beta``).
        per_token_entropy: ``[B, T]``; its masked mean is ``metrics["entropy"]``.
        entropy_mask: ``[B, T]`` (``grpo.high_entropy_mask``): the tokens the geometric mean counts; ``None``: all.

    Returns:
        ``(loss, metrics)``: TRL's ``kl`` (``beta != 0``), ``entropy`` and ``clip_ratio/low_mean``, ``high_mean``,
        ``region_mean``, ``low_min``, ``high_max``.
    """
    if settings.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"beta={settings.beta} needs ref_per_token_logps (the reference model's log-probabilities).")
    logps = per_token_logps.astype(jnp.float32)
    mask = completion_mask.astype(jnp.float32)
    advantages = advantages.astype(jnp.float32)
    column = advantages[:, None]
    old_logps = jax.lax.stop_gradient(logps) if old_per_token_logps is None else old_per_token_logps.astype(
        jnp.float32)
    log_ratio = logps - old_logps
    clamped = jnp.clip(log_ratio, -settings.epsilon, settings.epsilon_high)
    clipped = jnp.where(column > 0, jnp.minimum(log_ratio, clamped), jnp.maximum(log_ratio, clamped))
    counted = mask if entropy_mask is None else mask * entropy_mask.astype(jnp.float32)
    log_weights = (clipped * counted).sum(-1) / jnp.maximum(counted.sum(-1), 1.0)
    per_sequence_loss = -jnp.exp(log_weights) * advantages
    metrics: dict[str, jax.Array] = {}
    if settings.beta != 0.0:
        gap = ref_per_token_logps.astype(jnp.float32) - logps
        per_token_kl = jnp.exp(gap) - gap - 1
        per_sequence_loss = per_sequence_loss + settings.beta * (per_token_kl * mask).sum(-1) / jnp.maximum(
            mask.sum(-1), 1.0)
        metrics["kl"] = grpo.batch_mean(per_token_kl, mask)
    if per_token_entropy is not None:
        metrics["entropy"] = grpo.batch_mean(per_token_entropy, mask)
    is_low = (log_ratio < -settings.epsilon) & (column < 0)
    is_high = (log_ratio > settings.epsilon_high) & (column > 0)
    metrics.update({
        "clip_ratio/low_mean": grpo.batch_mean(is_low, mask),
        "clip_ratio/high_mean": grpo.batch_mean(is_high, mask),
        "clip_ratio/region_mean": grpo.batch_mean(is_low | is_high, mask),
        "clip_ratio/low_min": jnp.nanmin(grpo.sequence_means(is_low.astype(jnp.float32), mask)),
        "clip_ratio/high_max": jnp.nanmax(grpo.sequence_means(is_high.astype(jnp.float32), mask)),
    })
    return per_sequence_loss.mean(), metrics


def gmpo_step_loss(family: Family, settings: grpo.GRPOLossSettings,
                   block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds what :func:`.grpo.grpo_step_loss` reads (``input_ids``/``attention_mask``, ``completion_mask``,
    optionally ``tool_mask``, ``advantages``, optionally ``old_logps``/``ref_logps``) and ``step_weight`` (1: each
    micro-batch's loss is a mean, which accumulation averages as TRL divides by the accumulation steps). With
    ``top_entropy_quantile < 1`` the geometric mean counts only the tokens of ``grpo.high_entropy_mask``.
    """

    def loss(module, batch, num_items_in_batch=None):
        mask = grpo.loss_mask(batch)
        scores = grpo.completion_scores(family, module, batch, settings.temperature, block_size, with_entropies=True,
                                        compute_dtype=settings.compute_dtype,
                                        lm_head_in_float32=settings.cast_lm_head_to_fp32)
        entropy_mask = None
        if settings.top_entropy_quantile < 1.0:
            entropy_mask = grpo.high_entropy_mask(scores.entropies, mask, 1.0 - settings.top_entropy_quantile)
        value, metrics = gmpo_loss(scores.log_probs, batch.get("old_logps"), batch.get("ref_logps"),
                                   batch["advantages"], mask, settings, per_token_entropy=scores.entropies,
                                   entropy_mask=entropy_mask)
        return value, batch["step_weight"][0], metrics

    return loss
