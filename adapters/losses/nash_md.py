"""Nash-MD (``trl.experimental.nash_md.NashMDTrainer``, TRL 1.0.0): the REINFORCE step loss on the policy's own
completions, judged against completions of the policy/reference geometric mixture, with TRL 1.0.0's metrics.

A micro-batch holds ``B`` rows, one per prompt: the policy's completion of it (prompt left-padded, completion
right-padded, ``position_ids`` ``0 .. T - 1`` as TRL's forward pass takes them) and what was learnt from the mixture's
completion of the same prompt. Columns: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, P + C]``;
``completion_mask`` and ``completion_window`` ``[B, C]`` (equal: every sum runs over the completion mask, as TRL zeroes
the padding); ``ref_logps`` ``[B, C]`` (the reference's log-probabilities, :func:`.online_dpo.make_reference_pass`);
``probability`` ``[B]`` (that the policy's completion beats the mixture's: the judge's score, or the sigmoid of the
reward difference); ``contain_eos`` and ``mixture_contain_eos``, ``rewards`` and ``mixture_rewards``, ``beta`` and
``mixture_coef`` ``[B]``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from .grpo import completion_scores
from .online_dpo import window_view

__all__ = ["nash_md_losses", "nash_md_step_loss"]


def nash_md_losses(log_probs: jax.Array, ref_log_probs: jax.Array, probability: jax.Array, beta: jax.Array | float
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TRL 1.0.0's ``NashMDTrainer._compute_losses``: ``(loss, score [B], kl [B])``.

    With ``s`` the policy's summed log-probability of its completion and ``r = stop_gradient(log_probs -
    ref_log_probs)`` the per-token log-ratio, ``score = (probability - 0.5) s`` (REINFORCE with 0.5 as the control
    variate), ``kl = sum(r)`` (the logged KL estimate) and the loss is ``mean(beta * sum(r * log_probs) - score)``
    (the KL's REINFORCE gradient).

    Args:
        log_probs: ``[B, C]`` the policy's per-token log-probabilities of its completions, 0 on padding.
        ref_log_probs: ``[B, C]`` the reference's, 0 on padding.
        probability: ``[B]`` that each policy completion beats the mixture's.
        beta: the KL weight.
    """
    score = (probability - 0.5) * log_probs.sum(-1)
    log_ratio = jax.lax.stop_gradient(log_probs - ref_log_probs)
    kl = log_ratio.sum(-1)
    loss = beta * (log_ratio * log_probs).sum(-1) - score
    return loss.mean(), score, kl


def nash_md_step_loss(family: Family, gradient_accumulation_steps: int, scored: bool,
                      block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``: TRL 1.0.0's
    ``NashMDTrainer.training_step`` on one micro-batch (:func:`nash_md_losses` on the untempered policy's
    log-probabilities). ``weight`` is ``1 / gradient_accumulation_steps``: TRL back-propagates each micro-batch's mean
    loss, so the gradients of an accumulation window add up.

    ``metrics`` are TRL 1.0.0's, means over the rows: ``loss/score``, ``loss/kl``, ``logps/chosen`` (the policy's
    summed log-probability ``s``), ``logps/rejected`` (the reference's ``s_ref``), ``rewards/probabilities``,
    ``objective/entropy`` (``-s``), ``rewards/margins`` (``s - s_ref``), ``rewards/accuracies`` (``s > s_ref``),
    ``val/model_contain_eos_token``, ``val/ref_contain_eos_token`` (the mixture's completions), ``beta``,
    ``mixture_coef``, and with reward scores (``scored`` set) ``rewards/chosen`` and ``rewards/rejected`` (the
    policy's and the mixture's scores).

    Args:
        family: the model's adapter family (its forward pass).
        gradient_accumulation_steps: micro-batches per optimizer step.
        scored: whether ``probability`` came from reward scores (the ``rewards`` columns), not from a judge.
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`).
    """
    weight = jnp.float32(1.0 / gradient_accumulation_steps)

    def loss(module, batch, num_items_in_batch=None):
        mask = batch["completion_mask"].astype(jnp.float32)
        log_probs = completion_scores(family, module, window_view(batch), 1.0, block_size).log_probs * mask
        ref_log_probs = batch["ref_logps"] * mask
        probability, beta = batch["probability"], batch["beta"][0]
        value, score, kl = nash_md_losses(log_probs, ref_log_probs, probability, beta)
        sums, ref_sums = jax.lax.stop_gradient(log_probs).sum(-1), ref_log_probs.sum(-1)
        margin = sums - ref_sums
        metrics = {"loss/score": jax.lax.stop_gradient(score).mean(),
                   "loss/kl": kl.mean(),
                   "logps/chosen": sums.mean(),
                   "logps/rejected": ref_sums.mean(),
                   "rewards/probabilities": probability.mean(),
                   "objective/entropy": -sums.mean(),
                   "rewards/margins": margin.mean(),
                   "rewards/accuracies": (margin > 0).astype(jnp.float32).mean(),
                   "val/model_contain_eos_token": batch["contain_eos"].mean(),
                   "val/ref_contain_eos_token": batch["mixture_contain_eos"].mean(),
                   "beta": beta,
                   "mixture_coef": batch["mixture_coef"][0]}
        if scored:
            metrics.update({"rewards/chosen": batch["rewards"].mean(),
                            "rewards/rejected": batch["mixture_rewards"].mean()})
        return value, weight, metrics

    return loss
