"""XPO (``trl.experimental.xpo.XPOTrainer``, TRL 1.0.0): online DPO's loss on a pair of one policy completion and one
reference completion per prompt, plus XPO's exploration term, with TRL 1.0.0's metrics.

The micro-batch is online DPO's (:mod:`.online_dpo`: ``2B`` rows, chosen first then rejected), whose pairs are a
policy completion and a reference completion of the same prompt; two more columns say which is which and carry the
epoch's ``alpha``: ``from_reference`` ``[2B]`` (1 on the reference's completions) and ``alpha`` ``[2B]``. Unlike online
DPO's, XPO's metrics sum log-probabilities over each completion's mask only (TRL 1.0.0 zeroes the padding).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from .dpo import DPOLossSettings, dpo_loss
from .grpo import completion_scores
from .online_dpo import OnlineDPOLossSettings, window_view

__all__ = ["xpo_step_loss"]


def xpo_step_loss(family: Family, settings: OnlineDPOLossSettings, scored: bool,
                  block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``make_train_step``: TRL 1.0.0's
    ``XPOTrainer.training_step`` on one micro-batch.

    With ``c``, ``r`` the policy's summed completion log-probabilities of the chosen and rejected halves, ``c_ref``,
    ``r_ref`` the reference's, and ``q`` the policy's summed log-probability of the pair's reference completion, the
    loss is the mean over pairs of online DPO's pair loss on ``(c - r) - (c_ref - r_ref)`` (``sigmoid`` or ``ipo``, as
    :func:`.online_dpo.online_dpo_step_loss`) plus ``alpha q``. ``weight`` is ``1 / gradient_accumulation_steps``.

    ``metrics`` are TRL 1.0.0's: ``loss/dpo``, ``loss/xpo`` (mean of ``alpha q``), ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (:func:`.dpo.dpo_loss`), ``logps/chosen`` (mean of
    ``c`` plus mean of ``c_ref``), ``logps/rejected`` (likewise), ``objective/kl`` (mean over the ``2B`` completions of
    their summed log-ratio), ``objective/entropy`` (minus the mean summed log-probability),
    ``val/model_contain_eos_token``, ``val/ref_contain_eos_token``, ``alpha``, ``beta``, and with reward scores
    (``scored`` set) ``objective/model_scores``, ``objective/ref_scores``, ``objective/scores_margin``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: online DPO's loss settings (``loss_type``, ``gradient_accumulation_steps``).
        scored: whether the pairs were ranked by reward scores (the ``rewards`` column), not by a judge.
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`).
    """
    weight = jnp.float32(1.0 / settings.gradient_accumulation_steps)

    def loss(module, batch, num_items_in_batch=None):
        mask = batch["completion_mask"].astype(jnp.float32)
        per_token = completion_scores(family, module, window_view(batch), 1.0, block_size).log_probs
        sums, ref_sums = (per_token * mask).sum(-1), (batch["ref_logps"] * mask).sum(-1)
        chosen, rejected = jnp.split(sums, 2)
        ref_chosen, ref_rejected = jnp.split(ref_sums, 2)
        beta, alpha = batch["beta"][0], batch["alpha"][0]
        ones = jnp.ones_like(chosen)
        dpo_value, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected,
                                      DPOLossSettings(beta=beta, loss_type=settings.loss_type),
                                      chosen_lengths=ones, rejected_lengths=ones)
        from_reference = batch["from_reference"]
        # Each pair holds one reference completion: q is the policy's log-probability of it.
        reference_logps = sum(jnp.split(sums * from_reference, 2))
        xpo_losses = alpha * reference_logps
        sums, from_policy = jax.lax.stop_gradient(sums), 1.0 - from_reference
        rewards, contain_eos, pairs = batch["rewards"], batch["contain_eos"], from_reference.sum()
        metrics = {**metrics,
                   "loss/dpo": dpo_value,
                   "loss/xpo": jax.lax.stop_gradient(xpo_losses).mean(),
                   "logps/chosen": jax.lax.stop_gradient(chosen).mean() + ref_chosen.mean(),
                   "logps/rejected": jax.lax.stop_gradient(rejected).mean() + ref_rejected.mean(),
                   "objective/kl": (sums - ref_sums).mean(),
                   "objective/entropy": -sums.mean(),
                   "val/model_contain_eos_token": (contain_eos * from_policy).sum() / pairs,
                   "val/ref_contain_eos_token": (contain_eos * from_reference).sum() / pairs,
                   "alpha": alpha,
                   "beta": beta}
        if scored:
            model_scores = (rewards * from_policy).sum() / pairs
            ref_scores = (rewards * from_reference).sum() / pairs
            metrics.update({"objective/model_scores": model_scores, "objective/ref_scores": ref_scores,
                            "objective/scores_margin": model_scores - ref_scores})
        return dpo_value + xpo_losses.mean(), weight, metrics

    return loss
