"""Training steps on Tunix NNX modules: causal-LM loss with a loss mask, gradient accumulation
normalised by the total number of loss tokens, LoRA-only or full updates, rematerialisation.

Tunix's ``PeftTrainer`` averages per-micro-batch means through ``optax.MultiSteps``; transformers
and TRL divide the summed loss by the number of loss tokens across all micro-batches. This
module owns the step so the numerics match TRL, while the model, its forward pass and Qwix LoRA
stay Tunix's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import qwix_lora
from .families import Family


def enable_rematerialisation(module: nnx.Module) -> int:
    """Turns on per-decoder-layer rematerialisation (``gradient_checkpointing``); returns the layers changed."""
    changed = 0
    for _, child in nnx.iter_modules(module):
        config = getattr(child, "config", None)
        remat = getattr(config, "remat_config", None)
        if remat is not None and hasattr(type(remat), "DECODER") and type(child).__name__ == "DecoderLayer":
            child.config = dataclasses.replace(config, remat_config=type(remat).DECODER)
            changed += 1
    return changed


def causal_lm_loss(family: Family) -> Callable:
    """``loss(module, batch) -> (summed token NLL, number of loss tokens)``.

    ``batch`` holds ``input_ids``, ``attention_mask`` and ``loss_mask`` of shape ``[B, T]``; the
    label of position ``t`` is ``input_ids[t]``, predicted from position ``t - 1``, counted when
    ``loss_mask[t]`` and ``attention_mask[t]`` are both 1 (TRL's ``completion_mask`` alignment).
    """

    def loss(module, batch):
        mask = batch["attention_mask"].astype(bool)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
        length = mask.shape[-1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        attention = causal[None] & mask[:, None, :]
        logits = family.forward(module, batch["input_ids"].astype(jnp.int32), positions, attention)
        log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        targets = batch["input_ids"][:, 1:].astype(jnp.int32)
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        weights = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).astype(jnp.float32)
        return -(picked * weights).sum(), weights.sum()

    return loss


TRACE_COUNTS: dict[str, int] = {"train_step": 0, "eval_step": 0}
"""How many times each step function was traced (each trace is a new XLA program); tests and
debugging read it to check that shapes stay fixed."""


def _cast_floating(state, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def make_train_step(
    loss_sum: Callable,
    trainable: Any,
    compute_dtype=None,
    lora: bool = False,
    seed: int = 0,
) -> Callable:
    """A jitted ``step(module, optimizer, micro_batches, step_index) -> metrics``.

    Args:
        loss_sum: ``(module, batch) -> (summed loss, item count)``.
        trainable: the NNX filter of the parameters to update (``nnx.LoRAParam`` or ``nnx.Param``).
        compute_dtype: run the forward/backward pass with parameters cast to this dtype
            (bf16/fp16 mixed precision); the optimizer keeps the full-precision weights.
        lora: run LoRA ops in training mode (dropout on).
        seed: the dropout RNG of step ``i`` is ``fold_in(key(seed), i)``, so a resumed run draws
            the same masks (the key is made inside the program: no host-side key crosses processes).

    The returned step takes ``micro_batches`` with a leading accumulation axis ``[A, B, T]``,
    sums the gradients of the summed loss over the ``A`` micro-batches and divides by the total
    item count, as transformers does with ``num_items_in_batch``.
    """
    def forward(module, batch):
        if compute_dtype is not None:
            graphdef, state = nnx.split(module)
            module = nnx.merge(graphdef, _cast_floating(state, compute_dtype))
        if lora:
            with qwix_lora.lora_mode(qwix_lora.TRAIN):
                return loss_sum(module, batch)
        return loss_sum(module, batch)

    grad_fn = nnx.value_and_grad(forward, argnums=nnx.DiffState(0, trainable), has_aux=True)

    @nnx.jit
    def step(module, optimizer, micro_batches, step_index):
        TRACE_COUNTS["train_step"] += 1  # runs at trace time only
        if lora:
            qwix_lora.set_dropout_rng(module, jax.random.fold_in(jax.random.key(seed), step_index))
        count = jax.tree.leaves(micro_batches)[0].shape[0]
        total_loss, total_items, grads = 0.0, 0.0, None
        for index in range(count):
            batch = jax.tree.map(lambda x, i=index: x[i], micro_batches)
            (loss, items), micro_grads = grad_fn(module, batch)
            total_loss, total_items = total_loss + loss, total_items + items
            grads = micro_grads if grads is None else jax.tree.map(jnp.add, grads, micro_grads)
        scale = 1.0 / jnp.maximum(total_items, 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        grad_norm = optax.tree.norm(grads)
        optimizer.update(module, grads)
        return {"loss": total_loss * scale, "grad_norm": grad_norm, "num_tokens": total_items}

    return step


def make_eval_step(loss_sum: Callable, compute_dtype=None) -> Callable:
    """A jitted ``step(module, batch) -> (summed loss, item count)`` (adapters in eval mode, no dropout)."""

    @nnx.jit
    def step(module, batch):
        TRACE_COUNTS["eval_step"] += 1  # runs at trace time only
        if compute_dtype is not None:
            graphdef, state = nnx.split(module)
            module = nnx.merge(graphdef, _cast_floating(state, compute_dtype))
        return loss_sum(module, batch)

    return step

