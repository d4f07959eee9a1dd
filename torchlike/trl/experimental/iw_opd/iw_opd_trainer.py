"""``IWOPDTrainer``: TRL 1.16's ``trl.experimental.iw_opd.IWOPDTrainer`` (Importance-Weighted On-Policy Distillation)
on torchlike's student-teacher trainer.

The data is ``messages`` conversations (:mod:`.iw_opd_data`). Each optimizer step takes ``generation_batch_size``
prompts, each ``num_generations`` times, and each of its ``gradient_accumulation_steps`` micro-batches is, with
probability ``lmbda`` (Python's ``random``, as TRL's buffer draws it), replaced by the student's own completions of its
prompts. The loss is the sampled-token IW-OPD objective or the generalized JSD on TRL's top-k supports against the
frozen teacher (``adapters.losses.iw_opd``), over the step's dataset labels (TRL's ``num_items_in_batch``), with TRL's
``iw_opd/*``, on/off-policy loss and completion-length metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ....adapters.losses.iw_opd import IWOPDLossSettings, iw_opd_step_loss
from ....training import batches
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    RowsLike,
    Tokenizer,
)
from ...online.rollouts import Rollout
from ...trainer.base_trainer import check_text_dataset
from ...trainer.distillation_trainer import StudentTeacherAlgorithm, StudentTeacherTrainer, check_vocabularies
from ..gkd.gkd_data import dataset_columns, empty_columns, sampled_columns
from .iw_opd_config import IWOPDConfig
from .iw_opd_data import flagged, tokenize_row

if TYPE_CHECKING:
    from ....adapters.families.base import Family

__all__ = ["IWOPD", "IWOPDTrainer"]


class IWOPD(StudentTeacherAlgorithm):
    """TRL's IW-OPD on :class:`StudentTeacherTrainer`'s ``"dataset"`` schedule: the rows tokenised as TRL's collator
    does, each prompt ``num_generations`` times in a step's rows, each micro-batch the student's completions with
    probability ``lmbda``, and the IW-OPD or JSD objective."""

    schedule = "dataset"

    def prepare(self, dataset: RowsLike, name: str, tokenizer: Tokenizer, tools: list[Callable]) -> list[dict]:
        """The rows tokenised as TRL's ``_DistillationCollator`` (:func:`.iw_opd_data.tokenize_row`)."""
        rows = batches.as_sequence(dataset)
        if len(rows) == 0:
            raise ValueError(f"{name} is empty.")
        return [tokenize_row(dict(row), tokenizer, self.args.max_length, self.args.max_prompt_length)
                for row in rows]

    def sampling_overrides(self) -> dict:
        """TRL's generation config: the config's temperature, ``top_p`` and ``top_k``, nothing else."""
        return {}

    def train_order(self, order: np.ndarray) -> np.ndarray:
        """TRL's ``RepeatSampler``: whole groups of ``generation_batch_size`` prompts (a partial last one dropped),
        each prompt ``num_generations`` times in a row."""
        group = self.args.generation_batch_size
        return np.repeat(order[:len(order) // group * group], self.args.num_generations)

    def step_loss(self, student: Family, teacher: Family) -> Callable:
        """TRL's IW-OPD loss (:func:`adapters.losses.iw_opd.iw_opd_step_loss`) with the config's settings."""
        return iw_opd_step_loss(student, teacher, IWOPDLossSettings.from_config(self.args))

    @property
    def evaluation_metrics(self) -> tuple[str, ...]:
        """TRL's IW-OPD records its ``iw_opd/*`` metrics in evaluation too (the on/off-policy ones in training
        only)."""
        if self.args.distillation_objective != "iw_opd":
            return ()
        return ("iw_opd/mean_advantage", "iw_opd/mean_abs_advantage", "iw_opd/mean_weight", "iw_opd/min_weight",
                "iw_opd/max_weight")

    def finish_logs(self, logs: dict[str, float]) -> None:
        """TRL's ``log`` rounds the running on- and off-policy losses to 4 decimals."""
        for key in ("on_policy_loss", "off_policy_loss"):
            if key in logs:
                logs[key] = round(logs[key], 4)

    def source(self, draw: float) -> str:
        """The student's completions when ``draw <= lmbda`` (TRL's ``_fill_buffer``), else the dataset's."""
        return "student" if draw <= self.args.lmbda else "dataset"

    def dataset_columns(self, rows: list[dict], width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        return flagged(dataset_columns(rows, width, pad_token_id), on_policy=False)

    def sampled_columns(self, record: Rollout, dataset_columns: dict[str, np.ndarray], width: int,
                        pad_token_id: int) -> dict[str, np.ndarray]:
        return flagged(sampled_columns(record.prompt_ids, record.prompt_mask, record.tokens, record.completion_mask,
                                       dataset_columns["label_count"], width, pad_token_id), on_policy=True)

    def empty_columns(self, count: int, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        return flagged(empty_columns(count, width, pad_token_id), on_policy=False)


class IWOPDTrainer(StudentTeacherTrainer):
    """``trl.experimental.iw_opd.IWOPDTrainer`` with TRL 1.16's signature, training a torchlike student on a JAX mesh.

    Args:
        model: the student: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object
            (converted), or a path / hub id loaded with ``args.model_init_kwargs``.
        teacher_model: the teacher, a loaded :class:`~torchlike.CausalLM` or a path / hub id loaded with
            ``args.teacher_model_init_kwargs`` (and ``teacher_model_revision``); ``None`` loads
            ``args.teacher_model_name_or_path``. Its ``vocab_size`` must be the student's.
        args: :class:`IWOPDConfig` (default: ``IWOPDConfig(output_dir="tmp_iw_opd")``, as TRL's).
        data_collator: refused: the batches are TRL's collator's, built here.
        compute_metrics: ``EvalPrediction -> dict``, given what transformers' ``prediction_step`` gives TRL's IW-OPD:
            the student's logits on each eval batch's sequences and TRL's collator labels (``-100`` on the prompt and
            padding), each batch left-padded to its longest row and padded with ``-100`` across batches.
        preprocess_logits_for_metrics: applied to each batch's logits first, as transformers does.
        train_dataset, eval_dataset: rows with ``messages`` (a list of dicts or a ``datasets.Dataset``;
            ``eval_dataset`` may be a dict of them).
        processing_class: the tokenizer with a chat template (default: loaded from the student's path); without a
            pad token its eos token pads.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter on the student.

    Example:

    ```python
    >>> from torchlike.trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
    >>> trainer = IWOPDTrainer(model="path/to/Qwen2.5-0.5B-Instruct", teacher_model="path/to/Qwen2.5-1.5B-Instruct",
    ...                        args=IWOPDConfig("out", max_completion_length=64),
    ...                        train_dataset=[{"messages": [{"role": "user", "content": "Hi"}]}] * 64)
    >>> trainer.train()
    ```
    """

    algorithm_class = IWOPD
    _config_class = IWOPDConfig
    _output_suffix = "IWOPD"
    _tag_names = ["trl", "iw-opd"]

    def __init__(self, model: ModelLike | None = None, teacher_model: ModelLike | None = None,
                 args: IWOPDConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None):
        if data_collator is not None:
            raise ValueError("IWOPDTrainer does not take data_collator: it batches the messages rows as TRL's collator "
                             "does.")
        if args is None:
            args = IWOPDConfig(output_dir="tmp_iw_opd")
        args = self._trl_args(model, args)
        self.algorithm = self.algorithm_class(args)
        args.remove_unused_columns = False  # as TRL: its collator reads the messages column
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: rows with a 'messages' column.")
        for dataset in [train_dataset, *batches.each_dataset(eval_dataset)]:
            check_text_dataset(dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, None)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        for config in (model.config, model.generation_config):
            config.pad_token_id = processing_class.pad_token_id  # TRL mirrors the pad token onto the model
        if args.teacher_model_init_kwargs is not None and teacher_model is not None \
                and not isinstance(teacher_model, str | os.PathLike):
            raise ValueError("You passed teacher_model_init_kwargs to the config, but your teacher_model is already "
                             "instantiated.")
        self.teacher_model = self._load_teacher(teacher_model, args, model, revision=args.teacher_model_revision)
        check_vocabularies(model, self.teacher_model, "IW-OPD")
        train_rows, eval_rows = self._sequence_rows(train_dataset, eval_dataset, processing_class, model,
                                                    args.max_completion_length)
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._show_eval_dataset(eval_dataset)
        self._pair_with_teacher()
        # TRL's attributes.
        for name in ("lmbda", "beta", "distillation_objective", "iw_opd_gamma", "iw_opd_epsilon", "temperature",
                     "top_p", "num_generations", "reverse_kl_top_1_mode", "loss_top_k", "loss_add_tail"):
            setattr(self, name, getattr(args, name))
