"""GOLD (``trl.experimental.gold.GOLDTrainer``, TRL 1.16): General Online Logit Distillation's step loss, with TRL's
metrics.

Without ULD the loss is TRL's ``GOLDTrainer.generalized_jsd_loss``: the generalized JSD of the student's and the
teacher's next-token distributions over the whole vocabulary (both models' logits divided by ``temperature``; ``beta``
0 is the forward KL, 1 the reverse KL) summed over the labelled positions and divided by TRL's ``num_items_in_batch``
(the step's dataset labels counted once per micro-batch: TRL's micro-batches are slices of one repeated batch). With
``use_uld_loss`` the teacher reads its own tokenisation of the texts and the loss is
:func:`adapters.losses.uld.uld_loss` of the micro-batch, which TRL neither divides by the labels nor by
``gradient_accumulation_steps``: the step's loss is the sum of its micro-batches'.

Metrics, each recorded only by the micro-batches it concerns (``present/<name>``): ``on_policy_loss`` and
``off_policy_loss`` (TRL's running totals of ``training_step``'s loss by source, over step-equivalents of ``1 /
gradient_accumulation_steps`` each) and, with the hybrid ULD loss, ``matched_loss`` and ``unmatched_loss`` the same
way.

Columns of a micro-batch (GKD's, ``torchlike.trl.experimental.gkd.gkd_data``): ``input_ids``/``attention_mask``
``[B, W]``, ``completion_mask`` ``[B, W - 1]`` (1 where token ``t + 1`` is a label), ``window_label_count`` ``[B]`` (the
step's dataset labels) and ``on_policy`` ``[B]`` (1 where the micro-batch is the student's own completions); with ULD
``teacher_input_ids``/``teacher_attention_mask`` ``[B, W_t]`` (the teacher's own tokenisation) and the alignment plan's
``uld_*`` columns (:func:`adapters.losses.uld.alignment_columns`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..families import Family
from ..training.step_metrics import PRESENCE_PREFIX
from . import logprobs
from .distillation import generalized_jsd
from .iw_opd import completion_logits
from .settings import LossSettings
from .uld import HybridVocabulary, ULDLossSettings, alignment_from_columns, uld_loss

__all__ = ["GOLDLossSettings", "gold_step_loss"]


@dataclass(frozen=True)
class GOLDLossSettings(LossSettings):
    """The settings of GOLD's loss, named as their ``GOLDConfig`` fields (:meth:`from_config`).

    Args:
        beta: the generalized JSD's interpolation.
        temperature: both models' logits are divided by it in the JSD.
        use_uld_loss: ULD across tokenizers instead of the JSD.
        gradient_accumulation_steps: micro-batches per optimizer step (the step-equivalents of TRL's running
            on/off-policy totals).
    """

    beta: float = 0.5
    temperature: float = 0.9
    use_uld_loss: bool = False
    gradient_accumulation_steps: int = 1


def _recorded(metrics: dict, name: str, value: jax.Array, present: jax.Array) -> None:
    metrics[name] = value * present
    metrics[PRESENCE_PREFIX + name] = present


def _full_logits(family: Family, module, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """``[B, W, V]`` float32 logits at every position of a batch."""
    hidden = logprobs.hidden_states(family, module, {"input_ids": input_ids, "attention_mask": attention_mask})
    return family.logits_from_hidden(module, hidden).astype(jnp.float32)


def gold_step_loss(student_family: Family, teacher_family: Family, settings: GOLDLossSettings,
                   uld: ULDLossSettings | None = None, vocabulary: HybridVocabulary | None = None) -> Callable:
    """``loss(pair, batch, num_items_in_batch) -> (value, weight, metrics)`` for ``train_step.make_train_step``: the
    step's ``sum(values) / sum(weights)`` is TRL's loss of the step (see the module docstring).

    Args:
        student_family, teacher_family: the two models' families.
        settings: the loss's settings.
        uld: with ``use_uld_loss``, the ULD loss's settings.
        vocabulary: with ``uld_use_hybrid_loss``, the two vocabularies' split
            (:func:`adapters.losses.uld.hybrid_vocabulary`).
    """
    if settings.use_uld_loss and uld is None:
        raise ValueError("use_uld_loss=True needs the ULD settings: pass uld=ULDLossSettings.from_config(args).")
    # TRL's running on/off-policy totals divide by step-equivalents of 1 / gradient_accumulation_steps.
    per_step = float(settings.gradient_accumulation_steps)

    def jsd(pair, batch):
        student_logits = completion_logits(student_family, pair.student, batch, settings.temperature)
        teacher_logits = jax.lax.stop_gradient(completion_logits(teacher_family, pair.teacher, batch,
                                                                 settings.temperature))
        divergence = generalized_jsd(student_logits, teacher_logits, settings.beta).divergence
        total = jnp.where(batch["completion_mask"].astype(bool), divergence, 0.0).sum()
        weight = batch["window_label_count"][0].astype(jnp.float32)
        return total, weight, jax.lax.stop_gradient(total / jnp.maximum(weight, 1e-12)), {}

    def universal(pair, batch):
        student_logits = _full_logits(student_family, pair.student, batch["input_ids"], batch["attention_mask"])
        teacher_logits = _full_logits(teacher_family, pair.teacher, batch["teacher_input_ids"],
                                      batch["teacher_attention_mask"])
        rows = (batch["attention_mask"].sum(-1) > 0).sum()
        output = uld_loss(student_logits, teacher_logits, alignment_from_columns(batch), uld, vocabulary, rows)
        metrics = {}
        if uld.uld_use_hybrid_loss:
            present = output.has_hybrid_components.astype(jnp.float32)
            for name, value in (("matched_loss", output.matched_loss), ("unmatched_loss", output.unmatched_loss)):
                _recorded(metrics, name, value * per_step, present)
        # transformers leaves a loss that ignores num_items_in_batch undivided (the model takes loss kwargs): the
        # step's loss is the sum of its micro-batches' ULD losses.
        return output.loss, jnp.float32(1.0 / per_step), jax.lax.stop_gradient(output.loss) * per_step, metrics

    def loss(pair, batch, num_items_in_batch=None):
        total, weight, recorded, metrics = (universal if settings.use_uld_loss else jsd)(pair, batch)
        on_policy = batch["on_policy"].max()
        _recorded(metrics, "on_policy_loss", recorded, on_policy)
        _recorded(metrics, "off_policy_loss", recorded, 1.0 - on_policy)
        return total, weight, metrics

    return loss
