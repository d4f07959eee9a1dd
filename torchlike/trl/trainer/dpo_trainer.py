"""``DPOTrainer``: TRL 1.16's Direct Preference Optimization trainer and constructor on torchlike's ``Trainer``.

Each step scores the chosen and rejected sequences of a batch in one forward pass and applies TRL's DPO loss
(``adapters.losses.dpo.dpo_loss``: every loss type, f-divergences, LD-DPO) with TRL's metrics. The reference
log-probabilities are computed once, before training, by a jitted forward of the reference (``ref_model``; else the
base weights with the LoRA adapter off when the adapter is new; else the initial weights) and stored with each
example. TRL computes them in every step by default; the values are the same, since the reference is frozen and has no
dropout, and no second copy of the model is kept for full fine-tuning.

A vision dataset (``images`` or ``image`` beside ``prompt``/``chosen``/``rejected``) on a vision-language model is
processed batch by batch by the model's processor
(:class:`~torchlike.trl.data.dpo_vision.VisionPreferenceCollator`), for the reference pass as for the steps: each
pair's images go through the vision tower with both its sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...adapters.losses import dpo as dpo_losses
from ...adapters.losses.dpo import dpo_step_loss
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
from ..data.dpo_data import collate_preference_batch, padded_length, prepare_preference_examples
from ..data.dpo_vision import (
    VisionPreferenceCollator,
    check_vision_preference_settings,
    most_images,
    vision_preference_rows,
)
from ..data.model_images import ModelImages
from .base_trainer import check_vision_model, is_vision_dataset, vision_processor
from .dpo_config import DPOConfig
from .offline_trainer import PrecomputedReferenceTrainer, ReferenceAlgorithm, rows_trl_gathers

if TYPE_CHECKING:
    from ...modeling import CausalLM

__all__ = ["DPO", "DPOTrainer", "dpo_step_loss"]


class DPO(ReferenceAlgorithm):
    """TRL 1.16's DPO on the reference loop: preference pairs tokenised (or a vision dataset's rows kept for the
    vision collator), the reference's summed log-probabilities of the chosen and rejected sequences as columns, and
    TRL's DPO loss (``adapters.losses.dpo.dpo_loss``: every loss type, f-divergences, LD-DPO)."""

    reference_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared examples of ``dataset``, checked against the vocabulary of the models that will read them; the
        rows of a vision dataset as they are (its collator processes them), with image slots for the most images a
        row has."""
        trainer = self.trainer
        if trainer._is_vision_dataset:
            rows = vision_preference_rows(dataset)
            collator = trainer._vision_collator
            collator.images_per_row = max(collator.images_per_row, most_images(rows))
            return rows
        examples = prepare_preference_examples(dataset, tokenizer, max_length=args.max_length,
                                               truncation_mode=args.truncation_mode, num_proc=args.dataset_num_proc)
        largest = max([trainer.pad_token_id, *(max(e[key], default=0) for e in examples
                                               for key in ("prompt_ids", "chosen_ids", "rejected_ids"))])
        trainer._check_token_ids(largest, tokenizer, {"model": model, "ref_model": trainer.ref_model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        if self.trainer._is_vision_dataset:
            return 1  # the vision collator pads each batch to a bucketed length
        args = self.trainer.args
        return padded_length(examples, args.max_length, args.truncation_mode, args.pad_to_multiple_of)

    def reference_pass(self) -> Callable:
        """``(module, batch) -> (chosen [B], rejected [B])`` summed log-probabilities of the trainer's reference."""
        reference = self.trainer.reference
        return dpo_losses.reference_pass(reference.family, reference.lora, reference.mesh,
                                         dpo_losses.DPOLossSettings.from_config(self.trainer.args))

    def step_loss(self) -> tuple[Callable, None]:
        """TRL's DPO loss (:func:`adapters.losses.dpo.dpo_step_loss`) with the config's settings."""
        trainer = self.trainer
        settings = dpo_losses.DPOLossSettings.from_config(trainer.args,
                                                          router_aux_loss_coef=trainer._router_loss_weight())
        return dpo_step_loss(trainer.model.family, settings), None

    def metrics_rows(self, batch: dict) -> tuple[Any, Any]:
        """TRL's rows: the chosen sequences on top of the rejected ones."""
        import jax.numpy as jnp

        return (jnp.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
                jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]))

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """The ``rows`` real pairs' chosen rows, then their rejected rows; of a short last batch only its first
        ``rows`` rows, its chosen ones (:func:`.offline_trainer.rows_trl_gathers`)."""
        return rows_trl_gathers(found, rows, 2)


