"""CPO (``trl.experimental.cpo.CPOTrainer``, TRL 1.16): the CPO / SimPO / AlphaPO losses and the step loss with its
metrics.

Beside :mod:`adapters.dpo_loss`; the forward pass is :func:`adapters.pairwise_scores.pair_scores`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import logprobs as chunked_logprobs
from .dpo import masked_mean
from .pairwise import chosen_cross_entropy, pair_scores, stacked

__all__ = ["LOSS_TYPES", "cpo_loss", "cpo_step_loss"]

#: The loss types ``CPOTrainer.cpo_loss`` computes (``"alphapo"`` is turned into ``"simpo"`` by ``CPOConfig``).
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "simpo")


def cpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, *, loss_type: str, beta: float,
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, alpha: float = 0.0
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-pair CPO loss (TRL's ``CPOTrainer.cpo_loss``).

    The rewards are ``c``, ``r`` (the policy's completion log-probabilities), or with ``alpha != 0`` AlphaPO's
    ``(1 - p^-alpha) / alpha = (1 - exp(-alpha * logp)) / alpha``; ``z = c - r`` (SimPO: ``z - simpo_gamma / beta``).

    - ``sigmoid`` and ``simpo``: ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``, ``eps =
      label_smoothing``
    - ``hinge``: ``relu(1 - beta z)``
    - ``ipo``: ``(z - 1 / (2 beta))^2``

    Args:
        chosen_logps, rejected_logps: ``[B]`` completion log-probabilities (summed; mean for ``ipo`` and ``simpo``).
        loss_type: one of :data:`LOSS_TYPES`.
        beta, label_smoothing, simpo_gamma, alpha: the ``CPOConfig`` fields.

    Returns:
        ``(losses [B], chosen_rewards [B], rejected_rewards [B])``, the rewards ``beta`` times the (transformed)
        log-probabilities, without gradient.

    Raises:
        ValueError: an unknown ``loss_type``, in TRL's words.
    """
    if alpha != 0.0:
        chosen, rejected = ((1 - jnp.exp(-alpha * logps)) / alpha for logps in (chosen_logps, rejected_logps))
    else:
        chosen, rejected = chosen_logps, rejected_logps
    logits = chosen - rejected
    if loss_type in ("simpo", "sigmoid"):
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        losses = (-jax.nn.log_sigmoid(beta * logits) * (1 - label_smoothing)
                  - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', 'simpo']")
    return losses, beta * jax.lax.stop_gradient(chosen), beta * jax.lax.stop_gradient(rejected)


def cpo_step_loss(family, *, loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                  alpha: float = 0.0, cpo_alpha: float = 1.0, router_aux_loss_coef: float = 0.0,
                  block_size: chunked_logprobs.BlockSize = "auto") -> Callable:
    """The CPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._loss``).

    ``value = mean over pairs of cpo_loss + cpo_alpha * nll``, where ``nll`` is the token mean of the chosen
    responses' cross-entropy (the behaviour-cloning term; 0 when ``cpo_alpha`` is 0) and the log-probabilities are
    summed over the completion (averaged for ``ipo`` and ``simpo``), plus ``router_aux_loss_coef * aux_loss`` when it
    is not 0. ``weight`` is 1 when the micro-batch holds a pair, so accumulated micro-batches are averaged.
    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected`` (every position of TRL's padded
    block, :func:`pair_scores`) and ``nll_loss``.

    Args:
        family: the model's adapter family (its forward pass).
        loss_type, beta, label_smoothing, simpo_gamma, alpha, cpo_alpha: the ``CPOConfig`` fields.
        router_aux_loss_coef: the weight of a mixture-of-experts model's router loss (0: not added).
        block_size: positions per block of the log-prob computation.

    The batch holds ``dpo_data.collate_preference_batch``'s columns, padded one column past its longest row.
    """
    average = loss_type in ("ipo", "simpo")
    settings = dict(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
                    alpha=alpha)

    def loss(module, batch, num_items_in_batch=None):
        scores = pair_scores(family, module, batch, logits_positions=0, block_size=block_size,
                             router_aux_loss_coef=router_aux_loss_coef)
        nll = (chosen_cross_entropy(scores, stacked(batch, "completion_mask")[:, 1:]) if cpo_alpha != 0
               else jnp.zeros(()))
        chosen, rejected = ((scores.chosen_mean, scores.rejected_mean) if average
                            else (scores.chosen_sum, scores.rejected_sum))
        losses, chosen_rewards, rejected_rewards = cpo_loss(chosen, rejected, **settings)
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
