"""TRL's callbacks (``trl/trainer/callbacks.py``) for torchlike's trainers, with TRL's names, arguments and effects.

torchlike's trainers run transformers' ``CallbackHandler``, so these are ``transformers.TrainerCallback`` s that read
what TRL's read from the handler's keyword arguments (``model``, ``processing_class``); what differs is what they do
with the model: its weights are JAX arrays (NNX variables) rather than torch parameters, and it generates with
:meth:`torchlike.CausalLM.generate`.

- :class:`SyncRefModelCallback`: TR-DPO's reference update, ``ref = alpha * policy + (1 - alpha) * ref``.
- :class:`BEMACallback`: bias-corrected exponential moving average of the trained weights, saved to
  ``output_dir/bema``.
- :class:`LogCompletionsCallback`: completions of the eval prompts every ``freq`` steps, as a table for the reporters.
- :class:`WeaveCallback`: the same completions, traced (and scored) with W&B Weave at each evaluation.
- :class:`RichProgressCallback`: progress bars and the latest logs with ``rich``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from transformers import TrainerCallback

from ...adapters.model import nnx_state
from ...adapters.training import reference_sync
from ..data_utils import maybe_apply_chat_template
from ..models import frozen_copy_model

if TYPE_CHECKING:
    from flax import nnx
    from transformers import GenerationConfig

    from ...modeling import CausalLM
    from ...training.trainer import Trainer
    from ...type_aliases import ProcessingClass

__all__ = ["BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback", "WeaveCallback"]

logger = logging.getLogger("torchlike")


def _module_of(model: CausalLM | nnx.Module) -> nnx.Module:
    """The NNX module of a torchlike model (``CausalLM``, ``PeftModel``, a reward model) or the module itself."""
    return getattr(model, "module", model)


class SyncRefModelCallback(TrainerCallback):
    """TRL's ``SyncRefModelCallback`` (TR-DPO): after every ``args.ref_model_sync_steps``-th optimizer step, every
    parameter of the reference becomes ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``.

    The trainers that take ``sync_ref_model=True`` add it themselves, as TRL's do.

    Args:
        ref_model: the reference (a torchlike model or its NNX module), updated in place.
        accelerator: TRL's ``Accelerator`` (it unwraps the model there); accepted for TRL's signature and unused:
            torchlike's trainers hand callbacks the model itself.
    """

    def __init__(self, ref_model: CausalLM | nnx.Module | None, accelerator: object = None):
        self.accelerator = accelerator
        self.ref_model = ref_model

    @staticmethod
    def sync_target_model(model: CausalLM | nnx.Module, target_model: CausalLM | nnx.Module, alpha: float) -> None:
        """Mixes ``model`` into ``target_model`` in place: ``target = alpha * model + (1 - alpha) * target``."""
        reference_sync.mix_into(_module_of(target_model), _module_of(model), alpha)

    def on_step_end(self, args, state, control, **kwargs):
        if self.ref_model is not None and state.global_step % args.ref_model_sync_steps == 0:
            self.sync_target_model(kwargs["model"], self.ref_model, args.ref_model_mixup_alpha)


class BEMACallback(TrainerCallback):
    r"""TRL's ``BEMACallback``: BEMA (bias-corrected exponential moving average, Block & Zhang,
    https://huggingface.co/papers/2508.00180) of the trained weights, kept in ``running_model`` and saved to
    ``output_dir/bema`` when training ends.

    Every ``update_freq`` steps after ``update_after``, with ``t`` the step,
    ``beta = max((lag + multiplier * t) ** -ema_power, min_ema_multiplier)``,
    ``ema = (1 - beta) * ema + beta * theta_t`` and the running weights are
    ``ema + (lag + multiplier * t) ** -bias_power * (theta_t - theta_0)``, where ``theta_0`` (and the first ``ema``)
    are the weights at step ``update_after`` (at the start of training when it is 0), as in TRL.

    Args:
        update_freq (`int`, defaults to `400`): steps between BEMA updates.
        ema_power (`float`, defaults to `0.5`): the EMA decay's power (``0.0`` disables the EMA).
        bias_power (`float`, defaults to `0.2`): the bias correction's power.
        lag (`int`, defaults to `10`): the schedules' starting age.
        update_after (`int`, defaults to `0`): burn-in steps before the first snapshot.
        multiplier (`float`, defaults to `1.0`): the schedules' step multiplier.
        min_ema_multiplier (`float`, defaults to `0.0`): the EMA decay's floor.
        device (`str`, defaults to `"cpu"`): where ``theta_0`` and the EMA are kept: ``"cpu"``, host memory (numpy);
            anything else (``"cuda"``, ``"tpu"``), the model's own devices.

    Example:
        >>> from torchlike.trl import BEMACallback, SFTTrainer
        >>> trainer = SFTTrainer(..., callbacks=[BEMACallback(update_freq=50)])
    """

    def __init__(self, update_freq: int = 400, ema_power: float = 0.5, bias_power: float = 0.2, lag: int = 10,
                 update_after: int = 0, multiplier: float = 1.0, min_ema_multiplier: float = 0.0,
                 device: str = "cpu"):
        self.update_freq = update_freq
        self.ema_power = ema_power
        self.bias_power = bias_power
        self.lag = lag
        self.update_after = update_after
        self.multiplier = multiplier
        self.min_ema_multiplier = min_ema_multiplier
        self.device = device
        self.param_names: list[str] = []
        self.theta0_params: list[Any] = []  # numpy arrays on "cpu", jax arrays elsewhere
        self.ema_params: list[Any] = []
        self.running_model = None
        self._model = None

    def _trained(self) -> dict[str, Any]:
        """The trained model's trainable parameters now, by dotted name."""
        variables = nnx_state.flat_variables(self._model.module)
        return {name: variables[name].get_value() for name in self.param_names}

    def _buffer(self, value: jax.Array) -> Any:
        """A copy of ``value`` in host memory (numpy) with ``device="cpu"``; the array itself otherwise, or when other
        processes hold parts of it (a multi-host mesh)."""
        if self.device == "cpu" and value.is_fully_addressable:
            return np.array(jax.device_get(value))
        return value

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if hasattr(model, "peft_config"):
            raise ValueError("BEMACallback averages a full model's weights, and the trained model is a PeftModel "
                             "(TRL's callback builds a new model of the trained one's class, which a peft model cannot "
                             "do either). Train without peft_config, or leave BEMACallback out.")
        self._model = model
        self.running_model = frozen_copy_model(model, _cloned(model.module))
        trainable = nnx_state.flat_variables(model.module, nnx_state.TRAINABLE)
        self.param_names = list(trainable)
        self.theta0_params = [self._buffer(variable.get_value()) for variable in trainable.values()]
        self.ema_params = [buffer.copy() for buffer in self.theta0_params]

    def _ema_beta(self, step: int) -> float:
        """``beta_t = max((lag + multiplier * t) ** -ema_power, min_ema_multiplier)``."""
        return max((self.lag + self.multiplier * step) ** (-self.ema_power), self.min_ema_multiplier)

    def _bema_alpha(self, step: int) -> float:
        """``alpha_t = (lag + multiplier * t) ** -bias_power``."""
        return (self.lag + self.multiplier * step) ** (-self.bias_power)

    def _update_bema_weights(self, step: int) -> None:
        beta, alpha = self._ema_beta(step), self._bema_alpha(step)
        trained = self._trained()
        running = {}
        for index, name in enumerate(self.param_names):
            theta = self._buffer(trained[name])
            ema = self.ema_params[index] * (1 - beta) + beta * theta  # torch: ema.mul_(1 - beta).add_(theta, beta)
            self.ema_params[index] = ema
            running[name] = ema + alpha * (theta - self.theta0_params[index])
        variables = nnx_state.flat_variables(self.running_model.module, nnx_state.TRAINABLE)
        for name, value in running.items():
            old = variables[name].get_value()
            variables[name].set_value(jax.device_put(jax.numpy.asarray(value, old.dtype), old.sharding))

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step < self.update_after:
            return
        if step == self.update_after:  # the snapshot: theta_0 and the EMA restart from the weights now
            trained = self._trained()
            self.theta0_params = [self._buffer(trained[name]) for name in self.param_names]
            self.ema_params = [buffer.copy() for buffer in self.theta0_params]
        elif (step - self.update_after) % self.update_freq == 0:
            self._update_bema_weights(step)
            logger.info(f"Updated BEMA weights at step {step}")

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            save_directory = f"{args.output_dir}/bema"
            self.running_model.save_pretrained(save_directory)
            logger.info(f"Saved BEMA model to {save_directory}")


def _cloned(module: nnx.Module) -> nnx.Module:
    from flax import nnx

    return nnx.clone(module)


def _eval_prompts(trainer: Trainer, callback: str, num_prompts: int | None) -> list:
    """The ``prompt`` column of ``trainer.eval_dataset`` (its first ``num_prompts`` rows), as TRL's completion
    callbacks read it."""
    dataset = trainer.eval_dataset
    if dataset is None:
        raise ValueError(f"Trainer must have an evaluation dataset to use the {callback}.")
    if isinstance(dataset, Mapping):
        raise ValueError(f"{callback} reads one evaluation dataset's prompt column, and the trainer's eval_dataset is "
                         f"a dict of {list(dataset)}; give the trainer one dataset (or use one callback per dataset "
                         "with its own trainer).")
    rows = dataset if num_prompts is None else dataset.select(range(num_prompts)) if hasattr(dataset, "select") \
        else list(dataset)[:num_prompts]
    columns = getattr(rows, "column_names", None) or (list(rows[0]) if len(rows) else [])
    if "prompt" not in columns:
        raise ValueError(f"{callback} generates from the eval dataset's 'prompt' column, and it has {columns}; add a "
                         "'prompt' column to the eval dataset.")
    return list(rows["prompt"]) if hasattr(rows, "column_names") else [row["prompt"] for row in rows]


