"""``GKDTrainer``: TRL 1.16's ``trl.experimental.gkd.GKDTrainer`` (Generalized Knowledge Distillation) on torchlike's
student-teacher trainer.

The data is SFT-style ``messages`` conversations, batched as TRL's ``DataCollatorForChatML`` batches them
(:mod:`.gkd_data`). Each micro-batch, as TRL's ``training_step`` decides it with Python's ``random``: with probability
``lmbda`` its conversations are replaced by the student's own sampled completions of their prompts (on-policy),
otherwise, with ``seq_kd``, by the teacher's (sequence-level KD), otherwise they are trained on as they are. The loss is
TRL's generalized Jensen-Shannon divergence between the student's and the frozen teacher's next-token distributions at
every labelled position (``adapters.losses.distillation.gkd_step_loss``), divided by the labels of the accumulation
window's dataset batches, as transformers' ``num_items_in_batch``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ....adapters.losses import distillation as distillation_losses
from ....training import batches
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
    Tokenizer,
)
from ...data_utils import load_chat_template
from ...online.rollouts import Rollout
from ...trainer.base_trainer import check_text_dataset
from ...trainer.distillation_trainer import StudentTeacherAlgorithm, StudentTeacherTrainer, check_vocabularies
from .gkd_config import GKDConfig
from .gkd_data import dataset_columns, empty_columns, sampled_columns, tokenize_conversation

if TYPE_CHECKING:
    import jax
    from numpy.typing import ArrayLike

    from ....adapters.families.base import Family

__all__ = ["GKD", "GKDTrainer"]

logger = logging.getLogger(__name__)


class GKD(StudentTeacherAlgorithm):
    """TRL's Generalized Knowledge Distillation on :class:`StudentTeacherTrainer`'s ``"dataset"`` schedule: the
    conversations batched as TRL's ``DataCollatorForChatML`` batches them, each micro-batch's replaced by the
    student's completions with probability ``lmbda``, else by the teacher's with ``seq_kd``, and TRL's generalized
    JSD at every labelled position."""

    schedule = "dataset"

    def prepare(self, dataset: RowsLike, name: str, tokenizer: Tokenizer, tools: list[Callable]) -> list[dict]:
        """The rows tokenised as TRL's collator tokenises them (:func:`.gkd_data.tokenize_conversation`)."""
        rows = batches.as_sequence(dataset)
        if len(rows) == 0:
            raise ValueError(f"{name} is empty.")
        return [tokenize_conversation(dict(row), tokenizer, self.args.max_length) for row in rows]

    def sampling_overrides(self) -> dict:
        """TRL's GKD generation config: sampling at ``temperature`` with no top-k or top-p filtering."""
        return {"top_k": 0, "top_p": 1.0}

    def completion_limit(self) -> int:
        return self.args.max_new_tokens

    def step_loss(self, student: Family, teacher: Family) -> Callable:
        """TRL's GKD loss (:func:`adapters.losses.distillation.gkd_step_loss`) with the config's settings."""
        return distillation_losses.gkd_step_loss(student, teacher, distillation_losses.GKDLossSettings.from_config(
            self.args))

    def source(self, draw: float) -> str:
        """On-policy when ``draw <= lmbda``, else the teacher's completions with ``seq_kd``, else the dataset's (TRL's
        ``training_step``)."""
        if draw <= self.args.lmbda:
            return "student"
        return "teacher" if self.args.seq_kd else "dataset"

    def dataset_columns(self, rows: list[dict], width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        return dataset_columns(rows, width, pad_token_id)

    def sampled_columns(self, record: Rollout, dataset_columns: dict[str, np.ndarray], width: int,
                        pad_token_id: int) -> dict[str, np.ndarray]:
        return sampled_columns(record.prompt_ids, record.prompt_mask, record.tokens, record.completion_mask,
                               dataset_columns["label_count"], width, pad_token_id)

    def empty_columns(self, count: int, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        return empty_columns(count, width, pad_token_id)


class GKDTrainer(StudentTeacherTrainer):
    """``trl.experimental.gkd.GKDTrainer`` with TRL 1.16's signature, training a torchlike student on a JAX mesh.

    Args:
        model: the student: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs``.
        teacher_model: the teacher, a loaded :class:`~torchlike.CausalLM` or a path / hub id loaded with
            ``args.teacher_model_init_kwargs``; ``None`` loads ``args.teacher_model_name_or_path``. Its
            ``vocab_size`` must be the student's; its size and family may differ.
        args: :class:`GKDConfig` (default: one with ``output_dir="<model>-GKD"``).
        data_collator: refused: the batches are TRL's ``DataCollatorForChatML`` batches, built here.
        train_dataset, eval_dataset: rows with ``messages`` (the last message is the completion; a rendered
            ``prompt`` column, when present, is the prompt text) or tokenised ``input_ids``; a list of dicts or a
            ``datasets.Dataset`` (``eval_dataset`` may be a dict of them).
        processing_class: the tokenizer, with a chat template and a pad token (default: loaded from the student's
            path).
        compute_metrics: ``EvalPrediction -> dict``, given what transformers' ``prediction_step`` gives TRL's GKD:
            the student's logits on each eval batch's conversations and TRL's collator labels (``-100`` on the
            prompt and padding), each batch left-padded to its longest row and padded with ``-100`` across batches.
        preprocess_logits_for_metrics: applied to each batch's logits first, as transformers does.
        formatting_func: refused (TRL's collator never calls it).
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter on the student.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.

    Raises:
        ValueError: TRL's errors (a tokenizer without a pad token, ``teacher_model_init_kwargs`` with a loaded teacher,
            vocabularies of different sizes, a row with no prompt token left after truncation), no teacher, no
            ``train_dataset``, or a refused argument.

    Example:

    ```python
    >>> from torchlike.trl.experimental.gkd import GKDConfig, GKDTrainer
    >>> trainer = GKDTrainer(model="path/to/Qwen2.5-0.5B-Instruct", teacher_model="path/to/Qwen2.5-1.5B-Instruct",
    ...                      args=GKDConfig("out", lmbda=0.5, beta=0.5, max_new_tokens=64),
    ...                      train_dataset=[{"messages": [{"role": "user", "content": "Hi"},
    ...                                                   {"role": "assistant", "content": "Hello!"}]}] * 64)
    >>> trainer.train()
    ```
    """

    algorithm_class = GKD
    _config_class = GKDConfig
    _output_suffix = "GKD"
    _tag_names = ["trl", "gkd"]

    def __init__(self, model: ModelLike | None = None, teacher_model: ModelLike | None = None,
                 args: GKDConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None,
                 formatting_func: Callable | None = None, quantization_config: QuantizationConfig | None = None):
        refused = {name: value for name, value in (("data_collator", data_collator),
                                                   ("formatting_func", formatting_func)) if value is not None}
        if refused:
            raise ValueError(f"GKDTrainer does not take {', '.join(refused)}: it batches the messages rows as TRL's "
                             "DataCollatorForChatML does (which never calls formatting_func).")
        args = self._trl_args(model, args)
        self.algorithm = self.algorithm_class(args)
        # As TRL: the collator reads the raw messages column, never SFT's prepared dataset.
        args.remove_unused_columns = False
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: rows with a 'messages' column (a conversation whose last "
                             "message is the completion).")
        for dataset in [train_dataset, *batches.each_dataset(eval_dataset)]:
            check_text_dataset(dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
        if processing_class.pad_token_id is None:
            raise ValueError("The tokenizer does not have a pad token. Please set `pad_token_id` in the tokenizer.")
        if args.chat_template_path is not None:
            load_chat_template(processing_class, args.chat_template_path)
        if args.teacher_model_init_kwargs is not None and teacher_model is not None \
                and not isinstance(teacher_model, str | os.PathLike):
            raise ValueError("You passed teacher_model_init_kwargs to the GKDConfig, but your teacher_model is "
                             "already instantiated.")
        self.teacher_model = self._load_teacher(teacher_model, args, model)
        check_vocabularies(model, self.teacher_model, "GKD")
        train_rows, eval_rows = self._sequence_rows(train_dataset, eval_dataset, processing_class, model,
                                                    args.max_new_tokens)
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._show_eval_dataset(eval_dataset)
        self._pair_with_teacher()
        # TRL's attributes.
        self.lmbda, self.beta, self.temperature, self.seq_kd = args.lmbda, args.beta, args.temperature, args.seq_kd
        self.generation_kwargs = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                  "do_sample": True, "top_k": 0, "top_p": 1.0, "pad_token_id": self.pad_token_id}
        if self.lmbda == 1.0 and self.temperature == 1.0:
            logger.warning("This GKD configuration (`lmbda=1.0`, `temperature=1.0`) is fully covered by "
                           "`DistillationTrainer`, which is maintained in the main codebase. Consider migrating: "
                           "replace `GKDConfig`/`GKDTrainer` with `DistillationConfig`/`DistillationTrainer`, "
                           "`max_new_tokens` with `max_completion_length`, and set "
                           f"`beta={self.beta}` explicitly (`beta` means the same in both, but defaults to 0.5 here "
                           "and 1.0 there).")

    @staticmethod
    def generalized_jsd_loss(student_logits: ArrayLike, teacher_logits: ArrayLike, labels: ArrayLike | None = None,
                             beta: float = 0.5, temperature: float = 1.0, reduction: str = "batchmean",
                             num_items_in_batch: int | ArrayLike | None = None) -> jax.Array:
        """TRL's ``GKDTrainer.generalized_jsd_loss`` on arrays
        (``adapters.losses.distillation.reduced_generalized_jsd``): the generalized JSD of Eq. (1) of
        https://huggingface.co/papers/2306.13649 at each position whose label is not ``-100``, reduced by
        ``num_items_in_batch`` or ``reduction`` (``"batchmean"``, ``"sum"``, ``"mean"``, ``"none"``).

        Args:
            student_logits, teacher_logits: ``[B, T, V]``.
            labels: ``[B, T]`` with ``-100`` where no loss is taken, or ``None``.
            beta: 0 is ``KL(teacher || student)``, 1 is ``KL(student || teacher)``.
            temperature: softmax temperature of both distributions.
            reduction, num_items_in_batch: as in TRL.

        Returns:
            The loss (a scalar ``jax.Array``; with ``"none"`` the kept per-vocabulary terms).
        """
        return distillation_losses.reduced_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature,
                                                         reduction, num_items_in_batch)
