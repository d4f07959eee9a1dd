"""CPO (``trl.experimental.cpo.CPOTrainer``, TRL 1.16): the CPO / SimPO / AlphaPO losses and the step loss with its
metrics.

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

__all__ = ["CPO_LOSSES", "CPOLossSettings", "LOSS_TYPES", "cpo_loss", "cpo_step_loss"]


@dataclass(frozen=True)
class CPOLossSettings(LossSettings):
    """The settings of the CPO loss, named as their ``CPOConfig`` fields (:meth:`from_config`), defaults TRL's.

    Args:
        loss_type: one of :data:`LOSS_TYPES` (``"alphapo"`` is turned into ``"simpo"`` by ``CPOConfig``).
        beta: the temperature of the preference term.
        label_smoothing: ``eps`` of ``sigmoid`` and ``simpo``.
        simpo_gamma: SimPO's target margin.
        alpha: AlphaPO's reward shape (0: the log-probabilities themselves).
        cpo_alpha: the weight of the chosen responses' NLL (behaviour cloning).
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router loss (0: not added).
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0
    cpo_alpha: float = 1.0
    router_aux_loss_coef: float = runtime_field(0.0)


def smoothed_sigmoid_loss(logits: jax.Array, settings: CPOLossSettings) -> jax.Array:
    """``sigmoid``: ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``, ``eps = label_smoothing``."""
    beta, eps = settings.beta, settings.label_smoothing
    return -jax.nn.log_sigmoid(beta * logits) * (1 - eps) - jax.nn.log_sigmoid(-beta * logits) * eps


def simpo_loss(logits: jax.Array, settings: CPOLossSettings) -> jax.Array:
    """``simpo``: :func:`smoothed_sigmoid_loss` of ``z - simpo_gamma / beta``."""
    return smoothed_sigmoid_loss(logits - settings.simpo_gamma / settings.beta, settings)


def hinge_loss(logits: jax.Array, settings: CPOLossSettings) -> jax.Array:
    """``hinge``: ``relu(1 - beta z)``."""
    return jax.nn.relu(1 - settings.beta * logits)


def ipo_loss(logits: jax.Array, settings: CPOLossSettings) -> jax.Array:
    """``ipo``: ``(z - 1 / (2 beta))^2``."""
    return (logits - 1 / (2 * settings.beta)) ** 2


#: ``loss_type`` -> ``(z [B], settings) -> losses [B]``, the loss types ``CPOTrainer.cpo_loss`` computes.
CPO_LOSSES: dict[str, Callable[[jax.Array, CPOLossSettings], jax.Array]] = {
    "sigmoid": smoothed_sigmoid_loss, "hinge": hinge_loss, "ipo": ipo_loss, "simpo": simpo_loss,
}
#: The loss types ``CPOTrainer.cpo_loss`` computes (``"alphapo"`` is turned into ``"simpo"`` by ``CPOConfig``).
LOSS_TYPES: tuple[str, ...] = tuple(CPO_LOSSES)


def cpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, settings: CPOLossSettings
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-pair CPO loss (TRL's ``CPOTrainer.cpo_loss``).

    The rewards are ``c``, ``r`` (the policy's completion log-probabilities), or with ``alpha != 0`` AlphaPO's
    ``(1 - p^-alpha) / alpha = (1 - exp(-alpha * logp)) / alpha``; ``z = c - r``, and the losses are the
    ``loss_type``'s entry of :data:`CPO_LOSSES` on ``z``.

    Args:
        chosen_logps, rejected_logps: ``[B]`` completion log-probabilities (summed; mean for ``ipo`` and ``simpo``).
        settings: the loss settings.

    Returns:
        ``(losses [B], chosen_rewards [B], rejected_rewards [B])``, the rewards ``beta`` times the (transformed)
        log-probabilities, without gradient.

    Raises:
        ValueError: an unknown ``loss_type``, in TRL's words.
    """
    alpha, beta = settings.alpha, settings.beta
    if alpha != 0.0:
        chosen, rejected = ((1 - jnp.exp(-alpha * logps)) / alpha for logps in (chosen_logps, rejected_logps))
    else:
        chosen, rejected = chosen_logps, rejected_logps
    if settings.loss_type not in CPO_LOSSES:
        raise ValueError(f"Unknown loss type: {settings.loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', "
                         "'simpo']")
    losses = CPO_LOSSES[settings.loss_type](chosen - rejected, settings)
    return losses, beta * jax.lax.stop_gradient(chosen), beta * jax.lax.stop_gradient(rejected)


def cpo_step_loss(family: Family, settings: CPOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The CPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    ``value = mean over pairs of cpo_loss + cpo_alpha * nll``, where ``nll`` is the token mean of the chosen
    responses' cross-entropy (the behaviour-cloning term; 0 when ``cpo_alpha`` is 0) and the log-probabilities are
    summed over the completion (averaged for ``ipo`` and ``simpo``), plus ``router_aux_loss_coef * aux_loss`` when that
    is not 0. ``weight`` is 1 when the micro-batch holds a pair, so accumulated micro-batches are averaged.
    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected`` (every position of TRL's padded
    block, :func:`pair_scores`) and ``nll_loss``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation.

    The batch holds ``dpo_data.collate_preference_batch``'s columns, padded one column past its longest row.
    """
    average = settings.loss_type in ("ipo", "simpo")
    cpo_alpha, router_aux_loss_coef = settings.cpo_alpha, settings.router_aux_loss_coef

    def loss(module, batch, num_items_in_batch=None):
        scores = pair_scores(family, module, batch, logits_positions=0, block_size=block_size,
                             router_aux_loss_coef=router_aux_loss_coef)
        nll = (chosen_cross_entropy(scores, stacked(batch, "completion_mask")[:, 1:]) if cpo_alpha != 0
               else jnp.zeros(()))
        chosen, rejected = ((scores.chosen_mean, scores.rejected_mean) if average
                            else (scores.chosen_sum, scores.rejected_sum))
        losses, chosen_rewards, rejected_rewards = cpo_loss(chosen, rejected, settings)
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        value = masked_mean(losses, real) + cpo_alpha * nll
        metrics = {
            "rewards/chosen": masked_mean(chosen_rewards, real),
            "rewards/rejected": masked_mean(rejected_rewards, real),
            "rewards/accuracies": masked_mean((chosen_rewards > rejected_rewards).astype(jnp.float32), real),
            "rewards/margins": masked_mean(chosen_rewards - rejected_rewards, real),
            "logps/rejected": masked_mean(jax.lax.stop_gradient(rejected), real),
            "logps/chosen": masked_mean(jax.lax.stop_gradient(chosen), real),
            "logits/rejected": scores.logits_rejected,
            "logits/chosen": scores.logits_chosen,
            "nll_loss": jax.lax.stop_gradient(nll),
        }
        if scores.aux_loss is not None:
            value = value + router_aux_loss_coef * scores.aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss
