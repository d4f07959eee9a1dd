"""RLOO (TRL 1.16's ``RLOOTrainer``): leave-one-out advantages, the PPO-clipped loss on sequence ratios, and the
jitted step loss on Tunix modules. The rollout and the completion log-prob pass are GRPO's (:mod:`.grpo`).

Every function reproduces the TRL code named in its docstring, to float32 rounding. Shapes: ``N`` completions, ``B``
sequences in a batch, ``C`` completion positions, ``F`` reward functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from . import router as router_loss
from .advantages import REWARD_STD_EPSILON, check_groups, combine_rewards, nanstd, reward_metrics
from .grpo import completion_scores, loss_mask
from .settings import LossSettings, runtime_field


@dataclass(frozen=True)
class RLOOLossSettings(LossSettings):
    """The settings of RLOO's loss, named as their ``RLOOConfig`` fields (:meth:`from_config`).

    Args:
        epsilon: lower clip of the sequence ratio.
        epsilon_high: upper clip (``None``: ``epsilon``).
        temperature: runtime value: the sampling temperature the logits are divided by.
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = runtime_field(1.0)
    router_aux_loss_coef: float = runtime_field(0.0)

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)


def rloo_advantages(rewards_per_func: jax.Array, num_generations: int, *,
                    reward_weights: Sequence[float] | jax.Array | None = None,
                    reward_clip_range: tuple[float, float] | None = None, kl: jax.Array | None = None,
                    beta: float = 0.0, normalize_advantages: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Advantages and reward metrics of a generation batch, as ``RLOOTrainer._generate_and_score_completions``.

    ``r[n] = clip(nansum_f(w[f] * rewards[n, f])) - beta * kl[n]`` (NaN where every function returned ``None``);
    ``A[n] = r[n] - mean of the other scorable rewards of its group`` (the leave-one-out baseline); with
    ``normalize_advantages``, ``(A - nanmean(A)) / (nanstd(A) + 1e-4)`` over the batch; NaN -> 0.

    Args:
        rewards_per_func: ``[N, F]`` rewards of the whole generation batch; NaN where a function returned ``None``.
        num_generations: completions per prompt.
        reward_weights: ``[F]``; ``None`` weighs every function 1.0.
        reward_clip_range: ``(min, max)`` applied to the summed reward, before the KL penalty.
        kl: ``[N]`` summed ``log(pi_old / pi_ref)`` over each completion's tokens (``beta != 0``).
        beta: the KL coefficient.
        normalize_advantages: normalise the advantages over the batch.

    Returns:
        ``(advantages [N], metrics)``: ``"reward"``, ``"reward_std"`` (of the weighted sum before clipping and KL, as
        TRL logs it), ``"frac_reward_zero_std"`` (groups whose KL-penalised rewards are all equal),
        ``"rewards_per_func/mean"`` and ``"rewards_per_func/std"`` (``[F]``).
    """
    rewards_per_func = jnp.asarray(rewards_per_func, jnp.float32)
    check_groups(rewards_per_func.shape[0], num_generations)
    logged = combine_rewards(rewards_per_func, reward_weights)
    rewards = logged
    if reward_clip_range is not None:
        rewards = jnp.clip(rewards, reward_clip_range[0], reward_clip_range[1])
    if beta != 0.0 and kl is not None:
        rewards = rewards - beta * jnp.asarray(kl, jnp.float32)
    grouped = rewards.reshape(-1, num_generations)
    std = nanstd(grouped, axis=1) if num_generations > 1 else jnp.zeros(grouped.shape[0], jnp.float32)
    if num_generations > 1:
        scorable = (~jnp.isnan(grouped)).sum(axis=1, keepdims=True).astype(jnp.float32)
        baselines = (jnp.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
        advantages = rewards - baselines.reshape(-1)
    else:  # evaluation with num_generations_eval=1
        advantages = jnp.zeros_like(rewards)
    if normalize_advantages:
        advantages = (advantages - jnp.nanmean(advantages)) / (nanstd(advantages) + REWARD_STD_EPSILON)
    metrics = reward_metrics(logged, rewards_per_func, std)
    return jnp.nan_to_num(advantages, nan=0.0), metrics


def rloo_loss(sequence_log_probs: jax.Array, old_sequence_log_probs: jax.Array, advantages: jax.Array,
              settings: RLOOLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL 1.16's ``RLOOTrainer._compute_loss``: a PPO-clipped objective on sequence ratios, averaged over sequences.

    ``ratio = exp(logp - old_logp)`` with ``logp`` the summed completion log-probabilities;
    ``loss = mean(-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A))``.

    Args:
        sequence_log_probs: ``[B]`` summed log-probabilities of each completion under the policy being trained.
        old_sequence_log_probs: ``[B]`` the same under the policy that sampled them.
        advantages: ``[B]``.
        settings: the clip range (``epsilon``, ``epsilon_high``).

    Returns:
        ``(loss, metrics)``: TRL's ``clip_ratio/low_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_mean``,
        ``clip_ratio/high_max`` and ``clip_ratio/region_mean`` of the micro-batch.
    """
    epsilon_low, epsilon_high = settings.epsilon, settings.epsilon_high
    ratio = jnp.exp(sequence_log_probs - old_sequence_log_probs)
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -jnp.minimum(ratio * advantages, clipped * advantages).mean()
    is_low = ((ratio < 1 - epsilon_low) & (advantages < 0)).astype(jnp.float32)
    is_high = ((ratio > 1 + epsilon_high) & (advantages > 0)).astype(jnp.float32)
    metrics = {"clip_ratio/low_mean": is_low.mean(), "clip_ratio/low_min": is_low.min(),
               "clip_ratio/high_mean": is_high.mean(), "clip_ratio/high_max": is_high.max(),
               "clip_ratio/region_mean": jnp.maximum(is_low, is_high).mean()}
    return loss, metrics


def rloo_step_loss(family: Family, settings: RLOOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """RLOO's ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]``, ``completion_mask`` ``[B, C]``, optionally
    ``tool_mask`` ``[B, C]``, ``advantages`` ``[B]`` and ``old_logps`` ``[B]`` (the sampling policy's summed
    log-probabilities of the :func:`~.grpo.loss_mask` tokens). The value is :func:`rloo_loss` of the micro-batch on
    the summed log-probabilities of the same tokens, a mean over its sequences (weight 1: accumulated micro-batches
    are averaged, as TRL's Trainer divides by the accumulation steps); ``metrics`` add TRL's ``entropy``, the mean
    over those tokens. With ``settings.router_aux_loss_coef`` (a mixture-of-experts model) the value adds
    ``router_aux_loss_coef * aux_loss`` of the micro-batch's forward pass, logged as ``aux_loss``, as TRL does.
    """

    def loss(module, batch, num_items_in_batch=None):
        mask = loss_mask(batch)
        scores, aux_loss = router_loss.run_with_router_loss(
            family,
            lambda module: completion_scores(family, module, batch, settings.temperature, block_size,
                                             with_entropies=True),
            module, batch["attention_mask"], settings.router_aux_loss_coef)
        value, metrics = rloo_loss((scores.log_probs * mask).sum(-1), batch["old_logps"], batch["advantages"],
                                   settings)
        metrics["entropy"] = (scores.entropies * mask).sum() / jnp.maximum(mask.sum(), 1).astype(jnp.float32)
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        return value, jnp.float32(1.0), metrics

    return loss
