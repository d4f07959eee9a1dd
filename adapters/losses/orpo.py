"""ORPO (``trl.experimental.orpo.ORPOTrainer``, TRL 1.16): the odds-ratio loss and the step loss with its metrics.

Beside :mod:`.dpo`; the forward pass is :func:`.pairwise.pair_scores`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from .dpo import masked_mean
from .pairwise import chosen_cross_entropy, pair_scores, stacked
from .settings import LossSettings, runtime_field

__all__ = ["ORPOLossSettings", "log1mexp", "odds_ratio_loss", "orpo_step_loss"]


@dataclass(frozen=True)
class ORPOLossSettings(LossSettings):
    """The settings of the ORPO loss, named as their ``ORPOConfig`` fields (:meth:`from_config`).

    Args:
        beta: ORPO's lambda, the weight of the odds-ratio term.
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router loss (0: not added).
    """

    beta: float = 0.1
    router_aux_loss_coef: float = runtime_field(0.0)


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, branching at ``-ln 2`` to avoid cancellation (TRL's ``log1mexp``)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def odds_ratio_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, settings: ORPOLossSettings
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """ORPO's odds-ratio term (TRL's ``ORPOTrainer.odds_ratio_loss``).

    With ``c``, ``r`` the mean completion log-probabilities of the chosen and rejected responses,
    ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))`` and ``ratio = log sigmoid(log_odds)``; the term is
    ``beta * ratio``, which the step subtracts from the chosen NLL.

    Args:
        chosen_logps, rejected_logps: ``[B]`` mean log-probabilities (< 0).
        settings: the loss settings (``beta``, ORPO's lambda).

    Returns:
        ``(losses [B], ratio [B], log_odds [B], (chosen_rewards, rejected_rewards))``: the rewards are
        ``beta * logps``, without gradient.
    """
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    ratio = jax.nn.log_sigmoid(log_odds)
    beta = settings.beta
    rewards = (beta * jax.lax.stop_gradient(chosen_logps), beta * jax.lax.stop_gradient(rejected_logps))
    return beta * ratio, ratio, log_odds, rewards


def orpo_step_loss(family: Family, settings: ORPOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The ORPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    ``value = nll - mean over pairs of beta * log sigmoid(log_odds)`` (:func:`odds_ratio_loss`), where ``nll`` is the
    token mean of the chosen rows' cross-entropy over prompt and response (TRL: "orpo chosen nll loss is computed
    over the full prompt and response"), plus ``router_aux_loss_coef * aux_loss`` when that is not 0. ``weight`` is 1
    when the micro-batch holds a pair, so accumulated micro-batches are averaged, as TRL's Trainer divides by the
    accumulation steps.
    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected`` (mean completion log-probabilities), ``logits/chosen``, ``logits/rejected``
    (over TRL's padded block, :func:`pair_scores`), ``nll_loss``, ``log_odds_ratio`` (mean ``ratio``) and
    ``log_odds_chosen`` (mean ``log_odds``).

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation.

    The batch holds ``dpo_data.collate_preference_batch``'s columns.
    """
    def loss(module, batch, num_items_in_batch=None):
        scores = pair_scores(family, module, batch, logits_positions=-1, block_size=block_size,
                             router_aux_loss_coef=settings.router_aux_loss_coef)
        nll = chosen_cross_entropy(scores, stacked(batch, "attention_mask")[:, 1:])
        losses, ratio, log_odds, (chosen_rewards, rejected_rewards) = odds_ratio_loss(
            scores.chosen_mean, scores.rejected_mean, settings)
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        value = nll - masked_mean(losses, real)
        metrics = {
            "rewards/chosen": masked_mean(chosen_rewards, real),
            "rewards/rejected": masked_mean(rejected_rewards, real),
            "rewards/accuracies": masked_mean((chosen_rewards > rejected_rewards).astype(jnp.float32), real),
            "rewards/margins": masked_mean(chosen_rewards - rejected_rewards, real),
            "logps/rejected": masked_mean(jax.lax.stop_gradient(scores.rejected_mean), real),
            "logps/chosen": masked_mean(jax.lax.stop_gradient(scores.chosen_mean), real),
            "logits/rejected": scores.logits_rejected,
            "logits/chosen": scores.logits_chosen,
            "nll_loss": jax.lax.stop_gradient(nll),
            "log_odds_ratio": jax.lax.stop_gradient(masked_mean(ratio, real)),
            "log_odds_chosen": jax.lax.stop_gradient(masked_mean(log_odds, real)),
        }
        if scores.aux_loss is not None:
            value = value + settings.router_aux_loss_coef * scores.aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss
