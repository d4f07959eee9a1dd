"""``TrainingArguments`` optimizer and learning-rate schedule settings as optax transformations.

The learning rates are transformers' own: ``transformers.get_scheduler(lr_scheduler_type, ...)`` with
``get_warmup_steps(total_steps)`` and ``lr_scheduler_kwargs`` builds its ``LambdaLR`` on a one-parameter torch
optimizer, and step ``k`` (0-based, one per optimizer update) gets ``learning_rate * lr_lambda(k)``: the rate the torch
scheduler gives after ``k`` calls to ``scheduler.step()``. The rates are computed once on the host, in float64, and the
train step reads them from a table, so every schedule and every keyword transformers accepts behaves as it does there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import optax

from .adapters.model.nnx_state import dotted_path
from .training_args import LR_SCHEDULERS, OPTIMIZERS


class LearningRateSchedule:
    """The learning rate of each optimizer step, as a table: an optax schedule and the values transformers logs.

    Args:
        learning_rates: the rate of steps ``0 .. total_steps - 1`` (Python floats, float64).

    Calling it with an optimizer step count (traced inside the train step) gives that step's rate in float32; a count
    past the table gives the last rate. :meth:`learning_rate` gives the float64 value transformers' ``Trainer`` logs.
    """

    def __init__(self, learning_rates: list[float]):
        if not learning_rates:
            learning_rates = [0.0]
        self.learning_rates = list(learning_rates)
        self._table = np.asarray(self.learning_rates, np.float32)

    def __call__(self, count):
        return jnp.asarray(self._table)[jnp.minimum(count, len(self._table) - 1)]

    def learning_rate(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0-based) as a Python float."""
        return self.learning_rates[min(max(int(step), 0), len(self.learning_rates) - 1)]


def learning_rate_schedule(args, total_steps: int) -> LearningRateSchedule:
    """The rate of each of ``total_steps`` optimizer steps for ``args.lr_scheduler_type`` and
    ``args.lr_scheduler_kwargs``, from transformers' ``get_scheduler``.

    Args:
        args: the ``TrainingArguments``: ``learning_rate``, ``lr_scheduler_type``, ``lr_scheduler_kwargs`` and
            ``warmup_steps`` are read.
        total_steps: the run's optimizer steps.

    Raises:
        ValueError: an unsupported schedule, listing the supported ones; or whatever transformers raises for the
            schedule's keywords (``TypeError`` for a keyword the schedule does not take, ``ValueError`` for
            ``cosine_with_min_lr`` without ``min_lr`` / ``min_lr_rate``...).
    """
    import torch
    from transformers.optimization import get_scheduler

    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if name not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {list(LR_SCHEDULERS)}.")
    peak = float(args.learning_rate)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=peak)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=args.get_warmup_steps(total_steps),
                              num_training_steps=total_steps,
                              scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}))
    lr_lambda = scheduler.lr_lambdas[0]  # LambdaLR's rate after k steps is base_lr * lr_lambda(k)
    return LearningRateSchedule([peak * lr_lambda(step) for step in range(total_steps)])


_LAYER_NORM = re.compile(r"(^|\.)ln\d*\.")


def _decay_mask(overrides: Mapping[str, bool] | None = None):
    """transformers decays every weight except biases and normalisation weights (Tunix names its vision tower's
    layer norms ``ln1``/``ln2``); ``overrides`` (NNX path regex -> decays) settle the norms whose name and type
    transformers reads otherwise (``Family.decay_overrides``)."""
    import jax

    rules = [(re.compile(pattern), decays) for pattern, decays in (overrides or {}).items()]

    def decays(path, _):
        name = dotted_path(path)
        for pattern, decided in rules:
            if pattern.fullmatch(name):
                return decided
        name = name.lower()
        return not ("norm" in name or name.endswith("bias") or "_bias" in name or _LAYER_NORM.search(name))

    return lambda params: jax.tree_util.tree_map_with_path(decays, params)


def build_optimizer(args, total_steps: int, decay_overrides: Mapping[str, bool] | None = None
                    ) -> tuple[optax.GradientTransformation, LearningRateSchedule]:
    """The optax chain for ``args``: global-norm clipping (``max_grad_norm > 0``) then AdamW (or SGD)
    with the learning-rate schedule; ``optim`` names map as in ``training_args.OPTIMIZERS``.

    Args:
        decay_overrides: NNX path regex -> whether weight decay applies, over the name rule (the model family's
            ``decay_overrides``: a norm ``transformers`` decays because it is neither an ``nn.LayerNorm`` nor named
            like a norm).

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
                           weight_decay=args.weight_decay,
                           mask=_decay_mask(decay_overrides) if args.weight_decay else None)
    elif kind == "sgd":
        core = optax.chain(optax.add_decayed_weights(args.weight_decay, _decay_mask(decay_overrides)),
                           optax.sgd(schedule))
    else:
        raise ValueError(f"optim={optim!r} is not supported on JAX; use one of {list(OPTIMIZERS)}.")
    if args.max_grad_norm and args.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), core), schedule
    return core, schedule
