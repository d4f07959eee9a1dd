"""GRPO and DPO math as pure JAX functions that give TRL 1.16's numbers: rewards to advantages, the GRPO policy loss,
the DPO losses, and token log-probabilities.

Every function reproduces the TRL 1.16 code named in its docstring (``GRPOTrainer._generate_and_score_completions``,
``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``, ``trl.trainer.utils.selective_log_softmax``), to float32
rounding, including the gradients (what TRL detaches is under ``jax.lax.stop_gradient`` here). Shapes: ``N``
completions, ``B`` sequences in a batch, ``T`` completion positions, ``V`` vocabulary, ``F`` reward functions.

What comes from Tunix and what is ours (``adapters.upstream`` gives the Tunix versions this was checked on):

- Tunix's: ``tunix.rl.common.selective_log_softmax`` (float32 log-softmax and gather), ``compute_kl_divergence``
  with ``method="low_var_kl"`` (Schulman's k3 estimator, TRL's per-token KL), ``aggregate_loss`` in its
  ``"token-mean"`` and ``"sequence-mean-token-sum-norm"`` modes (every TRL loss normalisation is one of these with
  the right ``norm``), and ``tunix.rl.algo_core.compute_entropy_from_logits``.
- Ours, because Tunix differs from TRL: the advantages (Tunix's ``"grpo"`` estimator divides by ``std + 1e-6`` where
  TRL uses ``1e-4``, and has no ``None``/NaN rewards, reward weights, ``"batch"`` scaling or GDPO aggregation); the
  policy-loss core (Tunix's ``grpo_loss_fn`` runs the model itself, clips the log-ratio to +-20, has no ``delta``,
  CISPO, SAPO, LUSPO, VESPO, off-policy mask or KL bias correction, and its ``"gspo-token"`` ratio has other gradients
  than TRL's ``importance_sampling_level="sequence"`` and is clipped at 10); the GRPO normalisations built on
  Tunix's ``"sequence-mean-token-mean"`` / ``"sequence-mean-token-scale"`` modes, which divide by the number of
  non-empty rows where TRL divides by all rows (they differ once ``mask_truncated_completions`` empties a row); and
  the DPO losses (Tunix's ``dpo_loss_fn`` runs the model itself, has only the sigmoid loss, and applies
  ``label_smoothing`` to it as cDPO, which TRL 1.16 no longer does).

Longer than most modules on purpose: it is a catalogue of small pure functions, one per TRL formula (eight GRPO
loss types, fifteen DPO ones), each short and self-contained; splitting it would scatter the side-by-side reading
against TRL's code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core as tunix_algo_core
from tunix.rl import common as tunix_common

#: GRPO ``loss_type`` values (TRL 1.16's list, all implemented).
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: ``importance_sampling_level`` values: per-token ratios, or one ratio per sequence (GSPO).
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
#: ``scale_rewards`` values (``True`` means ``"group"``, ``False`` means ``"none"``).
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
#: ``multi_objective_aggregation`` values.
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
#: DPO ``loss_type`` values (TRL 1.16's list, all implemented).
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                                   "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                                   "sigmoid_norm")
#: DPO ``f_divergence_type`` values.
F_DIVERGENCE_TYPES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: DPO loss types built on the chosen-minus-rejected score, the only ones with an f-divergence generalisation.
F_DIVERGENCE_LOSS_TYPES: frozenset[str] = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust",
                                                     "discopop", "sft"})

#: Added to the reward standard deviation before dividing (TRL's constant).
REWARD_STD_EPSILON = 1e-4

_GRPO_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _check(name: str, value: str, accepted: Sequence[str]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(v) for v in accepted)}.")


# --- Rewards -> advantages (GRPOTrainer._generate_and_score_completions) -----------------------------------------

def nanstd(values: jax.Array, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """Standard deviation over the non-NaN entries with Bessel's correction, as ``trl.trainer.utils.nanstd``.

    ``sqrt(nanmean((x - nanmean(x))**2) * n / (n - 1))`` with ``n`` the number of non-NaN entries; NaN where
    ``n < 2``.

    Args:
        values: any shape.
        axis: axis to reduce; ``None`` reduces all.
        keepdims: keep the reduced axis with size 1.

    Returns:
        The standard deviation, float32.
    """
    values = jnp.asarray(values, jnp.float32)
    mean = jnp.nanmean(values, axis=axis, keepdims=True)
    variance = jnp.nanmean((values - mean) ** 2, axis=axis, keepdims=keepdims)
    count = jnp.sum(~jnp.isnan(values), axis=axis, keepdims=keepdims).astype(jnp.float32)
    correction = jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
    return jnp.sqrt(variance * correction)


def scale_rewards_mode(scale_rewards: str | bool) -> str:
    """``scale_rewards`` as one of ``SCALE_REWARDS``: ``True`` -> ``"group"``, ``False`` -> ``"none"`` (TRL's mapping).

    Raises:
        ValueError: any other value.
    """
    mode = {True: "group", False: "none"}[scale_rewards] if isinstance(scale_rewards, bool) else scale_rewards
    _check("scale_rewards", mode, SCALE_REWARDS)
    return mode


def _reward_weights(reward_weights: Sequence[float] | jax.Array | None, num_funcs: int) -> jax.Array:
    if reward_weights is None:
        return jnp.ones(num_funcs, jnp.float32)
    weights = jnp.asarray(reward_weights, jnp.float32)
    if weights.shape != (num_funcs,):
        raise ValueError(f"reward_weights has shape {weights.shape} but there are {num_funcs} reward functions; give "
                         "one weight per reward function.")
    return weights


def _weighted_sum(values: jax.Array, weights: jax.Array, rewards_per_func: jax.Array) -> jax.Array:
    """``nansum_f(values * weights)``, NaN on the rows where every raw reward is NaN (unscorable completions)."""
    return jnp.where(jnp.isnan(rewards_per_func).all(axis=1), jnp.nan, jnp.nansum(values * weights, axis=1))


def combine_rewards(rewards_per_func: jax.Array, reward_weights: Sequence[float] | jax.Array | None = None
                    ) -> jax.Array:
    """One reward per completion: the weighted sum over reward functions, skipping ``None`` (NaN) rewards.

    ``reward[n] = nansum_f(rewards_per_func[n, f] * reward_weights[f])``, and NaN where every function returned
    ``None`` for completion ``n`` (TRL marks those rows unscorable so the group baseline skips them).

    Args:
        rewards_per_func: ``[N, F]``; NaN where a function returned ``None``.
        reward_weights: ``[F]``; ``None`` weighs every function 1.0.

    Returns:
        ``[N]`` float32.
    """
    rewards_per_func = jnp.asarray(rewards_per_func, jnp.float32)
    weights = _reward_weights(reward_weights, rewards_per_func.shape[1])
    return _weighted_sum(rewards_per_func, weights, rewards_per_func)


def _check_groups(num_completions: int, num_generations: int) -> None:
    if num_generations < 1 or num_completions % num_generations:
        raise ValueError(f"{num_completions} rewards do not split into groups of num_generations={num_generations}; "
                         "each prompt's completions must be consecutive and complete.")


def _reward_std(rewards: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
    """TRL's ``std_rewards`` ([N]): per group for ``"group"``/``"none"``, over the batch for ``"batch"``."""
    if scale_rewards == "batch":
        return jnp.broadcast_to(nanstd(rewards), rewards.shape) if rewards.size > 1 else jnp.zeros_like(rewards)
    if num_generations == 1:  # TRL: possible in evaluation with num_generations_eval=1
        return jnp.zeros_like(rewards)
    return jnp.repeat(nanstd(rewards.reshape(-1, num_generations), axis=1), num_generations)


def _sum_then_normalize(rewards: jax.Array, num_generations: int, scale_rewards: str) -> tuple[jax.Array, jax.Array]:
    group_mean = jnp.repeat(jnp.nanmean(rewards.reshape(-1, num_generations), axis=1), num_generations)
    std = _reward_std(rewards, num_generations, scale_rewards)
    advantages = rewards - group_mean
    if scale_rewards != "none":
        advantages = advantages / (std + REWARD_STD_EPSILON)
    return jnp.nan_to_num(advantages, nan=0.0), std


def group_advantages(rewards: jax.Array, num_generations: int, scale_rewards: str | bool = "group") -> jax.Array:
    """GRPO advantages: each completion's reward minus its group's mean, divided by a standard deviation.

    ``A[n] = (r[n] - nanmean(r[group(n)])) / (std[n] + 1e-4)`` with ``std`` the NaN-ignoring, Bessel-corrected
    standard deviation (``nanstd``) of the group (``"group"``) or of the whole batch (``"batch"``); ``"none"`` skips
    the division. NaN rewards (unscorable completions) are left out of the statistics and get ``A = 0``. Groups are
    ``num_generations`` consecutive entries, as TRL lays them out.

    Args:
        rewards: ``[N]`` combined rewards (``combine_rewards``), ``N`` a multiple of ``num_generations``.
        num_generations: completions per prompt.
        scale_rewards: ``"group"`` (or ``True``), ``"batch"``, ``"none"`` (or ``False``).

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    _check_groups(rewards.shape[0], num_generations)
    return _sum_then_normalize(rewards, num_generations, scale_rewards_mode(scale_rewards))[0]


def _normalize_then_sum(rewards_per_func: jax.Array, reward_weights: jax.Array | Sequence[float] | None,
                        num_generations: int) -> tuple[jax.Array, jax.Array]:
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.reshape(-1, num_generations, num_funcs)
    group_mean = jnp.nanmean(grouped, axis=1, keepdims=True)
    group_std = (nanstd(grouped, axis=1, keepdims=True) if num_generations > 1 else jnp.zeros_like(group_mean))
    normalised = ((grouped - group_mean) / (group_std + REWARD_STD_EPSILON)).reshape(-1, num_funcs)
    rewards = _weighted_sum(normalised, _reward_weights(reward_weights, num_funcs), rewards_per_func)
    std = jnp.broadcast_to(nanstd(rewards), rewards.shape) if rewards.size > 1 else jnp.zeros_like(rewards)
    advantages = (rewards - jnp.nanmean(rewards)) / (std + REWARD_STD_EPSILON)
    return jnp.nan_to_num(advantages, nan=0.0), std


def decoupled_group_advantages(rewards_per_func: jax.Array, num_generations: int,
                               reward_weights: Sequence[float] | jax.Array | None = None) -> jax.Array:
    """GDPO advantages (``multi_objective_aggregation="normalize_then_sum"``): normalise each reward, then sum.

    ``z[n, f] = (r[n, f] - nanmean_group(r[:, f])) / (nanstd_group(r[:, f]) + 1e-4)``;
    ``s[n] = nansum_f(w[f] * z[n, f])`` (NaN where every function returned ``None``);
    ``A[n] = (s[n] - nanmean(s)) / (nanstd(s) + 1e-4)`` over the batch, NaN -> 0.

    Args:
        rewards_per_func: ``[N, F]``; NaN where a function returned ``None``.
        num_generations: completions per prompt.
        reward_weights: ``[F]``; ``None`` weighs every function 1.0.

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards_per_func = jnp.asarray(rewards_per_func, jnp.float32)
    _check_groups(rewards_per_func.shape[0], num_generations)
    return _normalize_then_sum(rewards_per_func, reward_weights, num_generations)[0]


def grpo_advantages(rewards_per_func: jax.Array, num_generations: int, *,
                    reward_weights: Sequence[float] | jax.Array | None = None, scale_rewards: str | bool = "group",
                    multi_objective_aggregation: str = "sum_then_normalize"
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Advantages and reward metrics of a generation batch, as ``GRPOTrainer._generate_and_score_completions``.

    ``"sum_then_normalize"``: ``group_advantages(combine_rewards(rewards_per_func, reward_weights), ...)``;
    ``"normalize_then_sum"``: ``decoupled_group_advantages(...)`` (``scale_rewards`` is not read, as in TRL).

    Args:
        rewards_per_func: ``[N, F]`` rewards of the whole generation batch (all processes); NaN for ``None``.
        num_generations: completions per prompt (``num_generations_eval`` in evaluation).
        reward_weights: ``[F]``; ``None`` weighs every function 1.0.
        scale_rewards: ``"group"`` (or ``True``), ``"batch"``, ``"none"`` (or ``False``).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.

    Returns:
        ``(advantages [N], metrics)``. ``metrics`` holds TRL's logged values: ``"reward"`` and ``"reward_std"``
        (NaN-ignoring mean and ``nanstd`` of the weighted reward sum, unscorable rows left out),
        ``"frac_reward_zero_std"`` (share of completions whose scaling std is 0), and ``"rewards_per_func/mean"`` /
        ``"rewards_per_func/std"`` (``[F]``, logged by TRL as ``rewards/<function name>/mean|std``).
    """
    rewards_per_func = jnp.asarray(rewards_per_func, jnp.float32)
    _check_groups(rewards_per_func.shape[0], num_generations)
    _check("multi_objective_aggregation", multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    rewards = combine_rewards(rewards_per_func, reward_weights)
    if multi_objective_aggregation == "sum_then_normalize":
        advantages, std = _sum_then_normalize(rewards, num_generations, scale_rewards_mode(scale_rewards))
    else:
        advantages, std = _normalize_then_sum(rewards_per_func, reward_weights, num_generations)
    metrics = {
        "reward": jnp.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": jnp.isclose(std, 0.0).astype(jnp.float32).mean(),
        "rewards_per_func/mean": jnp.nanmean(rewards_per_func, axis=0),
        "rewards_per_func/std": nanstd(rewards_per_func, axis=0),
    }
    return advantages, metrics


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
    _check_groups(rewards_per_func.shape[0], num_generations)
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
    metrics = {
        "reward": jnp.nanmean(logged),
        "reward_std": nanstd(logged),
        "frac_reward_zero_std": jnp.isclose(std, 0.0).astype(jnp.float32).mean(),
        "rewards_per_func/mean": jnp.nanmean(rewards_per_func, axis=0),
        "rewards_per_func/std": nanstd(rewards_per_func, axis=0),
    }
    return jnp.nan_to_num(advantages, nan=0.0), metrics


def rloo_loss(sequence_log_probs: jax.Array, old_sequence_log_probs: jax.Array, advantages: jax.Array,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL 1.16's ``RLOOTrainer._compute_loss``: a PPO-clipped objective on sequence ratios, averaged over sequences.

    ``ratio = exp(logp - old_logp)`` with ``logp`` the summed completion log-probabilities;
    ``loss = mean(-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A))``.

    Args:
        sequence_log_probs: ``[B]`` summed log-probabilities of each completion under the policy being trained.
        old_sequence_log_probs: ``[B]`` the same under the policy that sampled them.
        advantages: ``[B]``.
        epsilon_low, epsilon_high: the clip range.

    Returns:
        ``(loss, metrics)``: TRL's ``clip_ratio/low_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_mean``,
        ``clip_ratio/high_max`` and ``clip_ratio/region_mean`` of the micro-batch.
    """
    ratio = jnp.exp(sequence_log_probs - old_sequence_log_probs)
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -jnp.minimum(ratio * advantages, clipped * advantages).mean()
    is_low = ((ratio < 1 - epsilon_low) & (advantages < 0)).astype(jnp.float32)
    is_high = ((ratio > 1 + epsilon_high) & (advantages > 0)).astype(jnp.float32)
    metrics = {"clip_ratio/low_mean": is_low.mean(), "clip_ratio/low_min": is_low.min(),
               "clip_ratio/high_mean": is_high.mean(), "clip_ratio/high_max": is_high.max(),
               "clip_ratio/region_mean": jnp.maximum(is_low, is_high).mean()}
    return loss, metrics


# --- Token log-probabilities ---------------------------------------------------------------------------------------

def _scaled_logits(logits: jax.Array, temperature: float) -> jax.Array:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be positive: log-probabilities are those of "
                         "softmax(logits / temperature).")
    logits = logits.astype(jnp.float32)
    return logits if temperature == 1.0 else logits / temperature


def token_log_probs(logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None,
                    temperature: float = 1.0) -> jax.Array:
    """Log-probability of each chosen token: ``log_softmax(logits / temperature)[b, t, tokens[b, t]]``, float32.

    TRL's ``selective_log_softmax(logits, index, temperature)`` (and its fused LM head): the logits are cast to
    float32 and divided by the sampling temperature before the log-softmax. ``logits[:, t]`` must be the distribution
    of ``tokens[:, t]`` (for a causal LM: ``logits[:, :-1]`` with ``input_ids[:, 1:]``).

    Args:
        logits: ``[B, T, V]``.
        tokens: ``[B, T]`` integer ids.
        mask: ``[B, T]``; positions where it is 0 get 0.0 (TRL's ignored labels). ``None`` keeps every position.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32.
    """
    log_probs = tunix_common.selective_log_softmax(_scaled_logits(logits, temperature), tokens.astype(jnp.int32))
    return log_probs if mask is None else jnp.where(mask.astype(bool), log_probs, 0.0)


def token_entropies(logits: jax.Array, mask: jax.Array | None = None, temperature: float = 1.0) -> jax.Array:
    """Entropy of each next-token distribution, ``-sum_v p log p`` with ``p = softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]``.
        mask: ``[B, T]``; positions where it is 0 get 0.0. ``None`` keeps every position.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32 (nats).
    """
    entropies = tunix_algo_core.compute_entropy_from_logits(_scaled_logits(logits, temperature))
    return entropies if mask is None else jnp.where(mask.astype(bool), entropies, 0.0)


def token_log_sum_squared_probs(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log(sum_v p_v**2)`` of each next-token distribution, ``p = softmax(logits / temperature)``: the
    ``log_sum_sq_probs`` of TRL's fused LM head, which WPO weighting (``DPOConfig.use_weighting``) subtracts from each
    token's log-probability.

    Args:
        logits: ``[B, T, V]``.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32.
    """
    log_p = jax.nn.log_softmax(_scaled_logits(logits, temperature), axis=-1)
    return jax.nn.logsumexp(2.0 * log_p, axis=-1)


def sequence_log_probs(logits: jax.Array, tokens: jax.Array, mask: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each sequence: ``sum_t mask[b, t] * token_log_probs(logits, tokens)[b, t]``.

    Args:
        logits: ``[B, T, V]``, aligned with ``tokens`` as in ``token_log_probs``.
        tokens: ``[B, T]``.
        mask: ``[B, T]``, 1 on the scored (completion) tokens.
        temperature: > 0.

    Returns:
        ``[B]`` float32.
    """
    return token_log_probs(logits, tokens, mask, temperature).sum(axis=-1)


def length_desensitised_log_probs(chosen_per_token_logps: jax.Array, rejected_per_token_logps: jax.Array,
                                  chosen_mask: jax.Array, rejected_mask: jax.Array, ld_alpha: float
                                  ) -> tuple[jax.Array, jax.Array]:
    """LD-DPO sequence log-probabilities (``DPOConfig.ld_alpha``): the tail past the shorter response is down-weighted.

    With ``l = min(len_chosen, len_rejected)`` per pair and ``k`` the index of a completion token among its
    sequence's completion tokens (1-based): ``logp = sum_{k <= l} logp_k + ld_alpha * sum_{k > l} logp_k``.

    Args:
        chosen_per_token_logps: ``[B, T]`` (0 outside the completion).
        rejected_per_token_logps: ``[B, T]``.
        chosen_mask: ``[B, T]``, 1 on the chosen completion's tokens.
        rejected_mask: ``[B, T]``.
        ld_alpha: weight of the tail, in ``[0, 1]``.

    Returns:
        ``(chosen [B], rejected [B])`` float32.
    """
    shared = jnp.minimum(chosen_mask.sum(axis=-1), rejected_mask.sum(axis=-1))[:, None]

    def weighted(per_token_logps: jax.Array, mask: jax.Array) -> jax.Array:
        position = jnp.cumsum(mask, axis=-1)
        in_shared = (position > 0) & (position <= shared)
        per_token_logps = per_token_logps.astype(jnp.float32)
        return (per_token_logps * in_shared).sum(-1) + ld_alpha * (per_token_logps * (position > shared)).sum(-1)

    return weighted(chosen_per_token_logps, chosen_mask), weighted(rejected_per_token_logps, rejected_mask)


def wpo_weights(per_token_logps: jax.Array, log_sum_squared_probs: jax.Array, completion_mask: jax.Array
                ) -> jax.Array:
    """WPO's sequence weights (``DPOConfig.use_weighting``, Eq. 2 of the WPO paper), as ``DPOTrainer._compute_loss``.

    ``w = exp(sum_t m_t (logp_t - log sum_v p_v**2) / max(sum_t m_t, 1))``, without gradient; TRL multiplies each
    pair's loss by ``w_chosen * w_rejected``.

    Args:
        per_token_logps: ``[N, T]`` log-probabilities of the completion tokens (plain, not LD-DPO weighted).
        log_sum_squared_probs: ``[N, T]`` (:func:`token_log_sum_squared_probs`).
        completion_mask: ``[N, T]``, 1 on the completion tokens.

    Returns:
        ``[N]`` float32.
    """
    mask = completion_mask.astype(jnp.float32)
    aligned = jax.lax.stop_gradient((per_token_logps.astype(jnp.float32) - log_sum_squared_probs) * mask)
    return jnp.exp(aligned.sum(-1) / jnp.maximum(mask.sum(-1), 1.0))


# --- GRPO loss (GRPOTrainer._compute_loss) ------------------------------------------------------------------------

def _off_policy_mask(advantages: jax.Array, per_token_logps: jax.Array, sampling_per_token_logps: jax.Array,
                     mask: jax.Array, threshold: float) -> jax.Array:
    """DeepSeek-V3.2 off-policy sequence mask ([B, 1]): keep if ``A >= 0`` or mean(log pi_old - log pi) <= threshold."""
    kl = jnp.nan_to_num(sampling_per_token_logps - jax.lax.stop_gradient(per_token_logps), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).astype(jnp.float32)


def _vespo_gamma_weights(advantages: jax.Array, log_ratio: jax.Array, mask: jax.Array, k_pos: float,
                         lambda_pos: float, k_neg: float, lambda_neg: float) -> jax.Array:
    """VESPO's detached weight ``phi(w) = exp(lambda + k log w - lambda w)`` of the sequence ratio ``w`` ([B, 1])."""
    lower = math.log(1e-8)
    sequence_log_ratio = (jnp.clip(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdims=True)
    log_w = jnp.clip(sequence_log_ratio, lower, 20.0)
    non_negative = advantages >= 0
    k = jnp.where(non_negative, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(non_negative, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def high_entropy_mask(per_token_entropy: jax.Array, completion_mask: jax.Array, quantile: float) -> jax.Array:
    """The tokens whose entropy reaches the batch's ``quantile``, as ``GRPOTrainer.get_high_entropy_mask``.

    ``cutoff = quantile_q(entropies over the masked tokens)`` (linear interpolation, ``torch.quantile``'s method);
    ``keep = (entropy * mask >= cutoff) & mask``. TRL calls it with ``q = 1 - top_entropy_quantile`` on the batch of
    every process, which is one SPMD batch here. No masked token: nothing is kept.

    Args:
        per_token_entropy: ``[B, T]``.
        completion_mask: ``[B, T]``, 1 on the tokens that count.
        quantile: ``q`` in ``[0, 1]``.

    Returns:
        ``[B, T]`` bool, without gradient.
    """
    entropies = jax.lax.stop_gradient(per_token_entropy.astype(jnp.float32))
    valid = completion_mask.astype(bool)
    cutoff = jnp.nanquantile(jnp.where(valid, entropies, jnp.nan), quantile)
    return (entropies * valid >= cutoff) & valid


def entropy_sums(per_token_entropy: jax.Array, completion_mask: jax.Array,
                 entropy_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(sum(entropy * m), sum(m))`` over the tokens of GRPO's entropy bonus, ``m = completion_mask`` (times
    ``entropy_mask`` when ``top_entropy_quantile < 1``): TRL's ``effective_mask`` sums, which its adaptive entropy
    controller (``use_adaptive_entropy``) adds up over the micro-batches of an optimizer step.

    Args:
        per_token_entropy: ``[B, T]``.
        completion_mask: ``[B, T]``.
        entropy_mask: ``[B, T]`` (:func:`high_entropy_mask`), or ``None``.

    Returns:
        Two float32 scalars, differentiable through ``per_token_entropy``.
    """
    mask = completion_mask.astype(jnp.float32)
    if entropy_mask is not None:
        mask = mask * entropy_mask.astype(jnp.float32)
    return (per_token_entropy.astype(jnp.float32) * mask).sum(), mask.sum()


def entropy_bonus(per_token_entropy: jax.Array, completion_mask: jax.Array,
                  entropy_mask: jax.Array | None = None) -> jax.Array:
    """The mean entropy ``H`` of GRPO's entropy bonus, as ``GRPOTrainer._compute_loss`` (``entropy_coef``).

    ``H = sum(entropy * m) / max(sum(m), 1)`` with ``m = completion_mask`` (times ``entropy_mask`` when
    ``top_entropy_quantile < 1``). TRL's training loss is ``policy loss - entropy_coef * H / k`` with ``k`` the
    gradient accumulation steps, for every loss type (the bonus is not rescaled by a loss type's normalisation).
    Differentiable through ``per_token_entropy``.

    Args:
        per_token_entropy: ``[B, T]``.
        completion_mask: ``[B, T]``.
        entropy_mask: ``[B, T]`` (:func:`high_entropy_mask`), or ``None``.

    Returns:
        A float32 scalar.
    """
    total, count = entropy_sums(per_token_entropy, completion_mask, entropy_mask)
    return total / jnp.maximum(count, 1.0)


SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""``vllm_importance_sampling_mode`` values (TRL's names)."""


def sampler_importance_ratio(old_per_token_logps: np.ndarray, sampling_per_token_logps: np.ndarray,
                             completion_mask: np.ndarray, mode: str = "sequence_mask",
                             clip_min: float | None = None, clip_max: float | None = 3.0) -> np.ndarray:
    """TRL's correction of the gap between the sampling engine's and the trainer's policy (GRPOTrainer's
    ``vllm_importance_sampling_ratio``), on the host.

    ``d = (logp_old - logp_sampling) * mask`` (NaN differences count as 0); ``r = exp(d)`` per token
    (``token_*`` modes) or ``exp(sum_t d)`` per sequence (``sequence_*``); ``*_truncate`` clamps ``r`` to
    ``[clip_min, clip_max]``, ``*_mask`` sets ``r`` outside that range to 0 (a bound of ``None`` is open).
    The per-token loss is multiplied by ``r``.

    Args:
        old_per_token_logps: ``[B, T]`` the trainer's log-probs of the sampled tokens (its policy when the batch
            is used); sampling_per_token_logps: ``[B, T]`` the engine's, when it sampled them.
        completion_mask: ``[B, T]`` 1 on the tokens the loss counts.
        mode: one of :data:`SAMPLER_CORRECTION_MODES`; clip_min, clip_max: the bounds.

    Returns:
        ``[B, T]`` float32 for ``token_*`` modes, ``[B, 1]`` for ``sequence_*``.
    """
    _check("vllm_importance_sampling_mode", mode, SAMPLER_CORRECTION_MODES)
    difference = (np.asarray(old_per_token_logps, np.float64) - np.asarray(sampling_per_token_logps, np.float64))
    difference = np.nan_to_num(difference * np.asarray(completion_mask, np.float64), nan=0.0)
    if mode.startswith("sequence"):
        difference = difference.sum(axis=-1, keepdims=True)
    ratio = np.exp(difference)
    low = -np.inf if clip_min is None else clip_min
    high = np.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = np.clip(ratio, low, high)
    else:
        ratio = np.where((ratio < low) | (ratio > high), 0.0, ratio)
    return ratio.astype(np.float32)


def grpo_loss(
    per_token_logps: jax.Array,
    old_per_token_logps: jax.Array | None,
    ref_per_token_logps: jax.Array | None,
    advantages: jax.Array,
    completion_mask: jax.Array,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | jax.Array | None = None,
    use_bias_correction_kl: bool = True,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    per_token_entropy: jax.Array | None = None,
    entropy_mask: jax.Array | None = None,
    importance_sampling_ratio: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of one batch of completions and TRL's loss metrics, as ``GRPOTrainer._compute_loss``.

    Ratio: ``log_w = logp - logp_old`` per token (``importance_sampling_level="token"``), or its masked mean over
    the sequence, one value per sequence (``"sequence"``, GSPO); ``w = exp(log_w)``. Per-token loss ``l``:

    - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``l = -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A)``
      with ``w' = min(w, delta)`` when ``delta`` is set (INTELLECT-2 two-sided clipping), else ``w' = w``.
    - ``cispo``: ``l = -sg(min(w, eps_high)) A logp``.
    - ``sapo``: ``l = -sigmoid(tau (w - 1)) 4 / tau A`` with ``tau = sapo_temperature_pos`` where ``A > 0``, else
      ``sapo_temperature_neg``.
    - ``vespo``: ``l = -sg(phi) A logp`` with ``phi = exp(lambda + k log W - lambda W)``, ``W`` the clipped sequence
      ratio ``exp(sum_t log_ratio)`` and ``(k, lambda)`` the ``vespo_*_pos`` values where ``A >= 0``, else ``*_neg``.

    Then ``l *= keep`` (``off_policy_mask_threshold``: a sequence with ``A < 0`` whose mean ``logp_old - logp`` exceeds
    the threshold is dropped), ``l *= entropy_mask`` (``top_entropy_quantile``), ``l *= importance_sampling_ratio``
    (:func:`sampler_importance_ratio`, the sampling engine's correction), and with ``beta != 0``,
    ``l += beta * kl``, ``kl = exp(r - logp) - (r - logp) - 1`` (``r = ref_per_token_logps``), times ``w`` when
    ``use_bias_correction_kl``. Aggregation over ``mask``:

    - ``grpo``, ``sapo``: ``mean_b(sum_t l m / max(sum_t m, 1))`` (all ``B`` rows, empty ones count 0);
    - ``bnpo``: ``sum l m / max(sum m, 1)``;
    - ``dr_grpo``: ``sum l m / (B * max_completion_length)``;
    - ``dapo``, ``cispo``, ``vespo``: ``sum l m / num_items_in_batch``;
    - ``luspo``: ``mean_b(sum_t l m)``.

    The loss is that of one micro-batch without gradient accumulation (TRL's ``policy_loss``). With ``k``
    accumulation steps TRL divides the ``grpo``, ``bnpo``, ``dr_grpo``, ``sapo`` and ``luspo`` losses by ``k``;
    ``dapo``, ``cispo`` and ``vespo`` are scaled through ``num_items_in_batch`` instead. TRL's ``bnpo`` divides by
    each process's own token count; over one SPMD batch this is the token count of the whole batch. The keyword
    settings are Python values (static under ``jax.jit``), except ``num_items_in_batch``, which may be an array.

    Args:
        per_token_logps: ``[B, T]`` log-probabilities of the completion tokens under the policy being trained (the
            only input gradients flow through).
        old_per_token_logps: ``[B, T]`` under the policy that sampled them; ``None`` means on-policy
            (``stop_gradient(per_token_logps)``, TRL's shortcut when ``num_iterations == 1``).
        ref_per_token_logps: ``[B, T]`` under the reference model; required when ``beta != 0``.
        advantages: ``[B]`` (or ``[B, T]``).
        completion_mask: ``[B, T]``, 1 on the completion tokens that count.
        loss_type: one of ``GRPO_LOSS_TYPES``.
        beta: KL coefficient.
        epsilon_low: lower clip ``epsilon`` (``GRPOConfig.epsilon``).
        epsilon_high: upper clip (``GRPOConfig.epsilon_high``; ``None``: ``epsilon_low``); for ``cispo`` the cap on
            the ratio itself.
        delta: upper bound on the unclipped ratio (``GRPOConfig.delta``), ``None`` for none.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        max_completion_length: the ``dr_grpo`` constant.
        num_items_in_batch: the ``dapo``/``cispo``/``vespo`` divisor. TRL's is ``max(loss tokens of the generation
            batch over all processes, 1) * gradient_accumulation_steps / steps_per_generation``; ``None`` gives
            ``max(completion_mask.sum(), 1)`` (a batch on its own).
        use_bias_correction_kl: multiply the KL by the ratio ``w``.
        off_policy_mask_threshold: drop threshold of the off-policy sequence mask; ``None`` disables it.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO Gamma-weight parameters.
        per_token_entropy: ``[B, T]``; when given, its masked mean is returned as ``metrics["entropy"]``.
        entropy_mask: ``[B, T]`` (:func:`high_entropy_mask`); only these tokens get the policy loss (the KL term
            keeps every token, as in TRL). ``None`` keeps all. The entropy bonus is :func:`entropy_bonus`.
        importance_sampling_ratio: ``[B, T]`` or ``[B, 1]`` (:func:`sampler_importance_ratio`), or ``None``.

    Returns:
        ``(loss, metrics)``, float32. ``metrics`` has TRL's names: ``"kl"`` (``beta != 0``), ``"entropy"`` (when
        given), ``"clip_ratio/low_mean"``, ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"``,
        ``"clip_ratio/low_min"``, ``"clip_ratio/high_max"`` (clipped loss types), ``"cispo_clip_ratio"`` or
        ``"vespo/phi_seq_mean"``.
    """
    _check("loss_type", loss_type, GRPO_LOSS_TYPES)
    _check("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"beta={beta} needs ref_per_token_logps (the reference model's log-probabilities).")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' divides by batch size x max_completion_length; pass "
                         "max_completion_length.")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high

    logps = per_token_logps.astype(jnp.float32)
    mask = completion_mask.astype(jnp.float32)
    advantages = advantages.astype(jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    old_logps = jax.lax.stop_gradient(logps) if old_per_token_logps is None else old_per_token_logps.astype(
        jnp.float32)
    batch_size = logps.shape[0]

    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]
    ratio = jnp.exp(log_weights)

    if beta != 0.0:
        per_token_kl = tunix_common.compute_kl_divergence(logps, ref_per_token_logps, method="low_var_kl")
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio

    metrics: dict[str, jax.Array] = {}
    if loss_type == "cispo":
        per_token_loss = -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high)) * advantages * logps
    elif loss_type in _GRPO_CLIPPED_LOSSES:
        clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = jnp.minimum(ratio, delta)
        per_token_loss = -jnp.minimum(ratio * advantages, clipped * advantages)
    elif loss_type == "sapo":
        temperature = jnp.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -jax.nn.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    else:  # vespo
        phi = _vespo_gamma_weights(advantages, log_ratio, mask, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                                   vespo_lambda_neg)
        per_token_loss = -phi * advantages * logps

    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * _off_policy_mask(advantages, logps, old_logps, mask,
                                                           off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.astype(jnp.float32)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio.astype(jnp.float32)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    per_token_loss = jnp.broadcast_to(per_token_loss, mask.shape)

    if loss_type in ("grpo", "sapo"):
        lengths = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
        loss = tunix_common.aggregate_loss(per_token_loss / lengths, mask, "sequence-mean-token-sum-norm",
                                           norm=batch_size)
    elif loss_type == "bnpo":
        loss = tunix_common.aggregate_loss(per_token_loss, mask, "token-mean")
    else:
        if loss_type == "dr_grpo":
            norm = batch_size * max_completion_length
        elif loss_type == "luspo":
            norm = batch_size
        else:
            norm = jnp.maximum(mask.sum(), 1.0) if num_items_in_batch is None else num_items_in_batch
        loss = tunix_common.aggregate_loss(per_token_loss, mask, "sequence-mean-token-sum-norm", norm=norm)

    def sequence_means(values: jax.Array) -> jax.Array:
        if values.shape[1] == 1:
            return values[:, 0]
        return (values * mask).sum(-1) / mask.sum(-1)

    def batch_mean(values: jax.Array) -> jax.Array:
        values = values.astype(jnp.float32)
        if values.shape[1] == 1:
            return values.sum() / batch_size
        return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    if beta != 0.0:
        metrics["kl"] = batch_mean(per_token_kl)
    if per_token_entropy is not None:
        metrics["entropy"] = batch_mean(per_token_entropy)
    if loss_type in _GRPO_CLIPPED_LOSSES:
        is_low = (ratio < 1 - epsilon_low) & (advantages < 0)
        is_high = (ratio > 1 + epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"] = batch_mean(is_low)
        metrics["clip_ratio/high_mean"] = batch_mean(is_high)
        metrics["clip_ratio/region_mean"] = batch_mean(is_low | is_high)
        metrics["clip_ratio/low_min"] = jnp.nanmin(sequence_means(is_low.astype(jnp.float32)))
        metrics["clip_ratio/high_max"] = jnp.nanmax(sequence_means(is_high.astype(jnp.float32)))
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = batch_mean((ratio > epsilon_high) & (advantages > 0))
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = batch_mean(phi)
    return loss, metrics


# --- DPO loss (DPOTrainer._compute_loss) ---------------------------------------------------------------------------

def _f_divergence_scores(log_ratios: jax.Array, f_divergence_type: str, alpha: float) -> jax.Array:
    """``f'(pi / pi_ref)`` of the f-DPO paper, from the log-ratio ``log(pi / pi_ref)``."""
    if f_divergence_type == "reverse_kl":
        return log_ratios
    if f_divergence_type == "forward_kl":
        return 1 - jnp.exp(-log_ratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + jax.nn.log_sigmoid(log_ratios)
    if abs(alpha - 1.0) < 1e-6:  # alpha -> 1 is the reverse KL
        return log_ratios
    return (jnp.exp(jnp.minimum((alpha - 1.0) * log_ratios, 80.0)) - 1.0) / (alpha - 1.0)


def _dpo_pair_losses(loss_type: str, *, beta: float, label_smoothing: float, discopop_tau: float,
                     chosen_logps: jax.Array, rejected_logps: jax.Array, ref_chosen_logps: jax.Array,
                     ref_rejected_logps: jax.Array, chosen_scores: jax.Array, rejected_scores: jax.Array,
                     chosen_lengths: jax.Array | None, rejected_lengths: jax.Array | None,
                     sft_chosen_logps: jax.Array) -> jax.Array:
    """The ``[B]`` losses of one DPO ``loss_type`` (TRL's ``per_sequence_loss``)."""
    log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid
    chosen_log_ratios = chosen_logps - ref_chosen_logps
    rejected_log_ratios = rejected_logps - ref_rejected_logps
    score = chosen_scores - rejected_scores
    if loss_type in ("ipo", "sigmoid_norm", "sft") and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"DPO loss_type={loss_type!r} needs chosen_lengths and rejected_lengths (completion tokens "
                         "per sequence).")

    def smoothed(margin: jax.Array) -> jax.Array:
        return -log_sigmoid(beta * margin) * (1 - label_smoothing) - log_sigmoid(-beta * margin) * label_smoothing

    if loss_type == "sigmoid":
        return -log_sigmoid(beta * score)
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * score)
    if loss_type in ("ipo", "sigmoid_norm"):
        average = (chosen_scores / jnp.maximum(chosen_lengths, 1.0)
                   - rejected_scores / jnp.maximum(rejected_lengths, 1.0))
        return (average - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -log_sigmoid(beta * average)
    if loss_type == "exo_pair":
        return (sigmoid(beta * score) * (log_sigmoid(beta * score) - math.log1p(-label_smoothing))
                + sigmoid(-beta * score) * (log_sigmoid(-beta * score) - math.log(label_smoothing)))
    if loss_type == "nca_pair":
        return (-log_sigmoid(beta * chosen_log_ratios) - 0.5 * log_sigmoid(-beta * chosen_log_ratios)
                - 0.5 * log_sigmoid(-beta * rejected_log_ratios))
    if loss_type == "robust":
        return ((-(1 - label_smoothing) * log_sigmoid(beta * score) + label_smoothing * log_sigmoid(-beta * score))
                / (1 - 2 * label_smoothing))
    if loss_type == "bco_pair":
        return -log_sigmoid(beta * chosen_log_ratios) - log_sigmoid(-beta * rejected_log_ratios)
    if loss_type == "sppo_hard":
        return (chosen_log_ratios - 0.5 / beta) ** 2 + (rejected_log_ratios + 0.5 / beta) ** 2
    if loss_type == "aot":
        return smoothed(jnp.sort(chosen_logps - rejected_logps) - jnp.sort(ref_chosen_logps - ref_rejected_logps))
    if loss_type == "aot_unpaired":
        return smoothed(jnp.sort(chosen_log_ratios) - jnp.sort(rejected_log_ratios))
    if loss_type == "apo_zero":
        return 1 - sigmoid(beta * chosen_log_ratios) + sigmoid(beta * rejected_log_ratios)
    if loss_type == "apo_down":
        return sigmoid(beta * chosen_log_ratios) + 1 - sigmoid(beta * (chosen_log_ratios - rejected_log_ratios))
    if loss_type == "discopop":
        logits = beta * score
        modulation = sigmoid(logits / discopop_tau)
        return -log_sigmoid(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
    # sft: negative mean log-probability of the chosen tokens, the same value for every pair
    return jnp.broadcast_to(-sft_chosen_logps.sum() / chosen_lengths.sum(), chosen_logps.shape)


def dpo_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    chosen_lengths: jax.Array | None = None,
    rejected_lengths: jax.Array | None = None,
    sft_chosen_logps: jax.Array | None = None,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of a batch of preference pairs and TRL's reward metrics, as ``DPOTrainer._compute_loss``.

    With log-ratios ``c = logp_chosen - ref_chosen``, ``r = logp_rejected - ref_rejected``, scores ``s_c = f'(c)``,
    ``s_r = f'(r)`` (``f_divergence_type``; the identity for ``"reverse_kl"``) and ``d = s_c - s_r``:

    - ``sigmoid``: ``-log sigmoid(beta d)`` (TRL 1.16 no longer smooths it; ``label_smoothing`` is read by
      ``robust``, ``exo_pair``, ``aot`` and ``aot_unpaired`` only);
    - ``hinge``: ``relu(1 - beta d)``; ``ipo``: ``(s_c / n_c - s_r / n_r - 1 / (2 beta))**2`` with ``n`` the
      completion lengths; ``sigmoid_norm``: ``-log sigmoid(beta (s_c / n_c - s_r / n_r))``;
    - ``robust``: ``(-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps)``;
    - ``exo_pair``: ``q log(q / (1 - eps)) + (1 - q) log((1 - q) / eps)``, ``q = sigmoid(beta d)``;
    - ``nca_pair``, ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``aot``,
      ``aot_unpaired`` and ``sft``: TRL's formulas on ``c`` and ``r`` (``aot`` sorts within the batch; ``sft`` is the
      mean negative log-probability of the chosen tokens, ``-sum(logp_chosen) / sum(n_c)``).

    ``loss = sum_i loss_weights[i] * mean_b(loss_i)`` over the listed ``loss_type`` values. The keyword settings are
    Python values (static under ``jax.jit``); the lengths may be arrays.

    Args:
        policy_chosen_logps: ``[B]`` summed log-probabilities of the chosen completions under the policy
            (``sequence_log_probs``, or ``length_desensitised_log_probs`` for ``ld_alpha``).
        policy_rejected_logps: ``[B]``.
        ref_chosen_logps: ``[B]`` under the reference model.
        ref_rejected_logps: ``[B]``.
        beta: the DPO temperature (``tau`` for IPO).
        loss_type: one of ``DPO_LOSS_TYPES`` or a list of them.
        loss_weights: one weight per loss type; ``None`` weighs each 1.0.
        label_smoothing: ``eps`` of ``robust``, ``exo_pair`` (must be > 0), ``aot``, ``aot_unpaired``.
        chosen_lengths: ``[B]`` completion tokens of each chosen sequence (``ipo``, ``sigmoid_norm``, ``sft``).
        rejected_lengths: ``[B]`` (``ipo``, ``sigmoid_norm``).
        sft_chosen_logps: ``[B]`` plain (unweighted) sums of the chosen tokens' log-probabilities, read by ``sft``;
            ``None`` uses ``policy_chosen_logps``, which is the same unless ``ld_alpha`` weighted it.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES``; other than ``"reverse_kl"`` only with
            ``F_DIVERGENCE_LOSS_TYPES``.
        f_alpha_divergence_coef: ``alpha`` of ``"alpha_divergence"``.
        discopop_tau: DiscoPOP temperature.

    Returns:
        ``(loss, metrics)``, float32. ``metrics``: ``"rewards/chosen"`` (mean of ``beta c``), ``"rewards/rejected"``
        (mean of ``beta r``), ``"rewards/accuracies"`` (share of pairs with ``c > r``), ``"rewards/margins"`` (mean
        of ``beta (c - r)``), ``"logps/chosen"``, ``"logps/rejected"`` (means of the policy log-probabilities).
    """
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(loss_types)} loss types {loss_types}; "
                         "give one weight per loss type.")
    for name in loss_types:
        _check("loss_type", name, DPO_LOSS_TYPES)
    _check("f_divergence_type", f_divergence_type, F_DIVERGENCE_TYPES)
    if f_divergence_type != "reverse_kl" and not set(loss_types) <= F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(f"f_divergence_type={f_divergence_type!r} only works with the loss types "
                         f"{sorted(F_DIVERGENCE_LOSS_TYPES)}; got {loss_types}.")
    if "exo_pair" in loss_types and label_smoothing == 0.0:
        raise ValueError("loss_type='exo_pair' needs label_smoothing > 0 (the EXO paper recommends 1e-3).")

    chosen_logps = policy_chosen_logps.astype(jnp.float32)
    rejected_logps = policy_rejected_logps.astype(jnp.float32)
    ref_chosen_logps = ref_chosen_logps.astype(jnp.float32)
    ref_rejected_logps = ref_rejected_logps.astype(jnp.float32)
    chosen_log_ratios = chosen_logps - ref_chosen_logps
    rejected_log_ratios = rejected_logps - ref_rejected_logps
    if chosen_lengths is not None:
        chosen_lengths = jnp.asarray(chosen_lengths, jnp.float32)
    if rejected_lengths is not None:
        rejected_lengths = jnp.asarray(rejected_lengths, jnp.float32)

    loss = jnp.float32(0.0)
    for name, weight in zip(loss_types, weights, strict=True):
        pair_losses = _dpo_pair_losses(
            name, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau, chosen_logps=chosen_logps,
            rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
            chosen_scores=_f_divergence_scores(chosen_log_ratios, f_divergence_type, f_alpha_divergence_coef),
            rejected_scores=_f_divergence_scores(rejected_log_ratios, f_divergence_type, f_alpha_divergence_coef),
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
            sft_chosen_logps=chosen_logps if sft_chosen_logps is None else sft_chosen_logps.astype(jnp.float32))
        loss = loss + pair_losses.mean() * weight

    chosen_rewards = beta * jax.lax.stop_gradient(chosen_log_ratios)
    rejected_rewards = beta * jax.lax.stop_gradient(rejected_log_ratios)
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": jax.lax.stop_gradient(chosen_logps).mean(),
        "logps/rejected": jax.lax.stop_gradient(rejected_logps).mean(),
    }
    return loss, metrics