class DPOTrainer(PrecomputedReferenceTrainer):
    """``trl.DPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL).
        ref_model: the reference model (a :class:`~torchlike.CausalLM`, or a ``transformers`` model object converted
            as ``model`` is; used on its own mesh when it has one, else placed on the trainer's). ``None``: with a new
            LoRA adapter the base weights (adapter off), otherwise the initial weights of ``model``.
        args: :class:`~torchlike.trl.DPOConfig` (default: one with ``output_dir="<model>-DPO"``).
        data_collator: replaces the fixed-shape pair collator; it receives prepared examples (``prompt_ids``,
            ``chosen_ids``, ``rejected_ids``, and ``ref_chosen_logps``/``ref_rejected_logps`` once computed) and
            must return ``collate_preference_batch``'s columns with one row per example.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL
            preference format (``prompt``/``chosen``/``rejected``, or implicit prompt ``chosen``/``rejected``;
            strings or message lists); with an ``images`` (or ``image``) column, TRL's vision preference data for a
            vision-language model (explicit prompt; ``trainer.train_dataset`` is then its rows as dicts with the
            reference columns added). ``train_dataset`` is required; ``eval_dataset`` may be a dict of datasets (a
            ``datasets.DatasetDict``), each prepared and scored by the reference alike and evaluated with its own
            loss name (``eval_<name>_loss``; TRL's own metrics stay ``eval_rewards/chosen``..., as TRL logs them).
        processing_class: the tokenizer, or for vision data the model's processor (default: loaded from the
            model's path, the processor for vision data).
        compute_metrics: ``EvalPrediction -> dict``, as TRL (which deprecates it, with a ``FutureWarning``, since
            its logits take an extra forward pass): the logits of the chosen rows, then the rejected rows, of each
            batch and ``label_ids`` their ``input_ids`` (prompt + response, right-padded as TRL's collator pads).
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.

    Example:

    ```python
    >>> from torchlike.trl import DPOConfig, DPOTrainer
    >>> data = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}] * 64
    >>> trainer = DPOTrainer(model="path/to/qwen2", args=DPOConfig("out", beta=0.1), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = DPO
    _config_class = DPOConfig
    _output_suffix = "DPO"
    _tag_names = ["trl", "dpo"]
    _takes_vision_data = True  # refused for a text-only model by _vision_processor, in TRL's words

    def __init__(self, model: ModelLike, ref_model: ModelLike | None = None, args: DPOConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: QuantizationConfig | None = None,
                 peft_config: PeftConfigLike | None = None):
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: preference pairs ('prompt', 'chosen', 'rejected').")
        self._is_vision_dataset = is_vision_dataset(train_dataset)
        if self._is_vision_dataset:
            check_vision_preference_settings(args, data_collator, compute_metrics)
        ref_model = self._check_reference_settings(args, model, ref_model, train_dataset, eval_dataset)
        if args.use_weighting and {"aot", "aot_unpaired"} & set(args.loss_type):
            raise NotImplementedError("WPO-style weighting is not implemented for 'aot' or 'aot_unpaired' because "
                                      "those losses sort samples, which would misalign per-pair weights.")
        given_processing_class = processing_class
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config,
                                                  load_processor=True)
        self._setup_router_loss(model, args)
        self.ref_model = ref_model
        tokenizer = processing_class
        if self._is_vision_dataset:
            processing_class = self._vision_processor(model, ref_model, given_processing_class)
            tokenizer = processing_class.tokenizer
        self.pad_token_id = self._pad_token_id(tokenizer, args.pad_token)
        for config in (model.config, model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        if self._is_vision_dataset:
            family, config = model.family, model.config
            collator = self._vision_collator = VisionPreferenceCollator(
                processing_class, ModelImages(family, config), self.pad_token_id,
                max_length=args.max_length)
        else:
            collator = data_collator or (lambda rows: collate_preference_batch(
                rows, self.pad_token_id, self.padded_length, args.max_length, args.truncation_mode))
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self._start_reference(ref_model, train_examples, eval_examples)
        self._warn_if_sorting_loss_sees_padding()
        # What TRL users read: a datasets.Dataset with TRL's columns (prompt_ids, chosen_ids, rejected_ids and the
        # precomputed ref_chosen_logps / ref_rejected_logps). TRL leaves vision data unprepared: its rows stay.
        if not self._is_vision_dataset:
            self._show_prepared_datasets(train_examples, eval_examples)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _vision_processor(model: CausalLM, ref_model: CausalLM | None,
                          processing_class: ProcessingClass | None) -> Any:
        """The processor of a vision dataset (:func:`.base_trainer.vision_processor`), after TRL's refusal of vision
        data for a ``ref_model`` that is not a vision-language one."""
        processor = vision_processor(model, processing_class)
        if ref_model is not None:
            check_vision_model(ref_model.family, which="ref_model")
        return processor

    def _warn_if_sorting_loss_sees_padding(self) -> None:
        sorting = sorted(set(self.args.loss_type) & {"aot", "aot_unpaired"})
        if sorting and len(self.train_dataset) % self._global_batch_size() and not self.args.dataloader_drop_last:
            warnings.warn(f"loss_type {sorting} sorts the pairs of a batch; the last, partial batch is padded with "
                          f"empty pairs that enter the sort ({len(self.train_dataset)} examples, batches of "
                          f"{self._global_batch_size()}). Set dataloader_drop_last=True for TRL's values.",
                          UserWarning, stacklevel=3)
