"""The jitted train and eval steps on Tunix NNX modules, used by every trainer.

Gradient accumulation normalised by the total number of loss tokens, LoRA-only or full updates, mixed precision
(:func:`cast_floating`) and rematerialisation (:func:`rematerialised`), around a step loss from ``adapters/losses/``
(SFT's next-token loss is ``adapters.losses.sft.sft_step_loss``).

Tunix's ``PeftTrainer`` averages per-micro-batch means through ``optax.MultiSteps``; transformers
and TRL divide the summed loss by the number of loss tokens across all micro-batches. This
module owns the step so the numerics match TRL, while the model, its forward pass and Qwix LoRA
stay Tunix's (``adapters.upstream`` lists what each step works around).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..lora import runtime as lora_runtime
from ..runtime.tracing import record_trace, traced_cheaply


@contextlib.contextmanager
def rematerialised(module: nnx.Module):
    """Rematerialises each decoder layer of a Tunix ``module`` (``gradient_checkpointing``) inside the block.

    Meant to be entered while a train step is traced, so rematerialisation applies only where gradients are taken:
    the sampler, log-prob and eval passes run the same module without it (``nnx.remat`` inside the sampler's
    ``while_loop`` fails, and costs recomputation where nothing is differentiated). Decoder layers whose config has
    a ``remat_config`` get ``DECODER``; modules that hold a ``remat_config`` of their own (Gemma's attention
    blocks) get ``BLOCK``. The previous settings are restored on exit, so the module's structure is unchanged. It
    reads Tunix's ``remat_config`` fields, listed in ``adapters.upstream``.

    Raises:
        ValueError: the module has no layer Tunix can rematerialise.
    """
    restore: list[Callable[[], None]] = []
    for _, child in nnx.iter_modules(module):
        config = getattr(child, "config", None)
        remat = getattr(config, "remat_config", None)
        if remat is not None and hasattr(type(remat), "DECODER") and type(child).__name__ == "DecoderLayer":
            child.config = dataclasses.replace(config, remat_config=type(remat).DECODER)
            restore.append(lambda child=child, config=config: setattr(child, "config", config))
        own = getattr(child, "remat_config", None)
        if own is not None and hasattr(type(own), "BLOCK"):
            child.remat_config = type(own).BLOCK
            restore.append(lambda child=child, own=own: setattr(child, "remat_config", own))
    if not restore:
        raise ValueError(f"gradient_checkpointing=True but {type(module).__name__} has no layer that Tunix can "
                         "rematerialise; set gradient_checkpointing=False for this model.")
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


_micro_batch_keys: list[jax.Array] = []


def training_key() -> jax.Array | None:
    """The random key of the micro-batch whose loss a train step (:func:`make_train_step`) is tracing, ``None``
    anywhere else (eval steps, log-prob passes, the sampler): a loss that perturbs only in training
    (``adapters.model.neftune``) reads it. Step ``i``'s micro-batch ``m`` gets
    ``split(fold_in(key(seed), i), A)[m]``, so a resumed run draws what an uninterrupted one does."""
    return _micro_batch_keys[-1] if _micro_batch_keys else None


@contextlib.contextmanager
def _micro_batch_key(key: jax.Array):
    _micro_batch_keys.append(key)
    try:
        yield
    finally:
        _micro_batch_keys.pop()


def mean_loss(loss_fn: Callable) -> Callable:
    """Wraps a JAX-native ``loss_fn(model, batch) -> loss | (loss, aux)`` (a mean over its batch, ``aux`` a
    dict of scalars): each micro-batch weighs 1, so accumulation averages the micro-batch losses."""

    def loss(module, batch, num_items_in_batch=None):
        out = loss_fn(module, batch)
        value, aux = out if isinstance(out, tuple) else (out, {})
        if not isinstance(aux, dict):
            raise TypeError(f"loss_fn returned (loss, {type(aux).__name__}); the second element must be a dict of "
                            "scalar metrics, e.g. {'accuracy': acc}.")
        return value, jnp.float32(1.0), aux

    return loss


def label_count(shift: bool, label_name: str = "labels") -> Callable:
    """``count(batch) -> labels != -100`` over ``labels[..., 1:]`` when ``shift`` (causal LMs, as transformers
    counts ``num_items_in_batch``), or over all labels; a ``shift_labels`` column is used as is. ``label_name`` is
    the batch key of the labels (``TrainingArguments.label_names[0]``)."""

    def count(batch):
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        else:
            labels = batch[label_name][..., 1:] if shift else batch[label_name]
        return (labels != -100).sum().astype(jnp.float32)

    return count


def transformers_loss(compute_loss_func: Callable, call_model: Callable, count: Callable,
                      label_names: tuple[str, ...] = ("labels",)) -> Callable:
    """A transformers ``compute_loss_func(outputs, labels, num_items_in_batch)`` as a step loss.

    ``outputs = call_model(module, inputs)`` where ``inputs`` is the batch without its label columns
    (``label_names``) and ``shift_labels``; ``labels`` is the one label column, or a tuple of them in
    ``label_names`` order. The function receives the item count of the whole accumulated step, so (as in
    transformers) its value is already normalised and the micro-batch values add up: each is returned scaled back
    by that count, with its own count as weight.
    """

    def loss(module, batch, num_items_in_batch=None):
        missing = [name for name in label_names if name not in batch]
        if missing:
            raise KeyError(f"compute_loss_func needs the label column(s) {missing} (args.label_names="
                           f"{list(label_names)}) but the batch has {sorted(batch)}; set label_names to the "
                           "columns that hold the labels.")
        inputs = {key: value for key, value in batch.items() if key not in (*label_names, "shift_labels")}
        labels = tuple(batch[name] for name in label_names)
        items = count(batch)
        total = items if num_items_in_batch is None else num_items_in_batch
        value = compute_loss_func(call_model(module, inputs), labels[0] if len(labels) == 1 else labels,
                                  num_items_in_batch=total)
        return value * total, items, {}

    return loss


def cast_floating(module: nnx.Module, dtype) -> nnx.Module:
    """A copy of ``module`` whose floating-point state is cast to ``dtype`` (``module`` itself when ``dtype`` is
    ``None``): bf16 compute on full-precision parameters, like torch autocast. Inside a jitted function the cast is
    part of the program, so gradients flow back to the original parameters in their own dtype."""
    if dtype is None:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state))


def make_train_step(
    loss: Callable,
    trainable: Any,
    compute_dtype=None,
    lora: bool = False,
    seed: int = 0,
    count_items: Callable | None = None,
    merged_lora_scale: float | None = None,
    rematerialise: bool = False,
) -> Callable:
    """A jitted ``step(module, optimizer, micro_batches, step_index) -> metrics``.

    Args:
        loss: ``(module, batch, num_items_in_batch) -> (value, weight, aux)``: the step's loss is
            ``sum(values) / sum(weights)`` over the micro-batches (summed NLL / token count for
            :func:`adapters.losses.sft.sft_step_loss`), ``aux`` a dict of scalars averaged over micro-batches.
        trainable: the NNX filter of the parameters to update (``nnx.LoRAParam`` or ``nnx.Param``).
        compute_dtype: run the forward/backward pass with parameters cast to this dtype
            (bf16 mixed precision); the optimizer keeps the full-precision weights.
        lora: run LoRA ops in training mode (dropout on).
        seed: the dropout RNG of step ``i`` is ``fold_in(key(seed), i)``, so a resumed run draws
            the same masks (the key is made inside the program: no host-side key crosses processes); the
            losses' keys (:func:`training_key`) derive from it too.
        count_items: ``batch -> item count``; when given, the step passes the count over all its
            micro-batches to ``loss`` as ``num_items_in_batch`` (transformers' convention).
        merged_lora_scale: run adapted layers as one matmul on ``W + scale * A @ B`` with the factors'
            gradients from thin products (:func:`lora_runtime.lora_linear`) instead of Qwix's three
            matmuls; the caller checks :func:`lora_runtime.mergeable` and that LoRA dropout is off.
        rematerialise: recompute each decoder layer's activations in the backward pass
            (``gradient_checkpointing``; :func:`rematerialised`), in this step only.

    The returned step takes ``micro_batches`` with a leading accumulation axis ``[A, B, T]`` and
    sums the gradients of the values over the ``A`` micro-batches before dividing by the total
    weight, as transformers does with ``num_items_in_batch``. The micro-batches run in one
    ``jax.lax.scan``, so the program holds one forward and backward pass whatever ``A`` is
    (``benchmarks/accumulation.py`` times its compilation against ``A``).
    """
    if merged_lora_scale is not None and lora:
        raise ValueError("merged LoRA weights cannot apply LoRA dropout; use the factored step when lora_dropout > 0.")

    def forward(module, batch, num_items):
        module = cast_floating(module, compute_dtype)
        if merged_lora_scale is not None:
            context = lora_runtime.merged_lora(merged_lora_scale)
        else:
            context = lora_runtime.lora_mode(lora_runtime.TRAIN) if lora else contextlib.nullcontext()
        with rematerialised(module) if rematerialise else contextlib.nullcontext(), context:
            value, weight, aux = loss(module, batch, num_items)
        return value, (weight, aux)

    grad_fn = nnx.value_and_grad(forward, argnums=nnx.DiffState(0, trainable), has_aux=True)

    @nnx.jit
    def step(module, optimizer, micro_batches, step_index):
        record_trace("train_step", dict(sorted(micro_batches.items())))
        if lora:
            lora_runtime.set_dropout_rng(module, jax.random.fold_in(jax.random.key(seed), step_index))
        count = jax.tree.leaves(micro_batches)[0].shape[0]
        num_items = None
        if count_items is not None:
            num_items = sum(count_items(jax.tree.map(lambda x, i=index: x[i], micro_batches)) for index in range(count))
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), step_index), count)
        graphdef, state = nnx.split(module)
        # The gradients are summed over the micro-batches as flat leaves in the order of the trainable state's.
        trainable_state = nnx.state(module, trainable)
        grad_leaves = [jnp.zeros(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(trainable_state)]

        def body(carry, inputs):
            # One micro-batch: its gradients join the sum, its value, weight and metrics are stacked (summed in
            # order after the scan), and the module's state goes on to the next one (the LoRA dropout stream).
            state, grad_sum = carry
            batch, key = inputs
            micro_module = nnx.merge(graphdef, state)
            with _micro_batch_key(key):
                (value, (weight, aux)), micro_grads = grad_fn(micro_module, batch, num_items)
            leaves = jax.tree.leaves(micro_grads)
            if [(leaf.shape, leaf.dtype) for leaf in leaves] != [(leaf.shape, leaf.dtype) for leaf in grad_sum]:
                raise ValueError("the gradients do not have the trainable parameters' shapes and dtypes")
            return (nnx.state(micro_module), [total + leaf for total, leaf in zip(grad_sum, leaves, strict=True)]), \
                (value, weight, aux)

        # The micro-batches run in one scan: one compiled forward and backward pass whatever the accumulation.
        (state, grad_leaves), (values, weights, auxes) = jax.lax.scan(body, (state, grad_leaves),
                                                                     (micro_batches, keys))
        grads = jax.tree.unflatten(jax.tree.structure(trainable_state), grad_leaves)
        total_value, total_weight = values[0], weights[0]
        aux_sum = {key: value[0] for key, value in auxes.items()}
        for index in range(1, count):  # in order, as a loop over the micro-batches adds them
            total_value, total_weight = total_value + values[index], total_weight + weights[index]
            aux_sum = {key: aux_sum[key] + auxes[key][index] for key in aux_sum}
        nnx.update(module, state)
        scale = 1.0 / jnp.maximum(total_weight, 1e-9)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)  # bf16 grads stay bf16: no dtype drift
        grad_norm = optax.tree.norm(grads)
        optimizer.update(module, grads)
        return {"loss": total_value * scale, "grad_norm": grad_norm, "weight": total_weight,
                **{key: value / count for key, value in aux_sum.items()}}

    return traced_cheaply(step)


def make_eval_step(loss: Callable, compute_dtype=None, count_items: Callable | None = None) -> Callable:
    """A jitted ``step(module, batch) -> (value, weight, aux)`` with ``loss`` as in :func:`make_train_step`
    (adapters in eval mode, no dropout)."""

    @nnx.jit
    def step(module, batch):
        record_trace("eval_step", dict(sorted(batch.items())))
        module = cast_floating(module, compute_dtype)
        return loss(module, batch, count_items(batch) if count_items is not None else None)

    return traced_cheaply(step)