def _generate_completions(prompts: list, model: CausalLM, tokenizer: ProcessingClass,
                          generation_config: GenerationConfig | None, batch_size: int) -> tuple[list[str], list[str]]:
    """TRL's ``_generate_completions``: each prompt rendered as ``maybe_apply_chat_template({"prompt": ...})``
    renders it, tokenized left-padded in batches of ``batch_size`` (truncated to the tokenizer's length), continued by
    ``model.generate(generation_config=...)``, and the new tokens decoded without special tokens. Returns the rendered
    prompts and the completions."""
    tokenizer.padding_side = "left"
    prompts = [maybe_apply_chat_template({"prompt": prompt}, tokenizer)["prompt"] for prompt in prompts]
    completions = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="np", padding=True, truncation=True)
        generated = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                   generation_config=generation_config)
        width = batch["input_ids"].shape[1]
        completions += [tokenizer.decode(row[width:], skip_special_tokens=True) for row in np.asarray(generated)]
    return prompts, completions


class LogCompletionsCallback(TrainerCallback):
    """TRL's ``LogCompletionsCallback``: every ``freq`` steps, the model completes the eval dataset's prompts and
    the table of every completion so far (columns ``step``, ``prompt``, ``completion``) goes to the reporters.

    As TRL, to ``wandb`` (``wandb.log({"completions": table})``) and ``comet_ml`` (``completions.csv``) when
    ``args.report_to`` names them; torchlike also writes it to ``tensorboard`` (a markdown table under
    ``completions``). The rows are kept in ``self.table``.

    Args:
        trainer: the trainer the callback is added to; its ``eval_dataset`` must have a ``prompt`` column.
        generation_config (`transformers.GenerationConfig`, *optional*): how to generate (default: the model's).
        num_prompts (`int`, *optional*): complete only the first ``num_prompts`` prompts.
        freq (`int`, *optional*): steps between logs (default: ``eval_steps``).

    Example:
        >>> trainer = DPOTrainer(...)
        >>> trainer.add_callback(LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=32), num_prompts=8))
    """

    def __init__(self, trainer: Trainer, generation_config: GenerationConfig | None = None,
                 num_prompts: int | None = None, freq: int | None = None):
        self.trainer = trainer
        self.generation_config = generation_config
        self.freq = freq
        self.table: list[tuple[str, str, str]] = []
        self._last_logged_step = -1
        self.prompts = _eval_prompts(trainer, "LogCompletionsCallback", num_prompts)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return
        if state.global_step % (self.freq or state.eval_steps) != 0:
            return
        prompts, completions = _generate_completions(self.prompts, self.trainer.model, kwargs["processing_class"],
                                                     self.generation_config, args.per_device_eval_batch_size)
        if state.is_world_process_zero:
            self.table.extend((str(state.global_step), prompt, completion)
                              for prompt, completion in zip(prompts, completions, strict=True))
            _report_table(self.table, args.report_to, state.global_step, self.trainer)
        self._last_logged_step = state.global_step


def _report_table(rows: list[tuple[str, str, str]], report_to: list[str] | str | None, step: int,
                  trainer: Trainer) -> None:
    """Sends the completions table to the reporters ``report_to`` names (W&B, Comet, TensorBoard)."""
    import pandas as pd

    reporters = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in reporters:
        reporters = ["wandb", "comet_ml", "tensorboard"]
    table = pd.DataFrame(columns=["step", "prompt", "completion"], data=rows)
    if "wandb" in reporters and importlib.util.find_spec("wandb") is not None:
        import wandb

        wandb.log({"completions": table})
    if "comet_ml" in reporters and importlib.util.find_spec("comet_ml") is not None:
        import comet_ml

        experiment = comet_ml.get_running_experiment()
        if experiment is not None:
            experiment.log_table(tabular_data=table, filename="completions.csv")
    if "tensorboard" in reporters:
        writers = [callback.tb_writer for callback in trainer.callback_handler.callbacks
                   if getattr(callback, "tb_writer", None) is not None]
        for writer in writers:
            writer.add_text("completions", table.to_markdown(index=False) if _has_tabulate() else table.to_string(),
                            step)


def _has_tabulate() -> bool:
    return importlib.util.find_spec("tabulate") is not None


class WeaveCallback(TrainerCallback):
    """TRL's ``WeaveCallback``: at each evaluation, the model completes the eval dataset's prompts and each
    prediction is logged with W&B Weave's ``EvaluationLogger`` (tracing mode), with the ``scorers``' scores and their
    means as the summary (evaluation mode).

    Without ``weave`` installed it warns and logs nothing, as TRL's does.

    Args:
        trainer: the trainer; its ``eval_dataset`` must have a ``prompt`` column.
        project_name (`str`, *optional*): the Weave project (default: the running Weave client's, else the active
            W&B run's).
        scorers (`dict[str, Callable]`, *optional*): ``{name: scorer(prompt, completion) -> float}``.
        generation_config (`transformers.GenerationConfig`, *optional*): how to generate.
        num_prompts (`int`, *optional*): complete only the first ``num_prompts`` prompts.
        dataset_name (`str`, defaults to `"eval_dataset"`): the dataset's name in Weave.
        model_name (`str`, *optional*): the model's name in Weave (default: its ``name_or_path``).
    """

    def __init__(self, trainer: Trainer, project_name: str | None = None,
                 scorers: dict[str, Callable[[str, str], float]] | None = None,
                 generation_config: GenerationConfig | None = None, num_prompts: int | None = None,
                 dataset_name: str = "eval_dataset", model_name: str | None = None):
        self.trainer = trainer
        self.project_name = project_name
        self.scorers = scorers or {}
        self.generation_config = generation_config
        self.dataset_name = dataset_name
        self.model_name = model_name
        self._last_logged_step = -1
        self._weave_initialized = False
        self._evaluation_logger = None
        self.prompts = _eval_prompts(trainer, "WeaveCallback", num_prompts)

    @property
    def is_evaluation_mode(self) -> bool:
        """Whether scorers were given (evaluation mode) rather than none (tracing mode)."""
        return bool(self.scorers)

    def _initialize_weave(self) -> None:
        if self._weave_initialized:
            return
        if importlib.util.find_spec("weave") is None:
            logger.warning("Weave is not available. Please install weave to enable logging: `pip install weave`")
            return
        import weave
        from weave import EvaluationLogger
        from weave.trace.context import weave_client_context

        if weave_client_context.get_weave_client() is None:
            if self.project_name is None and importlib.util.find_spec("wandb") is not None:
                import wandb

                if wandb.run is not None:
                    self.project_name = f"{wandb.run.entity}/{wandb.run.project}"
            if self.project_name is None:
                raise ValueError("No existing Weave client found and no project_name provided. Please either "
                                 "initialize weave with `weave.init('project-name')`, provide a project_name to the "
                                 "WeaveCallback, or ensure an active wandb run exists.")
            weave.init(self.project_name)
        if self.model_name is None:
            self.model_name = getattr(self.trainer.model, "name_or_path", None) or "unknown_model"
        self._evaluation_logger = EvaluationLogger
        self._weave_initialized = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._initialize_weave()

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return
        self._initialize_weave()
        if not self._weave_initialized:
            return
        prompts, completions = _generate_completions(self.prompts, self.trainer.model, kwargs["processing_class"],
                                                     self.generation_config, args.per_device_eval_batch_size)
        if state.is_world_process_zero:
            self._log(prompts, completions, state.global_step)
        self._last_logged_step = state.global_step

    def _log(self, prompts: list[str], completions: list[str], step: int) -> None:
        evaluation = self._evaluation_logger(
            model=self.model_name, dataset=self.dataset_name,
            eval_attributes={"training_step": step, "model_name": self.model_name,
                             "generation_config": self.generation_config.to_dict() if self.generation_config else None})
        scores: dict[str, list[float]] = {}
        for prompt, completion in zip(prompts, completions, strict=True):
            prediction = evaluation.log_prediction(inputs={"prompt": prompt}, output=completion)
            for name, scorer in self.scorers.items():
                score = scorer(prompt, completion)
                prediction.log_score(scorer=name, score=score)
                scores.setdefault(name, []).append(score)
            prediction.finish()
        if self.is_evaluation_mode:
            evaluation.log_summary({"total_predictions": len(prompts), "successful_predictions": len(prompts),
                                    **{f"avg_{name}": sum(values) / len(values) for name, values in scores.items()}})
        else:
            evaluation.finish()


