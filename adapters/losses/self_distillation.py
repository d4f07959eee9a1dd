"""Self-distillation (``trl.experimental.sdft.SDFTTrainer``, TRL 1.16; its ``loss_utils``, which SDPO shares): the
student's next-token distribution on its own sampled completion is pulled towards a teacher's, the teacher reading the
same completion after a prompt with privileged context.

The per-token objectives (``distillation_mode``): ``"topk_logits"`` (the divergence over the student's top-k tokens,
renormalised or with a tail bucket for the rest of the mass), ``"full_logits"`` (over the whole vocabulary) and
``"sampled_token"`` (reverse KL estimated on the sampled token: ``stop_gradient(log s - log t) * log s``). The
divergence interpolates with ``distillation_alpha``: 0 is ``KL(teacher || student)``, 1 ``KL(student || teacher)``,
between them the two KLs to the ``alpha``-mixture, interpolated (:func:`divergence`). With ``distillation_is_clip``
and rollout log-probabilities the per-token loss is weighted by the clipped importance ratio
``min(exp(log s - log s_old), clip)``. Both models' logits are divided by the sampling temperature, as TRL does.

Columns of a micro-batch (``B`` rows, ``C`` completion positions): ``input_ids``, ``attention_mask`` ``[B, Ps + C]``
(the student prompt, left-padded, then the completion); ``teacher_input_ids``, ``teacher_attention_mask``
``[B, Pt + C]``; ``completion_ids``, ``loss_mask`` ``[B, C]``; ``old_logps`` ``[B, C]`` when the rollout's
log-probabilities are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from ..families import Family
from ..lora import runtime as lora_runtime
from . import logprobs
from .settings import LossSettings, runtime_field

__all__ = ["DISTILLATION_MODES", "SDPOLossSettings", "SDPO_LOSS_TYPES", "SelfDistillationLossSettings",
           "add_tail_bucket", "distillation_loss", "divergence", "policy_loss", "sdpo_step_loss",
           "self_distillation_step_loss", "token_losses"]

#: ``distillation_mode`` values, as TRL lists them.
DISTILLATION_MODES: tuple[str, ...] = ("sampled_token", "full_logits", "topk_logits")


@dataclass(frozen=True)
class SelfDistillationLossSettings(LossSettings):
    """The settings of the self-distillation loss, named as their config fields (:meth:`from_config`).

    Args:
        distillation_mode: one of :data:`DISTILLATION_MODES`.
        distillation_alpha: the divergence's interpolation (0 forward KL, 1 reverse KL).
        distillation_topk: the student's top tokens the ``"topk_logits"`` divergence is taken over.
        distillation_is_clip: the importance ratio's upper clip (``None``: no importance weighting).
        distillation_add_tail: ``"topk_logits"`` adds a bucket for the mass outside the top k instead of
            renormalising.
        temperature: the sampling temperature both models' logits are divided by.
        teacher_lora: runtime value: the LoRA mode of the teacher's forward pass (``"disabled"``: the student's base
            weights, TRL's ``teacher_model_kind="base"`` with an adapter).
        metric_prefix: runtime value: the trainer's metric prefix (``"sdft"``), beside ``self_distillation``.
    """

    distillation_mode: str = "topk_logits"
    distillation_alpha: float = 0.5
    distillation_topk: int | None = 100
    distillation_is_clip: float | None = 2.0
    distillation_add_tail: bool = False
    temperature: float = 1.0
    teacher_lora: str = runtime_field(lora_runtime.EVAL)
    metric_prefix: str = runtime_field("sdft")


def divergence(student_log_probs: jax.Array, teacher_log_probs: jax.Array, alpha: float) -> jax.Array:
    """TRL's ``compute_divergence``: per position, summed over the last axis.

    ``alpha=0``: ``KL(teacher || student)``; ``alpha=1``: ``KL(student || teacher)``; otherwise, with ``m`` the
    mixture ``(1 - alpha) * student + alpha * teacher``, ``(1 - alpha) * KL(student || m) + alpha * KL(teacher || m)``.
    """
    def kl(target: jax.Array, reference: jax.Array) -> jax.Array:  # torch's kl_div(reference, target, log_target)
        return jnp.exp(target) * (target - reference)

    if alpha == 0.0:
        terms = kl(teacher_log_probs, student_log_probs)
    elif alpha == 1.0:
        terms = kl(student_log_probs, teacher_log_probs)
    else:
        mixture = jnp.logaddexp(student_log_probs + jnp.log1p(-alpha), teacher_log_probs + jnp.log(alpha))
        student_kl, teacher_kl = kl(student_log_probs, mixture), kl(teacher_log_probs, mixture)
        terms = student_kl + alpha * (teacher_kl - student_kl)
    return terms.sum(-1)


def add_tail_bucket(log_probs: jax.Array) -> jax.Array:
    """TRL's ``add_tail_bucket``: the top-k log-probabilities with one more entry, ``log(1 - captured mass)``."""
    captured = jnp.minimum(jax.nn.logsumexp(log_probs, axis=-1, keepdims=True), -1e-7)
    return jnp.concatenate([log_probs, jnp.log(-jnp.expm1(captured))], axis=-1)


