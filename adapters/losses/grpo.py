"""GRPO (TRL 1.16's ``GRPOTrainer``): rewards to advantages, the policy loss of every loss type, and the jitted step
loss on Tunix modules, each formula a pure JAX function that gives TRL's numbers.

Every function reproduces the TRL code named in its docstring (``GRPOTrainer._generate_and_score_completions``,
``GRPOTrainer._compute_loss``), to float32 rounding, including the gradients (what TRL detaches is under
``jax.lax.stop_gradient`` here). Shapes: ``N`` completions, ``B`` sequences in a batch, ``T`` completion positions,
``F`` reward functions. The step loss runs the Tunix forward pass with fixed shapes: prompts left-padded to ``P``
tokens, completions right-padded to ``C = max_completion_length``, so one program serves every step.

What comes from Tunix and what is ours (``adapters.upstream`` gives the Tunix versions this was checked on):

- Tunix's: ``tunix.rl.common.compute_kl_divergence`` with ``method="low_var_kl"`` (Schulman's k3 estimator, TRL's
  per-token KL) and ``aggregate_loss`` in its ``"token-mean"`` and ``"sequence-mean-token-sum-norm"`` modes (every
  TRL loss normalisation is one of these with the right ``norm``).
- Ours, because Tunix differs from TRL: the advantages (Tunix's ``"grpo"`` estimator divides by ``std + 1e-6`` where
  TRL uses ``1e-4``, and has no ``None``/NaN rewards, reward weights, ``"batch"`` scaling or GDPO aggregation); the
  policy-loss core (Tunix's ``grpo_loss_fn`` runs the model itself, clips the log-ratio to +-20, has no ``delta``,
  CISPO, SAPO, LUSPO, VESPO, off-policy mask or KL bias correction, and its ``"gspo-token"`` ratio has other gradients
  than TRL's ``importance_sampling_level="sequence"`` and is clipped at 10); and the GRPO normalisations built on
  Tunix's ``"sequence-mean-token-mean"`` / ``"sequence-mean-token-scale"`` modes, which divide by the number of
  non-empty rows where TRL divides by all rows (they differ once ``mask_truncated_completions`` empties a row).

A new loss knob is a :class:`GRPOLossSettings` field named as its ``GRPOConfig`` field, read where it acts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl import common as tunix_common

from ..families import Family
from ..lora import runtime as lora_runtime
from ..runtime.tracing import traced_cheaply
from ..training.train_step import cast_floating
from . import logprobs
from . import router as router_loss
from .advantages import (
    REWARD_STD_EPSILON,
    check_groups,
    combine_rewards,
    nanstd,
    reward_metrics,
    reward_weight_vector,
    weighted_reward_sum,
)
from .settings import LossSettings, check_choice, runtime_field

#: ``importance_sampling_level`` values: per-token ratios, or one ratio per sequence (GSPO).
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
#: ``scale_rewards`` values (``True`` means ``"group"``, ``False`` means ``"none"``).
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
#: ``multi_objective_aggregation`` values.
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
#: ``vllm_importance_sampling_mode`` values (TRL's names).
SAMPLER_CORRECTION_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: The step-loss metrics an adaptive entropy controller reads (``GRPOLossSettings.use_adaptive_entropy``): a
#: micro-batch's entropy summed over the entropy bonus's tokens, and their count (:func:`entropy_sums`). Not logged.
ADAPTIVE_ENTROPY_SUMS = ("adaptive_entropy/entropy_sum", "adaptive_entropy/tokens")

#: The batch column that carries TRL's ``num_items_in_batch`` for the :data:`NUM_ITEMS_NORMALISED_LOSSES`: the loss
#: tokens of the micro-batch's generation batch times ``gradient_accumulation_steps / steps_per_generation``. It is one
#: value per generation batch, repeated on every row because the step's inputs are row-sharded arrays; the Trainer's own
#: ``num_items_in_batch`` (one count per optimizer step) cannot carry it, since a step's micro-batches may come from
#: different generation batches. :func:`token_normaliser` reads it.
NUM_ITEMS_COLUMN = "num_items"


@dataclass(frozen=True)
class GRPOLossSettings(LossSettings):
    """The settings of GRPO's loss, named as their ``GRPOConfig`` fields (:meth:`from_config`), defaults TRL's formula
    defaults.

    Args:
        loss_type: one of :data:`GRPO_LOSS_TYPES`.
        beta: KL coefficient.
        epsilon: lower clip ``epsilon``.
        epsilon_high: upper clip (``None``: ``epsilon``); for ``cispo`` the cap on the ratio itself.
        delta: upper bound on the unclipped ratio, ``None`` for none.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        max_completion_length: the ``dr_grpo`` constant.
        use_bias_correction_kl: multiply the KL by the ratio.
        off_policy_mask_threshold: drop threshold of the off-policy sequence mask; ``None`` disables it.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO Gamma-weight parameters.
        top_entropy_quantile: below 1, the policy loss counts only the tokens of :func:`high_entropy_mask`.
        entropy_coef: the weight of the entropy bonus (:func:`entropy_bonus`).
        use_adaptive_entropy: the coefficient is each batch's ``entropy_coef`` column instead of ``entropy_coef`` (so
            it changes without a new program), and the metrics carry :data:`ADAPTIVE_ENTROPY_SUMS`.
        cast_lm_head_to_fp32: the output head multiplies float32 hidden states by the full-precision head weights.
        temperature: runtime value: the sampling temperature the logits are divided by.
        compute_dtype: runtime value: with ``cast_lm_head_to_fp32`` the loss casts the decoder to this dtype itself
            (the train step then casts nothing); otherwise ``None`` (the train step casts).
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).

    Raises:
        ValueError: a ``loss_type`` or ``importance_sampling_level`` not implemented, or ``dr_grpo`` without
            ``max_completion_length``.
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    cast_lm_head_to_fp32: bool = False
    temperature: float = runtime_field(1.0)
    compute_dtype: Any = runtime_field(None)
    router_aux_loss_coef: float = runtime_field(0.0)

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' divides by batch size x max_completion_length; pass "
                             "max_completion_length.")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)


