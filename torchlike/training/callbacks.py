"""transformers' callback machinery for the Trainer: the callbacks it starts with, fresh state and control, and the
stateful callbacks' states a checkpoint keeps.

transformers' ``DefaultFlowCallback`` decides when to log, evaluate, save and stop; the integrations named by
``report_to`` (TensorBoard, W&B) receive the logs; a tqdm bar showing the latest loss and learning rate (or, with
``disable_tqdm``, transformers' ``PrinterCallback``) shows progress. Callbacks that are transformers'
``ExportableState`` (``EarlyStoppingCallback``) have their state written to ``trainer_state.json`` and restored from it
as transformers does. transformers is imported on first use, so that importing the trainers stays light.
"""

from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger("torchlike")

__all__ = ["default_callbacks", "interval_steps", "new_control", "new_state", "point_tensorboard_at",
           "progress_bar_with_loss", "record_callback_states", "restore_callback_states", "run_state"]


def new_state():
    """A fresh transformers ``TrainerState``, with the process-zero flags of this JAX process."""
    import jax
    from transformers import TrainerState

    state = TrainerState()
    state.is_world_process_zero = state.is_local_process_zero = jax.process_index() == 0
    return state


def _exportable(callbacks: list, control) -> list:
    """The callbacks whose state a checkpoint holds (transformers' ``ExportableState`` ones) and the control."""
    from transformers.trainer_callback import ExportableState

    return [callback for callback in [*callbacks, control] if isinstance(callback, ExportableState)]


def run_state(args, total_steps: int, steps_per_epoch: int, train_batch_size: int, callbacks: list, control):
    """A fresh ``TrainerState`` for a run of ``total_steps``, with the intervals ``DefaultFlowCallback`` reads
    (``eval_steps`` falls back to ``logging_steps``, as in transformers) and, in ``stateful_callbacks``, the starting
    state of each ``ExportableState`` callback (``EarlyStoppingCallback``...) and of ``control``."""
    from transformers import TrainerState

    state = new_state()
    state.stateful_callbacks = TrainerState(stateful_callbacks=_exportable(callbacks, control)).stateful_callbacks
    state.max_steps = total_steps
    state.num_train_epochs = math.ceil(total_steps / steps_per_epoch)
    state.train_batch_size = train_batch_size
    state.logging_steps = interval_steps(args.logging_steps, total_steps)
    state.eval_steps = interval_steps(args.eval_steps or args.logging_steps, total_steps)
    state.save_steps = interval_steps(args.save_steps, total_steps)
    return state


def record_callback_states(state, callbacks: list, control) -> None:
    """Stores each ``ExportableState`` callback's ``state()`` (and ``control``'s) in ``state.stateful_callbacks`` before
    a checkpoint's ``trainer_state.json`` is written, as transformers' ``Trainer._save_checkpoint`` does (where the
    entry is a list, for several callbacks of one class, the states are appended to it, as there)."""
    for callback in _exportable(callbacks, control):
        name = type(callback).__name__
        if isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name].append(callback.state())
        else:
            state.stateful_callbacks[name] = callback.state()


def restore_callback_states(handler, stored: dict, control):
    """transformers' ``Trainer._load_callback_state``: each callback of ``handler`` (and ``control``) whose class a
    checkpoint's ``stateful_callbacks`` names is rebuilt from its stored ``args`` and ``attributes`` and replaces the
    running one; classes the trainer does not have are skipped with a warning.

    Args:
        handler: the trainer's ``CallbackHandler``.
        stored: ``stateful_callbacks`` of the checkpoint's ``trainer_state.json``.
        control: the trainer's ``TrainerControl``.

    Returns:
        The control to continue with (rebuilt when the checkpoint holds its state).
    """
    from transformers import TrainerControl

    not_found, rebuilt = [], []
    running = [*handler.callbacks, control]
    for name, states in stored.items():
        same_class = [callback for callback in running if type(callback).__name__ == name]
        if not same_class:
            not_found.append(name)
            continue
        for callback, saved in zip(same_class, states if isinstance(states, list) else [states], strict=False):
            new_callback = type(callback)(**saved.get("args", {}))
            for attribute, value in saved.get("attributes", {}).items():
                setattr(new_callback, attribute, value)
            if isinstance(callback, TrainerControl):
                control = new_callback
            else:
                rebuilt.append(new_callback)
            handler.remove_callback(type(new_callback))
    if not_found:
        logger.warning("Checkpoint included callbacks not included in current configuration. Ignoring. (%s)",
                       ", ".join(not_found))
    for callback in rebuilt:
        handler.add_callback(callback)
    return control


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