def token_losses(student_logits: jax.Array, teacher_logits: jax.Array, completion_ids: jax.Array,
                 settings: SelfDistillationLossSettings) -> jax.Array:
    """``[B, C]`` the per-token objective of ``settings.distillation_mode`` (TRL's ``compute_*_self_distillation_loss``)
    on temperature-scaled ``[B, C, V]`` logits.

    Raises:
        ValueError: an unknown mode, ``"topk_logits"`` without ``distillation_topk``, or ``"sampled_token"`` with an
            ``alpha`` other than 1 (TRL's messages).
    """
    mode, alpha = settings.distillation_mode, settings.distillation_alpha
    if mode == "topk_logits":
        if settings.distillation_topk is None:
            raise ValueError("`distillation_mode='topk_logits'` requires `distillation_topk` to be set.")
        top_student, indices = jax.lax.top_k(student_logits, settings.distillation_topk)
        student = top_student - jax.nn.logsumexp(student_logits, axis=-1, keepdims=True)
        teacher = (jnp.take_along_axis(teacher_logits, indices, axis=-1)
                   - jax.nn.logsumexp(teacher_logits, axis=-1, keepdims=True))
        if settings.distillation_add_tail:
            student, teacher = add_tail_bucket(student), add_tail_bucket(teacher)
        else:
            student = student - jax.nn.logsumexp(student, axis=-1, keepdims=True)
            teacher = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
        return divergence(student, teacher, alpha)
    if mode == "full_logits":
        return divergence(jax.nn.log_softmax(student_logits, -1), jax.nn.log_softmax(teacher_logits, -1), alpha)
    if mode == "sampled_token":
        if alpha != 1.0:
            raise ValueError("Only reverse KL (alpha=1.0) is supported for token-level distillation when "
                             f"`distillation_mode='sampled_token'`, got alpha={alpha}")
        student = sampled_log_probs(student_logits, completion_ids)
        teacher = sampled_log_probs(teacher_logits, completion_ids)
        return jax.lax.stop_gradient(student - teacher) * student
    raise ValueError("distillation_mode must be one of: 'sampled_token', 'full_logits', 'topk_logits', "
                     f"got {mode!r}")


