"""``TrainingArguments`` optimizer and learning-rate schedule settings as optax transformations.

The schedules follow transformers' ``get_scheduler`` (linear, cosine, constant,
constant_with_warmup): step ``k`` (0-based, one per optimizer update) gets the same learning
rate the torch scheduler gives after ``k`` calls to ``scheduler.step()``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import optax

from .adapters.nnx_state import dotted_path
from .training_args import LR_SCHEDULERS, OPTIMIZERS


def learning_rate_schedule(args, total_steps: int) -> Callable[[int], float]:
    """``step -> learning rate`` for ``args.lr_scheduler_type`` over ``total_steps`` optimizer steps.

    Raises:
        ValueError: an unsupported schedule, listing the supported ones.
    """
    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if name not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {list(LR_SCHEDULERS)}.")
    peak = float(args.learning_rate)
    warmup = args.get_warmup_steps(total_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(1, warmup)
        if name == "constant":
            return jnp.asarray(peak, jnp.float32)
        if name == "constant_with_warmup":
            return peak * jnp.where(step < warmup, warm, 1.0)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if name == "linear":
            after = jnp.maximum(0.0, (total_steps - step) / max(1, total_steps - warmup))
        else:
            after = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * 0.5 * 2.0 * progress)))
        return peak * jnp.where(step < warmup, warm, after)

    return schedule


def _decay_mask(params):
    """transformers decays every weight except biases and normalisation weights."""
    import jax

    def decays(path, _):
        name = dotted_path(path).lower()
        return not ("norm" in name or name.endswith("bias") or "_bias" in name)

    return jax.tree_util.tree_map_with_path(decays, params)


def build_optimizer(args, total_steps: int) -> tuple[optax.GradientTransformation, Callable[[int], float]]:
    """The optax chain for ``args``: global-norm clipping (``max_grad_norm > 0``) then AdamW (or SGD)
    with the learning-rate schedule; ``optim`` names map as in ``training_args.OPTIMIZERS``.

    Returns:
        ``(transformation, schedule)``.

    Raises:
        ValueError: an ``optim`` with no optax counterpart, listing the accepted names.
    """
    schedule = learning_rate_schedule(args, total_steps)
    optim = str(getattr(args.optim, "value", args.optim))
    kind = OPTIMIZERS.get(optim)
    if kind == "adamw":
        core = optax.adamw(schedule, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon,
                           weight_decay=args.weight_decay, mask=_decay_mask if args.weight_decay else None)
    elif kind == "sgd":
        core = optax.chain(optax.add_decayed_weights(args.weight_decay, _decay_mask), optax.sgd(schedule))
    else:
        raise ValueError(f"optim={optim!r} is not supported on JAX; use one of {list(OPTIMIZERS)}.")
    if args.max_grad_norm and args.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), core), schedule
    return core, schedule
