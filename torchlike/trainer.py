"""``Trainer``: the transformers training loop on a JAX device mesh, over Tunix models and optax.

The loop is ours (Tunix's ``PeftTrainer`` restores on construction, checkpoints on a timer, does
not save the data position and averages micro-batch means); each step is a jitted function from
``adapters.tunix_sft`` on the Tunix module, with Qwix LoRA when the model has an adapter.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from .adapters import tunix_sft
from .optim import build_optimizer

__all__ = ["Trainer", "TrainOutput"]


@dataclass
class TrainOutput:
    """What ``train()`` returns (transformers' field names)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


class Trainer:
    """A ``transformers.Trainer`` for torchlike models and plain Flax NNX modules.

    Args:
        model: a :class:`~torchlike.CausalLM` / ``PeftModel`` (causal-LM loss with a loss mask), or
            any ``flax.nnx.Module`` with ``loss_fn``.
        args: :class:`~torchlike.TrainingArguments` (or ``SFTConfig``).
        data_collator: ``list[example] -> dict[str, np.ndarray]`` with fixed shapes; default: stack.
        train_dataset, eval_dataset: sequences of examples (dicts of arrays or token lists).
        processing_class: the tokenizer (saved with ``save_model``).
        compute_loss_func: transformers-style ``(outputs, labels, num_items_in_batch=None) -> loss``;
            not supported yet on JAX (use ``loss_fn``), refused with a message.
        callbacks: ``transformers.TrainerCallback`` objects, called at the usual events.
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        loss_fn: JAX-native ``loss_fn(model, batch) -> (summed loss, item count)``; the step divides
            by the total item count across accumulated micro-batches.
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), loss_fn: Callable | None = None, **unsupported):
        if unsupported:
            raise TypeError(f"Trainer got unsupported arguments {sorted(unsupported)}.")
        if compute_loss_func is not None:
            raise ValueError("compute_loss_func (torch outputs/labels) cannot run on JAX; pass "
                             "loss_fn(model, batch) -> (summed loss, item count) instead.")
        if compute_metrics is not None:
            raise ValueError("compute_metrics is not supported yet; evaluate() reports eval_loss.")
        if args is None:
            from .training_args import TrainingArguments

            args = TrainingArguments(output_dir="trainer_output")
        self.args = args
        self.model = model
        self.data_collator = data_collator or _stack
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self._custom_optimizer = optimizers[0] if optimizers else None
        self._loss_fn = loss_fn
        self.state = self._new_state()
        self.control = self._new_control()
        self._call_event("on_init_end")

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _new_state():
        from transformers import TrainerState

        return TrainerState()

    @staticmethod
    def _new_control():
        from transformers import TrainerControl

        return TrainerControl()

    def _call_event(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            handler = getattr(callback, event, None)
            if handler is not None:
                result = handler(self.args, self.state, self.control, model=self.model,
                                 processing_class=self.processing_class, **kwargs)
                if result is not None:
                    self.control = result

    @property
    def _module(self):
        return getattr(self.model, "module", self.model)

    def _is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")

    def _trainable(self):
        from flax import nnx

        return nnx.LoRAParam if self._is_lora() else nnx.Param

    def _loss(self):
        if self._loss_fn is not None:
            return self._loss_fn
        family = getattr(self.model, "family", None)
        if family is None:
            raise ValueError("a plain NNX module needs loss_fn=(model, batch) -> (summed loss, item count).")
        return tunix_sft.causal_lm_loss(family)

    def _compute_dtype(self):
        import jax.numpy as jnp

        if getattr(self.args, "bf16", False):
            return jnp.bfloat16
        if getattr(self.args, "fp16", False):
            return jnp.float16
        return None

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """Example order for ``epoch``: a seeded shuffle, as transformers' ``RandomSampler``, or dataset
        order with ``train_sampling_strategy="sequential"``."""
        if getattr(self.args, "train_sampling_strategy", "random") == "sequential":
            return np.arange(len(self.train_dataset))
        seed = getattr(self.args, "data_seed", None) or self.args.seed
        return np.random.default_rng(seed + epoch).permutation(len(self.train_dataset))

    def _global_batch_size(self) -> int:
        # One data-parallel replica for now: the device-mesh placement of batches comes with mesh_shape support.
        return self.args.per_device_train_batch_size

    def _batches(self, epoch: int, skip: int = 0) -> Iterable[dict[str, np.ndarray]]:
        """Micro-batch groups ``[A, B, ...]`` for one epoch; the last partial batch is padded with
        rows whose masks are zero, so it trains without a new compilation."""
        batch_size = self._global_batch_size()
        accumulation = self.args.gradient_accumulation_steps
        order = self._get_train_sampler(epoch)
        per_step = batch_size * accumulation
        steps = math.ceil(len(order) / per_step)
        for step in range(skip, steps):
            indices = order[step * per_step:(step + 1) * per_step]
            examples = [self.train_dataset[int(i)] for i in indices]
            batch = self.data_collator(examples)
            missing = per_step - len(examples)
            if missing:
                batch = {key: np.concatenate([value, np.zeros((missing, *value.shape[1:]), value.dtype)])
                         for key, value in batch.items()}
            yield {key: value.reshape(accumulation, batch_size, *value.shape[1:]) for key, value in batch.items()}

    def _steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_dataset) / (self._global_batch_size() * self.args.gradient_accumulation_steps))

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

        Returns:
            :class:`TrainOutput` with the final step and mean training loss.
        """
        from flax import nnx

        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset.")
        total_steps = self._total_steps()
        transformation, schedule = (self._custom_optimizer, None) if self._custom_optimizer else \
            build_optimizer(self.args, total_steps)
        if getattr(self.args, "gradient_checkpointing", False):
            tunix_sft.enable_rematerialisation(self._module)
        trainable = self._trainable()
        self.optimizer = nnx.Optimizer(self._module, transformation, wrt=trainable)
        step_fn = tunix_sft.make_train_step(self._loss(), trainable, self._compute_dtype(), lora=self._is_lora())
        self.state = self._new_state()
        self.state.max_steps = total_steps
        self.state.logging_steps = self.args.logging_steps
        self.state.save_steps = self.args.save_steps
        start_step = 0
        if resume_from_checkpoint:
            start_step = self._resume(resume_from_checkpoint)
        rng = jax.random.key(self.args.seed)
        steps_per_epoch = self._steps_per_epoch()
        self._call_event("on_train_begin")
        losses, window, started = [], [], time.perf_counter()
        step = start_step
        epoch = step // steps_per_epoch
        while step < total_steps and not self.control.should_training_stop:
            self._call_event("on_epoch_begin")
            for batch in self._batches(epoch, skip=step - epoch * steps_per_epoch):
                self._call_event("on_step_begin")
                metrics = step_fn(self._module, self.optimizer, batch, jax.random.fold_in(rng, step))
                step += 1
                self.state.global_step = step
                self.state.epoch = epoch + (step - epoch * steps_per_epoch) / steps_per_epoch
                window.append(metrics)
                self._call_event("on_step_end")
                if step % self.args.logging_steps == 0 or step == total_steps:
                    values = jax.device_get(window)
                    loss = float(np.mean([v["loss"] for v in values]))
                    losses.extend(float(v["loss"]) for v in values)
                    lr = float(schedule(step - 1)) if schedule else float("nan")
                    self.log({"loss": loss, "grad_norm": float(values[-1]["grad_norm"]), "learning_rate": lr})
                    window = []
                if self._should_save(step):
                    self._save_checkpoint(step)
                if step >= total_steps or self.control.should_training_stop:
                    break
            epoch += 1
            self._call_event("on_epoch_end")
        values = jax.device_get(window)
        losses.extend(float(v["loss"]) for v in values)
        runtime = time.perf_counter() - started
        metrics = {"train_runtime": runtime, "train_loss": float(np.mean(losses)) if losses else float("nan"),
                   "train_steps_per_second": (step - start_step) / max(runtime, 1e-9)}
        self.log(metrics)
        self._call_event("on_train_end")
        return TrainOutput(step, metrics["train_loss"], metrics)

    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` in ``state.log_history`` (with epoch and step) and calls ``on_log``."""
        entry = {**logs, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self._call_event("on_log", logs=logs)

    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Mean loss over ``eval_dataset`` (adapters in eval mode, no dropout): ``{"eval_loss": ...}``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        step_fn = tunix_sft.make_eval_step(self._loss(), self._compute_dtype())
        size = self.args.per_device_eval_batch_size
        total, items = 0.0, 0.0
        for start in range(0, len(dataset), size):
            rows = [dataset[i] for i in range(start, min(start + size, len(dataset)))]
            batch = self.data_collator(rows)
            if len(rows) < size:
                batch = {k: np.concatenate([v, np.zeros((size - len(rows), *v.shape[1:]), v.dtype)])
                         for k, v in batch.items()}
            loss, count = jax.device_get(step_fn(self._module, batch))
            total, items = total + float(loss), items + float(count)
        metrics = {"eval_loss": total / max(items, 1.0)}
        self.log(metrics)
        self._call_event("on_evaluate", metrics=metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _should_save(self, step: int) -> bool:
        strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
        return strategy == "steps" and self.args.save_steps and step % int(self.args.save_steps) == 0

    def _save_checkpoint(self, step: int) -> Path:
        from flax import nnx

        from . import serialization
        from .state_dict import state_dict

        folder = Path(self.args.output_dir) / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        params = state_dict(self.model) if hasattr(self.model, "family") else {
            ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(self._module, nnx.Param))}
        serialization.save(params, folder / "model")
        optimizer_state = {".".join(map(str, p)): v.get_value()
                           for p, v in nnx.to_flat_state(nnx.state(self.optimizer, nnx.OptState))}
        serialization.save(optimizer_state, folder / "optimizer")
        (folder / "trainer_state.json").write_text(json.dumps(
            {"global_step": step, "epoch": self.state.epoch, "log_history": self.state.log_history}, indent=2))
        self._rotate_checkpoints()
        self._call_event("on_save")
        return folder

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        folders = sorted(Path(self.args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        for old in folders[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _resume(self, checkpoint: str | bool) -> int:
        from flax import nnx

        from . import serialization

        if checkpoint is True:
            folders = sorted(Path(self.args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
            if not folders:
                raise FileNotFoundError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint-* "
                                        "folder; train without it or pass a checkpoint path.")
            checkpoint = folders[-1]
        folder = Path(checkpoint)
        saved = json.loads((folder / "trainer_state.json").read_text())
        if hasattr(self.model, "load_state_dict"):
            self.model.load_state_dict(serialization.load(folder / "model"))
        optimizer_vars = dict(nnx.to_flat_state(nnx.state(self.optimizer, nnx.OptState)))
        stored = serialization.load(folder / "optimizer")
        by_name = {".".join(map(str, p)): v for p, v in optimizer_vars.items()}
        restored = stored.restore({name: var.get_value() for name, var in by_name.items() if name in stored})
        for name, value in restored.items():
            by_name[name].set_value(value)
        self.state.global_step = saved["global_step"]
        self.state.log_history = saved["log_history"]
        return int(saved["global_step"])

    def save_model(self, output_dir: str | os.PathLike | None = None) -> None:
        """Writes the model in Hugging Face format (a PEFT adapter for LoRA models) plus the tokenizer."""
        output_dir = output_dir or self.args.output_dir
        self.model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def push_to_hub(self, commit_message: str = "End of training", **kwargs) -> str:
        """Saves to ``output_dir`` and uploads it to ``args.hub_model_id`` (default: the folder name)."""
        from .adapters.hf_hub import upload_folder

        self.save_model()
        repo_id = getattr(self.args, "hub_model_id", None) or Path(self.args.output_dir).name
        return upload_folder(self.args.output_dir, repo_id, commit_message=commit_message, **kwargs)
