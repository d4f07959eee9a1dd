"""A*-PO (``trl.experimental.a2po.A2POTrainer``, TRL 1.16): the optimal values of stage 1 and the regression loss of
stage 2, with TRL's metrics.

Stage 1 samples ``N`` completions of every prompt from the reference policy and estimates the optimal value
``V*(x) = beta1 * log(mean_i exp(r_i / beta1))`` (:func:`optimal_values`). Stage 2 samples one completion per prompt
from the policy and regresses the implicit reward ``beta2 * log(pi(y|x) / pi_ref(y|x))`` onto the optimal advantage
``r - V*(x)`` (:func:`a2po_step_loss`), the log-probabilities summed over the completion (up to and with its first
end token), untempered.

Columns of a micro-batch (``B`` rows, ``P + C`` positions): ``input_ids``, ``attention_mask``, ``position_ids``;
``completion_mask`` ``[B, C]``; ``ref_logps``, ``rewards`` and ``v_star`` ``[B]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..families import Family
from . import logprobs
from .dpo import masked_mean
from .grpo import completion_scores
from .settings import LossSettings

__all__ = ["A2POLossSettings", "a2po_step_loss", "optimal_values"]


@dataclass(frozen=True)
class A2POLossSettings(LossSettings):
    """The settings of the stage-2 loss, named as their ``A2POConfig`` fields (:meth:`from_config`).

    Args:
        beta2: the KL temperature of the implicit reward.
    """

    beta2: float = 1e-3


def optimal_values(rewards: np.ndarray, beta1: float) -> np.ndarray:
    """TRL's stage-1 estimate ``V*(x) = beta1 * (logsumexp(r / beta1) - log N)`` of each prompt, computed stably.

    Args:
        rewards: ``[prompts, N]`` the rewards of each prompt's ``N`` reference completions.
        beta1: the KL temperature of the estimate.

    Returns:
        ``[prompts]`` float32.
    """
    scaled = np.asarray(rewards, np.float32) / np.float32(beta1)
    peak = scaled.max(axis=1, keepdims=True)
    log_sum = peak[:, 0] + np.log(np.exp(scaled - peak).sum(axis=1))
    return (np.float32(beta1) * (log_sum - np.float32(math.log(scaled.shape[1])))).astype(np.float32)


def a2po_step_loss(family: Family, settings: A2POLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The stage-2 step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)``
    (``Trainer._step_loss``): the mean over the micro-batch's rows of ``(beta2 * (logp - ref_logps) - (rewards -
    v_star))**2``, ``logp`` the policy's log-probability of the completion. Rows padding a partial batch (no attention)
    are left out; ``weight`` is 1 when the micro-batch holds a row, so accumulated micro-batches are averaged.

    ``metrics`` are TRL's: ``reward`` and ``v_star`` (what its ``_prepare_inputs`` logs), ``implicit_reward`` and
    ``advantage`` (``rewards - v_star``), each a mean over the rows.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation.
    """
    beta2 = settings.beta2

    def loss(module, batch, num_items_in_batch=None):
        per_token = completion_scores(family, module, batch, 1.0, block_size).log_probs
        policy = (per_token * batch["completion_mask"]).sum(-1)
        implicit_reward = beta2 * (policy - batch["ref_logps"])
        advantage = batch["rewards"] - batch["v_star"]
        real = batch["attention_mask"].any(-1).astype(jnp.float32)
        value = masked_mean((implicit_reward - advantage) ** 2, real)
        metrics = {"reward": masked_mean(batch["rewards"], real), "v_star": masked_mean(batch["v_star"], real),
                   "implicit_reward": masked_mean(jax.lax.stop_gradient(implicit_reward), real),
                   "advantage": masked_mean(advantage, real)}
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss
