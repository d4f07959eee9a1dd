"""Knowledge distillation on Tunix modules: TRL 1.16's generalized Jensen-Shannon divergence between a student's and
a frozen teacher's next-token distributions, and the jitted step loss of ``DistillationTrainer``.

TRL's ``DistillationTrainer`` runs both backbones, then compares the two full next-token distributions at every
completion position (``trl.trainer.distillation_trainer._chunked_divergence_loss`` with its
``ChunkedDivergenceFunction``), never holding either model's ``[B, C, V]`` logits at once. Here the same is done with
the output heads applied a block of positions at a time (:mod:`.logprobs`' blocks, under
``jax.checkpoint``). The teacher sits beside the student in one NNX graph (:class:`StudentTeacher`) so the jitted
train step reads both; the optimizer's filter (:func:`is_student`) leaves the teacher's weights out, and its logits
pass through ``stop_gradient``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..families import Family
from ..lora import runtime as lora_runtime
from . import logprobs
from .settings import LossSettings


@dataclass(frozen=True)
class DistillationLossSettings(LossSettings):
    """The settings of ``DistillationTrainer``'s loss, named as their ``DistillationConfig`` fields
    (:meth:`from_config`).

    Args:
        beta: the generalized JSD's interpolation (0: forward KL, 1: reverse KL).
        temperature: both models' logits are divided by it.
    """

    beta: float = 1.0
    temperature: float = 1.0


@dataclass(frozen=True)
class GKDLossSettings(LossSettings):
    """The settings of ``GKDTrainer``'s loss, named as their ``GKDConfig`` fields (:meth:`from_config`); its
    divergence is untempered, as TRL's ``GKDTrainer.compute_loss``.

    Args:
        beta: the generalized JSD's interpolation (0: forward KL, 1: reverse KL).
    """

    beta: float = 0.5


class TokenDivergences(NamedTuple):
    """Per-position values, each ``[...]`` float32.

    Attributes:
        divergence: the generalized JSD of the position (differentiable in the student's logits).
        entropy: the entropy of the student's tempered distribution (no gradient; a metric).
    """

    divergence: jax.Array
    entropy: jax.Array


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, beta: float,
                    temperature: float = 1.0) -> TokenDivergences:
    """TRL's per-token generalized Jensen-Shannon divergence (``ChunkedDivergenceFunction``).

    With ``p_s = softmax(student_logits / temperature)`` and ``p_t = softmax(teacher_logits / temperature)``:

    - ``beta == 0``: the forward KL, ``KL(p_t || p_s) = sum p_t (log p_t - log p_s)``;
    - ``beta == 1``: the reverse KL, ``KL(p_s || p_t)``;
    - otherwise ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture ``m = (1 - beta) p_s + beta p_t``
      (0.5: the symmetric JSD).

    Args:
        student_logits: ``[..., V]`` logits (after any soft-capping of the model's head).
        teacher_logits: ``[..., V]`` logits over the same vocabulary.
        beta: in ``[0, 1]`` (a Python float: it selects the formula).
        temperature: > 0, applied to both distributions (as ``logits * (1 / temperature)``, TRL's rounding).

    Returns:
        :class:`TokenDivergences` of shape ``[...]``.
    """
    terms, log_ps = _divergence_terms(student_logits, teacher_logits, beta, temperature)
    entropy = -jax.lax.stop_gradient(jnp.exp(log_ps) * log_ps).sum(-1)
    return TokenDivergences(terms.sum(-1), entropy)


def _divergence_terms(student_logits: jax.Array, teacher_logits: jax.Array, beta: float,
                      temperature: float) -> tuple[jax.Array, jax.Array]:
    """``(terms [..., V], student log-probs [..., V])``: the summands of :func:`generalized_jsd` per vocabulary
    entry (``pt (log pt - log ps)``, ``ps (log ps - log pt)``, or ``beta pt (log pt - log m) + (1 - beta) ps (log ps -
    log m)``)."""
    inverse = 1.0 / temperature
    log_ps = jax.nn.log_softmax(student_logits.astype(jnp.float32) * inverse, axis=-1)
    log_pt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) * inverse, axis=-1)
    ps, pt = jnp.exp(log_ps), jnp.exp(log_pt)
    if beta == 0.0:
        return pt * (log_pt - log_ps), log_ps
    if beta == 1.0:
        return ps * (log_ps - log_pt), log_ps
    log_m = jnp.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
    return beta * pt * (log_pt - log_m) + (1.0 - beta) * ps * (log_ps - log_m), log_ps


def masked_sums(divergences: TokenDivergences, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(divergence sum, entropy sum, valid positions)`` over the positions where ``mask`` is non-zero."""
    valid = mask != 0
    return (jnp.where(valid, divergences.divergence, 0.0).sum(), jnp.where(valid, divergences.entropy, 0.0).sum(),
            valid.sum().astype(jnp.float32))


def generalized_jsd_loss(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array, beta: float,
                         temperature: float = 1.0, num_items_in_batch: float | jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TRL's ``_chunked_divergence_loss`` on full logits: the masked divergence sum divided by ``num_items_in_batch``
    (the generation batch's completion tokens, gradient-accumulation correct) or, without it, by the number of valid
    positions (at least 1).

    Args:
        student_logits, teacher_logits: ``[B, K, V]``.
        mask: ``[B, K]``, non-zero at the completion positions that count.
        beta, temperature: as in :func:`generalized_jsd`.
        num_items_in_batch: the normaliser, or ``None``.

    Returns:
        ``(loss, student entropy summed over valid positions, number of valid positions)``.
    """
    total, entropy, count = masked_sums(generalized_jsd(student_logits, teacher_logits, beta, temperature), mask)
    normaliser = jnp.maximum(count, 1.0) if num_items_in_batch is None else num_items_in_batch
    return total / normaliser, entropy, count


def blockwise_divergences(student_hidden: jax.Array, teacher_hidden: jax.Array,
                          student_head: Callable[[jax.Array], jax.Array],
                          teacher_head: Callable[[jax.Array], jax.Array], beta: float, temperature: float = 1.0,
                          block_size: logprobs.BlockSize = "auto") -> TokenDivergences:
    """:func:`generalized_jsd` of ``student_head(student_hidden)`` against ``teacher_head(teacher_hidden)``, a block
    of positions at a time, as :func:`logprobs.token_scores` scores targets: each block's logits are made,
    reduced and (in the backward pass) remade, so neither model's ``[B, C, V]`` logits are ever held. The teacher's
    logits pass through ``stop_gradient``.

    Args:
        student_hidden: ``[B, C, H_s]`` head inputs of the student.
        teacher_hidden: ``[B, C, H_t]`` head inputs of the teacher at the same positions (its width may differ).
        student_head, teacher_head: ``hidden [B, c, H] -> float32 logits [B, c, V]``.
        beta, temperature: as in :func:`generalized_jsd`.
        block_size: positions per block (``logprobs.BlockSize``); ``"auto"`` sizes blocks from the
            vocabulary.

    Returns:
        :class:`TokenDivergences` of shape ``[B, C]``.
    """
    batch, length = student_hidden.shape[:2]
    vocab = jax.eval_shape(student_head, student_hidden[:, :1]).shape[-1] if block_size == "auto" else None
    block = logprobs.block_length(block_size, batch, length, vocab)

    def score(student_block, teacher_block):
        teacher_logits = jax.lax.stop_gradient(teacher_head(teacher_block))
        return generalized_jsd(student_head(student_block), teacher_logits, beta, temperature)

    if block >= length:
        return score(student_hidden, teacher_hidden)
    count = -(-length // block)
    padding = count * block - length

    def blocks(hidden):
        hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
        return hidden.reshape(batch, count, block, hidden.shape[-1]).swapaxes(0, 1)

    rematerialised = jax.checkpoint(score, prevent_cse=False)
    _, values = jax.lax.scan(lambda carry, xs: (carry, rematerialised(*xs)), None,
                             (blocks(student_hidden), blocks(teacher_hidden)))
    return jax.tree.map(lambda value: value.swapaxes(0, 1).reshape(batch, count * block)[:, :length], values)


class StudentTeacher(nnx.Module):
    """The student being trained and its frozen teacher in one NNX graph, so that one jitted step reads both.

    The student is the first attribute, so a variable the two share (one model passed twice) is found under the
    student's path; train with the optimizer filter ``nnx.All(<trainable type>, is_student)``.

    Args:
        student: the student's NNX module (the same object the trainer's model holds: updates land there).
        teacher: the teacher's NNX module.
    """

    def __init__(self, student: nnx.Module, teacher: nnx.Module):
        self.student = student
        self.teacher = teacher


def is_student(path: tuple, value: object) -> bool:
    """NNX filter: the variables under :class:`StudentTeacher`'s ``student``."""
    return path[:1] == ("student",)


def completion_hidden_states(family: Family, module: nnx.Module, batch: dict, length: int) -> jax.Array:
    """``[B, C, H]`` final-norm hidden states that predict the last ``C = length`` tokens of ``batch["input_ids"]``."""
    return logprobs.hidden_states(family, module, batch)[:, :-1][:, -length:]


def distillation_step_loss(student_family: Family, teacher_family: Family, settings: DistillationLossSettings,
                           block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(pair, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``train_step.make_train_step``.

    ``pair`` is a :class:`StudentTeacher`; ``batch`` holds ``input_ids``/``attention_mask`` ``[B, P + C]`` (prompt
    left-padded, completion right-padded) and ``completion_mask`` ``[B, C]``. ``value`` is the divergence summed over
    the completion tokens and ``weight`` their number, so the step's ``sum(values) / sum(weights)`` over its
    micro-batches is TRL's loss normalised by the generation batch's completion tokens. ``metrics["entropy"]`` is the
    micro-batch's mean student entropy (TRL's ``entropy``). The teacher runs with its adapter (if any) in eval mode
    and without gradient.
    """

    def loss(pair, batch, num_items_in_batch=None):
        mask = batch["completion_mask"]
        length = mask.shape[1]

        def teacher_head(block):
            with lora_runtime.lora_mode(lora_runtime.EVAL):
                return teacher_family.logits_from_hidden(pair.teacher, block)

        student_hidden = completion_hidden_states(student_family, pair.student, batch, length)
        with lora_runtime.lora_mode(lora_runtime.EVAL):
            teacher_hidden = jax.lax.stop_gradient(completion_hidden_states(teacher_family, pair.teacher, batch,
                                                                            length))
        divergences = blockwise_divergences(
            student_hidden, teacher_hidden, lambda block: student_family.logits_from_hidden(pair.student, block),
            teacher_head, settings.beta, settings.temperature, block_size)
        total, entropy, count = masked_sums(divergences, mask)
        return total, count, {"entropy": entropy / jnp.maximum(count, 1.0)}

    return loss


def gkd_step_loss(student_family: Family, teacher_family: Family, settings: GKDLossSettings,
                  block_size: logprobs.BlockSize = "auto") -> Callable:
    """``loss(pair, batch, num_items_in_batch) -> (value, weight, metrics)`` of TRL 1.16's experimental
    ``GKDTrainer.compute_loss`` for ``train_step.make_train_step``.

    TRL's loss is ``GKDTrainer.generalized_jsd_loss`` of the two models' full-sequence logits (no temperature) on the
    shifted labels: ``sum over positions t with labels[t + 1] != -100 of JSD_beta(t) / num_items_in_batch``, where
    ``JSD_beta`` is :func:`generalized_jsd` and ``num_items_in_batch`` counts the labels of the accumulation window's
    dataset batches, as transformers counts them before GKD swaps in on-policy (or teacher) sequences.

    ``batch`` holds ``input_ids``/``attention_mask`` ``[B, T]``, ``completion_mask`` ``[B, T - 1]`` (1 where token
    ``t + 1`` is a label) and ``label_count`` ``[B]`` (each row's dataset labels, TRL's ``num_items_in_batch`` share).
    ``value`` is the divergence summed over the labelled positions and ``weight`` the batch's ``label_count``, so the
    step's ``sum(values) / sum(weights)`` is TRL's loss. No metrics: TRL's GKD logs none of its own.
    """
    divergence = distillation_step_loss(student_family, teacher_family,
                                        DistillationLossSettings(beta=settings.beta, temperature=1.0), block_size)

    def loss(pair, batch, num_items_in_batch=None):
        total, _, _ = divergence(pair, batch)
        return total, batch["label_count"].astype(jnp.float32).sum(), {}

    return loss


def reduced_generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array | None = None,
                            beta: float = 0.5, temperature: float = 1.0, reduction: str = "batchmean",
                            num_items_in_batch: float | jax.Array | None = None) -> jax.Array:
    """TRL 1.16's experimental ``GKDTrainer.generalized_jsd_loss``: the terms of :func:`generalized_jsd` per position
    and vocabulary entry (TRL's ``F.kl_div(..., reduction="none")``), the positions whose label is ``-100`` dropped,
    then reduced.

    With ``num_items_in_batch`` the result is the kept sum divided by it; otherwise by ``reduction``:
    ``"batchmean"`` the kept sum over the number of kept positions (at least 1; without ``labels``, over the batch
    size), ``"sum"``, ``"mean"`` (over the kept positions' ``V`` terms each), anything else the kept terms (``[N, V]``;
    ``[B, T, V]`` without ``labels``). The selection is eager (not for ``jax.jit`` with ``"none"``).

    Args:
        student_logits, teacher_logits: ``[B, T, V]``.
        labels: ``[B, T]`` with ``-100`` at positions left out, or ``None``.
        beta, temperature: as in :func:`generalized_jsd`.
        reduction: ``"batchmean"``, ``"sum"``, ``"mean"`` or ``"none"``.
        num_items_in_batch: the normaliser that overrides ``reduction``.
    """
    terms, _ = _divergence_terms(student_logits, teacher_logits, beta, temperature)
    valid = jnp.ones(terms.shape[:-1], bool) if labels is None else jnp.asarray(labels) != -100
    total = jnp.where(valid, terms.sum(-1), 0.0).sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "batchmean":
        return total / (jnp.maximum(valid.sum(), 1) if labels is not None else max(terms.shape[0], 1))
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / (valid.sum() * terms.shape[-1])
    return terms if labels is None else terms[valid]
