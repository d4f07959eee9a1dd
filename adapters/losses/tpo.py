"""TPO (``trl.experimental.tpo.TPOTrainer``, TRL 1.16): Triple Preference Optimization's step loss with TRL's metrics.

TPO scores three responses to one prompt in one forward pass: the chosen and rejected ones enter a reference-free
preference loss on the policy's own log-probabilities (TRL's four loss types: the CPO formulas of :mod:`.cpo`,
``"tpo-l"`` being SimPO's shifted sigmoid with the margin ``tpo_l_gamma``), and the gold ``reference`` response a
negative log-likelihood term weighted by ``tpo_alpha``. Shapes: ``B`` triples, ``T`` positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from .cpo import CPO_LOSSES, CPOLossSettings
from .dpo import masked_mean
from .settings import LossSettings

__all__ = ["LOSS_TYPES", "RESPONSES", "TPOLossSettings", "check_loss_type", "responses_scored", "tpo_loss",
           "tpo_step_loss"]

#: ``loss_type`` -> the :data:`.cpo.CPO_LOSSES` entry TRL's TPO formula equals (``"tpo-l"`` is SimPO's).
_CPO_LOSS_OF: dict[str, str] = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "tpo-l": "simpo"}
#: The loss types ``TPOTrainer`` computes.
LOSS_TYPES: tuple[str, ...] = tuple(_CPO_LOSS_OF)
#: The loss types that average the completion log-probabilities over the completion's tokens (the others sum them).
LENGTH_NORMALISED: tuple[str, ...] = ("ipo", "tpo-l")
#: The responses of a batch, in the order their rows are stacked (TRL's collator order).
RESPONSES: tuple[str, ...] = ("chosen", "rejected", "reference")


@dataclass(frozen=True)
class TPOLossSettings(LossSettings):
    """The settings of the TPO loss, named as their ``TPOConfig`` fields (:meth:`from_config`), defaults TRL's.

    Args:
        loss_type: one of :data:`LOSS_TYPES`.
        beta: the temperature of the preference term (``tau`` for ``ipo``).
        label_smoothing: ``eps`` of ``sigmoid`` and ``tpo-l``.
        tpo_alpha: the weight of the gold response's NLL (0: the reference rows are not scored at all).
        tpo_l_gamma: the target reward margin of ``tpo-l``.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.01
    label_smoothing: float = 0.0
    tpo_alpha: float = 1.0
    tpo_l_gamma: float = 0.5

    def preference_settings(self) -> CPOLossSettings:
        """The CPO settings whose loss is TPO's preference term (``tpo-l``: SimPO with ``simpo_gamma=tpo_l_gamma``)."""
        return CPOLossSettings(loss_type=_CPO_LOSS_OF[self.loss_type], beta=self.beta,
                               label_smoothing=self.label_smoothing, simpo_gamma=self.tpo_l_gamma)


def check_loss_type(loss_type: str) -> None:
    """Raises TRL's ``ValueError`` for a ``loss_type`` not in :data:`LOSS_TYPES` (TRL raises it in the first step)."""
    if loss_type not in _CPO_LOSS_OF:
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', 'tpo-l']")


def tpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, settings: TPOLossSettings) -> jax.Array:
    """TRL's per-triple preference loss of ``z = chosen_logps - rejected_logps`` (no reference policy: TPO's
    "reference" is the gold response of the NLL term).

    Args:
        chosen_logps, rejected_logps: ``[B]`` completion log-probabilities (summed; averaged for ``ipo`` and
            ``tpo-l``).
        settings: the loss settings.

    Returns:
        ``[B]`` losses.

    Raises:
        ValueError: an unknown ``loss_type``, in TRL's words.
    """
    check_loss_type(settings.loss_type)
    preference = settings.preference_settings()
    return CPO_LOSSES[preference.loss_type](chosen_logps - rejected_logps, preference)


