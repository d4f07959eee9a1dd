"""``KTOTrainer``: TRL 1.16's Kahneman-Tversky Optimization trainer and constructor on torchlike's ``Trainer``.

Each step scores the completions of a batch of unpaired examples (and, for ``loss_type="kto"``, the mismatched KL
completions, in a second forward pass without gradient) and applies TRL's KTO loss (``adapters.losses.kto``) with TRL's
metrics. The reference log-probabilities of both are computed once, before training, by a jitted forward of the
reference (``ref_model``; else the base weights with the LoRA adapter off when the adapter is new; else the initial
weights) and stored with each example. TRL computes them in every step by default; the values are the same, since the
reference is frozen and has no dropout, and no second copy of the model is kept for full fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...adapters.losses import kto as kto_losses
from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
    TRLArgs,
)
from ..data.dpo_vision import most_images
from ..data.kto_data import check_desirability_balance, collate_unpaired_batch, padded_length, prepare_unpaired_examples
from ..data.kto_vision import VisionUnpairedCollator, check_vision_unpaired_settings, vision_unpaired_rows
from ..data.model_images import ModelImages
from .base_trainer import check_vision_model, is_vision_dataset, vision_processor
from .kto_config import KTOConfig
from .offline_trainer import PrecomputedReferenceTrainer, ReferenceAlgorithm

if TYPE_CHECKING:
    from ...modeling import CausalLM

__all__ = ["KTO", "KTOTrainer"]


class KTO(ReferenceAlgorithm):
    """TRL 1.16's KTO on the reference loop: unpaired examples tokenised with their mismatched KL completions, the
    reference's log-probabilities of both as columns (of the completions alone without a KL term), and TRL's KTO
    loss (``adapters.losses.kto``)."""

    @property
    def reference_columns(self) -> tuple[str, ...]:
        return kto_losses.reference_columns(self.trainer.loss_settings)

    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared examples of ``dataset`` (KL completions paired within chunks of ``per_device_train_batch_size``,
        for evaluation data too, as TRL does), checked against the vocabulary of the models that will read them."""
        trainer = self.trainer
        if trainer._is_vision_dataset:  # its collator processes the rows batch by batch, as TRL's
            rows = vision_unpaired_rows(dataset)
            collator = trainer._vision_collator
            collator.images_per_row = max(collator.images_per_row, most_images(rows))
            return rows
        examples = prepare_unpaired_examples(
            dataset, tokenizer, max_length=args.max_length, num_proc=args.dataset_num_proc,
            kl_chunk_size=args.per_device_train_batch_size if args.estimates_kl else None)
        largest = max([trainer.pad_token_id, *(max(e[key], default=0) for e in examples
                                               for key in ("prompt_ids", "completion_ids"))])
        trainer._check_token_ids(largest, tokenizer, {"model": model, "ref_model": trainer.ref_model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        if self.trainer._is_vision_dataset:
            return 1  # the vision collator pads each batch to a bucketed length
        return padded_length(examples, self.trainer.args.max_length, self.trainer.args.pad_to_multiple_of)

    def reference_pass(self) -> Callable:
        """``(module, batch) -> (ref_logps [B], ref_KL_logps [B])`` (``ref_logps`` alone without a KL term) of the
        trainer's reference."""
        reference = self.trainer.reference
        return kto_losses.reference_pass(reference.family, reference.lora, reference.mesh, self.trainer.loss_settings)

    def step_loss(self) -> tuple[Callable, None]:
        """TRL's KTO loss (:func:`adapters.losses.kto.kto_step_loss`) with the config's settings."""
        return kto_losses.kto_step_loss(self.trainer.model.family, self.trainer.loss_settings), None


class KTOTrainer(PrecomputedReferenceTrainer):
    """``trl.KTOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL).
        ref_model: the reference model (a :class:`~torchlike.CausalLM`, or a ``transformers`` model object converted
            as ``model`` is; used on its own mesh when it has one, else placed on the trainer's). ``None``: with a new
            LoRA adapter the base weights (adapter off), otherwise the initial weights of ``model``.
        args: :class:`~torchlike.trl.KTOConfig` (default: one with ``output_dir="<model>-KTO"``).
        data_collator: replaces the fixed-shape collator; it receives prepared examples (``prompt_ids``,
            ``completion_ids``, ``label``, ``KL_completion_ids`` for ``loss_type="kto"``, and ``ref_logps`` /
            ``ref_KL_logps`` once computed) and must return ``collate_unpaired_batch``'s columns with one row per
            example.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL unpaired
            preference format (``prompt``/``completion``/``label``; with ``images`` or ``image`` beside them, TRL's
            vision data for a vision-language model, processed batch by batch by its processor, each prompt's KL
            completion the one before it in its batch), or paired preference data
            (``prompt``/``chosen``/``rejected``, or ``chosen``/``rejected`` with an implicit prompt) that is unpaired
            as TRL does; strings or message lists. ``train_dataset`` is required; ``eval_dataset`` may be a dict of
            datasets, each prepared and scored by the reference alike and evaluated with its own loss name
            (``eval_<name>_loss``; TRL's own metrics stay ``eval_rewards/chosen``..., as TRL logs them).
        processing_class: the tokenizer (default: loaded from the model's path); the processor for vision data
            (default: the model's, as TRL loads it).
        compute_metrics: ``EvalPrediction -> dict``, as TRL (which deprecates it, with a ``FutureWarning``, since
            its logits take an extra forward pass): the logits of each example's prompt + completion and
            ``label_ids`` those ``input_ids``, right-padded as TRL's collator pads.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.

    Example:

    ```python
    >>> from torchlike.trl import KTOConfig, KTOTrainer
    >>> data = [{"prompt": "The sky is", "completion": " blue.", "label": True},
    ...         {"prompt": "The sky is", "completion": " green.", "label": False}] * 32
    >>> trainer = KTOTrainer(model="path/to/qwen2", args=KTOConfig("out", beta=0.1), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = KTO
    _config_class = KTOConfig
    _takes_vision_data = True  # refused for a text-only model by vision_processor, in TRL's words
    _output_suffix = "KTO"
    _tag_names = ["trl", "kto"]

    def __init__(self, model: ModelLike, ref_model: ModelLike | None = None, args: KTOConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: QuantizationConfig | None = None,
                 peft_config: PeftConfigLike | None = None):
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: unpaired preference examples ('prompt', 'completion', "
                             "'label'), or preference pairs ('prompt', 'chosen', 'rejected').")
        self._is_vision_dataset = is_vision_dataset(train_dataset)
        if self._is_vision_dataset:
            check_vision_unpaired_settings(args, next(iter(train_dataset)), data_collator, compute_metrics)
        ref_model = self._check_reference_settings(args, model, ref_model, train_dataset, eval_dataset)
        given_processing_class = processing_class
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config,
                                                  load_processor=self._is_vision_dataset)
        self._setup_router_loss(model, args)
        self.ref_model = ref_model
        tokenizer = processing_class
        if self._is_vision_dataset:
            processing_class = vision_processor(model, given_processing_class)
            if ref_model is not None:
                check_vision_model(ref_model.family, which="ref_model")
            tokenizer = processing_class.tokenizer
        self.pad_token_id = self._pad_token_id(tokenizer, None)
        for config in (model.config, model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        self.loss_settings = kto_losses.KTOLossSettings.from_config(args,
                                                                    router_aux_loss_coef=self._router_loss_weight())
        if self._is_vision_dataset:
            self._vision_collator = data_collator = VisionUnpairedCollator(
                processing_class, ModelImages(model.family, model.config), self.pad_token_id,
                max_length=args.max_length,
                kl_chunk_size=args.per_device_train_batch_size if self.loss_settings.estimates_kl else None)
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        check_desirability_balance([example["label"] for example in train_examples], args.desirable_weight,
                                   args.undesirable_weight)
        collator = data_collator or (lambda rows: collate_unpaired_batch(rows, self.pad_token_id, self.padded_length,
                                                                         args.max_length))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self._start_reference(ref_model, train_examples, eval_examples)
        # What TRL users read: a datasets.Dataset with TRL's columns (prompt_ids, completion_ids, label,
        # KL_completion_ids and the precomputed ref_logps / ref_KL_logps). TRL leaves vision data unprepared.
        if not self._is_vision_dataset:
            self._show_prepared_datasets(train_examples, eval_examples)