class RichProgressCallback(TrainerCallback):
    """TRL's ``RichProgressCallback``: a ``rich`` live panel with the training (and evaluation) progress bars and the
    latest logged values, grouped by their ``prefix/`` (process zero only).

    Raises:
        ImportError: ``rich`` is not installed (TRL's message).
    """

    def __init__(self):
        if importlib.util.find_spec("rich") is None:
            raise ImportError("RichProgressCallback requires the `rich` extra. To install, run `pip install rich`.")
        self.training_bar = self.evaluation_bar = self.training_task = self.evaluation_task = None
        self.rich_group = self.rich_console = self.training_status = self.current_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.console import Console, Group
        from rich.live import Live
        from rich.panel import Panel
        from rich.progress import Progress

        self.training_bar, self.evaluation_bar, self.rich_console = Progress(), Progress(), Console()
        self.training_status = self.rich_console.status("Nothing to log yet ...")
        self.rich_group = Live(Panel(Group(self.training_bar, self.evaluation_bar, self.training_status)))
        self.rich_group.start()
        self.training_task = self.training_bar.add_task("[blue]Training  ", total=state.max_steps)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None:
            return
        self.training_bar.update(self.training_task, advance=state.global_step - self.current_step, update=True)
        self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or self.evaluation_bar is None:
            return
        if self.evaluation_task is None:
            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            self.evaluation_task = self.evaluation_bar.add_task("[blue]Evaluation", total=total)
        self.evaluation_bar.update(self.evaluation_task, advance=1, update=True)

    def _end_evaluation(self) -> None:
        if self.evaluation_task is not None:
            self.evaluation_bar.remove_task(self.evaluation_task)
            self.evaluation_task = None

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._end_evaluation()

    def on_predict(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._end_evaluation()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar):
            return
        from rich.columns import Columns
        from rich.panel import Panel
        from rich.table import Table

        groups: dict[str | None, dict[str, Any]] = {}
        for key, value in (logs or {}).items():
            group, name = key.split("/", 1) if "/" in key else (None, key)
            groups.setdefault(group, {})[name] = value
        panels = []
        for group, metrics in groups.items():
            table = Table(title=f"[bold blue]{group}[/]" if group else None, header_style="bold magenta", box=None)
            table.add_column("Metric", justify="left", no_wrap=True)
            table.add_column("Value", justify="right")
            for name, value in metrics.items():
                table.add_row(name, f"{value:.3f}" if isinstance(value, (float, int)) else str(value))
            panels.append(Panel(table, border_style="cyan", padding=(0, 1)))
        self.training_status.update(Panel(Columns(panels, equal=False, expand=True),
                                          title=f"[bold green]Step {state.global_step}[/bold green]",
                                          border_style="green"))

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.rich_group is None:
            return
        self.rich_group.stop()
        self.training_bar = self.evaluation_bar = self.training_task = self.evaluation_task = None
        self.rich_group = self.rich_console = self.training_status = self.current_step = None
