"""IW-OPD (``trl.experimental.iw_opd.IWOPDTrainer``, TRL 1.16): Importance-Weighted On-Policy Distillation and the
generalized JSD on top-k supports, with TRL's metrics.

The sampled-token objective (``distillation_objective="iw_opd"``): with ``a_t = log p_teacher(y_t) - log
p_student(y_t)`` (no gradient) on the completion's tokens, each token's weight is ``w_t = 1 + gamma * (1 - sum_{s<t}
|a_s| / max(sum_s |a_s|, epsilon))``, and the loss is ``-sum_t log p_student(y_t) * w_t * a_t`` over the labelled
positions. The divergence objective (``"jsd"``) is the generalized JSD of the two next-token distributions
(``beta`` 0: forward KL, 1: reverse KL) on a support TRL chooses by ``loss_top_k``: the whole vocabulary (0), the
teacher's top-k (forward), the student's (reverse) or their union (JSD), renormalised or with a tail bucket for the
mass outside; with ``beta > 0`` and ``loss_top_k == 1`` the support is the teacher's top-1 token and the reverse term's
token (the sampled one, or the student's most likely with ``reverse_kl_top_1_mode="argmax"``). Both models' logits
are divided by ``temperature``. Sums are over the labelled positions; each micro-batch's value is divided by the
step's labels (TRL's ``num_items_in_batch``).

Columns of a micro-batch (GKD's, ``torchlike.trl.experimental.gkd.gkd_data``): ``input_ids``/``attention_mask``
``[B, W]``, ``completion_mask`` ``[B, W - 1]`` (1 where token ``t + 1`` is a label), ``window_label_count`` ``[B]`` (the
step's dataset labels) and ``on_policy`` ``[B]`` (1 where the micro-batch is the student's own completions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from ..training.step_metrics import PRESENCE_PREFIX
from . import logprobs
from .settings import LossSettings

__all__ = ["IWOPDLossSettings", "add_tail_bucket", "iw_opd_step_loss", "jsd_divergence", "support_divergence"]


@dataclass(frozen=True)
class IWOPDLossSettings(LossSettings):
    """The settings of IW-OPD's loss, named as their ``IWOPDConfig`` fields (:meth:`from_config`).

    Args:
        distillation_objective: ``"iw_opd"`` or ``"jsd"``.
        beta: the JSD's interpolation.
        temperature: both models' logits are divided by it.
        iw_opd_gamma, iw_opd_epsilon: the IW-OPD weights' amplification and floor.
        loss_top_k, loss_add_tail, reverse_kl_top_1_mode: the JSD's support.
        max_completion_length: the truncated-completion threshold of the metrics.
    """

    distillation_objective: str = "iw_opd"
    beta: float = 1.0
    temperature: float = 1.0
    iw_opd_gamma: float = 0.5
    iw_opd_epsilon: float = 1e-8
    loss_top_k: int = 1
    loss_add_tail: bool = True
    reverse_kl_top_1_mode: str = "sampled"
    max_completion_length: int = 512


def add_tail_bucket(log_probs: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """TRL's ``_add_tail_bucket``: one more entry, ``log(1 - captured mass)``, valid."""
    captured = jnp.minimum(jax.nn.logsumexp(log_probs, axis=-1, keepdims=True), -1e-7)
    return (jnp.concatenate([log_probs, jnp.log(-jnp.expm1(captured))], axis=-1),
            jnp.concatenate([valid, jnp.ones_like(valid[..., :1])], axis=-1))


def jsd_divergence(student: jax.Array, teacher: jax.Array, beta: float, support: jax.Array | None = None) -> jax.Array:
    """TRL's ``_jsd_divergence``: the per-entry terms of the generalized JSD (not summed), with masked entries (of
    ``support``) contributing 0; the mixture through probabilities on a support, through log-sum-exp on the whole
    vocabulary, as TRL computes each."""
    if support is None:
        def kl(target: jax.Array, reference: jax.Array) -> jax.Array:
            return jnp.exp(target) * (target - reference)

        if beta == 0:
            return kl(teacher, student)
        if beta == 1:
            return kl(student, teacher)
        mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
        return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)
    safe_student, safe_teacher = (jnp.where(support, values, 0.0) for values in (student, teacher))
    student_probs, teacher_probs = (jnp.where(support, jnp.exp(values), 0.0) for values in (student, teacher))
    if beta == 0:
        return jnp.nan_to_num(teacher_probs * (safe_teacher - safe_student), nan=0.0)
    if beta == 1:
        return jnp.nan_to_num(student_probs * (safe_student - safe_teacher), nan=0.0)
    tiny = jnp.finfo(student_probs.dtype).tiny
    mixture = jnp.where(support, jnp.log(jnp.maximum((1 - beta) * student_probs + beta * teacher_probs, tiny)), 0.0)
    return (beta * jnp.nan_to_num(teacher_probs * (safe_teacher - mixture), nan=0.0)
            + (1 - beta) * jnp.nan_to_num(student_probs * (safe_student - mixture), nan=0.0))


