"""The reward-model loss of TRL 1.16's ``RewardTrainer`` and its metrics, in ``jax.numpy``.

A reward model scores the chosen and the rejected sequence of each preference pair; the Bradley-Terry loss pushes
the chosen score above the rejected one (by at least the pair's ``margin`` when the data has one), and an optional
centring term pulls the scores towards zero. Shapes: ``B`` preference pairs, ``T`` positions.

TRL records its metrics once per micro-batch. A micro-batch made only of rows that pad a partial last step (TRL has no
such micro-batch) returns them as 0 with their ``present/<name>`` indicator 0, which
:func:`torchlike.adapters.losses.kto.finish_metrics` removes from the logged means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..training.step_metrics import PRESENCE_PREFIX
from .settings import LossSettings

__all__ = ["REWARD_METRICS", "RewardLossSettings", "bradley_terry_loss", "pair_inputs", "reward_batch_length",
           "reward_step_loss"]

#: The metrics TRL's ``RewardTrainer.compute_loss`` records for each micro-batch (besides ``num_tokens``).
REWARD_METRICS: tuple[str, ...] = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")


@dataclass(frozen=True)
class RewardLossSettings(LossSettings):
    """The settings of the reward-model loss, named as their ``RewardConfig`` fields (:meth:`from_config`).

    Args:
        center_rewards_coefficient: ``c`` of the centring term, or ``None`` for none.
    """

    center_rewards_coefficient: float | None = None


def bradley_terry_loss(
    chosen_rewards: jax.Array,
    rejected_rewards: jax.Array,
    margins: jax.Array | None = None,
    settings: RewardLossSettings = RewardLossSettings(),
    *,
    row_mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's ``RewardTrainer.compute_loss`` on the scores of a batch of preference pairs, with its metrics.

    ``loss = mean_b(-log sigmoid(r_chosen - r_rejected - margin)) + c * mean_b((r_chosen + r_rejected)^2)``, the
    second term only when ``settings.center_rewards_coefficient`` (``c``) is set (Eq. 2 of arXiv:2312.09244).

    Args:
        chosen_rewards: ``[B]`` scores of the chosen sequences.
        rejected_rewards: ``[B]`` scores of the rejected sequences.
        margins: ``[B]`` the data's ``margin`` column, or ``None`` (no margin).
        settings: the loss settings (``center_rewards_coefficient``).
        row_mask: ``[B]`` 1 for real pairs, 0 for rows padding a partial batch (left out of every mean, minimum and
            maximum); ``None``: all real.

    Returns:
        ``(loss, metrics)``, float32. ``metrics`` are TRL's: ``min_reward``, ``mean_reward`` and ``max_reward`` (over
        the chosen and rejected scores together), ``accuracy`` (the fraction of pairs scored chosen > rejected) and
        ``margin`` (the mean of ``r_chosen - r_rejected``, without the data's margin), each with its
        ``present/<name>`` indicator (1 when the batch holds a real pair).
    """
    chosen = chosen_rewards.astype(jnp.float32)
    rejected = rejected_rewards.astype(jnp.float32)
    real = jnp.ones(chosen.shape, jnp.float32) if row_mask is None else row_mask.astype(jnp.float32)
    count = real.sum()

    def mean(values: jax.Array) -> jax.Array:
        return jnp.where(count > 0, (values * real).sum() / jnp.maximum(count, 1.0), 0.0)

    gaps = chosen - rejected
    shifted = gaps if margins is None else gaps - margins.astype(jnp.float32)
    loss = mean(-jax.nn.log_sigmoid(shifted))
    if settings.center_rewards_coefficient is not None:
        loss = loss + settings.center_rewards_coefficient * mean((chosen + rejected) ** 2)

    present = count > 0
    both = jnp.concatenate([chosen, rejected])
    both_real = jnp.concatenate([real, real]).astype(bool)
    gaps = jax.lax.stop_gradient(gaps)
    metrics = {
        "min_reward": jnp.where(present, jnp.where(both_real, both, jnp.inf).min(), 0.0),
        "mean_reward": jnp.where(present, jnp.where(both_real, both, 0.0).sum() / jnp.maximum(2 * count, 1.0), 0.0),
        "max_reward": jnp.where(present, jnp.where(both_real, both, -jnp.inf).max(), 0.0),
        "accuracy": mean((gaps > 0).astype(jnp.float32)),
        "margin": mean(gaps),
    }
    metrics = {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}
    indicator = present.astype(jnp.float32)
    return loss, {**metrics, **{PRESENCE_PREFIX + name: indicator for name in REWARD_METRICS}}


def pair_inputs(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(input_ids, attention_mask)`` ``[2B, T]``: the chosen rows on top of the rejected ones, as TRL's
    ``DataCollatorForPreference`` stacks them."""
    return (jnp.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
            jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]))


def reward_step_loss(scores: Callable[..., jax.Array], settings: RewardLossSettings) -> Callable:
    """The reward-model step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)``
    (``Trainer._step_loss``).

    The chosen and rejected sequences are scored in one forward pass; ``value`` is :func:`bradley_terry_loss` of the
    micro-batch. Rows that pad a partial batch (all-zero attention masks) are left out; ``weight`` is 1 when the
    micro-batch holds a pair, so accumulated micro-batches are averaged, as TRL (whose loss is not scaled for
    gradient accumulation) divides by the accumulation steps. ``metrics``: :func:`bradley_terry_loss`'s and
    ``num_tokens`` (the micro-batch's real tokens, chosen and rejected; TRL logs a running total).

    Args:
        scores: ``(module, input_ids [N, T], attention_mask [N, T]) -> [N, 1]`` (a ``SequenceClassifier``'s
            ``scores_function``).
        settings: the loss settings.

    The batch holds ``chosen_input_ids``, ``chosen_attention_mask``, ``rejected_input_ids``,
    ``rejected_attention_mask`` ``[B, T]`` and optionally ``margin`` ``[B]``
    (``torchlike.trl.data.reward_data.collate_reward_batch``'s columns).
    """

    def loss(module, batch, num_items_in_batch=None):
        input_ids, attention_mask = pair_inputs(batch)
        rewards = scores(module, input_ids, attention_mask)[:, 0]
        chosen, rejected = jnp.split(rewards, 2)
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)
        value, metrics = bradley_terry_loss(chosen, rejected, batch.get("margin"), settings, row_mask=real)
        tokens = attention_mask.sum().astype(jnp.float32)
        return value, (real.sum() > 0).astype(jnp.float32), {**metrics, "num_tokens": tokens}

    return loss


def reward_batch_length(batch: Mapping[str, jax.Array], pad_to_multiple_of: int | None = None) -> jax.Array:
    """The ``L`` of NEFTune's magnitude for a pair batch: the width TRL's collator pads the ``2B`` stacked sequences
    to (the longest one's real tokens, rounded up to ``pad_to_multiple_of``)."""
    length = pair_inputs(batch)[1].astype(jnp.int32).sum(-1).max()
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return length
