"""The one forward pass of TRL's reference-free pairwise trainers (``trl.experimental`` ORPO and CPO): the chosen
rows stacked on the rejected rows (``2B``, TRL's ``concatenated_forward``), reduced to per-token log-probabilities
without materialising the logits (:mod:`.logprobs`), plus what those trainers read off the logits: the
token mean of the cross-entropy of the chosen rows and the mean logit of each half over TRL's padded block.

Beside :mod:`.orpo` and :mod:`.cpo`, which turn these scores into their losses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import logprobs
from . import router as router_loss
from .dpo import masked_mean

__all__ = ["PairScores", "chosen_cross_entropy", "pair_scores", "stacked"]


class PairScores(NamedTuple):
    """What one forward pass over ``B`` pairs yields; every field float32.

    Attributes:
        chosen_sum, rejected_sum: ``[B]`` summed completion log-probabilities (TRL's ``get_batch_logps``).
        chosen_mean, rejected_mean: ``[B]`` the same divided by the completion tokens (``average_log_prob=True``).
        token_log_probs: ``[2B, T-1]`` log-probability of each next token (chosen rows first).
        logits_chosen, logits_rejected: the mean logit of the chosen (rejected) rows over the positions TRL's
            collator pads the batch to (see :func:`pair_scores`).
        aux_loss: the router load-balancing loss of the forward pass, ``None`` when not asked for.
    """

    chosen_sum: jax.Array
    rejected_sum: jax.Array
    chosen_mean: jax.Array
    rejected_mean: jax.Array
    token_log_probs: jax.Array
    logits_chosen: jax.Array
    logits_rejected: jax.Array
    aux_loss: jax.Array | None


def stacked(batch: dict, name: str) -> jax.Array:
    """``[2B, T]``: the batch's ``chosen_<name>`` rows on top of its ``rejected_<name>`` rows."""
    return jnp.concatenate([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])


def pair_scores(family, module, batch: dict, *, logits_positions: int = -1,
                block_size: logprobs.BlockSize = "auto", router_aux_loss_coef: float = 0.0) -> PairScores:
    """Scores a fixed-shape pair batch (``dpo_data.collate_preference_batch``'s columns) as TRL's experimental
    ``concatenated_forward`` does.

    The rows run with position ids ``0 .. T-1``, as ``transformers`` numbers right-padded rows, so the logits at
    padding positions are those TRL averages into its ``logits/*`` metrics. TRL pads each batch to its longest row,
    ``L``; ``logits_chosen = mean over real chosen rows b, positions t < L + logits_positions, vocabulary v of
    logits[b, t, v]`` (ORPO: ``logits_positions=-1``, TRL's ``all_logits[:, :-1]``; CPO: ``0``, every position).
    With ``logits_positions=0`` the batch needs one padding column past its longest row, since the last position
    predicts no token here.

    Args:
        family, module: the model.
        batch: ``chosen_``/``rejected_`` ``input_ids``, ``attention_mask`` and ``completion_mask``, ``[B, T]``.
            Rows whose attention mask is all zero (padding a partial batch) are left out of the logit means.
        logits_positions: ``-1`` or ``0``, as above.
        block_size: positions per block of the log-prob computation (``logprobs.BlockSize``).
        router_aux_loss_coef: with a non-zero value the router load-balancing loss of the pass is returned.

    Returns:
        :class:`PairScores`.
    """
    input_ids, attention_mask = stacked(batch, "input_ids"), stacked(batch, "attention_mask")
    rows, length = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))

    def forward(module):
        return logprobs.next_token_scores(
            family, module, {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions},
            with_metrics=True, block_size=block_size)

    scores, aux_loss = router_loss.run_with_router_loss(family, forward, module, attention_mask,
                                                        router_aux_loss_coef)
    completion = stacked(batch, "completion_mask")[:, 1:].astype(jnp.float32)
    sums = (scores.log_probs * completion).sum(-1)
    means = sums / jnp.maximum(completion.sum(-1), 1.0)  # rows padding a partial batch have no completion
    chosen_sum, rejected_sum = jnp.split(sums, 2)
    chosen_mean, rejected_mean = jnp.split(means, 2)
    # TRL's padded block: the longest row of the batch, its logits cut by logits_positions.
    longest = attention_mask.sum(-1).max()
    in_block = (jnp.arange(length - 1) < longest + logits_positions).astype(jnp.float32)
    real = jnp.split(attention_mask.any(-1).astype(jnp.float32), 2)
    chosen_logits, rejected_logits = jnp.split(jax.lax.stop_gradient(scores.logit_means), 2)
    return PairScores(chosen_sum, rejected_sum, chosen_mean, rejected_mean, scores.log_probs,
                      masked_mean(chosen_logits, real[0][:, None] * in_block),
                      masked_mean(rejected_logits, real[1][:, None] * in_block), aux_loss)


def chosen_cross_entropy(scores: PairScores, token_mask: jax.Array) -> jax.Array:
    """TRL's ``cross_entropy_loss`` on the chosen rows: ``-sum(log p * mask) / sum(mask)`` over the chosen half of
    ``token_mask`` (``[2B, T-1]``, 1 on the next tokens whose labels are not ``-100``)."""
    chosen_log_probs = jnp.split(scores.token_log_probs, 2)[0]
    chosen_mask = jnp.split(token_mask.astype(jnp.float32), 2)[0]
    return -masked_mean(chosen_log_probs, chosen_mask)