def sampled_log_probs(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """``[B, C]`` the log-probability of each sampled token."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[..., None], axis=-1)[..., 0]


def completion_logits(family: Family, module: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array,
                      length: int, temperature: float) -> jax.Array:
    """``[B, C, V]`` float32 logits predicting the last ``C = length`` tokens, divided by ``temperature``."""
    hidden = logprobs.hidden_states(family, module, {"input_ids": input_ids, "attention_mask": attention_mask})
    logits = family.logits_from_hidden(module, hidden[:, :-1][:, -length:])
    return logits.astype(jnp.float32) / temperature


def distillation_loss(student_logits: jax.Array, teacher_logits: jax.Array, batch: dict,
                      settings: SelfDistillationLossSettings, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(value, metric)`` of TRL's ``_compute_self_distillation_loss``: the mean over rows of each row's per-token
    loss averaged over its ``loss_mask`` (importance-weighted when the batch has ``old_logps`` and
    ``distillation_is_clip`` is set), and the per-token loss averaged over every masked token."""
    ids = batch["completion_ids"]
    per_token = token_losses(student_logits, jax.lax.stop_gradient(teacher_logits), ids, settings)
    if settings.distillation_is_clip is not None and "old_logps" in batch:
        log_ratio = jnp.clip(jax.lax.stop_gradient(sampled_log_probs(student_logits, ids)) - batch["old_logps"],
                             -20.0, 20.0)
        per_token = per_token * jnp.minimum(jnp.exp(log_ratio), settings.distillation_is_clip)
    mask = loss_mask.astype(jnp.float32)
    masked = per_token * mask
    value = (masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    return value, jax.lax.stop_gradient(masked.sum() / jnp.maximum(mask.sum(), 1.0))


def teacher_logits_of(teacher_family: Family, pair: nnx.Module, batch: dict, settings: SelfDistillationLossSettings
                      ) -> jax.Array:
    """The teacher's temperature-scaled logits on the completion, after the teacher prompt, in its LoRA mode."""
    with lora_runtime.lora_mode(settings.teacher_lora):
        return completion_logits(teacher_family, pair.teacher, batch["teacher_input_ids"],
                                 batch["teacher_attention_mask"], batch["completion_ids"].shape[1],
                                 settings.temperature)


def self_distillation_step_loss(student_family: Family, teacher_family: Family,
                                settings: SelfDistillationLossSettings) -> Callable:
    """``loss(pair, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``train_step.make_train_step``.

    ``pair`` is an ``adapters.losses.distillation.StudentTeacher`` (the same module twice for TRL's ``"live"``
    teacher). ``value`` is :func:`distillation_loss` on the batch's ``loss_mask``; the teacher gets no gradient.
    ``weight`` is 1, so accumulated micro-batches are averaged (TRL divides each by the accumulation steps).
    ``metrics``: ``self_distillation/distillation_loss`` and ``<metric_prefix>/distillation_loss``, the per-token loss
    averaged over every masked token of the micro-batch.
    """
    names = ("self_distillation/distillation_loss", f"{settings.metric_prefix}/distillation_loss")

    def loss(pair, batch, num_items_in_batch=None):
        student_logits = completion_logits(student_family, pair.student, batch["input_ids"], batch["attention_mask"],
                                           batch["completion_ids"].shape[1], settings.temperature)
        value, metric = distillation_loss(student_logits, teacher_logits_of(teacher_family, pair, batch, settings),
                                          batch, settings, batch["loss_mask"])
        return value, jnp.float32(1.0), dict.fromkeys(names, metric)

    return loss


# --- SDPO: the policy-gradient term beside the distillation ----------------------------------------------------------

#: ``SDPOConfig.loss_type`` values.
SDPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class SDPOLossSettings(SelfDistillationLossSettings):
    """The settings of SDPO's loss (``trl.experimental.sdpo``): the self-distillation ones plus its policy term's.

    Args:
        distillation_weight: the distillation term's share (1: distillation only, 0: the policy term only).
        loss_type: how the policy term's per-token losses are reduced (:data:`SDPO_LOSS_TYPES`).
        epsilon, epsilon_high: the PPO clip range ``[1 - epsilon, 1 + epsilon_high]`` of the importance ratio.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (the log-ratio averaged over the completion).
        max_completion_length: ``dr_grpo``'s constant.
    """

    distillation_weight: float = 1.0
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int = 256
    metric_prefix: str = runtime_field("sdpo")


def policy_loss(student_logits: jax.Array, batch: dict, settings: SDPOLossSettings) -> jax.Array:
    """TRL's SDPO ``_compute_policy_loss``: ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` per completion token,
    ``r`` the ratio to the rollout's log-probabilities (1 without them), reduced by ``loss_type`` over the batch's
    ``completion_mask``.

    Raises:
        ValueError: an unknown ``loss_type`` (TRL's message).
    """
    log_probs = sampled_log_probs(student_logits, batch["completion_ids"])
    old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(log_probs)
    mask = batch["completion_mask"].astype(jnp.float32)
    log_ratio = log_probs - old
    if settings.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
    ratio = jnp.exp(log_ratio)
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    advantages = batch["advantages"][:, None]
    per_token = -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - settings.epsilon, 1 + high) * advantages)
    masked = per_token * mask
    if settings.loss_type == "grpo":
        return (masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    if settings.loss_type in ("bnpo", "dapo"):
        return masked.sum() / jnp.maximum(mask.sum(), 1.0)
    if settings.loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * settings.max_completion_length)
    raise ValueError(f"Unsupported loss_type: {settings.loss_type}")


def sdpo_step_loss(student_family: Family, teacher_family: Family, settings: SDPOLossSettings) -> Callable:
    """SDPO's step loss: ``(1 - w) * policy_loss + w * distillation_loss`` with ``w = distillation_weight`` (TRL
    computes only the distillation term at 1 and only the policy term, without a teacher forward pass, at 0). The
    distillation's ``loss_mask`` is the completion mask of the rows that have a teacher context
    (``self_distillation_mask``). ``metrics``: the distillation ones (unless ``w`` is 0) and
    ``self_distillation/policy_loss`` (unless ``w`` is 1).
    """
    weight = settings.distillation_weight
    names = ("self_distillation/distillation_loss", f"{settings.metric_prefix}/distillation_loss")

    def loss(pair, batch, num_items_in_batch=None):
        student_logits = completion_logits(student_family, pair.student, batch["input_ids"], batch["attention_mask"],
                                           batch["completion_ids"].shape[1], settings.temperature)
        metrics, value = {}, jnp.float32(0.0)
        if weight != 0.0:
            loss_mask = batch["completion_mask"] * batch["self_distillation_mask"][:, None]
            distilled, metric = distillation_loss(student_logits,
                                                  teacher_logits_of(teacher_family, pair, batch, settings), batch,
                                                  settings, loss_mask)
            value = value + weight * distilled
            metrics.update(dict.fromkeys(names, metric))
        if weight != 1.0:
            policy = policy_loss(student_logits, batch, settings)
            value = value + (1 - weight) * policy
            metrics["self_distillation/policy_loss"] = jax.lax.stop_gradient(policy)
        return value, jnp.float32(1.0), metrics

    return loss
