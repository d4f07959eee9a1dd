"""``DistillationTrainer``: TRL 1.16's on-policy knowledge distillation trainer and constructor, and the loop of TRL's
student-teacher trainers (``StudentTeacherTrainer``, with the ``StudentTeacherAlgorithm`` contract) it shares with
``GKDTrainer``.

Every optimizer step of Distillation samples one generation batch (``per_device_train_batch_size x data-parallel size
x gradient_accumulation_steps`` prompts, one completion each) from the student with the backend's rollout engine
(``adapters.rollout.default_engine``: the paged engine on the CPU; ``DistillationConfig`` has no ``rollout_engine``),
then trains the
student to match a frozen teacher's next-token distribution on those completion tokens under TRL's generalized
Jensen-Shannon divergence (``adapters.losses.distillation``: ``beta`` 0 is the forward KL, 1 the reverse KL), with
both models' logits at ``temperature``. The loss is summed over the completion tokens of the whole generation batch
and divided by their number, as TRL's ``num_items_in_batch``. Student and teacher share the trainer's mesh and one
jitted step; the teacher gets no gradient and no optimizer state.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...adapters.distributed import mesh as mesh_lib
from ...adapters.losses import distillation as distillation_losses
from ...adapters.rollout import sampling
from ...adapters.training import train_step
from ...training import batches
from ...training.evaluation import PredictionGatherer, prefixed_metrics, with_predictions
from ...training.trainer import Trainer
from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
    Tokenizer,
    TRLArgs,
)
from ..data.prompt_data import prepare_prompts
from ..online.rollout_worker import RolloutWorker
from ..online.rollouts import GenerationSchedule, Rollout
from .base_trainer import check_causal_lm, check_text_dataset
from .distillation_config import DistillationConfig
from .online_trainer import OnlineTrainer

if TYPE_CHECKING:
    from ...adapters.families.base import Family
    from ...modeling import CausalLM

__all__ = ["Distillation", "DistillationTrainer", "StudentTeacherAlgorithm", "StudentTeacherSteps",
           "StudentTeacherTrainer", "check_vocabularies"]


def check_vocabularies(student: CausalLM, teacher: CausalLM, method: str = "Distillation") -> None:
    """Raises TRL's ``ValueError`` when the student's and the teacher's ``vocab_size`` differ (the divergence compares
    the two full next-token distributions); ``method`` names the trainer's method in the message, as TRL's do."""
    student_vocab, teacher_vocab = (model.config.get_text_config().vocab_size for model in (student, teacher))
    if student_vocab != teacher_vocab:
        raise ValueError(f"The student model has vocab_size {student_vocab} but the teacher model has vocab_size "
                         f"{teacher_vocab}. {method} compares the teacher's full next-token distribution, which "
                         "requires a shared vocabulary. Use a teacher with the same vocab_size, or GOLDTrainer "
                         "with use_uld_loss=True for a teacher with its own tokenizer.")


class StudentTeacherAlgorithm:
    """What one student-teacher method decides on :class:`StudentTeacherTrainer`'s loop: how its rows are tokenised,
    where the sequences of each micro-batch come from, its sampling settings and its divergence. A subclass gives
    ``prepare`` and ``step_loss`` and overrides what else its method changes; the other defaults (the schedule, the
    sampling settings, the completion limit) are TRL's on-policy distillation's.

    Args:
        args: the trainer's config (its method's fields are read as TRL reads them).
    """

    schedule: str = "generation"
    """``"generation"``: each optimizer step trains on one generation batch the student samples for the prompt
    schedule's prompts (one completion each), and evaluation samples too (TRL's ``DistillationTrainer``);
    ``"dataset"``: the dataset's sequences in transformers' order, each micro-batch's replaced by sampled ones as
    :meth:`source` draws it, and evaluation reads them as they are (GKD)."""

    def __init__(self, args: TRLArgs):
        self.args = args

    def prepare(self, dataset: RowsLike, name: str, tokenizer: Tokenizer, tools: list[Callable]) -> list[dict]:
        """The rows of ``dataset`` tokenised: ``prompt_ids`` (and, for the ``"dataset"`` schedule, the sequence's
        ``input_ids`` and labels) next to the original columns."""
        raise NotImplementedError

    def sampling_overrides(self) -> dict:
        """The sampling settings laid over the config's sampling fields: ``generation_kwargs``."""
        return dict(self.args.generation_kwargs or {})

    def completion_limit(self) -> int:
        """The most tokens sampled per completion: ``max_completion_length``."""
        return self.args.max_completion_length

    def step_loss(self, student: Family, teacher: Family) -> Callable:
        """The jitted step's loss, ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)``, on the
        student-and-teacher module (``adapters.losses.distillation.StudentTeacher``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the "dataset" schedule
    def source(self, draw: float) -> str:
        """Whose sequences a micro-batch of the ``"dataset"`` schedule trains on, for its draw of Python's
        ``random.random()``: ``"student"`` (sampled on-policy), ``"teacher"`` (sampled by the teacher) or
        ``"dataset"``."""
        return "student"

    def dataset_columns(self, rows: list[dict], width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        """The step columns of the dataset's sequences of ``rows``, ``width`` tokens wide."""
        raise NotImplementedError

    @property
    def evaluation_metrics(self) -> tuple[str, ...]:
        """The step loss's metrics ``evaluate()`` reports (means over its batches) beside the loss; none by default."""
        return ()

    def finish_logs(self, logs: dict[str, float]) -> None:
        """Changes a log entry in place before it is recorded (as the algorithm's TRL trainer ``log`` does)."""

    def train_order(self, order: np.ndarray) -> np.ndarray:
        """The ``"dataset"`` schedule's rows of an epoch, from transformers' order of the dataset (as it is by
        default)."""
        return order

    def generation_rows(self, rows: list[dict]) -> list[dict]:
        """The rows whose ``prompt_ids`` the ``"dataset"`` schedule samples completions of (by default ``rows``
        as they are; GOLD keeps each prompt's last tokens within its budget)."""
        return rows

    def sampled_columns(self, record: Rollout, dataset_columns: dict[str, np.ndarray], width: int,
                        pad_token_id: int) -> dict[str, np.ndarray]:
        """The step columns of the completions ``record`` sampled for the prompts of rows whose dataset columns are
        ``dataset_columns``."""
        raise NotImplementedError

    def empty_columns(self, count: int, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        """``count`` padding rows of the step columns (no token counted)."""
        raise NotImplementedError

    def step_columns(self, micro_batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """The micro-batches of one optimizer step (or one evaluation batch) of the ``"dataset"`` schedule as the step
        reads them: by default as they are; GOLD's ULD turns their texts into the teacher's own tokenisation and the
        alignment, at one width for the whole step."""
        return micro_batches


class StudentTeacherSteps:
    """The steps of a trainer whose loss reads a teacher beside the student (Distillation, GKD, SDFT): they run on
    ``self._student_and_teacher`` (an ``adapters.losses.distillation.StudentTeacher``, which the trainer sets once its
    teacher is placed), and the optimizer updates the student's part only."""

    _student_and_teacher: distillation_losses.StudentTeacher

    @property
    def _module(self):
        """The NNX module the train and eval steps run on: the student and the teacher together
        (``adapters.losses.distillation.StudentTeacher``); the optimizer updates the student's part only."""
        return self._student_and_teacher

    def _trainable(self):
        """The student's trainable variables (its LoRA factors, or every parameter); never the teacher's."""
        from flax import nnx

        return nnx.All(super()._trainable(), distillation_losses.is_student)


class StudentTeacherTrainer(StudentTeacherSteps, OnlineTrainer):
    """The training loop of TRL's student-teacher trainers (``DistillationTrainer``, ``GKDTrainer``), and what a step
    of either does.

    The teacher is loaded or checked as TRL does, placed on the trainer's mesh and held beside the student in one NNX
    graph (``adapters.losses.distillation.StudentTeacher``) that the train and eval steps read; the optimizer updates
    the student's part only. The **algorithm** (:class:`StudentTeacherAlgorithm`) tokenises the rows, chooses the
    schedule and gives the divergence:

    - ``"generation"`` (Distillation): one generation batch per optimizer step (``per_device_train_batch_size x
      data-parallel size x gradient_accumulation_steps`` prompts), sampled by the student's rollout worker with the
      weights of the steps before it and split into the accumulation window's micro-batches (:meth:`_rollout`);
      evaluation samples a completion per prompt.
    - ``"dataset"`` (GKD): the dataset's rows in transformers' order; each micro-batch draws Python's
      ``random.random()`` as TRL's ``training_step`` does, and the algorithm's :meth:`~StudentTeacherAlgorithm.source`
      says whether the student's own completions, the teacher's or the dataset's sequences are trained on
      (:meth:`_micro_batch`); evaluation reads the dataset's sequences.

    A trainer on this loop is its TRL signature (``__init__``, which sets ``self.algorithm``, calls
    :meth:`_load_teacher` before ``Trainer.__init__`` and :meth:`_pair_with_teacher` after it), its config and its
    algorithm class; it overrides none of the loop's methods (``tests/test_architecture.py`` holds that).
    """

    algorithm_class: type[StudentTeacherAlgorithm] = StudentTeacherAlgorithm
    algorithm: StudentTeacherAlgorithm
    _allow_prefetch = False  # each step samples with the weights of the steps before it
    _generation_batch_fields = "per_device_train_batch_size x data-parallel size x gradient_accumulation_steps"
    _latest_completions: tuple[list[str], list[str]] = ([], [])
    _teacher_worker: RolloutWorker | None = None

    def _load_teacher(self, teacher_model: ModelLike, args: TRLArgs, model: CausalLM,
                      revision: str | None = None) -> CausalLM:
        """The teacher as TRL loads it: a string with ``teacher_model_init_kwargs`` (and the hub ``revision``, unless
        they set one) in the checkpoint's dtype unless they set one; ``None`` reads ``teacher_model_name_or_path``."""
        from ... import AutoModelForCausalLM

        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError("A teacher model is required for distillation training. Pass teacher_model, or set "
                             "args.teacher_model_name_or_path (`--teacher_model_name_or_path`).")
        if isinstance(teacher_model, str | os.PathLike):
            init_kwargs = dict(args.teacher_model_init_kwargs or {})
            if revision is not None:
                init_kwargs.setdefault("revision", revision)
            return AutoModelForCausalLM.from_pretrained(teacher_model, **init_kwargs)
        if args.teacher_model_init_kwargs is not None:
            raise ValueError("You passed teacher_model_init_kwargs to the config, but your teacher_model is already "
                             "instantiated.")
        check_causal_lm(teacher_model, "teacher_model", self._trainer_name)
        if teacher_model is model or teacher_model.module is model.module:
            raise ValueError("teacher_model is the model being trained; pass a separate teacher (for "
                             "self-distillation, load the checkpoint a second time).")
        return teacher_model

    def _sequence_rows(self, train_dataset: RowsLike, eval_dataset: EvalDatasetLike | None,
                       processing_class: ProcessingClass, model: CausalLM, completion_limit: int,
                       teacher_reads_them: bool = True) -> tuple[list[dict], list[dict] | dict[str, list[dict]] | None]:
        """The ``"dataset"`` schedule's set-up once the teacher is loaded: the sampling settings, the rows prepared by
        the algorithm, the prompt and sequence widths every batch is padded to (room for ``completion_limit``
        sampled tokens after the widest prompt), and every token id checked against the student's vocabulary and,
        when ``teacher_reads_them`` (not for a teacher with its own tokenizer), the teacher's. Returns
        ``(train rows, eval rows)``."""
        self._setup_sampling(self.args, model, processing_class)
        self.pad_token_id = processing_class.pad_token_id  # TRL's collators pad with it (never the eos token)
        self.tools, self.tool_calling = [], None
        train_rows = self._prepare(train_dataset, "train_dataset")
        eval_rows = batches.map_datasets(eval_dataset, lambda dataset: self._prepare(dataset, "eval_dataset"))
        all_rows = [row for rows in [train_rows, *batches.each_dataset(eval_rows)] for row in rows]
        self.prompt_length = self._padded(sampling.bucket_length(max(len(row["prompt_ids"]) for row in all_rows)))
        self.sequence_length = max(self._padded(sampling.bucket_length(max(len(row["input_ids"]) for row in all_rows))),
                                   self.prompt_length + self._padded(completion_limit))
        largest = max([self.pad_token_id, *self.eos_token_ids, *(max(row["input_ids"]) for row in all_rows)])
        models = {"model": model, "teacher_model": self.teacher_model} if teacher_reads_them else {"model": model}
        self._check_token_ids(largest, processing_class, models)
        return train_rows, eval_rows

    def _place_teacher(self) -> None:
        """Puts the teacher's weights on the trainer's mesh (the student's), unless they are there already."""
        teacher, mesh = self.teacher_model, self.mesh
        placed = teacher.mesh is not None and teacher.mesh.shape == mesh.shape and \
            list(teacher.mesh.devices.flat) == list(mesh.devices.flat)
        if not placed:
            mesh_lib.shard_module(teacher.module, mesh)
            teacher.mesh = mesh

    def _pair_with_teacher(self) -> None:
        """Places the teacher on the mesh and pairs it with the student for the steps."""
        self._place_teacher()
        self._student_and_teacher = distillation_losses.StudentTeacher(self._trainable_model.module,
                                                                     self.teacher_model.module)

    # ------------------------------------------------------------------ the algorithm's parts
    def _prepare(self, dataset: RowsLike, name: str) -> list[dict]:
        """The rows of ``dataset`` as the algorithm tokenises them (with tools, the chat template renders their
        schemas)."""
        return self.algorithm.prepare(dataset, name, self.tokenizer, self.tools)

    def _sampling_overrides(self, args: TRLArgs) -> dict:
        return self.algorithm.sampling_overrides()

    @property
    def _completion_limit(self) -> int:
        return self.algorithm.completion_limit()

    def _step_loss(self) -> tuple[Callable, None]:
        """The algorithm's divergence on the student-and-teacher module."""
        return self.algorithm.step_loss(self.model.family, self.teacher_model.family), None

    @property
    def teacher_worker(self) -> RolloutWorker:
        """The rollout worker that samples the teacher's completions (an engine of its own; GKD's ``seq_kd``)."""
        if self._teacher_worker is None:
            self._teacher_worker = self._new_worker(lambda: self.teacher_model.module)
        return self._teacher_worker

    # ------------------------------------------------------------------ batches
    def _generation_schedule(self) -> GenerationSchedule:
        """One generation batch per optimizer step (TRL reuses one generation over the accumulation window): one
        completion per prompt, split into ``gradient_accumulation_steps`` micro-batches, trained on once."""
        return GenerationSchedule(self._global_batch_size(), self.args.gradient_accumulation_steps, 1, 1)

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        return self._rollout(prompt_rows, self._generation_seed(epoch, generation_index))

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """The ``"generation"`` schedule's prompt order; the ``"dataset"`` schedule's is transformers' order of the
        rows (TRL's GKD is an SFT trainer), as the algorithm lays it out
        (:meth:`StudentTeacherAlgorithm.train_order`)."""
        if self.algorithm.schedule == "dataset":
            return self.algorithm.train_order(Trainer._get_train_sampler(self, epoch))
        return super()._get_train_sampler(epoch)

    def _steps_per_epoch(self) -> int:
        if self.algorithm.schedule == "dataset":
            return batches.steps_per_epoch(len(self._get_train_sampler(0)),
                                           self._global_batch_size() * self.args.gradient_accumulation_steps,
                                           self.args.dataloader_drop_last)
        return super()._steps_per_epoch()

    def _batches(self, epoch: int, skip: int = 0) -> Iterable[dict]:
        """The micro-batch groups of ``epoch`` from step ``skip`` on: the generation batches of the online schedule
        (``"generation"``), or the dataset's rows with each micro-batch's source drawn as TRL's ``training_step``
        draws it and sampled when it is due, with the weights of the steps before it (``"dataset"``)."""
        if self.algorithm.schedule != "dataset":
            yield from super()._batches(epoch, skip)
            return
        size, accumulation = self._global_batch_size(), self.args.gradient_accumulation_steps
        order = self._get_train_sampler(epoch)
        draws = self._policy_draws(epoch, skip)
        sharding = mesh_lib.batch_sharding(self.mesh, batch_axis=1)
        for step in range(skip, self._steps_per_epoch()):
            chosen = order[step * size * accumulation:(step + 1) * size * accumulation]
            group = []
            for part in range(accumulation):
                rows = [self.train_dataset[int(index)] for index in chosen[part * size:(part + 1) * size]]
                micro = step * accumulation + part
                group.append(self._micro_batch(rows, next(draws) if rows else 1.0,
                                               self._generation_seed(epoch, micro)))
            group = self.algorithm.step_columns(group)
            stacked = {key: np.stack([columns[key] for columns in group]) for key in group[0]}
            # The step's dataset labels, on every row: what transformers counts as num_items_in_batch when a step's
            # micro-batches are slices of one batch (IW-OPD's repeated batch).
            stacked["window_label_count"] = np.full_like(stacked["label_count"], stacked["label_count"].sum())
            yield mesh_lib.place_batch(stacked, sharding, size, batch_axis=1)

    def _micro_batches_per_epoch(self) -> int:
        """The non-empty micro-batches of an epoch of the ``"dataset"`` schedule (each makes one draw, as TRL's
        ``training_step``)."""
        size = self._global_batch_size()
        rows = min(len(self._get_train_sampler(0)),
                   self._steps_per_epoch() * self.args.gradient_accumulation_steps * size)
        return -(-rows // size)

    def _policy_draws(self, epoch: int, skip: int) -> Iterator[float]:
        """TRL's ``random.random()`` of each micro-batch from step ``skip`` of ``epoch`` on: Python's generator seeded
        with ``seed`` (transformers' ``set_seed``), past the draws of the micro-batches before."""
        generator = random.Random(self.args.seed)
        done = epoch * self._micro_batches_per_epoch() + min(skip * self.args.gradient_accumulation_steps,
                                                             self._micro_batches_per_epoch())
        for _ in range(done):
            generator.random()
        return iter(generator.random, None)

    def _micro_batch(self, rows: list[dict], draw: float, seed: int) -> dict[str, np.ndarray]:
        """One micro-batch's step columns of the ``"dataset"`` schedule (``per_device_train_batch_size x``
        data-parallel rows, padding rows last), from the source the algorithm draws: the student's completions, the
        teacher's, or the dataset's sequences."""
        algorithm = self.algorithm
        columns = algorithm.dataset_columns(rows, self.sequence_length, self.pad_token_id)
        source = algorithm.source(draw) if rows else "dataset"
        if source != "dataset":
            worker = self.teacher_worker if source == "teacher" else None
            record = self._generate(algorithm.generation_rows(rows), seed, worker=worker)
            columns = algorithm.sampled_columns(record, columns, self.sequence_length, self.pad_token_id)
        return self._padding_rows_added(columns, len(rows), self._global_batch_size())

    def _padding_rows_added(self, columns: dict[str, np.ndarray], rows: int, size: int) -> dict[str, np.ndarray]:
        """``columns`` of ``rows`` rows followed by the algorithm's padding rows up to ``size`` rows."""
        padding = self.algorithm.empty_columns(size - rows, self.sequence_length, self.pad_token_id)
        return {key: np.concatenate([columns[key], padding[key]]) for key in columns}

    # ------------------------------------------------------------------ generation
    def _rollout(self, rows: list[dict], seed: int, prefix: str = "", counted: int | None = None
                 ) -> dict[str, np.ndarray]:
        """Samples a completion for each row's prompt (continued through the student's tool calls when there are
        tools) and returns the step columns of the ``"generation"`` schedule: ``input_ids`` and ``attention_mask``
        ``[N, P + C]`` (prompt left-padded, completion right-padded to ``C = max_completion_length``) and
        ``completion_mask`` ``[N, C]``, the tokens the divergence is taken on (TRL's ``completion_mask x
        tool_mask``). The metrics of the first ``counted`` rows (default all; the rest pad an evaluation batch and
        are masked out) are kept for the next log."""
        counted = len(rows) if counted is None else counted
        record = self._generate(rows, seed)
        completion_mask = record.completion_mask.copy()
        completion_mask[counted:] = 0
        self._record_completion_metrics(record, prefix, train=not prefix, counted=counted)
        if not prefix and self.args.log_completions:
            decode = self.tokenizer.batch_decode
            self._latest_completions = (decode([row["prompt_ids"] for row in rows[:counted]], skip_special_tokens=True),
                                        decode(record.completion_ids[:counted], skip_special_tokens=True))
        masked = dataclasses.replace(record, completion_mask=completion_mask)
        return {**masked.columns(), "completion_mask": masked.model_tokens}

    # ------------------------------------------------------------------ logging and evaluation
    def log(self, logs: dict[str, float]) -> None:
        """The online trainer's log, after the algorithm's changes (:meth:`StudentTeacherAlgorithm.finish_logs`)."""
        self.algorithm.finish_logs(logs)
        super().log(logs)

    def _on_train_log(self) -> None:
        """With ``log_completions``, prints and saves the latest completions, as TRL's ``log``."""
        if getattr(self.args, "log_completions", False) and self.state.is_world_process_zero:
            self._log_completions()

    def _log_completions(self) -> None:
        """Prints ``num_completions_to_print`` of the latest generation batch and writes all of it to
        ``output_dir/completions/completions_<step>.parquet``."""
        import pandas as pd

        prompts, completions = self._latest_completions
        shown = len(prompts) if self.args.num_completions_to_print is None else self.args.num_completions_to_print
        print(f"step {self.state.global_step}: prompt | completion")
        for prompt, completion in list(zip(prompts, completions, strict=True))[:shown]:
            print(f"  {prompt!r} | {completion!r}")
        folder = os.path.join(self.args.output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        table = {"step": [self.state.global_step] * len(prompts), "prompt": prompts, "completion": completions}
        pd.DataFrame(table).to_parquet(os.path.join(folder, f"completions_{self.state.global_step:05d}.parquet"))

    def _evaluation_loop(self, examples: Sequence[dict], metric_key_prefix: str) -> dict[str, float]:
        """TRL's evaluation of each method: each batch's loss its divergence per counted token and ``eval_loss`` the
        mean over rows of their batch's loss. The ``"generation"`` schedule samples a completion for every prompt and
        adds ``eval_entropy`` (the mean over batches) and the completion metrics; the ``"dataset"`` schedule reads
        the dataset's sequences (no sampling)."""
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        sampled = self.algorithm.schedule != "dataset"
        loss, gatherer = self._loss()[0], None
        if not sampled and self.compute_metrics is not None and not self.args.prediction_loss_only:
            gatherer = PredictionGatherer(self.args, self.compute_metrics, self.preprocess_logits_for_metrics)
            loss = with_predictions(loss, self._student_found(), whole_batch=False)
        step = train_step.make_eval_step(loss, self._compute_dtype())
        sharding = mesh_lib.batch_sharding(self.mesh)
        prefix = f"{metric_key_prefix}_"
        losses, entropies, counts, reported = [], [], [], {}
        with mesh_lib.entered(self.mesh):
            for index, start in enumerate(range(0, len(examples), size)):
                rows = [examples[i] for i in range(start, min(start + size, len(examples)))]
                counted = len(rows)
                if sampled:
                    rows += [rows[0]] * (size - counted)  # a full batch: one compiled sampler and step
                    batch = self._rollout(rows, self._generation_seed(self.state.global_step, index, train=False),
                                          prefix, counted)
                else:
                    columns = self.algorithm.dataset_columns(rows, self.sequence_length, self.pad_token_id)
                    (batch,) = self.algorithm.step_columns([self._padding_rows_added(columns, counted, size)])
                    batch["window_label_count"] = np.full_like(batch["label_count"], batch["label_count"].sum())
                value, weight, aux, *found = mesh_lib.to_host(step(self._module,
                                                                   mesh_lib.place_batch(batch, sharding, size)))
                losses.append(float(value) / max(float(weight), 1.0))
                if gatherer is not None:
                    gatherer.add(self._found_as_trl_batches_them(found[0], counted), losses[-1], counted, None,
                                 last=start + size >= len(examples))
                if sampled:
                    entropies.append(float(aux["entropy"]))
                for name in self.algorithm.evaluation_metrics:
                    reported.setdefault(name, []).append(float(aux[name]))
                counts.append(counted)
        metrics = prefixed_metrics(gatherer.metrics(), metric_key_prefix) if gatherer is not None else {}
        metrics.update({f"{prefix}loss": float(np.average(losses, weights=counts)),
                        **{f"{prefix}{name}": float(np.mean(values)) for name, values in reported.items()}})
        if sampled:
            metrics[f"{prefix}entropy"] = float(np.mean(entropies))
            for key in [key for key in self._pending_metrics if key.startswith(prefix)]:
                metrics[key] = float(np.mean(self._pending_metrics.pop(key)))
        return metrics

    def _student_found(self) -> Callable:
        """What transformers' ``prediction_step`` hands ``compute_metrics`` on the ``"dataset"`` schedule (TRL's
        ``compute_loss`` returns the student's outputs): the student's logits on the batch's sequences and TRL's
        collator labels (each row's tokens after its prompt, ``-100`` elsewhere)."""
        import jax.numpy as jnp

        from ...training.loss_selection import select_outputs

        logits = select_outputs(self._trainable_model, None, ())

        def found(module, batch):
            ids, mask = batch["input_ids"], batch["attention_mask"]
            # completion_mask ([B, T - 1]) marks the positions that predict a label; the labels sit one later.
            labelled = jnp.pad(batch["completion_mask"], ((0, 0), (1, 0))) > 0
            return {"predictions": logits(module.student, {"input_ids": ids, "attention_mask": mask}),
                    "labels": jnp.where(labelled, ids, -100), "input_ids": ids, "lengths": mask.sum(-1)}

        return found

    @staticmethod
    def _found_as_trl_batches_them(found: dict, rows: int) -> dict:
        """One evaluation batch's predictions as TRL's collator shapes it: its ``rows`` examples, left-padded to the
        longest of them (torchlike left-pads every batch to one width so that the step compiles once)."""
        width = max(int(np.asarray(found["lengths"])[:rows].max()), 1)
        return {key: np.asarray(found[key])[:rows, -width:] for key in ("predictions", "labels", "input_ids")}


class Distillation(StudentTeacherAlgorithm):
    """TRL's on-policy distillation (``DistillationTrainer``) on :class:`StudentTeacherTrainer`'s loop: the student's
    completions of the prompts, the generalized Jensen-Shannon divergence on their tokens."""

    def prepare(self, dataset: RowsLike, name: str, tokenizer: Tokenizer, tools: list[Callable]) -> list[dict]:
        """Rows with ``prompt_ids`` next to the original columns (:func:`.prompt_data.prepare_prompts`; TRL's
        distillation keeps prompts whole); with tools the chat template also renders their schemas."""
        template_kwargs = dict(self.args.chat_template_kwargs or {})
        if tools:
            template_kwargs["tools"] = tools
        return prepare_prompts(dataset, tokenizer, name, None, template_kwargs)

    def step_loss(self, student: Family, teacher: Family) -> Callable:
        """TRL's generalized JSD loss (:func:`adapters.losses.distillation.distillation_step_loss`) with the config's
        settings."""
        settings = distillation_losses.DistillationLossSettings.from_config(self.args)
        return distillation_losses.distillation_step_loss(student, teacher, settings)


class DistillationTrainer(StudentTeacherTrainer):
    """``trl.DistillationTrainer`` with TRL 1.16's signature, training a torchlike student on a JAX mesh.

    Args:
        model: the student: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL).
        teacher_model: the teacher, a loaded :class:`~torchlike.CausalLM` or a path / hub id loaded with
            ``args.teacher_model_init_kwargs`` (and ``args.teacher_model_revision``); ``None`` loads
            ``args.teacher_model_name_or_path``. Its ``vocab_size`` must be the student's; its hidden size and family
            may differ. It is placed on the trainer's mesh.
        args: :class:`~torchlike.trl.DistillationConfig` (default: one with ``output_dir="<model>-Distillation"``).
        train_dataset: rows with a ``prompt`` (text, or chat messages rendered with the chat template and
            ``add_generation_prompt=True``); other columns are not read. A list of dicts or a ``datasets.Dataset``.
        eval_dataset: the same format (or a dict of such datasets); ``evaluate()`` samples a completion per prompt
            and reports the mean divergence (``eval_loss``), the student's entropy and the completion lengths.
        processing_class: the tokenizer (default: loaded from the student's path); without a pad token, its eos
            token pads.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter on the student.
        tools: functions the student may call while it generates (synchronous only, as TRL's ``DistillationTrainer``),
            run as in ``GRPOTrainer`` (:mod:`torchlike.trl.online.tool_calling`): the chat template renders their
            schemas, the student's tool calls are parsed, run and answered with ``tool`` messages, and generation
            continues up to ``args.max_tool_calling_iterations`` rounds within ``max_completion_length``; the
            tool-result tokens are in the sequence both models read but out of the divergence (TRL's ``tool_mask``).
            Prompts must be conversational.

    Raises:
        ValueError: no teacher, a teacher whose ``vocab_size`` differs from the student's (naming both), the student
            itself as teacher, ``teacher_model_init_kwargs`` with a loaded teacher, no ``train_dataset``, ``async``
            tools, or tools with prompts that are not chat messages.

    Example:

    ```python
    >>> from torchlike.trl import DistillationConfig, DistillationTrainer
    >>> trainer = DistillationTrainer(model="path/to/Qwen2.5-0.5B-Instruct",
    ...                               teacher_model="path/to/Qwen2.5-1.5B-Instruct",
    ...                               args=DistillationConfig("out", beta=0.5, max_completion_length=128),
    ...                               train_dataset=[{"prompt": "Explain gravity in one sentence."}] * 64)
    >>> trainer.train()
    ```
    """

    algorithm_class = Distillation
    _config_class = DistillationConfig
    _output_suffix = "Distillation"
    _tag_names = ["trl", "distillation"]

    def __init__(self, model: ModelLike, teacher_model: ModelLike | None = None, args: DistillationConfig | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: QuantizationConfig | None = None,
                 peft_config: PeftConfigLike | None = None, tools: list[Callable] | None = None):
        if any(inspect.iscoroutinefunction(tool) for tool in tools or []):
            raise ValueError("Async tools are not yet supported by `DistillationTrainer`. Pass synchronous tools.")
        args = self._trl_args(model, args)
        self.algorithm = self.algorithm_class(args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: rows with a 'prompt' column (text or chat messages).")
        for dataset in [train_dataset, *batches.each_dataset(eval_dataset)]:
            check_text_dataset(dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
        self.teacher_model = self._load_teacher(teacher_model, args, model, args.teacher_model_revision)
        check_vocabularies(model, self.teacher_model)
        self._setup_sampling(args, model, processing_class)
        self._setup_tools(tools, processing_class, args)
        train_rows = self._prepare(train_dataset, "train_dataset")
        eval_rows = batches.map_datasets(eval_dataset, lambda dataset: self._prepare(dataset, "eval_dataset"))
        self._check_tool_prompts([train_rows, *batches.each_dataset(eval_rows)])
        prompts = [row["prompt_ids"] for rows in [train_rows, *batches.each_dataset(eval_rows)] for row in rows]
        self.prompt_length = self._padded(sampling.bucket_length(max(len(ids) for ids in prompts)))
        largest = max([self.pad_token_id, *self.eos_token_ids, *(max(ids, default=0) for ids in prompts)])
        self._check_token_ids(largest, processing_class, {"model": model, "teacher_model": self.teacher_model})
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._show_eval_dataset(eval_dataset)  # TRL does not prepare an online trainer's data
        self._pair_with_teacher()
