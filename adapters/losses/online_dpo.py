"""Online DPO (``trl.experimental.online_dpo.OnlineDPOTrainer``, TRL 1.16): the step loss on the policy's own ranked
completions, with TRL's metrics.

Each micro-batch holds ``2B`` sampled completions of ``B`` prompts, ordered chosen first then rejected (the reward
functions ranked each prompt's two). TRL scores a completion with the log-probabilities of its tokens under the
untempered policy, summed over the completion mask (up to and with the first end token); the loss is DPO's
(:func:`.dpo.dpo_loss`) on those sums: ``sigmoid`` as in ``DPOTrainer``, ``ipo`` without DPO's length normalisation
(each completion counts as length 1). TRL's ``objective/kl`` and ``objective/entropy`` sum the per-token values over
every position of its generation window, padding after an end token included; the ``completion_window`` column marks
those positions, and the batch carries ``position_ids`` ``0 .. T - 1`` (the model's default positions in TRL's
forward pass), so the padding positions score as in TRL.

Columns of a micro-batch (``2B`` rows, ``C`` completion positions): ``input_ids``, ``attention_mask``,
``position_ids`` ``[2B, P + C]``; ``completion_mask`` and ``completion_window`` ``[2B, C]``; ``ref_logps`` ``[2B, C]``
(the reference's log-probabilities over the window, :func:`make_reference_pass`); ``rewards``, ``contain_eos`` and
``beta`` ``[2B]``; an image batch also ``images`` (the model's, one entry per row) and ``token_type_ids``
``[2B, P + C]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from ..lora import runtime as lora_runtime
from . import logprobs
from .dpo import DPOLossSettings, dpo_loss
from .grpo import completion_scores, make_log_prob_pass
from .settings import LossSettings

__all__ = ["ONLINE_DPO_LOSS_TYPES", "VISION_COLUMNS", "OnlineDPOLossSettings", "check_loss_type", "make_reference_pass",
           "online_dpo_step_loss", "window_view"]

#: The columns of an image batch the forward pass reads (the prompts' images and token types).
VISION_COLUMNS: tuple[str, ...] = ("images", "token_type_ids")

#: ``OnlineDPOConfig.loss_type`` values (TRL 1.16's).
ONLINE_DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


def check_loss_type(loss_type: str) -> None:
    """Raises TRL's ``NotImplementedError`` for a loss type ``OnlineDPOTrainer`` does not implement."""
    if loss_type not in ONLINE_DPO_LOSS_TYPES:
        raise NotImplementedError(f"invalid loss type {loss_type}")


@dataclass(frozen=True)
class OnlineDPOLossSettings(LossSettings):
    """The settings of the online DPO loss, named as their ``OnlineDPOConfig`` fields (:meth:`from_config`).

    ``beta`` is not here: it may change with the epoch (a list in the config), so each micro-batch carries it as a
    column and one compiled step serves every value.

    Args:
        loss_type: ``"sigmoid"`` or ``"ipo"``.
        gradient_accumulation_steps: TRL back-propagates each micro-batch's mean loss as it is, so the gradients of
            an accumulation window add up; each micro-batch weighs ``1 / gradient_accumulation_steps`` in the step's
            normaliser to give that sum (the trainer logs the mean loss, as TRL).

    Raises:
        NotImplementedError: another ``loss_type`` (TRL's message).
    """

    loss_type: str = "sigmoid"
    gradient_accumulation_steps: int = 1

    def __post_init__(self) -> None:
        check_loss_type(self.loss_type)


def window_view(batch: dict) -> dict:
    """The batch as :func:`.grpo.completion_scores` reads it: its tokens and positions (and an image batch's
    ``images`` and ``token_type_ids``), the generation window as the completion mask (per-token log-probabilities are
    kept over the whole window, padding included)."""
    view = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "position_ids": batch["position_ids"], "completion_mask": batch["completion_window"]}
    return {**view, **{name: batch[name] for name in VISION_COLUMNS if name in batch}}


def make_reference_pass(family: Family, lora: str = lora_runtime.EVAL, compute_dtype=None) -> Callable:
    """A jitted ``(module, batch) -> [2B, C]`` pass: the reference's per-token log-probabilities over the generation
    window (untempered, no dropout), with the adapter in mode ``lora`` (``"disabled"``: the base weights)."""
    scores = make_log_prob_pass(family, 1.0, lora, compute_dtype)
    return lambda module, batch: scores(module, window_view(batch))


def online_dpo_step_loss(family: Family, settings: OnlineDPOLossSettings,
                         block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``: TRL's
    ``OnlineDPOTrainer.training_step`` on one micro-batch.

    With ``c``, ``r`` the policy's summed completion log-probabilities of the chosen and rejected halves and ``c_ref``,
    ``r_ref`` the reference's, ``d = (c - r) - (c_ref - r_ref)``: ``sigmoid`` is ``-log sigmoid(beta d)``, ``ipo``
    ``(d - 1 / (2 beta))**2``, averaged over the pairs. ``weight`` is ``1 / gradient_accumulation_steps``.

    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
    ``logps/chosen``, ``logps/rejected`` (:func:`.dpo.dpo_loss`); with ``k`` a row's log-ratio summed over the window,
    ``objective/kl`` (mean of ``k``), ``objective/non_score_reward`` (mean of ``-beta k``), ``objective/rlhf_reward``
    (mean of ``reward - beta k``), ``objective/entropy`` (minus the mean summed log-probability), and
    ``objective/scores`` (mean reward), ``objective/scores_margin`` (chosen minus rejected reward),
    ``val/contain_eos_token`` and ``beta``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`).
    """
    weight = jnp.float32(1.0 / settings.gradient_accumulation_steps)

    def loss(module, batch, num_items_in_batch=None):
        per_token = completion_scores(family, module, window_view(batch), 1.0, block_size).log_probs
        ref_per_token = batch["ref_logps"]
        mask = batch["completion_mask"].astype(jnp.float32)
        chosen, rejected = jnp.split((per_token * mask).sum(-1), 2)
        ref_chosen, ref_rejected = jnp.split((ref_per_token * mask).sum(-1), 2)
        beta = batch["beta"][0]
        # DPO's ipo divides by the completion lengths; TRL's online ipo does not: lengths of 1.
        ones = jnp.ones_like(chosen)
        value, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected,
                                  DPOLossSettings(beta=beta, loss_type=settings.loss_type),
                                  chosen_lengths=ones, rejected_lengths=ones)
        per_token, rewards = jax.lax.stop_gradient(per_token), batch["rewards"]
        kl = (per_token - ref_per_token).sum(-1)
        chosen_rewards, rejected_rewards = jnp.split(rewards, 2)
        metrics = {**metrics,
                   "objective/kl": kl.mean(),
                   "objective/non_score_reward": (-beta * kl).mean(),
                   "objective/rlhf_reward": (rewards - beta * kl).mean(),
                   "objective/entropy": -per_token.sum(-1).mean(),
                   "objective/scores": rewards.mean(),
                   "objective/scores_margin": (chosen_rewards - rejected_rewards).mean(),
                   "val/contain_eos_token": batch["contain_eos"].mean(),
                   "beta": beta}
        return value, weight, metrics

    return loss