def responses_scored(settings: TPOLossSettings) -> tuple[str, ...]:
    """The responses whose rows a batch holds and the step scores: the reference only when ``tpo_alpha`` is not 0
    (TRL's collator then drops it, sparing a third of the forward pass)."""
    return RESPONSES if settings.tpo_alpha != 0.0 else RESPONSES[:2]


def tpo_step_loss(family: Family, settings: TPOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The TPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    One forward pass over the chosen rows stacked on the rejected rows and, with ``tpo_alpha`` not 0, the reference
    rows (TRL's layout). ``value = mean over triples of tpo_loss + tpo_alpha * nll``, ``nll`` the token mean of the
    gold responses' cross-entropy over the micro-batch; rows padding a partial batch (all-zero masks) are left out,
    and ``weight`` is 1 when the micro-batch holds a triple, so accumulated micro-batches are averaged, as TRL
    divides by the accumulation steps. TRL adds no router loss.

    ``metrics`` are TRL's: ``entropy`` (over every scored completion token, the gold ones included),
    ``num_tokens`` (the micro-batch's tokens; the trainer makes it a running total), ``logits/chosen``,
    ``logits/rejected``, ``mean_token_accuracy`` (chosen tokens), ``rewards/chosen``, ``rewards/rejected``
    (``beta`` times the log-probabilities), ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation.

    The batch holds ``<response>_input_ids``, ``_attention_mask`` and ``_completion_mask`` ``[B, T]`` for each of
    :func:`responses_scored`.
    """
    responses = responses_scored(settings)
    average = settings.loss_type in LENGTH_NORMALISED

    def loss(module, batch, num_items_in_batch=None):
        def stacked(name: str) -> jax.Array:
            return jnp.concatenate([batch[f"{response}_{name}"] for response in responses])

        scores = logprobs.next_token_scores(
            family, module, {"input_ids": stacked("input_ids"), "attention_mask": stacked("attention_mask")},
            with_metrics=True, block_size=block_size)
        mask = stacked("completion_mask")[:, 1:].astype(jnp.float32)
        per_token = jnp.where(mask > 0, scores.log_probs, 0.0)
        sums = per_token.sum(-1)
        logps = sums / jnp.maximum(mask.sum(-1), 1.0) if average else sums
        branch_logps, branch_masks = jnp.split(logps, len(responses)), jnp.split(mask, len(responses))
        chosen, rejected = branch_logps[0], branch_logps[1]
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        value = masked_mean(tpo_loss(chosen, rejected, settings), real)
        if settings.tpo_alpha != 0.0:
            gold_mask = branch_masks[2]
            nll = -jnp.split(per_token, 3)[2].sum() / jnp.maximum(gold_mask.sum(), 1.0)
            value = value + settings.tpo_alpha * nll
        chosen_rewards, rejected_rewards = (settings.beta * jax.lax.stop_gradient(v) for v in (chosen, rejected))
        logit_means, top1 = jnp.split(scores.logit_means, len(responses)), jnp.split(scores.top1, len(responses))
        metrics = {
            "entropy": masked_mean(scores.entropies, mask),
            "num_tokens": stacked("attention_mask").sum().astype(jnp.float32),
            "logits/chosen": masked_mean(logit_means[0], branch_masks[0]),
            "logits/rejected": masked_mean(logit_means[1], branch_masks[1]),
            "mean_token_accuracy": masked_mean(top1[0], branch_masks[0]),
            "rewards/chosen": masked_mean(chosen_rewards, real),
            "rewards/rejected": masked_mean(rejected_rewards, real),
            "rewards/accuracies": masked_mean((chosen_rewards > rejected_rewards).astype(jnp.float32), real),
            "rewards/margins": masked_mean(chosen_rewards - rejected_rewards, real),
            "logps/chosen": masked_mean(jax.lax.stop_gradient(chosen), real),
            "logps/rejected": masked_mean(jax.lax.stop_gradient(rejected), real),
        }
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss
