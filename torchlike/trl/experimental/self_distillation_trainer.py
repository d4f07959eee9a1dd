"""``SelfDistillationTrainer``: the loop TRL 1.16's self-distillation trainers share (SDFT, SDPO), on torchlike's
online trainer.

Each generation batch samples ``num_generations`` completions of each prompt with the student, as GRPO's schedule
does (``steps_per_generation`` micro-batches, ``num_iterations`` passes); the teacher (the initial student, the live
student or an EMA copy, ``teacher_model_kind``) reads each completion after a teacher prompt and student and teacher
run in one jitted step (``StudentTeacher``). What SDFT and SDPO change is a :class:`SelfDistillationAlgorithm`
(``algorithm_class``, beside each trainer): the prompt columns of a row, a generation's step columns (SDFT: the teacher
prompt from the row's ``privileged_context``; SDPO: rewards, advantages and teacher prompts built from successful
rollouts) and the step loss. A trainer on the loop redefines only ``__init__`` (SDPO's, for its reward functions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...adapters.distributed import mesh as mesh_lib
from ...adapters.lora import runtime as lora_runtime
from ...adapters.losses import distillation as distillation_losses
from ...adapters.losses.grpo import make_log_prob_pass
from ...adapters.rollout import sampling
from ...adapters.training import train_step
from ...training import step_logs
from ...training.batches import each_dataset, map_datasets
from ...type_aliases import DatasetLike, EvalDatasetLike, ModelLike, PeftConfigLike, ProcessingClass, RowsLike
from ..data_utils import get_dataset_column_names, is_message_list
from ..models import frozen_copy_model
from ..online.rollouts import GenerationSchedule, Rollout
from ..trainer.callbacks import SyncRefModelCallback
from ..trainer.distillation_trainer import StudentTeacherSteps
from ..trainer.online_trainer import OnlineTrainer
from .sdft.sdft_config import SelfDistillationConfig

__all__ = ["SelfDistillationAlgorithm", "SelfDistillationTrainer", "SyncTeacherModelCallback", "message_text"]


class SyncTeacherModelCallback(SyncRefModelCallback):
    """TRL's ``SyncTeacherModelCallback``: every ``args.teacher_sync_steps`` optimizer steps the ``"ema"`` teacher
    becomes ``teacher_update_rate * student + (1 - teacher_update_rate) * teacher``; with ``adapter_only``, its LoRA
    factors alone (TRL's ``PEFTAdapterEMACallback``, whose teacher adapter starts at zero on the student's base).

    Args:
        teacher_model: the teacher (a torchlike model or its NNX module), updated in place.
        accelerator: accepted for TRL's signature and unused.
        adapter_only: mix the LoRA factors only.
    """

    def __init__(self, teacher_model: Any, accelerator: object = None,  # Any: a torchlike model or an NNX module
                 adapter_only: bool = False):
        super().__init__(teacher_model, accelerator)
        self.adapter_only = adapter_only

    def on_step_end(self, args, state, control, **kwargs):
        from flax import nnx

        from ...adapters.training import reference_sync

        if self.ref_model is not None and state.global_step % args.teacher_sync_steps == 0:
            if self.adapter_only:
                reference_sync.mix_into(_module(self.ref_model), _module(kwargs["model"]), args.teacher_update_rate,
                                        nnx.LoRAParam)
            else:
                self.sync_target_model(kwargs["model"], self.ref_model, args.teacher_update_rate)


def _module(model: Any) -> Any:  # Any: a torchlike model or an NNX module
    return getattr(model, "module", model)


def _module(model: Any) -> Any:  # Any: a torchlike model or an NNX module
    return getattr(model, "module", model)


def message_text(message: dict) -> str:
    """A message's text: its ``content``, or the text parts of a list of content parts joined by spaces."""
    content = message.get("content", "")
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


class SelfDistillationAlgorithm:
    """What one self-distillation algorithm decides on :class:`SelfDistillationTrainer`'s loop: a row's prompt token
    columns, a generation's step columns and the step loss.

    Args:
        trainer: the loop it runs in (its config, tokenizer, sampling and the attributes its ``__init__`` set).
    """

    #: The prefix of the trainer's own loss metric (TRL's ``_name.lower()``), beside ``self_distillation``.
    metric_prefix: str

    def __init__(self, trainer: SelfDistillationTrainer):
        self.trainer = trainer

    def prompt_columns(self, row: dict) -> dict[str, list[int]]:
        """The token columns of one row, ``prompt_ids`` (the prompt sampled from) among them."""
        raise NotImplementedError

    def generation_columns(self, rows: list[dict], seed: int, prefix: str) -> dict[str, np.ndarray]:
        """The step columns of a generation of ``rows`` sampled with ``seed`` (``prefix`` ``"eval_"`` in evaluation,
        whose metrics then carry it)."""
        raise NotImplementedError

    def step_loss(self) -> tuple[Callable, None]:
        """``(loss, None)``: the jitted step's loss on :meth:`generation_columns`."""
        raise NotImplementedError


class SelfDistillationTrainer(StudentTeacherSteps, OnlineTrainer):
    """The loop of torchlike's ``SDFTTrainer`` and ``SDPOTrainer`` (see the module docstring): TRL's constructor
    (``model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers, peft_config``), the
    prompts tokenised by the algorithm, the teacher, GRPO's generation schedule and TRL's evaluation. A trainer on it
    sets ``algorithm_class``, ``_config_class``, ``_output_suffix`` and ``_tag_names``.
    """

    _allow_prefetch = False  # each generation batch samples with the weights of the steps before it
    _logs_num_tokens = False
    _generation_batch_fields = "generation_batch_size"
    algorithm_class: type[SelfDistillationAlgorithm]
    """The algorithm the loop trains with."""

    @functools.cached_property
    def algorithm(self) -> SelfDistillationAlgorithm:
        """The trainer's algorithm (made on first use: the constructor tokenises the prompts with it)."""
        return self.algorithm_class(self)

    def __init__(self, model: ModelLike, args: SelfDistillationConfig | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: PeftConfigLike | None = None):
        import datasets

        if isinstance(train_dataset, datasets.IterableDataset):
            raise NotImplementedError(f"Iterable datasets are not yet supported in {type(self).__name__}.")
        if any(isinstance(dataset, datasets.IterableDataset) for dataset in each_dataset(eval_dataset)):
            raise NotImplementedError(f"Iterable eval datasets are not yet supported in {type(self).__name__}.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        args = self._trl_args(model, args)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, None)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        for config in (model.config, model.generation_config):
            config.pad_token_id = processing_class.pad_token_id  # TRL mirrors the pad token onto the model
        self._setup_sampling(args, model, processing_class)
        self.tools, self.tool_calling = [], None
        # TRL's attributes.
        self.num_generations = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.num_iterations, self.temperature = args.num_iterations, args.temperature
        self.max_prompt_length, self.max_completion_length = args.max_prompt_length, args.max_completion_length
        for name in ("generate_from_teacher", "num_loss_tokens_to_skip"):  # SDFT's (SDPO has neither)
            if hasattr(args, name):
                setattr(self, name, getattr(args, name))
        train_rows = self._prepare(train_dataset, "train_dataset")
        eval_rows = map_datasets(eval_dataset, lambda dataset: self._prepare(dataset, "eval_dataset"))
        every_row = [*train_rows, *(row for rows in each_dataset(eval_rows) for row in rows)]
        self.prompt_length = sampling.bucket_length(max(len(row["prompt_ids"]) for row in every_row))
        token_keys = [key for key in every_row[0] if key.endswith("prompt_ids")]
        self._prompt_widths = {key: sampling.bucket_length(max(len(row[key]) for row in every_row))
                               for key in token_keys}
        largest = max([self.pad_token_id, *self.eos_token_ids,
                       *(max(max(row[key], default=0) for key in token_keys) for row in every_row)])
        self._check_token_ids(largest, processing_class, {"model": model})
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._setup_teacher()

    # ------------------------------------------------------------------ set-up
    def _setup_teacher(self) -> None:
        """The teacher TRL's ``_setup_teacher_model`` resolves, paired with the student for the steps: the student
        itself (``"live"``, and ``"base"`` with a LoRA adapter, run with the adapter off), else a frozen copy of the
        initial student, moved towards the student by :class:`SyncTeacherModelCallback` for ``"ema"`` (with a LoRA
        adapter, TRL's teacher adapter: zero factors at first, then an average of the student's)."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        kind, student = self.args.teacher_model_kind, self._trainable_model.module
        self._teacher_lora = lora_runtime.EVAL
        if kind == "live" or (kind == "base" and self._is_lora()):
            teacher = student
            self._teacher_lora = lora_runtime.DISABLED if kind == "base" else lora_runtime.EVAL
            self.teacher_model = self.model
        else:
            teacher = nnx.clone(student)
            adapter_only = kind == "ema" and self._is_lora()
            if adapter_only:  # TRL's teacher adapter: zero at first (the base model), then an EMA of the student's
                nnx.update(teacher, jax.tree.map(jnp.zeros_like, nnx.state(teacher, nnx.LoRAParam)))
            self.teacher_model = frozen_copy_model(self._trainable_model, teacher)
            if kind == "ema":
                self.add_callback(SyncTeacherModelCallback(self.teacher_model, self.accelerator, adapter_only))
        self._student_and_teacher = distillation_losses.StudentTeacher(student, teacher)

    def _sampling_overrides(self, args: SelfDistillationConfig) -> dict:
        return dict(args.generation_kwargs or {})

    def _prepare(self, dataset: RowsLike, name: str) -> list[dict]:
        """The rows with the token ids of their student prompt and teacher prompt (TRL's ``_tokenize_prompts``:
        conversations through the chat template with the generation prompt and ``chat_template_kwargs``, text with
        the tokenizer's special tokens; the last ``max_prompt_length`` tokens kept) and of the prompt sampled from
        (``prompt_ids``: the teacher prompt with ``generate_from_teacher``)."""
        columns = get_dataset_column_names(dataset)
        if "prompt" not in columns:
            raise ValueError(f"{name} has no 'prompt' column (found {columns}); {type(self).__name__} samples "
                             "completions of 'prompt' (text or chat messages) and builds the teacher prompt from it.")
        rows = []
        for index, row in enumerate(dataset):
            prompt = row["prompt"]
            if not isinstance(prompt, str) and not is_message_list(prompt):
                raise ValueError(f"{name} row {index}: 'prompt' must be a string or a list of chat messages, got "
                                 f"{type(prompt).__name__}.")
            row = {key: row[key] for key in ("prompt", "privileged_context") if key in row} \
                if self.args.remove_unused_columns else dict(row)
            row.update(self.algorithm.prompt_columns(row))
            rows.append(row)
        if not rows:
            raise ValueError(f"{name} is empty.")
        return rows

    def _prompt_token_ids(self, prompt: str | list[dict], truncate: bool = True) -> list[int]:
        """One prompt's token ids as TRL's ``_tokenize_prompts`` makes them (``truncate=False``: its
        ``_tokenize_prompts_untruncated``)."""
        if isinstance(prompt, list):
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True,
                                                     **(self.args.chat_template_kwargs or {}))["input_ids"]
        else:
            ids = self.tokenizer(text=prompt)["input_ids"]
        ids = list(ids)
        limit = self.args.max_prompt_length
        return ids[-limit:] if truncate and limit is not None else ids

    def _step_loss(self) -> tuple[Callable, None]:
        return self.algorithm.step_loss()

    # ------------------------------------------------------------------ the generation schedule
    def _generation_schedule(self) -> GenerationSchedule:
        """GRPO's schedule: ``generation_batch_size`` completions (``num_generations`` per prompt), split into
        ``steps_per_generation`` micro-batches, each trained on ``num_iterations`` times."""
        args = self.args
        return GenerationSchedule(self._global_batch_size(), args.steps_per_generation, args.num_iterations,
                                  args.num_generations)

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        rows = self._generation_rows(prompt_rows)
        return self.algorithm.generation_columns(rows, self._generation_seed(epoch, generation_index), "")

    def _prompts(self, rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of the rows' ``key`` prompts, left-padded to the dataset's width for them (or a wider
        bucket for longer prompts), so that the step compiles once."""
        sequences = [list(row[key]) for row in rows]
        width = max(self._prompt_widths.get(key, 1), sampling.bucket_length(max(map(len, sequences))))
        return self._left_padded(sequences, width)

    def _rollout_log_probs(self, columns: dict[str, np.ndarray], record: Rollout) -> np.ndarray:
        """``[N, C]`` the student's temperature-scaled log-probabilities of the sampled tokens, before any update."""
        if "_rollout_pass" not in self.__dict__:
            self._rollout_pass = make_log_prob_pass(self.model.family, self.args.temperature, lora_runtime.EVAL,
                                                    self._compute_dtype())
        inputs = {"input_ids": columns["input_ids"], "attention_mask": columns["attention_mask"],
                  "completion_mask": record.completion_mask}
        rows = len(inputs["input_ids"])
        with mesh_lib.entered(self.mesh):
            placed = mesh_lib.place_batch(inputs, mesh_lib.rows_sharding(self.mesh, rows), rows)
            values = self._rollout_pass(self._trainable_model.module, placed)
        return np.asarray(mesh_lib.to_host(values), np.float32)

    # ------------------------------------------------------------------ evaluation
    def _evaluation_loop(self, examples: Sequence[dict], metric_key_prefix: str) -> dict[str, float]:
        """TRL's evaluation (its ``prediction_step``): batches of ``per_device_eval_batch_size x`` data-parallel size
        completions, ``num_generations_eval`` of each prompt, sampled by the student, and the loss on them.
        ``<prefix>_loss`` is the mean over completions of their batch's loss; the distillation and completion metrics
        are means over batches."""
        generations = self.num_generations_eval
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        prompts = max(1, size // generations)
        if "_eval_step" not in self.__dict__:  # one jitted step for every evaluation
            self._eval_step = train_step.make_eval_step(self._loss()[0], self._compute_dtype())
        prefix = f"{metric_key_prefix}_"
        outputs, counts = [], []
        with mesh_lib.entered(self.mesh):
            for index, start in enumerate(range(0, len(examples), prompts)):
                rows = [row for row in examples[start:start + prompts] for _ in range(generations)]
                seed = self._generation_seed(self.state.global_step, index, train=False)
                batch = self.algorithm.generation_columns(rows, seed, prefix)
                count = len(rows)
                placed = mesh_lib.place_batch(batch, mesh_lib.rows_sharding(self.mesh, count), count)
                outputs.append(self._eval_step(self._module, placed))
                counts.append(count)
        outputs = mesh_lib.to_host(outputs)
        losses = [float(value) / max(float(weight), 1e-12) for value, weight, _ in outputs]
        metrics = {f"{prefix}{key.removeprefix('eval_')}": value
                   for key, value in step_logs.evaluation_metrics(outputs, runtime=0.0).items()
                   if key not in ("eval_loss", "eval_runtime")}
        for key in [key for key in self._pending_metrics if key.startswith(prefix)]:
            metrics[key] = float(np.nanmean(self._pending_metrics.pop(key)))
        metrics[f"{prefix}loss"] = float(np.average(losses, weights=counts))
        return metrics
