"""transformers' callback machinery for the Trainer: the callbacks it starts with, and fresh state and control.

transformers' ``DefaultFlowCallback`` decides when to log, evaluate, save and stop; the integrations named by
``report_to`` (TensorBoard, W&B) receive the logs; a tqdm bar showing the latest loss and learning rate (or, with
``disable_tqdm``, transformers' ``PrinterCallback``) shows progress. transformers is imported on first use, so that
importing the trainers stays light.
"""

from __future__ import annotations

import math
import os

__all__ = ["default_callbacks", "interval_steps", "new_control", "new_state", "point_tensorboard_at",
           "progress_bar_with_loss", "run_state"]


def new_state():
    """A fresh transformers ``TrainerState``, with the process-zero flags of this JAX process."""
    import jax
    from transformers import TrainerState

    state = TrainerState()
    state.is_world_process_zero = state.is_local_process_zero = jax.process_index() == 0
    return state


def run_state(args, total_steps: int, steps_per_epoch: int, train_batch_size: int):
    """A fresh ``TrainerState`` for a run of ``total_steps``, with the intervals ``DefaultFlowCallback`` reads
    (``eval_steps`` falls back to ``logging_steps``, as in transformers)."""
    state = new_state()
    state.max_steps = total_steps
    state.num_train_epochs = math.ceil(total_steps / steps_per_epoch)
    state.train_batch_size = train_batch_size
    state.logging_steps = interval_steps(args.logging_steps, total_steps)
    state.eval_steps = interval_steps(args.eval_steps or args.logging_steps, total_steps)
    state.save_steps = interval_steps(args.save_steps, total_steps)
    return state


def interval_steps(value: float | None, total_steps: int) -> int:
    """transformers' reading of ``logging_steps`` / ``eval_steps`` / ``save_steps``: a float below 1 is a fraction
    of the run."""
    if value is None:
        return 0
    return int(math.ceil(total_steps * value)) if 0 < value < 1 else int(value)


def new_control():
    """A fresh transformers ``TrainerControl`` (every flag off)."""
    from transformers import TrainerControl

    return TrainerControl()


def default_callbacks(args) -> list:
    """The callbacks (classes or instances) a Trainer built with ``args`` installs before the user's own.

    Args:
        args: the trainer's :class:`~torchlike.TrainingArguments`: ``report_to``, ``logging_dir`` and
            ``disable_tqdm`` are read.

    Returns:
        ``[DefaultFlowCallback, *reporting integrations, progress callback]``.
    """
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

    progress = PrinterCallback if args.disable_tqdm else progress_bar_with_loss()
    reporters = [reporter() for reporter in get_reporting_integration_callbacks(list(args.report_to or []))]
    point_tensorboard_at(reporters, args.logging_dir)
    return [DefaultFlowCallback, *reporters, progress]


def point_tensorboard_at(callbacks: list, logging_dir: str | os.PathLike | None) -> None:
    """Makes the ``TensorBoardCallback`` among ``callbacks`` write to ``logging_dir`` when it is given.

    transformers' callback reads only ``$TENSORBOARD_LOGGING_DIR`` (else ``output_dir/runs/<time>_<host>``), not
    ``args.logging_dir``, which it deprecates; torchlike still honours the argument, ahead of the variable (listed in
    ``adapters/upstream.py``).
    """
    from transformers.integrations import TensorBoardCallback

    if logging_dir is None:
        return
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = os.path.expanduser(os.fspath(logging_dir))


def progress_bar_with_loss():
    """A transformers ``ProgressCallback`` whose bar also shows the latest logged loss and learning rate."""
    from transformers.trainer_callback import ProgressCallback

    class ProgressWithLoss(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            bar = getattr(self, "training_bar", None)  # ProgressCallback creates it at on_train_begin
            if bar is not None and logs and "loss" in logs:
                bar.set_postfix(loss=f"{logs['loss']:.4g}", lr=f"{logs.get('learning_rate', float('nan')):.3g}",
                                refresh=False)
            return super().on_log(args, state, control, logs=logs, **kwargs)

    return ProgressWithLoss()