def _on_support(student_log_probs: jax.Array, teacher_log_probs: jax.Array, indices: jax.Array, valid: jax.Array,
                add_tail: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Both distributions gathered on ``indices`` (invalid entries ``-inf``), with a tail bucket or renormalised."""
    student = jnp.where(valid, jnp.take_along_axis(student_log_probs, indices, axis=-1), -jnp.inf)
    teacher = jnp.where(valid, jnp.take_along_axis(teacher_log_probs, indices, axis=-1), -jnp.inf)
    if add_tail:
        student, support = add_tail_bucket(student, valid)
        teacher, _ = add_tail_bucket(teacher, valid)
        return student, teacher, support
    return (student - jax.nn.logsumexp(student, axis=-1, keepdims=True),
            teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True), valid)


def _deduplicated(indices: jax.Array) -> jax.Array:
    """``[..., K]`` True where an index is the first of its value along the last axis."""
    equal = indices[..., :, None] == indices[..., None, :]
    earlier = jnp.tril(jnp.ones(equal.shape[-2:], bool), k=-1)
    return ~(equal & earlier).any(-1)


def support_divergence(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array,
                       settings: IWOPDLossSettings) -> jax.Array:
    """``[B, T, K]`` TRL's per-entry generalized JSD of temperature-scaled logits on ``settings``' support (see the
    module docstring); summed over its last axis and the labelled positions it is the ``"jsd"`` loss's numerator."""
    beta, top_k = settings.beta, settings.loss_top_k
    student_log_probs = jax.nn.log_softmax(student_logits, -1)
    teacher_log_probs = jax.nn.log_softmax(teacher_logits, -1)
    if beta > 0 and top_k == 1:
        reverse = (student_logits.argmax(-1) if settings.reverse_kl_top_1_mode == "argmax" else targets)[..., None]
        if beta == 1:
            indices = reverse
            valid = jnp.ones_like(indices, bool)
        else:
            indices = jnp.concatenate([teacher_logits.argmax(-1)[..., None], reverse], axis=-1)
            valid = jnp.concatenate([jnp.ones_like(reverse, bool), indices[..., 1:] != indices[..., :1]], axis=-1)
            indices = jnp.where(valid, indices, 0)
        student, teacher, support = _on_support(student_log_probs, teacher_log_probs, indices, valid,
                                                settings.loss_add_tail)
        return jsd_divergence(student, teacher, beta, support)
    if top_k > 0 and student_logits.shape[-1] > top_k:
        if beta == 0:
            indices = jax.lax.top_k(teacher_logits, top_k)[1]
        elif beta == 1:
            indices = jax.lax.top_k(student_logits, top_k)[1]
        else:
            indices = jnp.concatenate([jax.lax.top_k(teacher_logits, top_k)[1],
                                       jax.lax.top_k(student_logits, top_k)[1]], axis=-1)
        valid = _deduplicated(indices)
        indices = jnp.where(valid, indices, 0)
        student, teacher, support = _on_support(student_log_probs, teacher_log_probs, indices, valid,
                                                settings.loss_add_tail)
        return jsd_divergence(student, teacher, beta, support)
    return jsd_divergence(student_log_probs, teacher_log_probs, beta)


def iw_opd_terms(student_log_probs: jax.Array, teacher_log_probs: jax.Array, mask: jax.Array,
                 settings: IWOPDLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``([B, T] per-token losses, metrics)`` of TRL's ``_compute_iw_opd_loss`` on the sampled tokens'
    log-probabilities (``mask``: the labelled positions)."""
    advantage = jnp.where(mask, jax.lax.stop_gradient(teacher_log_probs - student_log_probs), 0.0)
    magnitude = jnp.abs(advantage)
    before = jnp.cumsum(magnitude, axis=-1) - magnitude
    total = jnp.maximum(magnitude.sum(-1, keepdims=True), settings.iw_opd_epsilon)
    weights = 1.0 + settings.iw_opd_gamma * (1.0 - before / total)
    weighted = weights * advantage
    count = jnp.maximum(mask.sum(), 1.0)
    metrics = {"iw_opd/mean_advantage": jnp.where(mask, weighted, 0.0).sum() / count,
               "iw_opd/mean_abs_advantage": jnp.where(mask, magnitude, 0.0).sum() / count,
               "iw_opd/mean_weight": jnp.where(mask, weights, 0.0).sum() / count,
               "iw_opd/min_weight": jnp.where(mask, weights, jnp.inf).min(),
               "iw_opd/max_weight": jnp.where(mask, weights, -jnp.inf).max()}
    return jnp.where(mask, -student_log_probs * weighted, 0.0), metrics


def completion_logits(family: Family, module, batch: dict, temperature: float) -> jax.Array:
    """``[B, W - 1, V]`` float32 next-token logits of a batch, divided by ``temperature``."""
    hidden = logprobs.hidden_states(family, module, {"input_ids": batch["input_ids"],
                                                     "attention_mask": batch["attention_mask"]})
    return family.logits_from_hidden(module, hidden[:, :-1]).astype(jnp.float32) / temperature


def iw_opd_step_loss(student_family: Family, teacher_family: Family, settings: IWOPDLossSettings) -> Callable:
    """``loss(pair, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``train_step.make_train_step``: the
    objective's sum over the labelled positions, weighed by the step's dataset labels (``window_label_count``), so the
    step's ``sum(values) / sum(weights)`` is TRL's loss over its ``num_items_in_batch`` (the step's labels counted once
    per micro-batch: TRL's micro-batches are slices of one repeated batch).

    ``metrics``: the IW-OPD ones (``iw_opd/*``) for that objective; ``on_policy_loss`` / ``off_policy_loss`` (the
    micro-batch's loss, as TRL's running totals by source) and ``completions/on_policy_*`` /
    ``completions/off_policy_*`` (mean, max and min label counts of its rows; with ``truncated_fraction`` on-policy),
    each recorded only by the micro-batches of that source (``present/<name>``).
    """
    def loss(pair, batch, num_items_in_batch=None):
        student_logits = completion_logits(student_family, pair.student, batch, settings.temperature)
        teacher_logits = jax.lax.stop_gradient(completion_logits(teacher_family, pair.teacher, batch,
                                                                 settings.temperature))
        targets = batch["input_ids"][:, 1:]
        mask = batch["completion_mask"].astype(bool)
        metrics = {}
        if settings.distillation_objective == "iw_opd":
            def sampled(logits):
                return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], axis=-1)[..., 0]

            per_token, metrics = iw_opd_terms(sampled(student_logits), sampled(teacher_logits), mask, settings)
            total = per_token.sum()
        else:
            terms = support_divergence(student_logits, teacher_logits, targets, settings)
            total = jnp.where(mask[..., None], terms, 0.0).sum()
        # TRL's num_items_in_batch counts the step's labels once per micro-batch (its micro-batches are slices of one
        # repeated batch): each micro-batch weighs the step's labels, so the step is sum / (steps x labels).
        weight = batch["window_label_count"][0].astype(jnp.float32)
        value = jax.lax.stop_gradient(total / jnp.maximum(weight, 1e-12))
        on_policy = batch["on_policy"].max()
        lengths = mask.sum(-1).astype(jnp.float32)
        for source, present in (("on_policy", on_policy), ("off_policy", 1.0 - on_policy)):
            recorded = {f"{source}_loss": value, f"completions/{source}_mean_length": lengths.mean(),
                        f"completions/{source}_max_length": lengths.max(),
                        f"completions/{source}_min_length": lengths.min()}
            if source == "on_policy":
                recorded["completions/truncated_fraction"] = (lengths >= settings.max_completion_length).mean()
            for name, recorded_value in recorded.items():
                metrics[name] = recorded_value * present
                metrics[PRESENCE_PREFIX + name] = present
        return total, weight, metrics

    return loss