# --- Rewards -> advantages (GRPOTrainer._generate_and_score_completions) -----------------------------------------

def scale_rewards_mode(scale_rewards: str | bool) -> str:
    """``scale_rewards`` as one of ``SCALE_REWARDS``: ``True`` -> ``"group"``, ``False`` -> ``"none"`` (TRL's mapping).

    Raises:
        ValueError: any other value.
    """
    mode = {True: "group", False: "none"}[scale_rewards] if isinstance(scale_rewards, bool) else scale_rewards
    check_choice("scale_rewards", mode, SCALE_REWARDS)
    return mode


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
    check_groups(rewards.shape[0], num_generations)
    return _sum_then_normalize(rewards, num_generations, scale_rewards_mode(scale_rewards))[0]


def _normalize_then_sum(rewards_per_func: jax.Array, reward_weights: jax.Array | Sequence[float] | None,
                        num_generations: int) -> tuple[jax.Array, jax.Array]:
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.reshape(-1, num_generations, num_funcs)
    group_mean = jnp.nanmean(grouped, axis=1, keepdims=True)
    group_std = (nanstd(grouped, axis=1, keepdims=True) if num_generations > 1 else jnp.zeros_like(group_mean))
    normalised = ((grouped - group_mean) / (group_std + REWARD_STD_EPSILON)).reshape(-1, num_funcs)
    rewards = weighted_reward_sum(normalised, reward_weight_vector(reward_weights, num_funcs), rewards_per_func)
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
    check_groups(rewards_per_func.shape[0], num_generations)
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
    check_groups(rewards_per_func.shape[0], num_generations)
    check_choice("multi_objective_aggregation", multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    rewards = combine_rewards(rewards_per_func, reward_weights)
    if multi_objective_aggregation == "sum_then_normalize":
        advantages, std = _sum_then_normalize(rewards, num_generations, scale_rewards_mode(scale_rewards))
    else:
        advantages, std = _normalize_then_sum(rewards_per_func, reward_weights, num_generations)
    metrics = reward_metrics(rewards, rewards_per_func, std)
    return advantages, metrics



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
    check_choice("vllm_importance_sampling_mode", mode, SAMPLER_CORRECTION_MODES)
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




# --- GRPO loss (GRPOTrainer._compute_loss) ------------------------------------------------------------------------

class PolicyRatio(NamedTuple):
    """What each per-token policy loss of :data:`POLICY_LOSSES` reads, float32.

    Args:
        logps: ``[B, T]`` log-probabilities under the policy being trained.
        log_ratio: ``[B, T]`` ``logps - old_logps``.
        ratio: ``[B, T]`` (``"token"``) or ``[B, 1]`` (``"sequence"``) importance weights ``w``.
        advantages: ``[B, 1]`` or ``[B, T]``.
        mask: ``[B, T]`` the tokens that count.
    """

    logps: jax.Array
    log_ratio: jax.Array
    ratio: jax.Array
    advantages: jax.Array
    mask: jax.Array


def batch_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """A metric's mean over the counted tokens (over the rows for a ``[B, 1]`` sequence-level value)."""
    values = values.astype(jnp.float32)
    if values.shape[1] == 1:
        return values.sum() / mask.shape[0]
    return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sequence_means(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B]`` per-sequence means over the counted tokens (the value itself for a ``[B, 1]`` one)."""
    if values.shape[1] == 1:
        return values[:, 0]
    return (values * mask).sum(-1) / mask.sum(-1)


def clipped_policy_loss(terms: PolicyRatio, settings: GRPOLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``l = -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A)``
    with ``w' = min(w, delta)`` when ``delta`` is set (INTELLECT-2 two-sided clipping), else ``w' = w``.

    Returns:
        ``(l, metrics)``: TRL's ``clip_ratio/low_mean``, ``high_mean``, ``region_mean``, ``low_min``, ``high_max``.
    """
    ratio, advantages, mask = terms.ratio, terms.advantages, terms.mask
    clipped = jnp.clip(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    if settings.delta is not None:
        ratio = jnp.minimum(ratio, settings.delta)
    per_token_loss = -jnp.minimum(ratio * advantages, clipped * advantages)
    is_low = (ratio < 1 - settings.epsilon) & (advantages < 0)
    is_high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    metrics = {
        "clip_ratio/low_mean": batch_mean(is_low, mask),
        "clip_ratio/high_mean": batch_mean(is_high, mask),
        "clip_ratio/region_mean": batch_mean(is_low | is_high, mask),
        "clip_ratio/low_min": jnp.nanmin(sequence_means(is_low.astype(jnp.float32), mask)),
        "clip_ratio/high_max": jnp.nanmax(sequence_means(is_high.astype(jnp.float32), mask)),
    }
    return per_token_loss, metrics


def cispo_policy_loss(terms: PolicyRatio, settings: GRPOLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``cispo``: ``l = -sg(min(w, eps_high)) A logp``; metric ``cispo_clip_ratio`` (share of capped tokens with
    ``A > 0``)."""
    ratio, advantages = terms.ratio, terms.advantages
    per_token_loss = -jax.lax.stop_gradient(jnp.minimum(ratio, settings.epsilon_high)) * advantages * terms.logps
    return per_token_loss, {"cispo_clip_ratio": batch_mean((ratio > settings.epsilon_high) & (advantages > 0),
                                                            terms.mask)}


def sapo_policy_loss(terms: PolicyRatio, settings: GRPOLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``sapo``: ``l = -sigmoid(tau (w - 1)) 4 / tau A`` with ``tau = sapo_temperature_pos`` where ``A > 0``, else
    ``sapo_temperature_neg``; no metrics."""
    advantages = terms.advantages
    temperature = jnp.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
    return -jax.nn.sigmoid(temperature * (terms.ratio - 1)) * 4 / temperature * advantages, {}


def vespo_policy_loss(terms: PolicyRatio, settings: GRPOLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``vespo``: ``l = -sg(phi) A logp`` with ``phi = exp(lambda + k log W - lambda W)``, ``W`` the clipped sequence
    ratio ``exp(sum_t log_ratio)`` and ``(k, lambda)`` the ``vespo_*_pos`` values where ``A >= 0``, else ``*_neg``;
    metric ``vespo/phi_seq_mean``."""
    phi = _vespo_gamma_weights(terms.advantages, terms.log_ratio, terms.mask, settings.vespo_k_pos,
                               settings.vespo_lambda_pos, settings.vespo_k_neg, settings.vespo_lambda_neg)
    return -phi * terms.advantages * terms.logps, {"vespo/phi_seq_mean": batch_mean(phi, terms.mask)}


def sequence_mean_aggregation(per_token_loss: jax.Array, mask: jax.Array, settings: GRPOLossSettings,
                              num_items_in_batch: float | jax.Array | None) -> jax.Array:
    """``grpo``, ``sapo``: ``mean_b(sum_t l m / max(sum_t m, 1))`` (all ``B`` rows, empty ones count 0)."""
    lengths = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
    return tunix_common.aggregate_loss(per_token_loss / lengths, mask, "sequence-mean-token-sum-norm",
                                       norm=mask.shape[0])


def token_mean_aggregation(per_token_loss: jax.Array, mask: jax.Array, settings: GRPOLossSettings,
                           num_items_in_batch: float | jax.Array | None) -> jax.Array:
    """``bnpo``: ``sum l m / max(sum m, 1)``."""
    return tunix_common.aggregate_loss(per_token_loss, mask, "token-mean")


def constant_length_aggregation(per_token_loss: jax.Array, mask: jax.Array, settings: GRPOLossSettings,
                                num_items_in_batch: float | jax.Array | None) -> jax.Array:
    """``dr_grpo``: ``sum l m / (B * max_completion_length)``."""
    return tunix_common.aggregate_loss(per_token_loss, mask, "sequence-mean-token-sum-norm",
                                       norm=mask.shape[0] * settings.max_completion_length)


def sequence_sum_aggregation(per_token_loss: jax.Array, mask: jax.Array, settings: GRPOLossSettings,
                             num_items_in_batch: float | jax.Array | None) -> jax.Array:
    """``luspo``: ``mean_b(sum_t l m)``."""
    return tunix_common.aggregate_loss(per_token_loss, mask, "sequence-mean-token-sum-norm", norm=mask.shape[0])


def token_sum_aggregation(per_token_loss: jax.Array, mask: jax.Array, settings: GRPOLossSettings,
                          num_items_in_batch: float | jax.Array | None) -> jax.Array:
    """``dapo``, ``cispo``, ``vespo``: ``sum l m / num_items_in_batch`` (``max(sum m, 1)`` when it is ``None``)."""
    norm = jnp.maximum(mask.sum(), 1.0) if num_items_in_batch is None else num_items_in_batch
    return tunix_common.aggregate_loss(per_token_loss, mask, "sequence-mean-token-sum-norm", norm=norm)


PolicyLoss = Callable[[PolicyRatio, GRPOLossSettings], tuple[jax.Array, dict[str, jax.Array]]]
Aggregation = Callable[[jax.Array, jax.Array, GRPOLossSettings, "float | jax.Array | None"], jax.Array]

#: ``loss_type`` -> ``(per-token policy loss, aggregation over the tokens)``, TRL 1.16's list in its order.
POLICY_LOSSES: dict[str, tuple[PolicyLoss, Aggregation]] = {
    "grpo": (clipped_policy_loss, sequence_mean_aggregation),
    "dr_grpo": (clipped_policy_loss, constant_length_aggregation),
    "dapo": (clipped_policy_loss, token_sum_aggregation),
    "bnpo": (clipped_policy_loss, token_mean_aggregation),
    "cispo": (cispo_policy_loss, token_sum_aggregation),
    "sapo": (sapo_policy_loss, sequence_mean_aggregation),
    "luspo": (clipped_policy_loss, sequence_sum_aggregation),
    "vespo": (vespo_policy_loss, token_sum_aggregation),
}
#: GRPO ``loss_type`` values (TRL 1.16's list, all implemented).
GRPO_LOSS_TYPES: tuple[str, ...] = tuple(POLICY_LOSSES)
#: Loss types whose micro-batch loss is a sum over tokens divided by the generation batch's token count
#: (TRL's ``num_items_in_batch`` normaliser, :data:`NUM_ITEMS_COLUMN`); the others are per-micro-batch means.
NUM_ITEMS_NORMALISED_LOSSES: tuple[str, ...] = tuple(name for name, (_, aggregation) in POLICY_LOSSES.items()
                                                     if aggregation is token_sum_aggregation)
#: Loss types that sum per-token terms, so each sequence weighs as its completion length: TRL warns that with
#: ``importance_sampling_level="sequence"`` they do not optimise GSPO's per-sequence objective.
LENGTH_WEIGHTED_LOSSES: tuple[str, ...] = ("bnpo", "dr_grpo", "dapo", "cispo")


def grpo_loss(
    per_token_logps: jax.Array,
    old_per_token_logps: jax.Array | None,
    ref_per_token_logps: jax.Array | None,
    advantages: jax.Array,
    completion_mask: jax.Array,
    settings: GRPOLossSettings,
    *,
    num_items_in_batch: float | jax.Array | None = None,
    per_token_entropy: jax.Array | None = None,
    entropy_mask: jax.Array | None = None,
    importance_sampling_ratio: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of one batch of completions and TRL's loss metrics, as ``GRPOTrainer._compute_loss``.

    Ratio: ``log_w = logp - logp_old`` per token (``importance_sampling_level="token"``), or its masked mean over
    the sequence, one value per sequence (``"sequence"``, GSPO); ``w = exp(log_w)``. Per-token loss ``l``: the
    ``loss_type``'s entry of :data:`POLICY_LOSSES` (:func:`clipped_policy_loss`, :func:`cispo_policy_loss`,
    :func:`sapo_policy_loss`, :func:`vespo_policy_loss`).

    Then ``l *= keep`` (``off_policy_mask_threshold``: a sequence with ``A < 0`` whose mean ``logp_old - logp`` exceeds
    the threshold is dropped), ``l *= entropy_mask`` (``top_entropy_quantile``), ``l *= importance_sampling_ratio``
    (:func:`sampler_importance_ratio`, the sampling engine's correction), and with ``beta != 0``,
    ``l += beta * kl``, ``kl = exp(r - logp) - (r - logp) - 1`` (``r = ref_per_token_logps``), times ``w`` when
    ``use_bias_correction_kl``. Aggregation over ``mask``: the ``loss_type``'s entry of :data:`POLICY_LOSSES`
    (:func:`sequence_mean_aggregation`, :func:`token_mean_aggregation`, :func:`constant_length_aggregation`,
    :func:`token_sum_aggregation`, :func:`sequence_sum_aggregation`).

    The loss is that of one micro-batch without gradient accumulation (TRL's ``policy_loss``). With ``k``
    accumulation steps TRL divides the ``grpo``, ``bnpo``, ``dr_grpo``, ``sapo`` and ``luspo`` losses by ``k``;
    ``dapo``, ``cispo`` and ``vespo`` are scaled through ``num_items_in_batch`` instead. TRL's ``bnpo`` divides by
    each process's own token count; over one SPMD batch this is the token count of the whole batch. The settings are
    Python values (static under ``jax.jit``), ``num_items_in_batch`` may be an array.

    Args:
        per_token_logps: ``[B, T]`` log-probabilities of the completion tokens under the policy being trained (the
            only input gradients flow through).
        old_per_token_logps: ``[B, T]`` under the policy that sampled them; ``None`` means on-policy
            (``stop_gradient(per_token_logps)``, TRL's shortcut when ``num_iterations == 1``).
        ref_per_token_logps: ``[B, T]`` under the reference model; required when ``beta != 0``.
        advantages: ``[B]`` (or ``[B, T]``).
        completion_mask: ``[B, T]``, 1 on the completion tokens that count.
        settings: the loss settings.
        num_items_in_batch: the :data:`NUM_ITEMS_NORMALISED_LOSSES` divisor. TRL's is ``max(loss tokens of the
            generation batch over all processes, 1) * gradient_accumulation_steps / steps_per_generation``; ``None``
            gives ``max(completion_mask.sum(), 1)`` (a batch on its own).
        per_token_entropy: ``[B, T]``; when given, its masked mean is returned as ``metrics["entropy"]``.
        entropy_mask: ``[B, T]`` (:func:`high_entropy_mask`); only these tokens get the policy loss (the KL term
            keeps every token, as in TRL). ``None`` keeps all. The entropy bonus is :func:`entropy_bonus`.
        importance_sampling_ratio: ``[B, T]`` or ``[B, 1]`` (:func:`sampler_importance_ratio`), or ``None``.

    Returns:
        ``(loss, metrics)``, float32. ``metrics`` has TRL's names: ``"kl"`` (``beta != 0``), ``"entropy"`` (when
        given), and the policy loss's own (``"clip_ratio/*"``, ``"cispo_clip_ratio"`` or ``"vespo/phi_seq_mean"``).
    """
    if settings.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"beta={settings.beta} needs ref_per_token_logps (the reference model's log-probabilities).")
    policy_loss, aggregation = POLICY_LOSSES[settings.loss_type]

    logps = per_token_logps.astype(jnp.float32)
    mask = completion_mask.astype(jnp.float32)
    advantages = advantages.astype(jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    old_logps = jax.lax.stop_gradient(logps) if old_per_token_logps is None else old_per_token_logps.astype(
        jnp.float32)

    log_ratio = logps - old_logps
    if settings.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]
    ratio = jnp.exp(log_weights)

    if settings.beta != 0.0:
        per_token_kl = tunix_common.compute_kl_divergence(logps, ref_per_token_logps, method="low_var_kl")
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio

    per_token_loss, policy_metrics = policy_loss(PolicyRatio(logps, log_ratio, ratio, advantages, mask), settings)
    if settings.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * _off_policy_mask(advantages, logps, old_logps, mask,
                                                           settings.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.astype(jnp.float32)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio.astype(jnp.float32)
    if settings.beta != 0.0:
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    per_token_loss = jnp.broadcast_to(per_token_loss, mask.shape)
    loss = aggregation(per_token_loss, mask, settings, num_items_in_batch)

    metrics: dict[str, jax.Array] = {}
    if settings.beta != 0.0:
        metrics["kl"] = batch_mean(per_token_kl, mask)
    if per_token_entropy is not None:
        metrics["entropy"] = batch_mean(per_token_entropy, mask)
    return loss, {**metrics, **policy_metrics}


# --- On Tunix modules ---------------------------------------------------------------------------------------------

def loss_mask(batch: dict):
    """The completion tokens the loss counts: ``completion_mask`` times ``tool_mask`` when the batch has one (0 on
    tokens the model did not write, such as tool results), as TRL's ``_compute_loss``. ``[B, C]``, numpy or JAX."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def completion_scores(family: Family, module: nnx.Module, batch: dict, temperature: float,
                      block_size: logprobs.BlockSize = "auto", *, with_entropies: bool = False,
                      compute_dtype=None, lm_head_in_float32: bool = False) -> logprobs.TokenScores:
    """``[B, C]`` log-probs (and entropies) of the completion tokens, TRL's ``_get_per_token_logps_and_entropies``.

    ``batch["input_ids"]`` is ``[B, P + C]`` (prompt left-padded, completion right-padded) with its
    ``attention_mask``; ``batch["completion_mask"]`` is ``[B, C]``. Logits are divided by the sampling
    ``temperature`` before the log-softmax, as TRL does; they are computed ``block_size`` completion positions at a
    time (:func:`logprobs.next_token_scores`). Positions outside the completion mask get 0.0.

    Args:
        with_entropies: also the (differentiable) entropies of the next-token distributions.
        compute_dtype: the decoder runs with its parameters cast to it (``None``: as they are).
        lm_head_in_float32: TRL's ``cast_lm_head_to_fp32``: the output head multiplies the float32 hidden states by
            the module's own (full-precision) head weights in float32, whatever ``compute_dtype`` is.
    """
    mask = batch["completion_mask"]
    length = mask.shape[1]
    decoder = cast_floating(module, compute_dtype)
    if lm_head_in_float32:
        hidden = logprobs.hidden_states(family, decoder, batch)[:, :-1][:, -length:].astype(jnp.float32)
        scores = logprobs.token_scores(
            hidden, batch["input_ids"][:, 1:][:, -length:], lambda block: family.logits_from_hidden(module, block),
            temperature=temperature, block_size=block_size, with_metrics=with_entropies)
    else:
        scores = logprobs.next_token_scores(family, decoder, batch, last=length, temperature=temperature,
                                            block_size=block_size, with_metrics=with_entropies)
    valid = mask.astype(bool)
    return scores._replace(log_probs=jnp.where(valid, scores.log_probs, 0.0),
                           entropies=None if scores.entropies is None else jnp.where(valid, scores.entropies, 0.0))


def completion_log_probs(family: Family, module: nnx.Module, batch: dict, temperature: float,
                         block_size: logprobs.BlockSize = "auto") -> jax.Array:
    """``[B, C]`` log-probs of the completion tokens (:func:`completion_scores`'s ``log_probs``)."""
    return completion_scores(family, module, batch, temperature, block_size).log_probs


def make_log_prob_pass(family: Family, temperature: float, lora: str = lora_runtime.EVAL,
                       compute_dtype=None, block_size: logprobs.BlockSize = "auto",
                       lm_head_in_float32: bool = False) -> Callable:
    """A jitted ``(module, batch) -> [B, C]`` log-prob pass (no dropout): old-policy log-probs with the
    adapter on (``lora="eval"``), or reference log-probs of the base weights (``lora="disabled"``).

    ``compute_dtype`` is the train step's (``bf16``): the stored log-probs then come from the same computation as
    the step's own, so an unchanged policy has a ratio of 1 and no KL to itself, as under TRL's autocast.
    ``block_size`` and ``lm_head_in_float32`` as in :func:`completion_scores`.
    """

    @nnx.jit
    def log_probs(module, batch):
        with lora_runtime.lora_mode(lora):
            return completion_scores(family, module, batch, temperature, block_size, compute_dtype=compute_dtype,
                                     lm_head_in_float32=lm_head_in_float32).log_probs

    return traced_cheaply(log_probs)


def token_normaliser(batch: dict) -> jax.Array:
    """TRL's ``num_items_in_batch`` of a micro-batch, from its :data:`NUM_ITEMS_COLUMN` (the same value on every
    row)."""
    return batch[NUM_ITEMS_COLUMN][0]


def grpo_step_loss(family: Family, settings: GRPOLossSettings,
                   block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]``, ``completion_mask`` ``[B, C]``, optionally
    ``tool_mask`` ``[B, C]`` (the loss then counts :func:`loss_mask`'s tokens only),
    ``advantages`` ``[B]``, optionally ``old_logps``/``ref_logps`` ``[B, C]`` and ``importance_sampling_ratio``
    ``[B, C]`` (:func:`sampler_importance_ratio`), the token normaliser :data:`NUM_ITEMS_COLUMN` of the
    :data:`NUM_ITEMS_NORMALISED_LOSSES` (the Trainer's ``num_items_in_batch`` argument is not read) and ``step_weight``
    (``1`` for per-micro-batch means, which accumulation then averages as TRL divides by the accumulation steps;
    ``1 / accumulation`` for token sums, which TRL adds up). ``block_size`` as in :func:`completion_log_probs`.

    With ``top_entropy_quantile < 1`` the policy loss counts only the tokens of :func:`high_entropy_mask`;
    with ``entropy_coef != 0`` the value is ``policy loss - entropy_coef * H * step_weight``
    (:func:`entropy_bonus`), which is TRL's ``- entropy_coef * H / accumulation`` for every loss type once the
    step divides by the summed weights. ``metrics`` then add TRL's ``policy_loss`` and ``entropy_coef``; ``entropy``
    is always there. With ``use_adaptive_entropy`` the coefficient is ``batch["entropy_coef"]`` (``[B]``, one value per
    row, like ``step_weight``), and ``metrics`` add ``policy_loss`` and the :data:`ADAPTIVE_ENTROPY_SUMS` the
    controller reads, not ``entropy_coef`` (the controller logs its own).

    With ``router_aux_loss_coef`` (a mixture-of-experts model) the value adds
    ``router_aux_loss_coef * aux_loss * step_weight``, the router load-balancing loss of the micro-batch's forward
    pass over its prompt and completion tokens (TRL's ``aux_loss / accumulation``), logged as ``aux_loss``.
    """
    token_sum = settings.loss_type in NUM_ITEMS_NORMALISED_LOSSES

    def loss(module, batch, num_items_in_batch=None):
        mask = loss_mask(batch)
        scores, aux_loss = router_loss.run_with_router_loss(
            family,
            lambda module: completion_scores(family, module, batch, settings.temperature, block_size,
                                             with_entropies=True, compute_dtype=settings.compute_dtype,
                                             lm_head_in_float32=settings.cast_lm_head_to_fp32),
            module, batch["attention_mask"], settings.router_aux_loss_coef)
        entropy_mask = None
        if settings.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(scores.entropies, mask, 1.0 - settings.top_entropy_quantile)
        value, metrics = grpo_loss(
            scores.log_probs, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask, settings,
            num_items_in_batch=token_normaliser(batch) if token_sum else None, per_token_entropy=scores.entropies,
            entropy_mask=entropy_mask, importance_sampling_ratio=batch.get("importance_sampling_ratio"))
        step_weight = batch["step_weight"][0]
        if settings.use_adaptive_entropy:
            metrics["policy_loss"] = value
            sums = entropy_sums(jax.lax.stop_gradient(scores.entropies), mask, entropy_mask)
            metrics.update(zip(ADAPTIVE_ENTROPY_SUMS, sums, strict=True))
            value = value - batch["entropy_coef"][0] * entropy_bonus(scores.entropies, mask,
                                                                     entropy_mask) * step_weight
        elif settings.entropy_coef != 0.0:
            metrics["policy_loss"] = value
            metrics["entropy_coef"] = jnp.float32(settings.entropy_coef)
            value = value - settings.entropy_coef * entropy_bonus(scores.entropies, mask, entropy_mask) * step_weight
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss * step_weight
            metrics["aux_loss"] = aux_loss
        return value, step_weight, metrics

    return loss
