"""AsyncGRPO (TRL 1.16's ``trl.experimental.async_grpo``): its advantages, and its loss on Tunix modules.

- Advantages: ``_AsyncRolloutLoop._score_group`` (``async_rollout_worker.py``). Per group of ``num_generations``
  completions: the reward is the sum over the reward functions skipping ``None`` (NaN), NaN where every function
  returned ``None``; then ``A = (r - mean) / (std + 1e-8)`` over the group's scored completions with NumPy's population
  standard deviation (``ddof=0``), and ``A = 0`` for an unscorable completion. No reward weights, no other scaling.
- Loss: ``AsyncGRPOTrainer.compute_loss``. PPO's clipped surrogate of ``r = exp(logp - logp_sampler)``, the ratio of
  the policy's log-probs to those of the sampler that drew the tokens, ``l = -min(r A, clip(r, 1 - eps_low,
  1 + eps_high) A)``, summed over a micro-batch's completion tokens and divided by their number (GRPO's ``bnpo``
  normalisation, :func:`.grpo.token_mean_aggregation`); accumulation averages the micro-batches (TRL divides each by
  the accumulation steps). No reference model and no KL term. Metrics: ``ratio`` (mean ``r``), ``kl`` (mean
  ``(r - 1) - log r``, Schulman's k3 estimate of the sampler-to-policy KL), ``entropy`` and ``clip_ratio/*``.

Shapes: ``N`` completions, ``F`` reward functions, ``B`` rows of a micro-batch, ``T`` completion positions.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..families import Family
from ..training.step_metrics import PRESENCE_PREFIX
from . import grpo, logprobs
from . import router as router_loss
from .advantages import check_groups
from .settings import LossSettings, runtime_field

__all__ = ["ADVANTAGE_EPSILON", "AsyncGRPOLossSettings", "async_grpo_advantages", "async_grpo_loss",
           "async_grpo_step_loss"]

#: Added to the group's standard deviation before dividing (TRL's AsyncGRPO constant; GRPO's is 1e-4).
ADVANTAGE_EPSILON = 1e-8


@dataclass(frozen=True)
class AsyncGRPOLossSettings(LossSettings):
    """The settings of AsyncGRPO's loss, named as their ``AsyncGRPOConfig`` fields (:meth:`from_config`).

    Args:
        epsilon: lower clip of the ratio, ``1 - epsilon``.
        epsilon_high: upper clip, ``1 + epsilon_high`` (``None``: ``epsilon``).
        temperature: runtime value: the sampling temperature the logits are divided by.
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = runtime_field(1.0)
    router_aux_loss_coef: float = runtime_field(0.0)

    def clipping(self) -> grpo.GRPOLossSettings:
        """GRPO's settings of the same surrogate: ``bnpo`` (a token mean over the micro-batch), no KL."""
        return grpo.GRPOLossSettings(loss_type="bnpo", epsilon=self.epsilon, epsilon_high=self.epsilon_high,
                                     temperature=self.temperature)


