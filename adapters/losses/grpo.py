"""GRPO on Tunix modules: completion log-probs of a prompt+completion batch and the jitted step loss.

The rollout (generation) is :mod:`adapters.sampling`; advantages and the loss formulas are
:mod:`adapters.rl_math` (TRL's numerics on Tunix's common ops). This module joins them to the
Tunix forward pass with fixed shapes: prompts left-padded to ``P`` tokens, completions
right-padded to ``C = max_completion_length``, so one program serves every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..families import Family
from ..lora import runtime as lora_runtime
from ..runtime.tracing import traced_cheaply
from ..training.train_step import cast_floating
from . import logprobs as chunked_logprobs
from . import rl_math
from . import router as router_loss

#: Loss types whose micro-batch loss is a sum over tokens divided by the generation batch's token count
#: (TRL's ``num_items_in_batch`` normaliser); the others are per-micro-batch means.
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")

#: The step-loss metrics an adaptive entropy controller reads (``GRPOLossSettings.adaptive_entropy``): a micro-batch's
#: entropy summed over the entropy bonus's tokens, and their count (:func:`rl_math.entropy_sums`). Not logged.
ADAPTIVE_ENTROPY_SUMS = ("adaptive_entropy/entropy_sum", "adaptive_entropy/tokens")


def loss_mask(batch: dict):
    """The completion tokens the loss counts: ``completion_mask`` times ``tool_mask`` when the batch has one (0 on
    tokens the model did not write, such as tool results), as TRL's ``_compute_loss``. ``[B, C]``, numpy or JAX."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def completion_scores(family: Family, module: nnx.Module, batch: dict, temperature: float,
                      block_size: chunked_logprobs.BlockSize = "auto", *, with_entropies: bool = False,
                      compute_dtype=None, lm_head_in_float32: bool = False) -> chunked_logprobs.TokenScores:
    """``[B, C]`` log-probs (and entropies) of the completion tokens, TRL's ``_get_per_token_logps_and_entropies``.

    ``batch["input_ids"]`` is ``[B, P + C]`` (prompt left-padded, completion right-padded) with its
    ``attention_mask``; ``batch["completion_mask"]`` is ``[B, C]``. Logits are divided by the sampling
    ``temperature`` before the log-softmax, as TRL does; they are computed ``block_size`` completion positions at a
    time (:func:`chunked_logprobs.next_token_scores`). Positions outside the completion mask get 0.0.

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
        hidden = chunked_logprobs.hidden_states(family, decoder, batch)[:, :-1][:, -length:].astype(jnp.float32)
        scores = chunked_logprobs.token_scores(
            hidden, batch["input_ids"][:, 1:][:, -length:], lambda block: family.logits_from_hidden(module, block),
            temperature=temperature, block_size=block_size, with_metrics=with_entropies)
    else:
        scores = chunked_logprobs.next_token_scores(family, decoder, batch, last=length, temperature=temperature,
                                                    block_size=block_size, with_metrics=with_entropies)
    valid = mask.astype(bool)
    return scores._replace(log_probs=jnp.where(valid, scores.log_probs, 0.0),
                           entropies=None if scores.entropies is None else jnp.where(valid, scores.entropies, 0.0))


def completion_log_probs(family: Family, module: nnx.Module, batch: dict, temperature: float,
                         block_size: chunked_logprobs.BlockSize = "auto") -> jax.Array:
    """``[B, C]`` log-probs of the completion tokens (:func:`completion_scores`'s ``log_probs``)."""
    return completion_scores(family, module, batch, temperature, block_size).log_probs


def make_log_prob_pass(family: Family, temperature: float, lora: str = lora_runtime.EVAL,
                       compute_dtype=None, block_size: chunked_logprobs.BlockSize = "auto",
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


@dataclass(frozen=True)
class GRPOLossSettings:
    """The static settings of :func:`rl_math.grpo_loss` (``GRPOConfig`` fields)."""

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    max_completion_length: int
    temperature: float
    use_bias_correction_kl: bool
    off_policy_mask_threshold: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    #: TRL's ``use_adaptive_entropy``: the coefficient is each batch's ``entropy_coef`` column instead of
    #: ``entropy_coef`` (so it changes without a new program), and the metrics carry :data:`ADAPTIVE_ENTROPY_SUMS`.
    adaptive_entropy: bool = False
    #: With ``lm_head_in_float32`` the loss casts the decoder to this dtype itself (the train step then casts
    #: nothing), so the head reads the full-precision weights; otherwise ``None`` (the train step casts).
    compute_dtype: object = None
    lm_head_in_float32: bool = False
    #: The weight of a mixture-of-experts model's router load-balancing loss (0: not added).
    router_aux_loss_coef: float = 0.0


def grpo_step_loss(family: Family, settings: GRPOLossSettings,
                   block_size: chunked_logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]``, ``completion_mask`` ``[B, C]``, optionally
    ``tool_mask`` ``[B, C]`` (the loss then counts :func:`loss_mask`'s tokens only),
    ``advantages`` ``[B]``, optionally ``old_logps``/``ref_logps`` ``[B, C]`` and ``importance_sampling_ratio``
    ``[B, C]`` (:func:`rl_math.sampler_importance_ratio`), and per-row constants
    ``num_items`` (the token normaliser of :data:`TOKEN_SUM_LOSSES`) and ``step_weight`` (``1`` for
    per-micro-batch means, which accumulation then averages as TRL divides by the accumulation
    steps; ``1 / accumulation`` for token sums, which TRL adds up). ``block_size`` as in
    :func:`completion_log_probs`.

    With ``top_entropy_quantile < 1`` the policy loss counts only the tokens of :func:`rl_math.high_entropy_mask`;
    with ``entropy_coef != 0`` the value is ``policy loss - entropy_coef * H * step_weight``
    (:func:`rl_math.entropy_bonus`), which is TRL's ``- entropy_coef * H / accumulation`` for every loss type once the
    step divides by the summed weights. ``metrics`` then add TRL's ``policy_loss`` and ``entropy_coef``; ``entropy``
    is always there. With ``adaptive_entropy`` the coefficient is ``batch["entropy_coef"]`` (``[B]``, one value per
    row, like ``step_weight``), and ``metrics`` add ``policy_loss`` and the :data:`ADAPTIVE_ENTROPY_SUMS` the
    controller reads, not ``entropy_coef`` (the controller logs its own).

    With ``router_aux_loss_coef`` (a mixture-of-experts model) the value adds
    ``router_aux_loss_coef * aux_loss * step_weight``, the router load-balancing loss of the micro-batch's forward
    pass over its prompt and completion tokens (TRL's ``aux_loss / accumulation``), logged as ``aux_loss``.
    """

    def loss(module, batch, num_items_in_batch=None):
        mask = loss_mask(batch)
        scores, aux_loss = router_loss.run_with_router_loss(
            family,
            lambda module: completion_scores(family, module, batch, settings.temperature, block_size,
                                             with_entropies=True, compute_dtype=settings.compute_dtype,
                                             lm_head_in_float32=settings.lm_head_in_float32),
            module, batch["attention_mask"], settings.router_aux_loss_coef)
        entropy_mask = None
        if settings.top_entropy_quantile < 1.0:
            entropy_mask = rl_math.high_entropy_mask(scores.entropies, mask, 1.0 - settings.top_entropy_quantile)
        value, metrics = rl_math.grpo_loss(
            scores.log_probs, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask,
            loss_type=settings.loss_type, beta=settings.beta, epsilon_low=settings.epsilon_low,
            epsilon_high=settings.epsilon_high, delta=settings.delta,
            importance_sampling_level=settings.importance_sampling_level,
            max_completion_length=settings.max_completion_length,
            num_items_in_batch=batch["num_items"][0] if settings.loss_type in TOKEN_SUM_LOSSES else None,
            use_bias_correction_kl=settings.use_bias_correction_kl,
            off_policy_mask_threshold=settings.off_policy_mask_threshold,
            sapo_temperature_pos=settings.sapo_temperature_pos, sapo_temperature_neg=settings.sapo_temperature_neg,
            vespo_k_pos=settings.vespo_k_pos, vespo_lambda_pos=settings.vespo_lambda_pos,
            vespo_k_neg=settings.vespo_k_neg, vespo_lambda_neg=settings.vespo_lambda_neg,
            per_token_entropy=scores.entropies, entropy_mask=entropy_mask,
            importance_sampling_ratio=batch.get("importance_sampling_ratio"))
        step_weight = batch["step_weight"][0]
        if settings.adaptive_entropy:
            metrics["policy_loss"] = value
            sums = rl_math.entropy_sums(jax.lax.stop_gradient(scores.entropies), mask, entropy_mask)
            metrics.update(zip(ADAPTIVE_ENTROPY_SUMS, sums, strict=True))
            value = value - batch["entropy_coef"][0] * rl_math.entropy_bonus(scores.entropies, mask,
                                                                             entropy_mask) * step_weight
        elif settings.entropy_coef != 0.0:
            metrics["policy_loss"] = value
            metrics["entropy_coef"] = jnp.float32(settings.entropy_coef)
            value = value - settings.entropy_coef * rl_math.entropy_bonus(scores.entropies, mask,
                                                                          entropy_mask) * step_weight
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss * step_weight
            metrics["aux_loss"] = aux_loss
        return value, step_weight, metrics

    return loss


def rloo_step_loss(family: Family, temperature: float, epsilon_low: float, epsilon_high: float,
                   block_size: chunked_logprobs.BlockSize = "auto", router_aux_loss_coef: float = 0.0) -> Callable:
    """RLOO's ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]``, ``completion_mask`` ``[B, C]``, optionally
    ``tool_mask`` ``[B, C]``, ``advantages`` ``[B]`` and ``old_logps`` ``[B]`` (the sampling policy's summed
    log-probabilities of the :func:`loss_mask` tokens). The value is :func:`rl_math.rloo_loss` of the micro-batch on
    the summed log-probabilities of the same tokens, a mean over its sequences (weight 1: accumulated micro-batches
    are averaged, as TRL's Trainer divides by the accumulation steps); ``metrics`` add TRL's ``entropy``, the mean
    over those tokens. With ``router_aux_loss_coef`` (a mixture-of-experts model) the value adds
    ``router_aux_loss_coef * aux_loss`` of the micro-batch's forward pass, logged as ``aux_loss``, as TRL does.
    """

    def loss(module, batch, num_items_in_batch=None):
        mask = loss_mask(batch)
        scores, aux_loss = router_loss.run_with_router_loss(
            family,
            lambda module: completion_scores(family, module, batch, temperature, block_size, with_entropies=True),
            module, batch["attention_mask"], router_aux_loss_coef)
        value, metrics = rl_math.rloo_loss((scores.log_probs * mask).sum(-1), batch["old_logps"],
                                           batch["advantages"], epsilon_low, epsilon_high)
        metrics["entropy"] = (scores.entropies * mask).sum() / jnp.maximum(mask.sum(), 1).astype(jnp.float32)
        if aux_loss is not None:
            value = value + router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        return value, jnp.float32(1.0), metrics

    return loss


def completion_mask(tokens: np.ndarray, eos_token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """TRL's completion mask: 1 up to and including the first end token of each row, 0 after.

    Returns:
        ``(mask [B, C] int32, ended [B] bool)``.
    """
    is_end = np.isin(tokens, np.asarray(eos_token_ids, dtype=tokens.dtype))
    ended = is_end.any(axis=1)
    first_end = np.where(ended, is_end.argmax(axis=1), tokens.shape[1])
    mask = (np.arange(tokens.shape[1])[None, :] <= first_end[:, None]).astype(np.int32)
    return mask, ended
