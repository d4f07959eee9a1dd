"""``GOLDTrainer``: TRL 1.16's ``trl.experimental.gold.GOLDTrainer`` (General Online Logit Distillation) on torchlike's
student-teacher trainer.

The data is SFT-style rows (``messages``, ``prompt``/``completion``) tokenised with their texts kept
(:mod:`.gold_data`) and batched as TRL's ``DataCollatorForChatML`` batches tokenised rows. Each optimizer step takes
``generation_batch_size`` prompts, each ``num_generations`` times (TRL's ``RepeatSampler``), and each of its
``gradient_accumulation_steps`` micro-batches is, with probability ``lmbda`` (Python's ``random``, as TRL's buffer
draws it), replaced by the student's own completions of its prompts (each prompt's last ``max_length -
max_completion_length`` tokens). The loss is the generalized JSD against the frozen teacher, or with
``use_uld_loss`` the Universal Logit Distillation loss against a teacher with its own tokenizer
(``adapters.losses.gold``), with TRL's on/off-policy (and matched/unmatched) loss logs. The schedule is IW-OPD's:
TRL's IW-OPD trainer is GOLD's loop with another objective.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ....adapters.losses.gold import GOLDLossSettings, gold_step_loss
from ....adapters.losses.uld import HybridVocabulary, ULDLossSettings, hybrid_vocabulary
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
from ...data_utils import load_chat_template
from ...online.rollouts import Rollout
from ...trainer.base_trainer import check_text_dataset
from ...trainer.distillation_trainer import StudentTeacherTrainer, check_vocabularies
from ..iw_opd.iw_opd_trainer import IWOPD
from .gold_config import GOLDConfig
from .gold_data import teacher_columns, text_columns, tokenize_row
from .uld_inputs import completion_byte_offsets

if TYPE_CHECKING:
    from ....adapters.families.base import Family

__all__ = ["GOLD", "GOLDTrainer"]

logger = logging.getLogger(__name__)


class GOLD(IWOPD):
    """TRL's GOLD on :class:`StudentTeacherTrainer`'s ``"dataset"`` schedule, laid out as IW-OPD's (whole generation
    batches, each prompt ``num_generations`` times, each micro-batch the student's completions with probability
    ``lmbda``): the rows tokenised as TRL's GOLD does, the on-policy prompts cut to their budget, and the generalized
    JSD or, with ``use_uld_loss``, ULD against a teacher that reads the texts through its own tokenizer (the
    trainer hands the algorithm both tokenizers with :meth:`use_tokenizers`)."""

    student_tokenizer: Tokenizer | None = None
    teacher_tokenizer: Tokenizer | None = None
    vocabulary: HybridVocabulary | None = None

    def use_tokenizers(self, student: Tokenizer, teacher: Tokenizer | None,
                       vocabulary: HybridVocabulary | None = None) -> None:
        """The student's tokenizer, the teacher's (ULD) and the hybrid loss's vocabulary split."""
        self.student_tokenizer, self.teacher_tokenizer, self.vocabulary = student, teacher, vocabulary

    @property
    def uld(self) -> bool:
        return self.args.use_uld_loss

    def prepare(self, dataset: RowsLike, name: str, tokenizer: Tokenizer, tools: list[Callable]) -> list[dict]:
        """The rows tokenised as TRL's ``_prepare_dataset_with_original_text`` and ``DataCollatorForChatML`` do
        (:func:`.gold_data.tokenize_row`)."""
        rows = batches.as_sequence(dataset)
        if len(rows) == 0:
            raise ValueError(f"{name} is empty.")
        args = self.args
        skip = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        max_length = args.max_length if args.max_length is not None else min(tokenizer.model_max_length, 1024)
        if self.uld and skip:
            raise ValueError("Off-policy batch missing 'original_prompt_text' or 'original_completion_text' fields: "
                             "use_uld_loss needs GOLD's own dataset preparation; drop skip_prepare_dataset from "
                             "dataset_kwargs.")
        return [tokenize_row(row, tokenizer, args.dataset_text_field, max_length, self.uld and args.use_extended_uld,
                             skip, keep_tokenized=not self.uld) for row in rows]

    def generation_rows(self, rows: list[dict]) -> list[dict]:
        """Each prompt's last ``max_length - max_completion_length`` tokens (at least 1), as TRL's
        ``_generate_non_vllm_for_slices`` budgets them; all of it without ``max_length``."""
        if self.args.max_length is None:
            return rows
        budget = max(1, self.args.max_length - self.args.max_completion_length)
        return [{**row, "prompt_ids": row["prompt_ids"][-budget:]} for row in rows]

    def step_loss(self, student: Family, teacher: Family) -> Callable:
        """TRL's GOLD loss (:func:`adapters.losses.gold.gold_step_loss`) with the config's settings."""
        uld = ULDLossSettings.from_config(self.args) if self.uld else None
        return gold_step_loss(student, teacher, GOLDLossSettings.from_config(self.args), uld, self.vocabulary)

    @property
    def evaluation_metrics(self) -> tuple[str, ...]:
        """TRL's GOLD evaluation reports ``eval_loss`` alone."""
        return ()

    def finish_logs(self, logs: dict[str, float]) -> None:
        """TRL's ``log`` rounds the running on/off-policy (and matched/unmatched) losses to 4 decimals."""
        for key in ("on_policy_loss", "off_policy_loss", "matched_loss", "unmatched_loss"):
            if key in logs:
                logs[key] = round(logs[key], 4)

    # ------------------------------------------------------------------ ULD's columns
    def dataset_columns(self, rows: list[dict], width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        """IW-OPD's columns, with ULD the rows' texts and byte offsets (left-padded as the ids)."""
        columns = super().dataset_columns(rows, width, pad_token_id)
        if not self.uld:
            return columns
        offsets = np.zeros((len(rows), width, 2), np.int64)
        for index, row in enumerate(rows):
            kept = np.asarray(row["byte_offsets"], np.int64).reshape(-1, 2)
            offsets[index, width - len(kept):] = kept
        return {**columns, **text_columns([row["original_prompt_text"] for row in rows],
                                          [row["original_completion_text"] for row in rows], offsets)}

    def sampled_columns(self, record: Rollout, dataset_columns: dict[str, np.ndarray], width: int,
                        pad_token_id: int) -> dict[str, np.ndarray]:
        """IW-OPD's columns of the student's completions, with ULD their texts as TRL decodes them (special tokens
        kept) and the byte offsets of the sampled pieces."""
        columns = super().sampled_columns(record, dataset_columns, width, pad_token_id)
        if not self.uld:
            return columns
        decode = self.student_tokenizer.decode
        prompts = [decode(ids[mask > 0].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
                   for ids, mask in zip(record.prompt_ids, record.prompt_mask, strict=True)]
        completions = [decode(tokens[mask > 0].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       for tokens, mask in zip(record.tokens, record.completion_mask, strict=True)]
        labels = np.where(np.pad(columns["completion_mask"], ((0, 0), (1, 0))) > 0, columns["input_ids"], -100)
        offsets = completion_byte_offsets(self.student_tokenizer, columns["input_ids"], labels) \
            if self.args.use_extended_uld else np.zeros((*labels.shape, 2), np.int64)
        return {**columns, **text_columns(prompts, completions, offsets)}

    def empty_columns(self, count: int, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
        columns = super().empty_columns(count, width, pad_token_id)
        if not self.uld:
            return columns
        return {**columns, **text_columns([""] * count, [""] * count, np.zeros((count, width, 2), np.int64))}

    def step_columns(self, micro_batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """With ULD, the texts become the teacher's tokenisation and the alignment
        (:func:`.gold_data.teacher_columns`)."""
        if not self.uld:
            return micro_batches
        return teacher_columns(micro_batches, self.teacher_tokenizer, ULDLossSettings.from_config(self.args))


class GOLDTrainer(StudentTeacherTrainer):
    """``trl.experimental.gold.GOLDTrainer`` with TRL 1.16's signature, training a torchlike student on a JAX mesh.

    Args:
        model: the student: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object
            (converted), or a path / hub id loaded with ``args.model_init_kwargs``.
        teacher_model: the teacher, a loaded :class:`~torchlike.CausalLM` or a path / hub id loaded with
            ``args.teacher_model_init_kwargs`` (and ``teacher_model_revision``); ``None`` loads
            ``args.teacher_model_name_or_path``. Without ``use_uld_loss`` its ``vocab_size`` must be the student's.
        args: :class:`GOLDConfig` (default: one with ``output_dir="<model>-GOLD"``).
        data_collator: refused: the batches are TRL's ``DataCollatorForChatML`` batches, built here.
        train_dataset, eval_dataset: rows with ``messages``, ``prompt``/``completion`` or tokenised ``input_ids``
            (with ``completion_mask``); a list of dicts or a ``datasets.Dataset`` (``eval_dataset`` may be a dict of
            them).
        processing_class: the student's tokenizer, with a pad token (default: loaded from the student's path).
        compute_metrics, preprocess_logits_for_metrics: accepted and never called, as in TRL (its GOLD evaluation
            returns the loss without logits); a warning says so.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter on the student.

    Raises:
        ValueError: TRL's errors (a tokenizer without a pad token, ``teacher_model_init_kwargs`` with a loaded teacher,
            a row with no prompt token left after truncation), vocabularies of different sizes without ULD, no teacher,
            no ``train_dataset``, or a refused argument.

    Example:

    ```python
    >>> from torchlike.trl.experimental.gold import GOLDConfig, GOLDTrainer
    >>> trainer = GOLDTrainer(model="path/to/Qwen2.5-0.5B-Instruct", teacher_model="path/to/Qwen2.5-1.5B-Instruct",
    ...                       args=GOLDConfig("out", lmbda=0.5, max_completion_length=64),
    ...                       train_dataset=[{"messages": [{"role": "user", "content": "Hi"},
    ...                                                    {"role": "assistant", "content": "Hello!"}]}] * 64)
    >>> trainer.train()
    ```
    """

    algorithm_class = GOLD
    _config_class = GOLDConfig
    _output_suffix = "GOLD"
    _tag_names = ["trl", "gold"]

    def __init__(self, model: ModelLike | None = None, teacher_model: ModelLike | None = None,
                 args: GOLDConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None):
        if data_collator is not None:
            raise ValueError("GOLDTrainer does not take data_collator: it batches the rows as TRL's "
                             "DataCollatorForChatML does.")
        unused = [name for name, value in (("compute_metrics", compute_metrics),
                                           ("preprocess_logits_for_metrics", preprocess_logits_for_metrics))
                  if value is not None]
        if unused:
            warnings.warn(f"GOLDTrainer never calls {' or '.join(unused)}: as TRL's, its evaluation returns the loss "
                          "without logits (eval_loss is reported).", UserWarning, stacklevel=2)
        args = self._trl_args(model, args)
        self.algorithm = self.algorithm_class(args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: rows with 'messages' or 'prompt'/'completion'.")
        for dataset in [train_dataset, *batches.each_dataset(eval_dataset)]:
            check_text_dataset(dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, None)
        if processing_class.pad_token_id is None:
            raise ValueError("The tokenizer does not have a pad token. Please set `pad_token_id` in the tokenizer.")
        if args.chat_template_path is not None:
            load_chat_template(processing_class, args.chat_template_path)
        if args.teacher_model_init_kwargs is not None and teacher_model is not None \
                and not isinstance(teacher_model, str | os.PathLike):
            raise ValueError("You passed teacher_model_init_kwargs to the GOLDConfig, but your teacher_model is "
                             "already instantiated.")
        self.teacher_model = self._load_teacher(teacher_model, args, model, revision=args.teacher_model_revision)
        self.use_uld_loss, self.teacher_tokenizer, vocabulary = args.use_uld_loss, None, None
        if args.use_uld_loss:
            self.teacher_tokenizer = self._teacher_tokenizer(teacher_model, args)
            if args.uld_use_hybrid_loss:
                vocabulary = hybrid_vocabulary(processing_class.get_vocab(), self.teacher_tokenizer.get_vocab(),
                                               *(loaded.config.get_text_config().vocab_size
                                                 for loaded in (model, self.teacher_model)))
        else:
            check_vocabularies(model, self.teacher_model, "GOLD without use_uld_loss")
        self.algorithm.use_tokenizers(processing_class, self.teacher_tokenizer, vocabulary)
        train_rows, eval_rows = self._sequence_rows(train_dataset, eval_dataset, processing_class, model,
                                                    args.max_completion_length,
                                                    teacher_reads_them=not args.use_uld_loss)
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._show_eval_dataset(eval_dataset)
        self._pair_with_teacher()
        # TRL's attributes.
        for name in ("lmbda", "beta", "temperature", "top_p", "seq_kd", "num_generations"):
            setattr(self, name, getattr(args, name))
        self.generation_kwargs = {"max_new_tokens": args.max_completion_length, "temperature": args.temperature,
                                  "top_p": args.top_p, "do_sample": True, "top_k": args.top_k,
                                  "pad_token_id": self.pad_token_id}

    def _teacher_tokenizer(self, teacher_model: ModelLike | None, args: GOLDConfig) -> Tokenizer:
        """The teacher's tokenizer for ULD, as TRL loads it: ``teacher_tokenizer_name_or_path``, by default the
        teacher's path (the config's ``teacher_model_revision`` when it is the teacher's own path); a missing pad token
        is the eos token."""
        from .... import AutoTokenizer

        # The loaded teacher's path is the string it was given (or teacher_model_name_or_path).
        source = args.teacher_tokenizer_name_or_path or self.teacher_model.config._name_or_path or None
        if source is None:
            raise ValueError("`teacher_tokenizer_name_or_path` must be set when using ULD loss with a pre-instantiated "
                             "teacher model.")
        revision = args.teacher_model_revision if str(source) == str(teacher_model) else None
        tokenizer = AutoTokenizer.from_pretrained(str(source), **({"revision": revision} if revision else {}))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