def _nanmean(values: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """``np.nanmean`` without its warning for an all-NaN slice (NaN there, as TRL logs it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=axis)


def async_grpo_advantages(rewards_per_func: np.ndarray, num_generations: int) -> tuple[np.ndarray, dict]:
    """Advantages and reward metrics of scored completions, as ``_AsyncRolloutLoop._score_group`` (float64 NumPy).

    Args:
        rewards_per_func: ``[N, F]``, NaN where a function returned ``None``; each group's ``num_generations`` rows
            are consecutive.
        num_generations: completions per prompt.

    Returns:
        ``(advantages [N] float32, metrics)``: ``A = (r - mean) / (std + 1e-8)`` per group over its scored rows
        (``std`` with ``ddof=0``), 0 for an unscorable row. ``metrics`` are TRL's per-sample metrics averaged over the
        samples, NaN-skipping: ``"reward"``, ``"reward_std"`` (each sample's group standard deviation) and
        ``"rewards_per_func/mean"`` (``[F]``, logged as ``rewards/<function name>``).

    Raises:
        ValueError: the rows do not split into whole groups.
    """
    rewards_per_func = np.asarray(rewards_per_func, dtype=float)
    check_groups(len(rewards_per_func), num_generations)
    rewards = np.nansum(rewards_per_func, axis=1)
    rewards[np.isnan(rewards_per_func).all(axis=1)] = np.nan
    advantages = np.zeros_like(rewards)
    group_std = np.full_like(rewards, np.nan)
    for start in range(0, len(rewards), num_generations):
        group = slice(start, start + num_generations)
        scored = ~np.isnan(rewards[group])
        if scored.any():
            values = rewards[group][scored]
            advantages[group][scored] = (values - values.mean()) / (values.std() + ADVANTAGE_EPSILON)
            group_std[group] = values.std()
    metrics = {"reward": float(_nanmean(rewards)), "reward_std": float(_nanmean(group_std)),
               "rewards_per_func/mean": _nanmean(rewards_per_func, axis=0)}
    return advantages.astype(np.float32), metrics


def async_grpo_loss(per_token_logps: jax.Array, sampler_logps: jax.Array | None, advantages: jax.Array,
                    completion_mask: jax.Array, settings: AsyncGRPOLossSettings, *,
                    per_token_entropy: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One micro-batch's AsyncGRPO loss and TRL's metrics, as ``AsyncGRPOTrainer.compute_loss``.

    Args:
        per_token_logps: ``[B, T]`` the policy's log-probabilities of the completion tokens (gradients flow here).
        sampler_logps: ``[B, T]`` the sampler's, the ratio's denominator; ``None``: the policy's own, detached (ratio
            1, for completions the sampler gave no log-probs of).
        advantages: ``[B]``.
        completion_mask: ``[B, T]``, 1 on the tokens that count.
        settings: the clipping range.
        per_token_entropy: ``[B, T]``; its token mean is ``metrics["entropy"]``.

    Returns:
        ``(loss, metrics)``: the token mean of the clipped surrogate over the micro-batch (0 without tokens); ``ratio``,
        ``kl``, ``entropy`` (when given) and ``clip_ratio/low_mean``, ``high_mean``, ``region_mean``, ``low_min``,
        ``high_max``.
    """
    loss, metrics = grpo.grpo_loss(per_token_logps, sampler_logps, None, advantages, completion_mask,
                                   settings.clipping(), per_token_entropy=per_token_entropy)
    logps = jax.lax.stop_gradient(per_token_logps.astype(jnp.float32))
    log_ratio = logps - (logps if sampler_logps is None else sampler_logps.astype(jnp.float32))
    ratio = jnp.exp(log_ratio)
    mask = completion_mask.astype(jnp.float32)
    metrics["ratio"] = grpo.batch_mean(ratio, mask)
    metrics["kl"] = grpo.batch_mean((ratio - 1) - log_ratio, mask)
    return loss, metrics


def async_grpo_step_loss(family: Family, settings: AsyncGRPOLossSettings,
                         block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]``, ``completion_mask`` ``[B, C]``, optionally
    ``tool_mask`` (the loss counts :func:`.grpo.loss_mask`'s tokens), ``advantages`` ``[B]`` and ``old_logps``
    ``[B, C]`` (the sampler's log-probs; absent: ratio 1). A micro-batch with loss tokens weighs 1, so accumulation
    averages their token means, as TRL divides each by the accumulation steps. One whose completions were all dropped
    (stale, masked out) weighs 0 and records no metric (each metric comes with its ``present/`` indicator,
    ``adapters.training.step_metrics``): TRL never trains such a micro-batch. With ``router_aux_loss_coef`` (a
    mixture-of-experts model) the value adds ``router_aux_loss_coef * aux_loss`` of the micro-batch's forward pass,
    logged as ``aux_loss``. ``block_size`` as in :func:`.grpo.completion_scores`.
    """

    def loss(module, batch, num_items_in_batch=None):
        mask = grpo.loss_mask(batch)
        scores, aux_loss = router_loss.run_with_router_loss(
            family,
            lambda module: grpo.completion_scores(family, module, batch, settings.temperature, block_size,
                                                  with_entropies=True),
            module, batch["attention_mask"], settings.router_aux_loss_coef)
        value, metrics = async_grpo_loss(scores.log_probs, batch.get("old_logps"), batch["advantages"], mask,
                                         settings, per_token_entropy=scores.entropies)
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        present = (mask.sum() > 0).astype(jnp.float32)
        metrics = {name: jnp.where(present > 0, metric, 0.0) for name, metric in metrics.items()}
        metrics.update({PRESENCE_PREFIX + name: present for name in list(metrics)})
        return value * present, present, metrics

    return loss
