"""KTO math as pure JAX functions that give TRL 1.16's numbers, and the KTO step loss over a batch of unpaired
preference examples.

:func:`kto_loss` and :func:`kto_token_metrics` reproduce the loss and metrics of ``trl.KTOTrainer._compute_loss``
(TRL 1.16 has no separate ``kto_loss`` method; the loss is written inline there), to float32 rounding, including the
gradients: what TRL detaches or computes under ``torch.no_grad`` (the KL estimate, the rewards) is under
``jax.lax.stop_gradient`` here. :func:`kto_step_loss` scores a batch with the policy (the completions, and the
mismatched KL completions in a second forward pass whose output carries no gradient) and reads the reference
log-probabilities from the batch. Shapes: ``B`` examples in a batch, ``T`` positions.

TRL records some metrics only for the micro-batches that hold what they average (``rewards/chosen`` only when the
micro-batch has a desirable example, ...) and logs the mean over the micro-batches that recorded it. The step loss
returns every metric for every micro-batch, 0 where TRL records nothing, with a companion ``present/<name>`` that is
1.0 where TRL records it; :func:`finish_metrics` turns the averaged pair back into TRL's value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from ..lora import runtime as lora_runtime
from ..training.step_metrics import PRESENCE_PREFIX, finish_metrics
from . import logprobs
from . import router as router_loss
from .settings import LossSettings, check_choice, runtime_field

__all__ = ["KL_LOSS_TYPES", "KTO_LOSSES", "KTO_LOSS_TYPES", "KTOLossSettings", "finish_metrics", "kto_loss",
           "kto_step_loss", "kto_token_metrics", "reference_columns", "reference_pass"]


def kto_example_losses(log_ratios: jax.Array, kl: jax.Array, beta: float) -> tuple[jax.Array, jax.Array]:
    """``"kto"`` (Eq. (7) of the KTO paper): desirable ``1 - sigmoid(beta (r - z))``, undesirable
    ``1 - sigmoid(beta (z - r))``.

    Returns:
        ``(desirable losses [B], undesirable losses [B])``.
    """
    return 1 - jax.nn.sigmoid(beta * (log_ratios - kl)), 1 - jax.nn.sigmoid(beta * (kl - log_ratios))


def apo_zero_unpaired_example_losses(log_ratios: jax.Array, kl: jax.Array, beta: float
                                     ) -> tuple[jax.Array, jax.Array]:
    """``"apo_zero_unpaired"`` (the unpaired variant of Eq. (7) of the APO paper; ``kl`` is not read): desirable
    ``1 - sigmoid(beta r)``, undesirable ``sigmoid(beta r)``.

    Returns:
        ``(desirable losses [B], undesirable losses [B])``.
    """
    return 1 - jax.nn.sigmoid(beta * log_ratios), jax.nn.sigmoid(beta * log_ratios)


#: ``loss_type`` -> ``(log_ratios, kl, beta) -> (desirable losses, undesirable losses)``, TRL 1.16's list.
KTO_LOSSES: dict[str, Callable[[jax.Array, jax.Array, float], tuple[jax.Array, jax.Array]]] = {
    "kto": kto_example_losses,
    "apo_zero_unpaired": apo_zero_unpaired_example_losses,
}
#: KTO ``loss_type`` values (TRL 1.16's list, all implemented).
KTO_LOSS_TYPES: tuple[str, ...] = tuple(KTO_LOSSES)
#: Loss types that estimate the KL term from mismatched (prompt, completion) pairs (TRL's ``calculate_KL``).
KL_LOSS_TYPES: tuple[str, ...] = ("kto",)


@dataclass(frozen=True)
class KTOLossSettings(LossSettings):
    """The settings of the KTO loss, named as their ``KTOConfig`` fields (:meth:`from_config`).

    Args:
        beta: temperature of the implied reward ``beta * log(pi / pi_ref)``.
        loss_type: one of :data:`KTO_LOSS_TYPES`.
        desirable_weight: weight of the losses of desirable examples (``label`` True).
        undesirable_weight: weight of the losses of undesirable examples.
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).
    """

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    router_aux_loss_coef: float = runtime_field(0.0)

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)

    @property
    def estimates_kl(self) -> bool:
        """Whether the loss reads the KL term (TRL's ``calculate_KL``): the batch then needs the KL columns."""
        return self.loss_type in KL_LOSS_TYPES


def _masked_sum(values: jax.Array, weights: jax.Array) -> jax.Array:
    return (values * weights).sum()


def _ratio(total: jax.Array, count: jax.Array) -> jax.Array:
    """``total / count``, 0 when ``count`` is 0 (TRL then records nothing; see :func:`finish_metrics`)."""
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def kto_loss(
    policy_logps: jax.Array,
    reference_logps: jax.Array,
    labels: jax.Array,
    policy_kl_logps: jax.Array | None = None,
    reference_kl_logps: jax.Array | None = None,
    *,
    settings: KTOLossSettings,
    row_mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The KTO loss of a batch of unpaired examples and TRL's reward metrics, as ``KTOTrainer._compute_loss``.

    With log-ratios ``r = logp - ref_logp`` and the KL estimate
    ``z = max(0, mean_b(stop_gradient(logp_KL - ref_logp_KL)))`` (the mean over the global batch stands for TRL's
    per-process mean averaged over processes; ``z = 0`` for ``"apo_zero_unpaired"``):

    each example's loss is its ``loss_type``'s entry of :data:`KTO_LOSSES` (:func:`kto_example_losses`,
    :func:`apo_zero_unpaired_example_losses`).

    ``loss = mean_b(w_b * loss_b)`` with ``w = desirable_weight`` or ``undesirable_weight`` by label.

    Args:
        policy_logps: ``[B]`` summed completion log-probabilities under the policy.
        reference_logps: ``[B]`` under the reference model.
        labels: ``[B]`` True (or 1) for desirable completions.
        policy_kl_logps: ``[B]`` summed log-probabilities of the KL completions (each prompt with another example's
            completion) under the policy; required when ``settings.estimates_kl``.
        reference_kl_logps: ``[B]`` under the reference model.
        settings: the loss settings.
        row_mask: ``[B]`` 1 for real examples, 0 for rows padding a partial batch (left out of every mean and
            count); ``None``: all real.

    Returns:
        ``(loss, metrics)``, float32. ``metrics`` are TRL's: ``kl`` (``z``), ``rewards/chosen`` and
        ``rewards/rejected`` (means of ``beta r`` over desirable / undesirable examples), ``logps/chosen`` and
        ``logps/rejected`` (means of the policy log-probabilities), ``rewards/margins`` (their difference), each
        of the last five with its ``present/<name>`` indicator (see the module docstring).
    """
    real = jnp.ones(policy_logps.shape, jnp.float32) if row_mask is None else row_mask.astype(jnp.float32)
    desirable = labels.astype(bool).astype(jnp.float32) * real
    undesirable = (1.0 - labels.astype(bool).astype(jnp.float32)) * real
    policy_logps = policy_logps.astype(jnp.float32)
    log_ratios = policy_logps - reference_logps.astype(jnp.float32)
    if settings.estimates_kl:
        if policy_kl_logps is None or reference_kl_logps is None:
            raise ValueError(f"loss_type={settings.loss_type!r} estimates the KL term: pass policy_kl_logps and "
                             "reference_kl_logps (the log-probabilities of the mismatched KL completions).")
        kl_gaps = jax.lax.stop_gradient(policy_kl_logps.astype(jnp.float32) - reference_kl_logps.astype(jnp.float32))
        kl = jnp.maximum(_ratio(_masked_sum(kl_gaps, real), real.sum()), 0.0)
    else:
        kl = jnp.float32(0.0)
    beta = settings.beta
    desirable_losses, undesirable_losses = KTO_LOSSES[settings.loss_type](log_ratios, kl, beta)
    losses = (settings.desirable_weight * desirable_losses * desirable
              + settings.undesirable_weight * undesirable_losses * undesirable)
    loss = _ratio(losses.sum(), real.sum())

    rewards = beta * jax.lax.stop_gradient(log_ratios)
    logps = jax.lax.stop_gradient(policy_logps)
    desirable_count, undesirable_count = desirable.sum(), undesirable.sum()
    metrics = {
        "kl": kl,
        "rewards/chosen": _ratio(_masked_sum(rewards, desirable), desirable_count),
        "logps/chosen": _ratio(_masked_sum(logps, desirable), desirable_count),
        "rewards/rejected": _ratio(_masked_sum(rewards, undesirable), undesirable_count),
        "logps/rejected": _ratio(_masked_sum(logps, undesirable), undesirable_count),
    }
    both = (desirable_count > 0) & (undesirable_count > 0)
    metrics["rewards/margins"] = jnp.where(both, metrics["rewards/chosen"] - metrics["rewards/rejected"], 0.0)
    presence = {"rewards/chosen": desirable_count > 0, "logps/chosen": desirable_count > 0,
                "rewards/rejected": undesirable_count > 0, "logps/rejected": undesirable_count > 0,
                "rewards/margins": both}
    return loss, {**metrics, **{PRESENCE_PREFIX + name: present.astype(jnp.float32)
                                for name, present in presence.items()}}


def kto_token_metrics(entropies: jax.Array, logit_means: jax.Array, completion_mask: jax.Array,
                      labels: jax.Array) -> dict[str, jax.Array]:
    """TRL's per-token KTO metrics: the completion-token mean of the entropy, and of the logits' vocabulary mean over
    the desirable (``logits/chosen``) and undesirable (``logits/rejected``) completions.

    Args:
        entropies: ``[B, T-1]`` entropy of the next-token distribution at each position.
        logit_means: ``[B, T-1]`` mean of the logits over the vocabulary at each position.
        completion_mask: ``[B, T-1]`` the shifted completion mask (1 where the position predicts a completion
            token); 0 on rows padding a partial batch.
        labels: ``[B]`` True (or 1) for desirable completions.

    Returns:
        ``entropy`` (0 when no completion token), ``logits/chosen`` and ``logits/rejected`` with their
        ``present/<name>`` indicators (TRL records them only when the micro-batch has such tokens).
    """
    mask = completion_mask.astype(jnp.float32)
    desirable = labels.astype(bool).astype(jnp.float32)[:, None] * mask
    undesirable = mask - desirable
    entropies, logit_means = jax.lax.stop_gradient(entropies), jax.lax.stop_gradient(logit_means)
    return {
        "entropy": _ratio(_masked_sum(entropies, mask), mask.sum()),
        "logits/chosen": _ratio(_masked_sum(logit_means, desirable), desirable.sum()),
        "logits/rejected": _ratio(_masked_sum(logit_means, undesirable), undesirable.sum()),
        PRESENCE_PREFIX + "logits/chosen": (desirable.sum() > 0).astype(jnp.float32),
        PRESENCE_PREFIX + "logits/rejected": (undesirable.sum() > 0).astype(jnp.float32),
    }


def _completion_log_probs(family: Family, module, batch: Mapping[str, jax.Array], prefix: str, with_metrics: bool,
                          block_size: logprobs.BlockSize) -> tuple[jax.Array, logprobs.TokenScores, jax.Array]:
    """``(summed completion log-probabilities [B], per-token scores [B, T-1], shifted completion mask)`` of the
    ``<prefix>input_ids`` rows."""
    inputs = {"input_ids": batch[f"{prefix}input_ids"], "attention_mask": batch[f"{prefix}attention_mask"]}
    if "images" in batch:  # a vision batch: the prompt's images serve its completion and its KL completion alike
        inputs["images"] = batch["images"]
        if f"{prefix}token_type_ids" in batch:
            inputs["token_type_ids"] = batch[f"{prefix}token_type_ids"]
    scores = logprobs.next_token_scores(family, module, inputs, with_metrics=with_metrics, block_size=block_size)
    mask = batch[f"{prefix}completion_mask"][:, 1:]
    return jnp.where(mask.astype(bool), scores.log_probs, 0.0).sum(-1), scores, mask


def kto_step_loss(family: Family, settings: KTOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The KTO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    ``value`` is TRL's ``KTOTrainer`` loss of the micro-batch (:func:`kto_loss`); the KL completions are scored in a
    second forward pass whose output carries no gradient (TRL runs it under ``torch.no_grad``). Rows that pad a
    partial batch (all-zero attention masks) are left out; ``weight`` is 1 when the micro-batch holds an example, so
    accumulated micro-batches are averaged, as TRL divides by the accumulation steps.
    ``metrics``: :func:`kto_loss`'s and :func:`kto_token_metrics`' (with their ``present/`` indicators, see
    :func:`finish_metrics`) and ``num_tokens`` (the micro-batch's prompt + completion tokens; TRL logs a running
    total). With ``settings.router_aux_loss_coef`` (a mixture-of-experts model) the load-balancing loss of the policy's
    forward pass over the real tokens (not the KL pass) is added times it and logged as ``aux_loss``, as TRL adds
    ``outputs.aux_loss``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`).

    The batch holds ``input_ids``, ``attention_mask``, ``completion_mask`` ``[B, T]``, ``label`` ``[B]`` and
    ``ref_logps`` ``[B]``; with ``settings.estimates_kl`` also ``KL_input_ids``, ``KL_attention_mask``,
    ``KL_completion_mask`` and ``ref_KL_logps`` (``torchlike.trl.data.kto_data.collate_unpaired_batch``'s columns plus
    the reference log-probabilities).
    """

    def loss(module, batch, num_items_in_batch=None):
        real = batch["attention_mask"].any(-1).astype(jnp.float32)
        labels = batch["label"]
        (policy_logps, scores, mask), aux_loss = router_loss.run_with_router_loss(
            family, lambda module: _completion_log_probs(family, module, batch, "", True, block_size),
            module, batch["attention_mask"], settings.router_aux_loss_coef)
        policy_kl_logps = reference_kl_logps = None
        if settings.estimates_kl:
            policy_kl_logps = jax.lax.stop_gradient(
                _completion_log_probs(family, module, batch, "KL_", False, block_size)[0])
            reference_kl_logps = batch["ref_KL_logps"]
        value, metrics = kto_loss(policy_logps, batch["ref_logps"], labels, policy_kl_logps, reference_kl_logps,
                                  settings=settings, row_mask=real)
        tokens = batch["attention_mask"].sum().astype(jnp.float32)
        metrics = {**metrics, **kto_token_metrics(scores.entropies, scores.logit_means, mask, labels),
                   "num_tokens": tokens}
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss


def reference_columns(settings: KTOLossSettings) -> tuple[str, ...]:
    """The batch columns of the reference log-probabilities :func:`kto_step_loss` reads (TRL's names)."""
    return ("ref_logps", "ref_KL_logps") if settings.estimates_kl else ("ref_logps",)


def reference_pass(family: Family, lora: str, mesh, settings: KTOLossSettings,
                   block_size: logprobs.BlockSize = "auto") -> Callable:
    """``(module, batch, num_items_in_batch=None) -> (ref_logps [B], ref_KL_logps [B])`` (only ``ref_logps`` when
    the loss type has no KL term): the summed completion log-probabilities of a reference (TRL's
    ``compute_ref_log_probs``), run with its adapter in mode ``lora`` and replicated over ``mesh`` so that every
    process reads all rows."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prefixes = ("", "KL_") if settings.estimates_kl else ("",)

    def reference_log_probs(module, batch, num_items_in_batch=None):
        with lora_runtime.lora_mode(lora):
            return tuple(jax.lax.with_sharding_constraint(
                _completion_log_probs(family, module, batch, prefix, False, block_size)[0], replicated)
                for prefix in prefixes)

    return reference_log_probs
