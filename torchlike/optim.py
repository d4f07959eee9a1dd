"""``TrainingArguments`` optimizer and learning-rate schedule settings as optax transformations.

The schedules follow transformers' ``get_scheduler`` (linear, cosine, constant,
constant_with_warmup): step ``k`` (0-based, one per optimizer update) gets the same learning
rate the torch scheduler gives after ``k`` calls to ``scheduler.step()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import optax

ADAMW_VARIANTS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused",
                  "adamw_anyprecision", "adamw")
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def warmup_steps_for(args, total_steps: int) -> int:
    """transformers' rule: ``warmup_steps`` if set (a float below 1 is a ratio of the total), else ``warmup_ratio``."""
    steps = getattr(args, "warmup_steps", 0) or 0
    if 0 < steps < 1:
        return math.ceil(total_steps * steps)
    if steps:
        return int(steps)
    ratio = getattr(args, "warmup_ratio", None) or 0.0
    return math.ceil(total_steps * ratio)


def learning_rate_schedule(args, total_steps: int) -> Callable[[int], float]:
    """``step -> learning rate`` for ``args.lr_scheduler_type`` over ``total_steps`` optimizer steps.

    Raises:
        ValueError: an unsupported schedule, listing the supported ones.
    """
    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {list(SCHEDULES)}.")
    peak = float(args.learning_rate)
    warmup = warmup_steps_for(args, total_steps)

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
        name = ".".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path).lower()
        return not ("norm" in name or name.endswith("bias") or "_bias" in name)

    return jax.tree_util.tree_map_with_path(decays, params)


def build_optimizer(args, total_steps: int) -> tuple[optax.GradientTransformation, Callable[[int], float]]:
    """The optax chain for ``args``: global-norm clipping (``max_grad_norm > 0``) then AdamW (or SGD /
    Adafactor) with the learning-rate schedule.

    Returns:
        ``(transformation, schedule)``.

    Raises:
        ValueError: an ``optim`` with no optax counterpart, listing the accepted names.
    """
    schedule = learning_rate_schedule(args, total_steps)
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in ADAMW_VARIANTS:
        core = optax.adamw(schedule, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon,
                           weight_decay=args.weight_decay, mask=_decay_mask if args.weight_decay else None)
    elif optim == "sgd":
        core = optax.chain(optax.add_decayed_weights(args.weight_decay, _decay_mask), optax.sgd(schedule))
    elif optim == "adafactor":
        core = optax.adafactor(schedule, weight_decay_rate=args.weight_decay or None)
    else:
        raise ValueError(f"optim={optim!r} is not supported on JAX; use one of {list(ADAMW_VARIANTS)}, 'sgd' or "
                         "'adafactor'.")
    if args.max_grad_norm and args.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), core), schedule
    return core, schedule
