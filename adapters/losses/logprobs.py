"""Per-token log-probabilities and entropies of given target tokens, from logits (TRL's ``selective_log_softmax``) or
from a decoder's hidden states a block of positions at a time.

SFT's token NLL, DPO's sequence log-probabilities and GRPO's completion log-probabilities all need
``log_softmax(logits)[target]`` at each position (DPO also logs per-position entropies), never the ``[B, T, V]``
logits themselves. At a real vocabulary (Qwen2.5: 151,936 tokens) one float32 copy of those logits is gigabytes, and
autodiff keeps several.
Here the decoder runs once up to its final norm (``Family.hidden_states``); then a ``lax.scan`` over blocks of
positions applies the output head (``Family.logits_from_hidden``) and reduces each block to per-token values,
under ``jax.checkpoint``, so the backward pass recomputes one block's logits at a time. Peak memory then scales
with one block's logits, not the sequence's, in the forward and the backward pass; the values are those of the
whole-sequence computation (the same functions on the same rows). What remains is what every path holds, such as
the head weight's ``[V, H]`` gradient, so the saving is large when the scored positions ``B * T`` far exceed the
hidden size ``H``.

Like Liger's fused linear cross entropy (TRL's ``use_liger_kernel``), this trades a second head matmul in the
backward pass for that memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import algo_core as tunix_algo_core
from tunix.rl import common as tunix_common

from ..families import Family
from ..model.tunix_model import batch_positions_and_attention, image_inputs

#: Bytes of float32 logits one block may hold, over the whole batch: ``"auto"`` blocks have
#: ``LOGITS_BLOCK_BYTES // (4 * batch * vocab)`` positions. Autodiff keeps a few such copies (logits, softmax, their
#: cotangents) for the block being processed; small vocabularies and sequences fit in one block (no chunking).
LOGITS_BLOCK_BYTES = 256 * 2**20

BlockSize = int | str | None
"""``"auto"`` (from :data:`LOGITS_BLOCK_BYTES`), a number of positions per block, or ``None`` (the whole sequence at
once: the unchunked computation, without rematerialisation)."""


class TokenScores(NamedTuple):
    """Per-position values for the target tokens, each ``[B, T]`` float32.

    ``log_probs`` and ``entropies`` are differentiable (GRPO's entropy bonus); the other fields carry no gradient.
    Fields not asked for are ``None``.
    """

    log_probs: jax.Array
    entropies: jax.Array | None = None
    logit_means: jax.Array | None = None
    top1: jax.Array | None = None
    log_sum_sq_probs: jax.Array | None = None


# --- From logits ---------------------------------------------------------------------------------------------------

def _scaled_logits(logits: jax.Array, temperature: float) -> jax.Array:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be positive: log-probabilities are those of "
                         "softmax(logits / temperature).")
    logits = logits.astype(jnp.float32)
    return logits if temperature == 1.0 else logits / temperature


def token_log_probs(logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None,
                    temperature: float = 1.0) -> jax.Array:
    """Log-probability of each chosen token: ``log_softmax(logits / temperature)[b, t, tokens[b, t]]``, float32.

    TRL's ``selective_log_softmax(logits, index, temperature)`` (and its fused LM head): the logits are cast to
    float32 and divided by the sampling temperature before the log-softmax. ``logits[:, t]`` must be the distribution
    of ``tokens[:, t]`` (for a causal LM: ``logits[:, :-1]`` with ``input_ids[:, 1:]``).

    Args:
        logits: ``[B, T, V]``.
        tokens: ``[B, T]`` integer ids.
        mask: ``[B, T]``; positions where it is 0 get 0.0 (TRL's ignored labels). ``None`` keeps every position.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32.
    """
    log_probs = tunix_common.selective_log_softmax(_scaled_logits(logits, temperature), tokens.astype(jnp.int32))
    return log_probs if mask is None else jnp.where(mask.astype(bool), log_probs, 0.0)


def token_entropies(logits: jax.Array, mask: jax.Array | None = None, temperature: float = 1.0) -> jax.Array:
    """Entropy of each next-token distribution, ``-sum_v p log p`` with ``p = softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]``.
        mask: ``[B, T]``; positions where it is 0 get 0.0. ``None`` keeps every position.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32 (nats).
    """
    entropies = tunix_algo_core.compute_entropy_from_logits(_scaled_logits(logits, temperature))
    return entropies if mask is None else jnp.where(mask.astype(bool), entropies, 0.0)


def token_log_sum_squared_probs(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log(sum_v p_v**2)`` of each next-token distribution, ``p = softmax(logits / temperature)``: the
    ``log_sum_sq_probs`` of TRL's fused LM head, which WPO weighting (``DPOConfig.use_weighting``) subtracts from each
    token's log-probability.

    Args:
        logits: ``[B, T, V]``.
        temperature: the sampling temperature, > 0.

    Returns:
        ``[B, T]`` float32.
    """
    log_p = jax.nn.log_softmax(_scaled_logits(logits, temperature), axis=-1)
    return jax.nn.logsumexp(2.0 * log_p, axis=-1)


def sequence_log_probs(logits: jax.Array, tokens: jax.Array, mask: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each sequence: ``sum_t mask[b, t] * token_log_probs(logits, tokens)[b, t]``.

    Args:
        logits: ``[B, T, V]``, aligned with ``tokens`` as in ``token_log_probs``.
        tokens: ``[B, T]``.
        mask: ``[B, T]``, 1 on the scored (completion) tokens.
        temperature: > 0.

    Returns:
        ``[B]`` float32.
    """
    return token_log_probs(logits, tokens, mask, temperature).sum(axis=-1)



# --- From hidden states, a block of positions at a time ---------------------------------------------------------

def block_length(block_size: BlockSize, batch: int, length: int, vocab: int | None) -> int:
    """Positions per block for a ``[batch, length]`` target array over ``vocab`` tokens.

    Blocks are made equal (``ceil(length / count)`` positions for the fewest blocks of at most the requested size),
    so at most one block's worth minus one of positions is padding.

    Raises:
        ValueError: ``block_size`` is not ``"auto"``, ``None`` or a positive integer.
    """
    if block_size is None:
        return length
    if block_size == "auto":
        block_size = max(1, LOGITS_BLOCK_BYTES // (4 * batch * vocab))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be 'auto', None or a positive number of positions, got {block_size!r}.")
    count = -(-length // block_size)
    return -(-length // count)


def token_scores(hidden: jax.Array, targets: jax.Array, head: Callable[[jax.Array], jax.Array], *,
                 temperature: float = 1.0, block_size: BlockSize = "auto", with_metrics: bool = False,
                 with_log_sum_sq_probs: bool = False) -> TokenScores:
    """Scores ``targets`` under ``softmax(head(hidden) / temperature)``, a block of positions at a time.

    ``log_probs[b, t] = log_softmax(head(hidden[b, t]) / temperature)[targets[b, t]]`` (TRL's
    ``selective_log_softmax``, :func:`token_log_probs`). With ``with_metrics``: ``entropies`` of that
    distribution (:func:`token_entropies`), ``logit_means`` (the mean of the raw logits over the vocabulary)
    and ``top1`` (1.0 where the target is the most likely token). With ``with_log_sum_sq_probs``:
    ``log(sum_v p_v**2)`` (:func:`token_log_sum_squared_probs`, WPO's weights).

    Args:
        hidden: ``[B, T, H]`` head inputs; position ``t`` scores ``targets[:, t]``.
        targets: ``[B, T]`` token ids.
        head: ``hidden [B, t, H] -> float32 logits [B, t, V]``.
        temperature: > 0.
        block_size: see :data:`BlockSize`. The last block is padded; its padding positions are dropped from the
            outputs, so they reach no loss and no gradient.
        with_metrics: also compute the metrics.
        with_log_sum_sq_probs: also compute ``log_sum_sq_probs``.

    Returns:
        :class:`TokenScores`.
    """
    batch, length = targets.shape
    vocab = jax.eval_shape(head, hidden[:, :1]).shape[-1] if block_size == "auto" else None
    block = block_length(block_size, batch, length, vocab)
    targets = targets.astype(jnp.int32)

    def score(hidden_block, target_block):
        return _scores(head(hidden_block), target_block, temperature, with_metrics, with_log_sum_sq_probs)

    if block >= length:
        return score(hidden, targets)
    count = -(-length // block)
    padding = count * block - length
    hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padding)))
    blocks = (hidden.reshape(batch, count, block, hidden.shape[-1]).swapaxes(0, 1),
              targets.reshape(batch, count, block).swapaxes(0, 1))
    rematerialised = jax.checkpoint(score, prevent_cse=False)
    _, scores = jax.lax.scan(lambda carry, xs: (carry, rematerialised(*xs)), None, blocks)
    return jax.tree.map(lambda values: values.swapaxes(0, 1).reshape(batch, count * block)[:, :length], scores)


def _scores(logits: jax.Array, targets: jax.Array, temperature: float, with_metrics: bool,
            with_log_sum_sq_probs: bool) -> TokenScores:
    scores = TokenScores(token_log_probs(logits, targets, None, temperature))
    detached = jax.lax.stop_gradient(logits)
    if with_metrics:
        scores = scores._replace(entropies=token_entropies(logits, None, temperature),
                                 logit_means=detached.mean(-1),
                                 top1=(jnp.argmax(detached, axis=-1) == targets).astype(jnp.float32))
    if with_log_sum_sq_probs:
        scores = scores._replace(log_sum_sq_probs=token_log_sum_squared_probs(detached, temperature))
    return scores


def hidden_states(family: Family, module: nnx.Module, batch: dict) -> jax.Array:
    """``[B, T, H]`` final-norm hidden states of a padded ``input_ids``/``attention_mask`` batch, packed rows when
    it has ``position_ids`` (the inputs of ``tunix_model.causal_lm_logits``'s head)."""
    positions, attention = batch_positions_and_attention(batch)
    return family.hidden_states(module, batch["input_ids"].astype(jnp.int32), positions, attention,
                                **image_inputs(batch))


def next_token_scores(family: Family, module: nnx.Module, batch: dict, *, last: int | None = None,
                      temperature: float = 1.0, block_size: BlockSize = "auto",
                      with_metrics: bool = False, with_log_sum_sq_probs: bool = False) -> TokenScores:
    """Scores of each next token of a padded causal-LM batch: position ``t`` scores ``input_ids[:, t + 1]``.

    Args:
        family, module: the model.
        batch: ``input_ids`` and ``attention_mask`` ``[B, T]``, optionally ``position_ids`` (packed rows).
        last: score only the last ``last`` tokens (GRPO's completions); ``None``: tokens ``1 .. T - 1``.
        temperature, block_size, with_metrics, with_log_sum_sq_probs: as in :func:`token_scores`.

    Returns:
        :class:`TokenScores` of shape ``[B, T - 1]`` (``[B, last]`` with ``last``).
    """
    hidden = hidden_states(family, module, batch)
    targets = batch["input_ids"][:, 1:]
    hidden = hidden[:, :-1]
    if last is not None:
        hidden, targets = hidden[:, -last:], targets[:, -last:]
    return token_scores(hidden, targets, lambda block: family.logits_from_hidden(module, block),
                        temperature=temperature, block_size=block_size, with_metrics=with_metrics,
                        with_log_sum_sq_probs=with_log_sum_sq_probs)
