"""``Trainer``: the transformers training loop on a JAX device mesh, over Tunix models and optax.

The loop is ours (Tunix's ``PeftTrainer`` restores on construction, checkpoints on a timer, does
not save the data position and averages micro-batch means); each step is a jitted function from
``adapters.tunix_sft`` on the Tunix module, with Qwix LoRA when the model has an adapter. The
flow around it is transformers' own: its ``CallbackHandler`` with ``DefaultFlowCallback`` decides
when to log, evaluate, save and stop, its ``ProgressCallback`` draws the tqdm bar and its
reporting integrations (TensorBoard, W&B) receive the logs.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from .adapters import mesh as mesh_lib
from .adapters import qwix_lora, tunix_sft
from .optim import build_optimizer

__all__ = ["Trainer", "TrainOutput"]


@dataclass
class TrainOutput:
    """What ``train()`` returns (transformers' field names)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([np.asarray(row[key]) for row in rows]) for key in rows[0]}


def _enum_value(value):
    return str(getattr(value, "value", value))


def _prefetched(batches: Iterator, depth: int) -> Iterator:
    """Runs ``batches`` (collation and device placement) ``depth`` items ahead in a thread, so the
    device never waits on Python between steps. ``depth <= 0`` runs it inline."""
    if depth <= 0:
        yield from batches
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    finished = object()

    def offer(item) -> bool:
        """Queues ``item`` unless the consumer stopped; returns whether it was queued."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in batches:
                if not offer(item):
                    return
            offer(finished)
        except BaseException as error:  # handed to the training thread, which re-raises it
            offer(error)

    worker = threading.Thread(target=produce, name="torchlike-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if item is finished:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # Training stopped early (max_steps, should_training_stop, an error): let the worker finish the batch
        # it is placing, so no thread is inside JAX when the interpreter exits (that aborts the process).
        stop.set()
        worker.join(timeout=60)


def _point_tensorboard_at(callbacks: list, logging_dir: str | None) -> None:
    """Makes the ``TensorBoardCallback`` among ``callbacks`` write to ``logging_dir`` when it is given.

    transformers 5.12's callback reads only ``$TENSORBOARD_LOGGING_DIR`` (else ``output_dir/runs/<time>_<host>``) and
    no longer ``args.logging_dir``, which it deprecates; torchlike still honours the argument, ahead of the variable.
    """
    from transformers.integrations import TensorBoardCallback

    if logging_dir is None:
        return
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = os.path.expanduser(os.fspath(logging_dir))


class _ProgressWithLoss:
    """transformers' ``ProgressCallback`` showing the latest loss and learning rate on the bar."""

    def __new__(cls):
        from transformers.trainer_callback import ProgressCallback

        class ProgressWithLoss(ProgressCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                bar = getattr(self, "training_bar", None)
                if bar is not None and logs and "loss" in logs:
                    bar.set_postfix(loss=f"{logs['loss']:.4g}", lr=f"{logs.get('learning_rate', float('nan')):.3g}",
                                    refresh=False)
                return super().on_log(args, state, control, logs=logs, **kwargs)

        return ProgressWithLoss()


class Accelerator:
    """The ``accelerate.Accelerator`` attributes TRL scripts touch (``trainer.accelerator``), for JAX processes."""

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def is_local_main_process(self) -> bool:
        return jax.process_index() == 0

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across JAX processes."""
        mesh_lib.barrier("torchlike.accelerator.wait_for_everyone")


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
        train_dataset, eval_dataset: sequences of examples (dicts of arrays or token lists). With
            ``remove_unused_columns`` (the default) the collator sees only the columns the loss reads: ``input_ids``,
            ``attention_mask`` and ``loss_mask`` for a torchlike model, the model's inputs and ``label_names`` with
            ``compute_loss_func``, every column with ``loss_fn``.
        processing_class: the tokenizer (saved with ``save_model``).
        compute_loss_func: transformers' ``(outputs, labels, num_items_in_batch=None) -> loss``, written with
            ``jax.numpy``: ``labels`` is the batch's ``args.label_names`` column (default ``labels``; a tuple for
            several names); ``outputs`` is ``model(**other columns)`` for a plain NNX module, or a
            :class:`~torchlike.CausalLMOutput` with ``logits`` for a torchlike model; ``num_items_in_batch`` counts
            ``labels != -100`` over the whole accumulated step (``labels[..., 1:]`` for torchlike causal LMs, as
            transformers does), so the returned loss is already normalised.
        callbacks: ``transformers.TrainerCallback`` objects (or classes), called at the usual events.
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        loss_fn: JAX-native ``loss_fn(model, batch) -> loss | (loss, aux)``: the mean loss of the
            micro-batch (accumulated micro-batches are averaged) and optionally a dict of scalar
            metrics, logged like ``loss``. Rows that pad the last batch are all zeros: give them no
            weight (e.g. through a mask), or set ``dataloader_drop_last``.

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
                 optimizers=(None, None), loss_fn: Callable | None = None, **unsupported):
        from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, PrinterCallback

        if unsupported:
            raise TypeError(f"Trainer got unsupported arguments {sorted(unsupported)}.")
        if compute_loss_func is not None and loss_fn is not None:
            raise ValueError("pass either compute_loss_func (transformers' convention) or loss_fn (JAX-native), "
                             "not both.")
        if compute_metrics is not None:
            raise ValueError("compute_metrics is not supported yet; evaluate() reports eval_loss.")
        if args is None:
            from .training_args import TrainingArguments

            args = TrainingArguments(output_dir="trainer_output")
        from .trl.fields import check_unsupported

        check_unsupported(args)
        if getattr(args, "compilation_cache_dir", None):
            from .compilation import enable_compilation_cache

            enable_compilation_cache(args.compilation_cache_dir)
        self.args = args
        self.model = model
        self.data_collator = data_collator or _stack
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self._custom_optimizer = optimizers[0] if optimizers else None
        self._loss_fn = loss_fn
        self._compute_loss_func = compute_loss_func
        self.optimizer = None
        self.lr_scheduler = None
        self.accelerator = Accelerator()
        self.mesh = self._resolve_mesh()
        self.state = self._new_state()
        self.control = self._new_control()
        from transformers.integrations import get_reporting_integration_callbacks

        progress = PrinterCallback if getattr(args, "disable_tqdm", False) else _ProgressWithLoss()
        reporters = [reporter() for reporter in get_reporting_integration_callbacks(list(args.report_to or []))]
        _point_tensorboard_at(reporters, args.logging_dir)
        defaults = [DefaultFlowCallback, *reporters, progress]
        self.callback_handler = CallbackHandler([*defaults, *(callbacks or [])], model, processing_class, None, None)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    @property
    def hub_model_id(self) -> str:
        """The Hub repository ``push_to_hub`` uploads to: ``args.hub_model_id`` or the name of ``output_dir``."""
        return getattr(self.args, "hub_model_id", None) or Path(self.args.output_dir).name

    def end(self) -> None:
        """Closes the reporting integrations' writers (transformers 5.18's ``Trainer.end``); there is no torch
        process group to destroy."""
        for callback in self.callback_handler.callbacks:
            writer = getattr(callback, "tb_writer", None)
            if writer is not None:
                writer.close()
                callback.tb_writer = None

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

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _new_state():
        from transformers import TrainerState

        state = TrainerState()
        state.is_world_process_zero = state.is_local_process_zero = jax.process_index() == 0
        return state

    @staticmethod
    def _new_control():
        from transformers import TrainerControl

        return TrainerControl()

    def _event(self, event: str, **kwargs) -> None:
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        self.control = getattr(self.callback_handler, event)(self.args, self.state, self.control, **kwargs)

    @property
    def _module(self):
        return getattr(self.model, "module", self.model)

    def _is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")

    def _lora_dropout(self) -> bool:
        """Whether LoRA dropout is on in the train step (a LoRA model with ``lora_dropout > 0``)."""
        return self._is_lora() and float(self.model.active_peft_config.lora_dropout or 0.0) > 0.0

    def _merged_lora_scale(self) -> float | None:
        """The LoRA scale when the train step runs on merged weights (``args.lora_step``), else ``None``.

        ``"auto"`` merges on CPU meshes, where XLA materialises transposed activations for Qwix's three
        matmuls per adapted layer (:func:`qwix_lora.lora_linear` avoids them); ``"merged"`` asks for it
        everywhere. Neither applies to LoRA
        dropout or to QLoRA's quantised base weights, which cannot be merged.
        """
        choice = getattr(self.args, "lora_step", "auto")
        if not self._is_lora() or choice == "factored":
            return None
        if self._lora_dropout():
            if choice == "merged":
                raise ValueError(f"lora_step='merged' cannot apply lora_dropout="
                                 f"{self.model.active_peft_config.lora_dropout}; set lora_dropout=0.0 or "
                                 "lora_step='auto'.")
            return None
        if not qwix_lora.mergeable(self._module):
            if choice == "merged":
                raise ValueError("lora_step='merged': this model's adapted base weights are quantised (QLoRA) and "
                                 "cannot be merged; use lora_step='auto' or 'factored'.")
            return None
        if choice == "auto" and {device.platform for device in self.mesh.devices.flat} != {"cpu"}:
            return None
        return float(self.model.active_peft_config.scale)

    def _trainable(self):
        from flax import nnx

        return nnx.LoRAParam if self._is_lora() else nnx.Param

    def _loss(self) -> tuple[Callable, Callable | None]:
        """The step loss ``(module, batch, num_items_in_batch) -> (value, weight, aux)`` and, for
        ``compute_loss_func``, the item counter that gives ``num_items_in_batch``."""
        family = getattr(self.model, "family", None)
        if self._compute_loss_func is not None:
            if family is not None:
                from .modeling import CausalLMOutput

                def call_model(module, inputs):
                    return CausalLMOutput(logits=tunix_sft.causal_lm_logits(family, module, inputs))
            else:
                def call_model(module, inputs):
                    return module(**inputs)
            label_names = self._label_names()
            count = tunix_sft.label_count(shift=family is not None, label_name=label_names[0])
            return tunix_sft.transformers_loss(self._compute_loss_func, call_model, count, label_names), count
        if self._loss_fn is not None:
            return tunix_sft.mean_loss(self._loss_fn), None
        if family is None:
            raise ValueError("a plain NNX module needs loss_fn=(model, batch) -> loss | (loss, aux), or "
                             "compute_loss_func=(outputs, labels, num_items_in_batch) -> loss.")
        return tunix_sft.causal_lm_loss(family), None

    def _label_names(self) -> tuple[str, ...]:
        """The batch columns that hold the labels: ``args.label_names``, by default ``("labels",)``."""
        return tuple(self.args.label_names or ("labels",))

    def _signature_columns(self) -> set[str] | None:
        """The example columns the training loss reads, which ``remove_unused_columns=True`` keeps (transformers'
        ``_set_signature_columns_if_needed``); ``None`` keeps every column.

        A torchlike causal LM with the built-in loss reads ``input_ids``, ``attention_mask`` and ``loss_mask``; with
        ``compute_loss_func`` the model reads ``input_ids`` and ``attention_mask`` (a plain NNX module: the
        parameters of its ``__call__``) and the loss the label columns. A JAX-native ``loss_fn`` may read any column,
        so every column is kept for it, as for a module whose ``__call__`` takes ``**kwargs``.
        """
        if not self.args.remove_unused_columns or self._loss_fn is not None:
            return None
        family = getattr(self.model, "family", None)
        if self._compute_loss_func is None:
            return {"input_ids", "attention_mask", "loss_mask"} if family is not None else None
        if family is not None:
            inputs = {"input_ids", "attention_mask"}
        else:
            parameters = inspect.signature(self._module.__call__).parameters.values()
            if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
                return None
            inputs = {parameter.name for parameter in parameters}
        return inputs | set(self._label_names()) | {"shift_labels"}

    def _compute_dtype(self):
        import jax.numpy as jnp

        return jnp.bfloat16 if getattr(self.args, "bf16", False) else None  # fp16 is refused by the field table

    def _resolve_mesh(self):
        """The mesh to train on: ``args.mesh_shape`` when set, else the model's own mesh, else every
        device on ``fsdp``; the model is moved onto it when it lives elsewhere."""
        args = self.args
        shape = getattr(args, "mesh_shape", None)
        model_mesh = getattr(self.model, "mesh", None)
        if shape is None and model_mesh is not None:
            return model_mesh
        devices = jax.devices("cpu") if getattr(args, "use_cpu", False) else None
        names = tuple(getattr(args, "mesh_axis_names", None) or mesh_lib.AXIS_NAMES)
        mesh = mesh_lib.make_mesh(shape, names, devices)
        same = model_mesh is not None and model_mesh.shape == mesh.shape and \
            list(model_mesh.devices.flat) == list(mesh.devices.flat)
        # Even on one device: parameters, optimizer state and batches share one sharding, so the
        # step's outputs come back with its inputs' shardings and the program is traced once.
        if self.model is not None and not same:
            mesh_lib.shard_module(self._module, mesh)
            if hasattr(self.model, "mesh"):
                self.model.mesh = mesh
        return mesh

    def _data_parallel_size(self) -> int:
        return mesh_lib.data_parallel_size(self.mesh)

    def _global_batch_size(self) -> int:
        return self.args.per_device_train_batch_size * self._data_parallel_size()

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """Example order for ``epoch``: a shuffle seeded by ``data_seed`` (``seed`` when it is ``None``), as
        transformers' ``RandomSampler``, or dataset order with ``train_sampling_strategy="sequential"``."""
        if self.args.train_sampling_strategy == "sequential":
            return np.arange(len(self.train_dataset))
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return np.random.default_rng(seed + epoch).permutation(len(self.train_dataset))

    def _collate_rows(self, dataset, indices: np.ndarray, what: str) -> dict[str, np.ndarray]:
        """Collates ``dataset[i]`` for ``indices``; ``-1`` entries become all-zero rows (masks 0), so a
        partial batch keeps the compiled shape."""
        real = indices >= 0
        if not real.any():
            fill = np.zeros_like(indices)
        else:
            fill = np.where(real, indices, indices[real][0])
        batch = self.data_collator(self._used_columns([dataset[int(i)] for i in fill]))
        for key, value in batch.items():
            value = np.asarray(value)
            if value.shape[:1] != (len(indices),):
                raise ValueError(
                    f"the {what} data_collator returned {value.shape[:1] or 'no'} rows for {key!r} but was given "
                    f"{len(indices)} examples; the global batch must split evenly over the data-parallel size "
                    f"{self._data_parallel_size()} (mesh {dict(self.mesh.shape)}), so the collator must return one "
                    "row per example.")
            if not real.all():
                value = value.copy()
                value[~real] = 0
            batch[key] = value
        return batch

    def _used_columns(self, examples: list) -> list:
        """``examples`` reduced to :meth:`_signature_columns` (``remove_unused_columns``), as transformers'
        ``RemoveColumnsCollator`` does before the data collator."""
        kept = self._signature_columns()
        if kept is None or not examples or not isinstance(examples[0], Mapping):
            return examples
        if not kept & set(examples[0]):
            raise ValueError(f"No column of the dataset is read by the training loss: it has {sorted(examples[0])}, "
                             f"the loss reads {sorted(kept)}. Rename the columns, set label_names, or set "
                             "remove_unused_columns=False to give the data collator every column.")
        return [{key: value for key, value in example.items() if key in kept} for example in examples]

    def _steps_per_epoch(self) -> int:
        per_step = self._global_batch_size() * self.args.gradient_accumulation_steps
        if getattr(self.args, "dataloader_drop_last", False):
            steps = len(self.train_dataset) // per_step
            if steps == 0:
                raise ValueError(f"dataloader_drop_last=True drops every batch: the dataset has "
                                 f"{len(self.train_dataset)} examples and one step takes {per_step} "
                                 "(global batch x gradient_accumulation_steps).")
            return steps
        return math.ceil(len(self.train_dataset) / per_step)

    def _batches(self, epoch: int, skip: int = 0) -> Iterable[dict[str, jax.Array]]:
        """This process's share of the micro-batch groups ``[A, B, ...]`` of one epoch, placed on the
        mesh (rows over the data axes). The last partial batch is padded with rows whose masks are
        zero, so it trains without a new compilation."""
        batch_size = self._global_batch_size()
        accumulation = self.args.gradient_accumulation_steps
        order = self._get_train_sampler(epoch)
        per_step = batch_size * accumulation
        sharding = mesh_lib.batch_sharding(self.mesh, batch_axis=1)
        rows = mesh_lib.local_rows(sharding, (accumulation, batch_size), batch_axis=1)
        for step in range(skip, self._steps_per_epoch()):
            indices = np.full(per_step, -1)
            chosen = order[step * per_step:(step + 1) * per_step]
            indices[:len(chosen)] = chosen
            local = indices.reshape(accumulation, batch_size)[:, rows].reshape(-1)
            batch = self._collate_rows(self.train_dataset, local, "training")
            batch = {key: value.reshape(accumulation, rows.stop - rows.start, *value.shape[1:])
                     for key, value in batch.items()}
            yield mesh_lib.place_batch(batch, sharding, batch_size, batch_axis=1)

    def _total_steps(self) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(math.ceil(self.args.num_train_epochs * self._steps_per_epoch()))

    def _interval(self, value, total_steps: int) -> int:
        """transformers' reading of ``*_steps``: a float below 1 is a fraction of the run."""
        if value is None:
            return 0
        return int(math.ceil(total_steps * value)) if 0 < value < 1 else int(value)

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Runs the training loop.

        Args:
            resume_from_checkpoint: ``True`` (the latest ``output_dir/checkpoint-*``) or a checkpoint
                path: restores parameters, optimizer state, step and data position, then continues.

        Returns:
            :class:`TrainOutput` with the final step, the mean training loss and run metrics.
        """
        from flax import nnx

        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset.")
        args = self.args
        total_steps = self._total_steps()
        transformation, schedule = (self._custom_optimizer, None) if self._custom_optimizer else \
            build_optimizer(args, total_steps)
        self.lr_scheduler = schedule
        trainable = self._trainable()
        self.optimizer = nnx.Optimizer(self._module, transformation, wrt=trainable)
        mesh_lib.shard_module(self.optimizer, self.mesh)  # moments follow the parameters; scalars replicated
        loss, count_items = self._loss()
        step_fn = tunix_sft.make_train_step(loss, trainable, self._compute_dtype(), lora=self._lora_dropout(),
                                            seed=args.seed, count_items=count_items,
                                            merged_lora_scale=self._merged_lora_scale(),
                                            rematerialise=args.gradient_checkpointing)
        if self._lora_dropout():
            # The dropout RNG nodes exist before the first trace, so the step's graph never changes shape.
            qwix_lora.set_dropout_rng(self._module, jax.random.key(args.seed))
            mesh_lib.shard_module(self._module, self.mesh)
        steps_per_epoch = self._steps_per_epoch()
        self.state = self._new_state()
        self.state.max_steps = total_steps
        self.state.num_train_epochs = math.ceil(total_steps / steps_per_epoch)
        self.state.train_batch_size = self._global_batch_size()
        self.state.logging_steps = self._interval(args.logging_steps, total_steps)
        self.state.eval_steps = self._interval(getattr(args, "eval_steps", None) or args.logging_steps, total_steps)
        self.state.save_steps = self._interval(args.save_steps, total_steps)
        start_step = self._resume(resume_from_checkpoint) if resume_from_checkpoint else 0
        step = start_step
        epoch = step // steps_per_epoch
        self._event("on_train_begin")
        if getattr(args, "eval_on_start", False) and self.eval_dataset is not None:
            self.evaluate()
        self._logged_losses: list[float] = []
        window: list = []
        started = time.perf_counter()
        with mesh_lib.entered(self.mesh):
            while step < total_steps and not self.control.should_training_stop:
                self._event("on_epoch_begin")
                batches = self._batches(epoch, skip=step - epoch * steps_per_epoch)
                depth = int(getattr(args, "prefetch_batches", 0) or 0) if self._allow_prefetch else 0
                for batch in _prefetched(batches, depth):
                    self._event("on_step_begin")
                    window.append(step_fn(self._module, self.optimizer, batch, np.int32(step)))
                    step += 1
                    self.state.global_step = step
                    self.state.epoch = epoch + (step - epoch * steps_per_epoch) / steps_per_epoch
                    self._event("on_step_end")
                    window = self._log_save_evaluate(window, schedule)
                    if self.control.should_epoch_stop or self.control.should_training_stop:
                        break
                epoch += 1
                self._event("on_epoch_end")
                window = self._log_save_evaluate(window, schedule)
        self._record_losses(window)
        runtime = time.perf_counter() - started
        steps_run = step - start_step
        losses = self._logged_losses
        metrics = {"train_runtime": runtime, "train_loss": float(np.mean(losses)) if losses else float("nan"),
                   "train_steps_per_second": steps_run / max(runtime, 1e-9),
                   "train_samples_per_second": steps_run * self.state.train_batch_size
                   * args.gradient_accumulation_steps / max(runtime, 1e-9)}
        self.log(metrics)
        self._event("on_train_end")
        return TrainOutput(step, metrics["train_loss"], metrics)

    def _record_losses(self, window: list) -> list[dict]:
        """Moves the step metrics of one logging window to the host (the only host synchronisation of
        the loop) and keeps their losses for the logs and ``train_loss``.

        With ``logging_nan_inf_filter``, a nan/inf step loss is replaced as transformers' training loop
        does: by the sum of the window's earlier (already filtered) losses divided by one plus their
        count, ``tr_loss / (1 + global_step - _globalstep_last_logged)``; the update itself is not
        skipped. transformers applies the rule per micro-batch; here the unit is the optimizer step.
        """
        values = mesh_lib.to_host(window)
        window_sum = 0.0
        for earlier, value in enumerate(values):
            loss = float(value["loss"])
            if self.args.logging_nan_inf_filter and not math.isfinite(loss):
                loss = window_sum / (1 + earlier)
            window_sum += loss
            self._logged_losses.append(loss)
        return values

    def _log_save_evaluate(self, window: list, schedule) -> list:
        if self.control.should_log and window:
            values = self._record_losses(window)
            losses = self._logged_losses[-len(values):]
            step = self.state.global_step
            extra = {key: float(np.mean([float(v[key]) for v in values]))
                     for key in values[-1] if key not in ("loss", "grad_norm", "weight")}
            self.log({"loss": float(np.mean(losses)), "grad_norm": float(values[-1]["grad_norm"]),
                      "learning_rate": float(schedule(step - 1)) if schedule else float("nan"), **extra})
            window = []
        if self.control.should_evaluate and self.eval_dataset is not None:
            self.evaluate()
        if self.control.should_save:
            self._save_checkpoint(self.state.global_step)
        return window

    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` in ``state.log_history`` (with epoch and step) and calls ``on_log``."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Mean loss over ``eval_dataset`` (adapters in eval mode, no dropout): ``{"eval_loss": ...}``.

        Args:
            eval_dataset: examples to score (default: the trainer's ``eval_dataset``).

        Returns:
            ``{"eval_loss": summed loss / loss items, "eval_runtime": seconds}``.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        loss, count_items = self._loss()
        step_fn = tunix_sft.make_eval_step(loss, self._compute_dtype(), count_items)
        size = self.args.per_device_eval_batch_size * self._data_parallel_size()
        started = time.perf_counter()
        values = self._run_in_batches(dataset, step_fn, self._module, self.mesh, size, "evaluation")
        loss = sum(float(v[0]) for v in values)
        items = sum(float(v[1]) for v in values)
        metrics = {"eval_loss": loss / max(items, 1.0), "eval_runtime": time.perf_counter() - started}
        for key in values[0][2] if values else ():
            metrics[f"eval_{key}"] = float(np.mean([float(v[2][key]) for v in values]))
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def _run_in_batches(self, examples, step: Callable, module, mesh, size: int, what: str) -> list:
        """``step(module, batch)`` over ``examples`` in global batches of ``size`` rows placed on ``mesh`` (the last
        one padded with masked rows, so one program serves all), results on the host."""
        sharding = mesh_lib.batch_sharding(mesh)
        rows = mesh_lib.local_rows(sharding, (size,))
        outputs = []
        with mesh_lib.entered(mesh):
            for start in range(0, len(examples), size):
                indices = np.full(size, -1)
                chosen = np.arange(start, min(start + size, len(examples)))
                indices[:len(chosen)] = chosen
                batch = self._collate_rows(examples, indices[rows], what)
                outputs.append(step(module, mesh_lib.place_batch(batch, sharding, size)))
        return mesh_lib.to_host(outputs)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoints(self) -> list[Path]:
        return sorted(Path(self.args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))

    def _save_checkpoint(self, step: int) -> Path:
        """Writes ``output_dir/checkpoint-<step>``: ``model`` (parameters, or LoRA and base), ``optimizer``
        (unless ``save_only_model``) via ``torchlike.save``, and transformers' ``trainer_state.json``.
        The step fixes the data position and the dropout RNG, so resuming continues exactly."""
        from flax import nnx

        from . import serialization
        from .state_dict import state_dict

        folder = Path(self.args.output_dir) / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        params = state_dict(self.model) if hasattr(self.model, "family") else {
            ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(self._module, nnx.Param))}
        serialization.save(params, folder / "model")
        if not getattr(self.args, "save_only_model", False):
            optimizer_state = {".".join(map(str, p)): v.get_value()
                               for p, v in nnx.to_flat_state(nnx.state(self.optimizer, nnx.OptState))}
            serialization.save(optimizer_state, folder / "optimizer")
        if self.state.is_world_process_zero:  # every process wrote its shards above; one writes the rest
            self.state.save_to_json(str(folder / "trainer_state.json"))
            self._rotate_checkpoints()
        mesh_lib.barrier(f"checkpoint-{step}")
        self._event("on_save")
        if getattr(self.args, "push_to_hub", False) and _enum_value(self.args.hub_strategy) == "every_save":
            self.push_to_hub(commit_message=f"Training in progress, step {step}")
        return folder

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        for old in self._checkpoints()[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _resume(self, checkpoint: str | bool) -> int:
        from flax import nnx

        from . import serialization

        if checkpoint is True:
            folders = self._checkpoints()
            if not folders:
                raise FileNotFoundError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint-* "
                                        "folder; train without it or pass a checkpoint path.")
            checkpoint = folders[-1]
        folder = Path(checkpoint)
        if not (folder / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{folder} is not a torchlike checkpoint (no trainer_state.json); pass an "
                                    "output_dir/checkpoint-<step> folder written by Trainer.")
        saved = json.loads((folder / "trainer_state.json").read_text())
        if hasattr(self.model, "load_state_dict"):
            self.model.load_state_dict(serialization.load(folder / "model"))
        if (folder / "optimizer").exists():
            by_name = {".".join(map(str, p)): v
                       for p, v in nnx.to_flat_state(nnx.state(self.optimizer, nnx.OptState))}
            stored = serialization.load(folder / "optimizer")
            restored = stored.restore({name: var.get_value() for name, var in by_name.items() if name in stored})
            for name, value in restored.items():
                by_name[name].set_value(value)
        else:
            import warnings

            warnings.warn(f"{folder} holds no optimizer state (saved with save_only_model=True): the optimizer "
                          "restarts from zero moments.", UserWarning, stacklevel=3)
        self.state.global_step = saved["global_step"]
        self.state.log_history = saved["log_history"]
        return int(saved["global_step"])

    def save_model(self, output_dir: str | os.PathLike | None = None, _internal_call: bool = False) -> None:
        """Writes the model in Hugging Face format (a PEFT adapter for LoRA models) plus the tokenizer.

        With ``args.push_to_hub``, it then pushes to the Hub (commit "Model save"), as transformers does whatever
        ``hub_strategy`` is: with ``hub_strategy="end"`` this is the push at the end of a script.

        Args:
            output_dir: where to write (default ``args.output_dir``).
            _internal_call: set by :meth:`push_to_hub`, which pushes itself.
        """
        if jax.process_count() > 1:
            raise NotImplementedError(
                "save_model() from several processes is not supported yet. Save a checkpoint (save_strategy), then "
                "export from one process: model.load_state_dict(torchlike.load('<checkpoint>/model')); "
                "model.save_pretrained(dir).")
        output_dir = output_dir or self.args.output_dir
        # The tokenizer's files go into the same staged folder, so the swap publishes model and tokenizer together.
        self.model.save_pretrained(output_dir, tokenizer=self.processing_class)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

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
        from .adapters.hf_hub import upload_folder

        self.save_model(_internal_call=True)
        return upload_folder(self.args.output_dir, self.hub_model_id, commit_message=commit_message,
                             private=getattr(self.args, "hub_private_repo", None),
                             token=token or getattr(self.args, "hub_token", None),
                             revision=revision or getattr(self.args, "hub_revision", None))
