"""``Trainer``: the transformers training loop on a JAX device mesh, over Tunix models and optax — the recipe.

The loop is ours (Tunix's ``PeftTrainer`` lacks transformers' checkpoint timing, data position and loss
normalisation: ``adapters.upstream``); each step is a jitted ``adapters.training.train_step`` function on the model's
NNX module. The flow around it is transformers' own: ``DefaultFlowCallback`` decides when to log, evaluate, save and
stop, ``ProgressCallback`` draws the bar and the reporting integrations receive the logs. The components it wires
sit beside it, one job per module (the package docstring lists them).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..adapters.distributed import mesh as mesh_lib
from ..adapters.distributed.peer_watch import PeerWatch
from ..adapters.distributed.preemption import PreemptionWatch
from ..adapters.lora import runtime as lora_runtime
from ..adapters.model import neftune, nnx_state
from ..adapters.training import train_step
from ..optim import build_optimizer
from ..type_aliases import RowsLike
from . import batches, checkpoints, hub, step_logs
from .accelerator import Accelerator
from .callbacks import (
    default_callbacks,
    new_control,
    new_state,
    record_callback_states,
    restore_callback_states,
    run_state,
)
from .device_mesh import resolve_mesh
from .evaluation import PredictionGatherer, causal_lm_found, prefixed_metrics, with_predictions
from .lora_step import dropout_in_step, merged_lora_scale
from .loss_selection import select_loss, select_outputs, signature_columns
from .model_interface import active_lora_config, as_trainable_model
from .prefetch import prefetched

if TYPE_CHECKING:
    from ..type_aliases import EvalDatasetLike

__all__ = ["TrainOutput", "Trainer"]

logger = logging.getLogger("torchlike")

#: The ``TrainerState`` fields a resumed run takes from the checkpoint's ``trainer_state.json``; the others (step
#: intervals, ``max_steps``...) come from the resuming run's arguments.
_RESUMED_STATE_FIELDS = ("global_step", "log_history", "best_metric", "best_global_step", "best_model_checkpoint",
                         "stateful_callbacks", "num_input_tokens_seen")


@dataclass
class TrainOutput:
    """What ``train()`` returns (transformers' field names)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """A ``transformers.Trainer`` for torchlike models and plain Flax NNX modules, on a JAX device mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` / ``PeftModel`` (causal-LM loss with a loss mask), or
            any ``flax.nnx.Module`` with ``loss_fn``.
        args: :class:`~torchlike.TrainingArguments` (or ``SFTConfig``). ``mesh_shape`` /
            ``mesh_axis_names`` pick the device mesh (default: the model's mesh, else every device on
            ``fsdp``); ``per_device_train_batch_size`` times the data-parallel size (the product of
            the mesh's non-``tp`` axes, over all processes) is the global batch.
        data_collator: ``list[example] -> dict[str, np.ndarray]`` with fixed shapes; default: stack.
        train_dataset: a sequence of examples (dicts of arrays or token lists). With
            ``remove_unused_columns`` (the default) the collator sees only the columns the loss reads: ``input_ids``,
            ``attention_mask`` and ``loss_mask`` for a torchlike model, the model's inputs and ``label_names`` with
            ``compute_loss_func``, every column with ``loss_fn``.
        eval_dataset: examples as ``train_dataset`` (a ``datasets.IterableDataset`` is read into a list), or a dict of
            them (a ``datasets.DatasetDict``): each is evaluated on its own, its metrics named
            ``eval_<name>_<metric>``.
        processing_class: the tokenizer (saved with ``save_model``).
        compute_loss_func: transformers' ``(outputs, labels, num_items_in_batch=None) -> loss``, written with
            ``jax.numpy``: ``labels`` is the batch's ``args.label_names`` column (default ``labels``; a tuple for
            several names); ``outputs`` is ``model(**other columns)`` for a plain NNX module, or a
            :class:`~torchlike.CausalLMOutput` with ``logits`` for a torchlike model; ``num_items_in_batch`` counts
            ``labels != -100`` over the whole accumulated step (``labels[..., 1:]`` for torchlike causal LMs, as
            transformers does), so the returned loss is already normalised.
        compute_metrics: transformers' ``EvalPrediction -> dict`` (with a ``compute_result`` argument under
            ``batch_eval_metrics``): ``predictions`` are the model's outputs (a causal LM's logits ``[N, T, V]``),
            ``label_ids`` the ``label_names`` columns or, for a torchlike causal LM, ``input_ids`` where ``loss_mask``
            is 1 and ``-100`` elsewhere; numpy arrays, sequences padded with ``-100`` across batches (see
            :mod:`.evaluation`). Its metrics are logged with the ``eval_`` prefix. Not with ``loss_fn``.
        callbacks: ``transformers.TrainerCallback`` objects (or classes), called at the usual events. transformers'
            ``EarlyStoppingCallback`` works as there: each evaluation during training is compared with
            ``args.metric_for_best_model`` (``state.best_metric``, ``state.best_model_checkpoint``), and its patience
            counter is saved with each checkpoint.
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        loss_fn: JAX-native ``loss_fn(model, batch) -> loss | (loss, aux)``: the mean loss of the
            micro-batch (accumulated micro-batches are averaged) and optionally a dict of scalar
            metrics, logged like ``loss``. Rows that pad the last batch are all zeros: give them no
            weight (e.g. through a mask), or set ``dataloader_drop_last``.
        preprocess_logits_for_metrics: transformers' ``(logits, labels) -> predictions``, run on each evaluation batch
            before it is kept for ``compute_metrics``; it receives CPU torch tensors, as transformers gives it the
            model's tensors.

    Example:

    ```python
    >>> from torchlike import AutoModelForCausalLM, Trainer, TrainingArguments
    >>> model = AutoModelForCausalLM.from_pretrained("path/to/qwen2", dtype="float32")
    >>> rows = [{"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [1] * len(ids)} for ids in data]
    >>> trainer = Trainer(model, TrainingArguments("out", max_steps=10), train_dataset=rows)
    >>> trainer.train().training_loss
    ```
    """

    #: Whether batches may be prepared ahead in a thread (not when preparing a batch reads the weights).
    _allow_prefetch = True

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), loss_fn: Callable | None = None,
                 preprocess_logits_for_metrics: Callable | None = None, **unsupported):
        from transformers.trainer_callback import CallbackHandler

        from ..field_support import check_unsupported

        if unsupported:
            raise TypeError(f"Trainer got unsupported arguments {sorted(unsupported)}.")
        if compute_loss_func is not None and loss_fn is not None:
            raise ValueError("pass either compute_loss_func (transformers' convention) or loss_fn (JAX-native), "
                             "not both.")
        if args is None:
            from ..training_args import TrainingArguments

            args = TrainingArguments(output_dir="trainer_output")
        if getattr(self, "_checked_args", None) is not args:  # a TRL trainer checks its config first, once
            check_unsupported(args)
        if (args.save_strategy == "best" or args.load_best_model_at_end) and args.metric_for_best_model is None:
            raise ValueError("`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
                             "`args.load_best_model_at_end` is set to `True`.")
        if args.compilation_cache_dir:
            from ..adapters.runtime.compilation import enable_compilation_cache

            enable_compilation_cache(args.compilation_cache_dir)
        self.args = args
        self.model = model  # what the user passed, as in transformers
        self._trainable_model = as_trainable_model(model)  # what the loop reads: module, family, mesh, state_dict
        self.data_collator = data_collator or batches.stack_rows
        batches.check_single_dataset(train_dataset, "train_dataset")
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.processing_class = processing_class
        self._custom_optimizer = optimizers[0] if optimizers else None
        self._loss_fn = loss_fn
        self._compute_loss_func = compute_loss_func
        self.optimizer = None
        self.lr_scheduler = None
        self.accelerator = Accelerator()
        self.mesh = resolve_mesh(args, self._trainable_model)
        if compute_metrics is not None and self._trainable_model is not None:
            select_outputs(self._trainable_model, loss_fn, self._label_names())  # refuses what cannot give outputs
        if args.neftune_noise_alpha and self._trainable_model is not None and self._trainable_model.family is None:
            raise ValueError(f"neftune_noise_alpha={args.neftune_noise_alpha} adds noise to a causal LM's input "
                             f"embeddings, but the model is a plain {type(self._module).__name__} with no known "
                             "embedding layer; add the noise in your model, or unset neftune_noise_alpha.")
        self.state = new_state()
        self.control = new_control()
        self.callback_handler = CallbackHandler([*default_callbacks(args), *(callbacks or [])], model,
                                                processing_class, None, None)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    @property
    def hub_model_id(self) -> str:
        """The Hub repository ``push_to_hub`` uploads to: ``args.hub_model_id`` or the name of ``output_dir``."""
        return hub.repo_id(self.args)

    def end(self) -> None:
        """Closes the reporting integrations' writers (transformers' ``Trainer.end``); there is no torch process
        group to destroy."""
        for callback in self.callback_handler.callbacks:
            writer = getattr(callback, "tb_writer", None)  # only TensorBoardCallback has one
            if writer is not None:
                writer.close()
                callback.tb_writer = None

    @property
    def model_wrapped(self) -> Any:
        """transformers' ``model_wrapped``: the model itself (nothing wraps a JAX model; TRL's callbacks read it).
        ``Any``: the model as given (a ``CausalLM``, ``PeftModel``, classifier or ``nnx.Module``)."""
        return self.model

    #: transformers' flags for torch's distributed wrappers: torchlike shards over a JAX mesh instead.
    is_deepspeed_enabled = False
    is_fsdp_enabled = False

    # ------------------------------------------------------------------ callbacks (transformers API)
    @property
    def callbacks(self) -> list:
        return self.callback_handler.callbacks

    def add_callback(self, callback) -> None:
        """Adds a ``TrainerCallback`` (instance or class)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Removes and returns a callback (instance or class)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Removes a callback (instance or class)."""
        self.callback_handler.remove_callback(callback)

    def _event(self, event: str, **kwargs) -> None:
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        self.control = getattr(self.callback_handler, event)(self.args, self.state, self.control, **kwargs)

    # ------------------------------------------------------------------ the step (hooks the TRL trainers override)
    @property
    def _module(self):
        """The NNX module the step trains."""
        return self._trainable_model.module

    def _model_checkpoints(self) -> bool:
        """Whether ``model.gradient_checkpointing_enable()`` was called (transformers' model then checkpoints whatever
        ``args.gradient_checkpointing`` says)."""
        return bool(getattr(self._trainable_model, "is_gradient_checkpointing", False))  # a PlainModule has none

    def _is_lora(self) -> bool:
        return active_lora_config(self._trainable_model) is not None

    def _lora_dropout(self) -> bool:
        """Whether LoRA dropout is on in the train step (off after TRL's ``disable_dropout_in_model(model)``)."""
        return dropout_in_step(active_lora_config(self._trainable_model)) and \
            not getattr(self._trainable_model, "dropout_disabled", False)

    def _merged_lora_scale(self) -> float | None:
        """The LoRA scale when the train step runs on merged weights (``args.lora_step``), else ``None``."""
        return merged_lora_scale(self.args.lora_step, active_lora_config(self._trainable_model), self._module,
                                 self.mesh, self._lora_dropout())

    def _trainable(self):
        """The NNX filter of the parameters the optimizer updates: an adapter's (its LoRA factors, and the
        ``modules_to_save`` such as a classifier's ``score`` head: ``PeftModel.trainable_filter``), else every
        parameter but the buffers (``nnx_state.TRAINABLE``)."""
        return self._trainable_model.trainable_filter if self._is_lora() else nnx_state.TRAINABLE

    def _loss(self) -> tuple[Callable, Callable | None]:
        """The step loss ``(module, batch, num_items_in_batch) -> (value, weight, aux)`` and, for
        ``compute_loss_func``, the item counter that gives ``num_items_in_batch``; with ``neftune_noise_alpha``,
        NEFTune noise on the input embeddings in training steps (``adapters.model.neftune``), as transformers' hook."""
        loss, count_items = self._step_loss()
        if self.args.neftune_noise_alpha:
            loss = neftune.with_neftune(loss, self.args.neftune_noise_alpha, self._neftune_length())
        return loss, count_items

    def _step_loss(self) -> tuple[Callable, Callable | None]:
        """The hook through which every trainer supplies its loss: ``(step loss, item counter or None)``, the step loss
        ``(module, batch, num_items_in_batch) -> (value, weight, aux)`` as :func:`train_step.make_train_step` reads
        it. Here the built-in loss, ``compute_loss_func`` or ``loss_fn``; a TRL trainer overrides it with its
        ``adapters.losses`` step loss, built from a settings record (``Settings.from_config(self.args, ...)``).
        :meth:`_loss` calls it and adds what the Trainer layers on every loss (NEFTune); subclasses extend
        :meth:`_loss` only to wrap that result (as the pairwise trainers weigh evaluation batches by pairs)."""
        return select_loss(self._trainable_model, self._compute_loss_func, self._loss_fn, self._label_names())

    def _neftune_length(self) -> Callable:
        """``batch -> L``, the length in NEFTune's magnitude ``alpha / sqrt(L * hidden)``: the longest row's real
        tokens, the width a pad-to-longest collator (transformers' default) gives the batch."""
        return neftune.batch_length

    def _label_names(self) -> tuple[str, ...]:
        """The batch columns that hold the labels: ``args.label_names``, by default ``("labels",)``."""
        return tuple(self.args.label_names or ("labels",))

    def _signature_columns(self) -> set[str] | None:
        """The example columns the loss reads, which ``remove_unused_columns=True`` keeps; ``None`` keeps all."""
        if not self.args.remove_unused_columns:
            return None
        return signature_columns(self._trainable_model, self._compute_loss_func, self._loss_fn, self._label_names())

    def _compute_dtype(self):
        import jax.numpy as jnp

        return jnp.bfloat16 if self.args.bf16 else None  # fp16 is refused by the field table

    # ------------------------------------------------------------------ data (hooks the TRL trainers override)
    def _global_batch_size(self) -> int:
        return self.args.per_device_train_batch_size * mesh_lib.data_parallel_size(self.mesh)

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """Example order for ``epoch``: a shuffle seeded by ``data_seed`` (``seed`` when it is ``None``), as
        transformers' ``RandomSampler``, or dataset order with ``train_sampling_strategy="sequential"``."""
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        return batches.sampler_order(len(self.train_dataset), epoch, args.train_sampling_strategy == "sequential",
                                     seed)

    @functools.cached_property
    def _kept_columns(self) -> set[str] | None:
        """:meth:`_signature_columns`, worked out once per trainer (transformers'
        ``_set_signature_columns_if_needed``), not once per batch."""
        return self._signature_columns()

    def _collate(self, examples: list) -> dict[str, np.ndarray]:
        """The data collator on ``examples`` reduced to :meth:`_signature_columns` (``remove_unused_columns``)."""
        return self.data_collator(batches.keep_columns(examples, self._kept_columns))

    def _steps_per_epoch(self) -> int:
        return batches.steps_per_epoch(len(self.train_dataset),
                                       self._global_batch_size() * self.args.gradient_accumulation_steps,
                                       self.args.dataloader_drop_last)

    def _batches(self, epoch: int, skip: int = 0) -> Iterable[dict[str, jax.Array]]:
        """This process's share of the micro-batch groups of one epoch, placed on the mesh (rows over the data axes),
        from step ``skip`` on; the last partial batch is padded, so it trains without a new compilation."""
        return batches.epoch_batches(self._train_rows(), self._get_train_sampler(epoch), self._collate, self.mesh,
                                     self._global_batch_size(), self.args.gradient_accumulation_steps,
                                     self._steps_per_epoch(), skip)

    def _train_rows(self) -> Sequence:
        """What the training batches index: ``train_dataset`` (a TRL trainer may read its prepared dataset through a
        view that hands the collator only the columns it reads)."""
        return self.train_dataset

    def _run_in_batches(self, examples, step: Callable, module, mesh, size: int, what: str) -> list:
        """``step(module, batch)`` over ``examples`` in padded global batches of ``size`` rows on ``mesh``."""
        return batches.run_in_batches(examples, step, module, mesh, size, self._collate, what)

    def _total_steps(self) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(math.ceil(self.args.num_train_epochs * self._steps_per_epoch()))

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Runs the training loop.

        Args:
            resume_from_checkpoint: ``True`` (the latest ``output_dir/checkpoint-*``) or a checkpoint
                path: restores parameters, optimizer state, step and data position, then continues.

        With ``args.load_best_model_at_end`` the model ends with the weights of ``state.best_model_checkpoint``.

        Returns:
            :class:`TrainOutput` with the final step, the mean training loss and run metrics.

        Raises:
            ValueError: no ``train_dataset`` (transformers' message).
        """
        from flax import nnx

        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = self.args
        total_steps = self._total_steps()
        family = getattr(self.model, "family", None)  # a plain module has none
        transformation, schedule = (self._custom_optimizer, None) if self._custom_optimizer else \
            build_optimizer(args, total_steps, getattr(family, "decay_overrides", None))
        self.lr_scheduler = schedule
        if not getattr(self._trainable_model, "requires_grad", True):  # a PlainModule has no such flag
            raise ValueError("optimizer got an empty parameter list: the model is frozen (requires_grad_(False), or "
                             "an adapter loaded with is_trainable=False). Train an unfrozen model, or load the adapter "
                             "with PeftModel.from_pretrained(..., is_trainable=True).")
        trainable = self._trainable()
        self.optimizer = nnx.Optimizer(self._module, transformation, wrt=trainable)
        mesh_lib.shard_module(self.optimizer, self.mesh)  # moments follow the parameters; scalars replicated
        loss, count_items = self._loss()
        step_fn = train_step.make_train_step(loss, trainable, self._compute_dtype(), lora=self._lora_dropout(),
                                             seed=args.seed, count_items=count_items,
                                             merged_lora_scale=self._merged_lora_scale(),
                                             rematerialise=args.gradient_checkpointing or self._model_checkpoints())
        if self._lora_dropout():
            # The dropout RNG nodes exist before the first trace, so the step's graph never changes shape.
            lora_runtime.set_dropout_rng(self._module, jax.random.key(args.seed))
            mesh_lib.shard_module(self._module, self.mesh)
        steps_per_epoch = self._steps_per_epoch()
        self.state = run_state(args, total_steps, steps_per_epoch, self._global_batch_size(),
                               self.callback_handler.callbacks, self.control)
        start_step = self._resume(resume_from_checkpoint) if resume_from_checkpoint else 0
        step = start_step
        epoch = step // steps_per_epoch
        self._event("on_train_begin")
        if args.eval_on_start and self._eval_examples is not None:
            self.evaluate()
        self._logged_losses: list[float] = []
        window: list = []
        started = self._window_started = time.perf_counter()
        watch = self._preemption_watch = (PreemptionWatch(args.jit_checkpoint_grace_period)
                                          if args.enable_jit_checkpoint else None)
        preempted = False
        with mesh_lib.entered(self.mesh), watch or contextlib.nullcontext(), PeerWatch(self._last_complete_checkpoint):
            while step < total_steps and not self.control.should_training_stop:
                self._event("on_epoch_begin")
                epoch_batches = self._batches(epoch, skip=step - epoch * steps_per_epoch)
                for batch in prefetched(epoch_batches, args.prefetch_batches if self._allow_prefetch else 0):
                    self._event("on_step_begin")
                    window.append(self._run_step(step_fn, batch, step))
                    step += 1
                    self.state.global_step = step
                    self.state.epoch = epoch + (step - epoch * steps_per_epoch) / steps_per_epoch
                    self._event("on_step_end")
                    preempted = watch is not None and watch.due(step)
                    if preempted:  # the grace period is for the checkpoint: no evaluation now
                        self.control.should_evaluate = False
                    timed = watch is not None and step - len(window) > start_step  # no compilation in the window
                    window = self._log_save_evaluate(window, schedule, timed=timed)
                    if preempted:
                        self._checkpoint_for_preemption(step)
                    if self.control.should_epoch_stop or self.control.should_training_stop:
                        break
                epoch += 1
                self._event("on_epoch_end")
                if preempted:  # the checkpoint is written: the epoch's evaluation and save would only delay the exit
                    self.control.should_evaluate = self.control.should_save = False
                window = self._log_save_evaluate(window, schedule)
        unlogged = self._record_losses(window)
        metrics = step_logs.run_metrics(self._logged_losses, time.perf_counter() - started, step - start_step,
                                        self.state.train_batch_size * args.gradient_accumulation_steps)
        self.log({**metrics, **self._unlogged_step_metrics(unlogged)})
        self._finish_best_model()
        self._event("on_train_end")
        return TrainOutput(step, metrics["train_loss"], metrics)

    def _last_complete_checkpoint(self) -> str:
        """The newest ``checkpoint-<step>`` folder of ``output_dir`` that passes :func:`checkpoints.check_checkpoint`,
        in words (what a job restarted after a lost process resumes from)."""
        folder, _ = checkpoints.latest_complete_checkpoint(self.args.output_dir, skip=(OSError, ValueError))
        return f"none in {self.args.output_dir} (the run would start over)" if folder is None else str(folder)

    def _checkpoint_for_preemption(self, step: int) -> None:
        """transformers' ``enable_jit_checkpoint``: after a preemption notice (SIGTERM), the checkpoint of the step
        just done (unless this step was saved already) and the end of training, so the job exits normally and
        ``resume_from_checkpoint=True`` continues from this step."""
        folder = Path(self.args.output_dir) / f"{checkpoints.PREFIX}{step}"
        if not (folder / checkpoints.TRAINER_STATE_NAME).is_file():
            folder = self._save_checkpoint(step)
        self._preemption_watch.report(step, str(folder))
        self.control.should_training_stop = True

    def _unlogged_step_metrics(self, values: list[dict]) -> dict[str, float]:
        """What the run's final log adds of the steps after the last logging step (``values``, their step metrics on
        the host): nothing, as transformers' ``Trainer`` (TRL's trainers add their pending metrics)."""
        return {}

    def _finish_best_model(self) -> None:
        """What transformers does with the best checkpoint when training ends: with ``load_best_model_at_end`` the
        model takes its weights; with ``save_total_limit=1`` every other checkpoint folder is deleted."""
        best = self.state.best_model_checkpoint
        if best is None:
            return
        if self.args.load_best_model_at_end:
            logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
            checkpoints.restore_model(best, self._trainable_model)
        if self.args.save_total_limit == 1 and self.state.is_world_process_zero:
            checkpoints.delete_all_but(self.args.output_dir, best)

    def _run_step(self, step_fn: Callable, batch: dict, step: int) -> dict:
        """Runs optimizer step ``step`` (from 0) on ``batch``, a micro-batch group on the mesh, and returns its outputs
        (device arrays) for the logging window. A subclass may add inputs the compiled step reads or take out outputs
        that are not for the logs (GRPO's adaptive entropy controller)."""
        return step_fn(self._module, self.optimizer, batch, np.int32(step))

    def _record_losses(self, window: list) -> list[dict]:
        """Moves the step metrics of one logging window to the host (the only host synchronisation of the loop) and
        keeps their losses, filtered as :func:`.step_logs.filtered_losses` says, for the logs and ``train_loss``."""
        values = mesh_lib.to_host(window)
        self._logged_losses.extend(step_logs.filtered_losses(values, self.args.logging_nan_inf_filter))
        return values

    def _log_save_evaluate(self, window: list, schedule, timed: bool = False) -> list:
        """Logs the window of step metrics, evaluates and saves as ``control`` says; returns the window left. With
        ``timed`` (a preemption watch runs and the window holds no compilation), the steps' time per step, measured
        where the logging waits for them, is told to the watch."""
        if self.control.should_log and window:
            values = self._record_losses(window)
            if timed:
                self._preemption_watch.record(step_seconds=(time.perf_counter() - self._window_started) / len(window))
            learning_rate = schedule.learning_rate(self.state.global_step - 1) if schedule else float("nan")
            self.log(step_logs.window_logs(values, self._logged_losses[-len(values):], learning_rate))
            window = []
        busy = time.perf_counter()
        if self.control.should_evaluate and self._eval_examples is not None:
            is_new_best = self._determine_best_metric(self.evaluate())
            if self.args.save_strategy == "best":
                self.control.should_save = is_new_best
        if self.control.should_save:
            self._save_checkpoint_or_warn(self.state.global_step)
        # The steps' timer runs from the window's start and leaves out the evaluations and saves made meanwhile.
        self._window_started = time.perf_counter() if not window else \
            self._window_started + (time.perf_counter() - busy)
        return window

    def _determine_best_metric(self, metrics: dict[str, float]) -> bool:
        """transformers' ``Trainer._determine_best_metric``: whether ``metrics`` (an evaluation's) beat
        ``state.best_metric`` on ``args.metric_for_best_model`` (``eval_`` prefixed when it is not), strictly, in the
        direction ``args.greater_is_better`` gives. A new best is recorded in ``state.best_metric`` and, when
        checkpoints are saved, ``state.best_global_step`` (whose folder becomes ``state.best_model_checkpoint`` once
        written).

        Raises:
            KeyError: the metric is not among ``metrics``.
        """
        args = self.args
        if args.metric_for_best_model is None:
            return False
        name = args.metric_for_best_model
        if not name.startswith("eval_"):
            name = f"eval_{name}"
        if name not in metrics:
            raise KeyError(f"The `metric_for_best_model` training argument is set to '{name}', which is not found in "
                           f"the evaluation metrics. The available evaluation metrics are: {list(metrics.keys())}. "
                           "Consider changing the `metric_for_best_model` via the TrainingArguments.")
        better = np.greater if args.greater_is_better else np.less
        if self.state.best_metric is None:
            self.state.best_metric = float("-inf") if args.greater_is_better else float("inf")
        if not better(metrics[name], self.state.best_metric):
            return False
        self.state.best_metric = metrics[name]
        if args.save_strategy in ("steps", "epoch", "best"):
            self.state.best_global_step = self.state.global_step
        return True

    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` in ``state.log_history`` (with epoch and step) and calls ``on_log``."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluates ``eval_dataset`` (adapters in eval mode, no dropout), as transformers' ``Trainer.evaluate``.

        Args:
            eval_dataset: examples to score (prepared like the trainer's, see :meth:`_prepare_eval_dataset`), a dict
                of them (each evaluated with the prefix ``f"{metric_key_prefix}_{name}"``), the name of one of the
                trainer's eval datasets, or ``None`` for the trainer's ``eval_dataset``.
            ignore_keys: accepted for transformers scripts; outputs are the logits, so there is nothing to ignore.
            metric_key_prefix: the metric names' prefix.

        Returns:
            ``{"eval_loss": summed loss / loss items, "eval_<metric>": ...}`` with ``compute_metrics``' metrics, the
            loss's own metrics and ``eval_runtime``, ``eval_samples_per_second``, ``eval_steps_per_second``; with a
            dict of datasets, the union of each one's.
        """
        from transformers.trainer_utils import speed_metrics

        override = eval_dataset is not None
        dataset = eval_dataset if override else self._eval_examples
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: pass one to evaluate() or to the trainer.")
        if isinstance(dataset, Mapping):
            metrics = {}
            for name, one in dataset.items():
                metrics.update(self.evaluate(one if override else name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if isinstance(dataset, str):
            if not isinstance(self._eval_examples, Mapping) or dataset not in self._eval_examples:
                names = list(self._eval_examples) if isinstance(self._eval_examples, Mapping) else None
                raise KeyError(f"evaluate(eval_dataset={dataset!r}) names one of the trainer's eval datasets, but "
                               f"its eval_dataset is {'a dict of ' + str(names) if names else 'not a dict'}; pass "
                               "one of those names, or the dataset itself.")
            dataset = self._eval_examples[dataset]
        examples = self._prepare_eval_dataset(dataset)
        started = time.time()
        metrics = self._evaluation_loop(examples, metric_key_prefix)
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        metrics.update(speed_metrics(metric_key_prefix, started, num_samples=len(examples),
                                     num_steps=math.ceil(len(examples) / size)))
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    @property
    def eval_dataset(self) -> Any:
        """The evaluation data, as transformers' attribute: what the trainer was given (or a subclass shows in its
        place, as TRL's trainers show their prepared ``datasets.Dataset``). Assigning it replaces what
        :meth:`evaluate` scores."""
        return self._shown_eval_dataset

    @eval_dataset.setter
    def eval_dataset(self, value: EvalDatasetLike | None) -> None:
        self._shown_eval_dataset = self._eval_examples = value

    def _show_eval_dataset(self, shown: RowsLike | dict[str, RowsLike] | None) -> None:
        """Makes ``eval_dataset`` read ``shown`` while :meth:`evaluate` keeps scoring the examples prepared from it."""
        self._shown_eval_dataset = shown

    def _prepare_eval_dataset(self, dataset) -> Sequence:
        """One evaluation dataset as the indexable examples the collator reads (a ``datasets.IterableDataset`` read
        into a list). The TRL trainers prepare raw data here as they prepare ``train_dataset``; the hook must leave
        data it already prepared as it is, since ``evaluate()`` passes every dataset through it."""
        return batches.as_sequence(dataset)

    def _metrics_length(self, lengths: np.ndarray) -> int | None:
        """The positions transformers' collator would have padded an evaluation batch to, given each row's real
        tokens: predictions and labels are cut there before ``compute_metrics`` sees them. ``None`` keeps the
        batch as the data collator made it (the base Trainer: the collator is the user's, as in transformers)."""
        return None

    def _found_for_metrics(self) -> Callable:
        """``(module, batch) -> found``, run inside the eval step: what ``compute_metrics`` reads of a batch
        (``predictions``, ``labels``, ``input_ids``, ``lengths``; :func:`.evaluation.causal_lm_found`)."""
        return causal_lm_found(select_outputs(self._trainable_model, self._loss_fn, self._label_names()),
                               self._label_names())

    def _host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """``(found, rows)`` of one evaluation batch on the host, ``rows`` being its leading real rows: a trainer whose
        batch rows are not the rows ``compute_metrics`` sees rearranges them here. As they are by default."""
        return found, rows

    def _step_metric_prefix(self, metric_key_prefix: str) -> str:
        """The prefix of the metrics the step loss returns (``aux``): the evaluation's own prefix."""
        return metric_key_prefix

    def _evaluation_loop(self, examples: Sequence, metric_key_prefix: str) -> dict[str, float]:
        """transformers' ``evaluation_loop`` over ``examples``: the loss (summed over loss items), the loss's own
        metrics and, with ``compute_metrics`` (unless ``args.prediction_loss_only``), its metrics, all prefixed."""
        loss, count_items = self._loss()
        gatherer = None
        if self.compute_metrics is not None and not self.args.prediction_loss_only:
            gatherer = PredictionGatherer(self.args, self.compute_metrics, self.preprocess_logits_for_metrics)
            whole_batch = gatherer.per_batch and "inputs" in gatherer.include
            loss = with_predictions(loss, self._found_for_metrics(), whole_batch)
        step_fn = train_step.make_eval_step(loss, self._compute_dtype(), count_items)
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        values, done = [], 0
        with mesh_lib.entered(self.mesh):
            for batch, rows in batches.ordered_batches(examples, self.mesh, size, self._collate, "evaluation"):
                outputs = step_fn(self._module, batch)
                values.append(outputs[:3])
                done += rows
                if gatherer is not None:
                    value, weight, _, found = mesh_lib.to_host(outputs)
                    found, rows = self._host_found(found, rows)
                    lengths = found.get("lengths")
                    length = self._metrics_length(np.asarray(lengths)[:rows]) if lengths is not None else None
                    with np.errstate(divide="ignore", invalid="ignore"):
                        batch_loss = float(value) / float(weight)
                    gatherer.add(found, batch_loss, rows, length, last=done == len(examples))
        metrics = prefixed_metrics(gatherer.metrics(), metric_key_prefix) if gatherer is not None else {}
        loss_metrics = step_logs.evaluation_metrics(mesh_lib.to_host(values), runtime=0.0)
        metrics[f"{metric_key_prefix}_loss"] = loss_metrics.pop("eval_loss")
        loss_metrics.pop("eval_runtime")  # evaluate() adds transformers' speed metrics
        step_prefix = self._step_metric_prefix(metric_key_prefix)
        metrics.update({f"{step_prefix}_{key.removeprefix('eval_')}": value for key, value in loss_metrics.items()})
        return metrics

    # ------------------------------------------------------------------ checkpoints and the Hub
    def _save_checkpoint(self, step: int) -> Path:
        """Writes ``output_dir/checkpoint-<step>``: the model in Hugging Face format with the tokenizer (a PEFT adapter
        for a LoRA model; not for a plain NNX module), as transformers' Trainer writes it, so ``from_pretrained``
        and serving engines open the folder, beside the Orbax state a resume reads; then pushes it with
        ``hub_strategy="every_save"``."""
        args = self.args
        record_callback_states(self.state, self.callback_handler.callbacks, self.control)

        def export(folder):
            if self._trainable_model.family is not None:
                hub.export_model(self._trainable_model, folder, self.processing_class)
            self._save_checkpoint_extras(Path(folder))

        started = time.perf_counter()
        folder = checkpoints.write_checkpoint(args.output_dir, step, self._trainable_model, self.optimizer,
                                              self.state, args.save_only_model, args.save_total_limit, export)
        if getattr(self, "_preemption_watch", None) is not None:
            self._preemption_watch.record(save_seconds=time.perf_counter() - started)
        self._event("on_save")
        if args.push_to_hub and args.hub_strategy == "every_save":
            self.push_to_hub(commit_message=f"Training in progress, step {step}")
        return folder

    def _save_checkpoint_or_warn(self, step: int) -> None:
        """:meth:`_save_checkpoint`, whose :class:`~.checkpoints.CheckpointSaveError` (a full disk...) stops training,
        or with ``args.on_save_error="warn"`` is logged as a warning while training goes on to the next save."""
        try:
            self._save_checkpoint(step)
        except checkpoints.CheckpointSaveError as error:
            if self.args.on_save_error == "raise":
                raise
            logger.warning("Step %d was not checkpointed; training goes on (on_save_error='warn'). %s", step, error)

    def _save_checkpoint_extras(self, folder: Path) -> None:
        """Writes a trainer's own files into a checkpoint being written (on every process, before the folder counts
        as a checkpoint: ``trainer_state.json`` comes after them). The Trainer has none."""

    def _resume(self, checkpoint: str | bool) -> int:
        """Restores the checkpoint ``resume_from_checkpoint`` names (kept as ``_resumed_from``); returns its step.

        The state takes the saved step, logs, best-model record and callback states, as transformers loads
        ``trainer_state.json``; with ``args.restore_callback_states_from_checkpoint`` the stateful callbacks (e.g.
        ``EarlyStoppingCallback``'s patience counter) and the control are rebuilt from them."""
        folder = checkpoints.find_checkpoint(self.args.output_dir, checkpoint)
        self._resumed_from = folder
        saved = checkpoints.restore_checkpoint(folder, self._trainable_model, self.optimizer)
        for name in _RESUMED_STATE_FIELDS:
            if name in saved:
                setattr(self.state, name, saved[name])
        if self.args.restore_callback_states_from_checkpoint:
            self.control = restore_callback_states(self.callback_handler, self.state.stateful_callbacks, self.control)
        return int(saved["global_step"])

    def save_model(self, output_dir: str | os.PathLike | None = None, _internal_call: bool = False) -> None:
        """Writes the model in Hugging Face format (a PEFT adapter for LoRA models) plus the tokenizer.

        With ``args.push_to_hub``, it then pushes to the Hub (commit "Model save"), as transformers does whatever
        ``hub_strategy`` is: with ``hub_strategy="end"`` this is the push at the end of a script.

        Args:
            output_dir: where to write (default ``args.output_dir``).
            _internal_call: set by :meth:`push_to_hub`, which pushes itself.

        Raises:
            NotImplementedError: a plain NNX module (no Hugging Face format).
        """
        hub.export_model(self._trainable_model, output_dir or self.args.output_dir, self.processing_class)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    # ------------------------------------------------------------------ transformers' metrics files
    def is_world_process_zero(self) -> bool:
        """Whether this is the one process of the run that writes shared files and prints (JAX process 0)."""
        return self.state.is_world_process_zero

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process on its host."""
        return self.state.is_local_process_zero

    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """transformers' ``Trainer.metrics_format``: ``*_runtime`` as a duration, ``*_mem_*`` in MB, ``total_flos``
        in GF, other floats rounded to 4 digits (transformers' own function).

        Args:
            metrics: what ``train()``/``evaluate()`` returned.

        Returns:
            A formatted copy.
        """
        from transformers.trainer_pt_utils import metrics_format

        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Prints ``metrics`` as transformers' ``Trainer.log_metrics`` does (``***** <split> metrics *****`` and one
        aligned ``key = value`` line each; transformers' own function), on process zero only.

        Args:
            split: ``"train"``, ``"eval"``, ``"test"``...
            metrics: what ``train()``/``evaluate()`` returned.
        """
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Writes ``output_dir/<split>_results.json`` as transformers' ``Trainer.save_metrics`` does (indented, sorted
        keys, raw numbers) and, with ``combined``, merges them into ``output_dir/all_results.json``; on process zero
        only, each file replaced atomically.

        Args:
            split: ``"train"``, ``"eval"``, ``"test"`` or ``"all"``.
            metrics: what ``train()``/``evaluate()`` returned.
            combined: also update ``all_results.json``.
        """
        import json

        if not self.is_world_process_zero():
            return
        folder = Path(self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        files = {f"{split}_results.json": metrics}
        if combined:
            every = folder / "all_results.json"
            files["all_results.json"] = {**(json.loads(every.read_text()) if every.exists() else {}), **metrics}
        for name, values in files.items():
            checkpoints.replace_atomically(folder / name, lambda path, values=values: path.write_text(
                json.dumps(values, indent=4, sort_keys=True)))

    def save_state(self) -> None:
        """Writes ``output_dir/trainer_state.json`` (transformers' ``TrainerState.save_to_json`` text), as
        transformers' ``Trainer.save_state`` does; on process zero only, replaced atomically."""
        if not self.is_world_process_zero():
            return
        folder = Path(self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoints.replace_atomically(folder / "trainer_state.json", lambda path: self.state.save_to_json(str(path)))

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, **model_card_kwargs) -> str:
        """Saves to ``output_dir`` and uploads it to ``args.hub_model_id`` (default: the folder name).

        Args:
            commit_message: the Hub commit message.
            blocking: accepted for transformers scripts; the upload always completes before returning.
            token, revision: override ``args.hub_token`` / ``args.hub_revision``.
            model_card_kwargs: transformers' model-card fields (``dataset_name``, ``tags``...); torchlike
                writes no model card, so they are accepted and not used.

        Returns:
            The commit URL.
        """
        self.save_model(_internal_call=True)
        return hub.upload_output_dir(self.args, commit_message, token=token, revision=revision)
