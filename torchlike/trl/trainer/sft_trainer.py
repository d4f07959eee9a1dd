"""``SFTTrainer``: TRL's supervised fine-tuning trainer, with TRL's constructor, on torchlike's ``Trainer``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import datasets
import numpy as np

from ...adapters.losses import sft as sft_loss
from ...adapters.model import neftune
from ...training.batches import check_single_dataset, each_dataset, map_datasets
from ...training.loss_selection import with_virtual_tokens
from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
)
from ..data.model_images import ModelImages
from ..data.sft_data import SFTRows, collate_sft_batch, is_prepared, prepare_sft_dataset, unprepared_sft_examples
from ..data.sft_vision import VisionLanguageCollator, check_vision_settings
from ..data_utils import load_chat_template
from .base_config import round_up_to_multiple
from .base_trainer import TRLTrainer, check_text_dataset, is_vision_dataset, vision_processor
from .offline_trainer import OfflineAlgorithm, OfflineTrainer
from .sft_config import SFTConfig

__all__ = ["SFT", "SFTTrainer"]


class SFT(OfflineAlgorithm):
    """What supervised fine-tuning decides on the offline loop (:class:`SFTTrainer` prepares the data): batches read
    through :class:`~torchlike.trl.data.sft_data.SFTRows`, TRL's SFT loss and metrics, TRL's collator's lengths for
    NEFTune and ``compute_metrics``, and data given to ``evaluate()`` prepared like ``train_dataset``."""

    #: transformers' names: ``eval_<name>_loss`` and ``eval_<name>_mean_token_accuracy`` for a dict of datasets.
    metrics_named_by_dataset = True

    def train_rows(self, dataset: Sequence) -> Sequence:
        """The prepared dataset read through :class:`~torchlike.trl.data.sft_data.SFTRows`: the collator gets each
        row's token columns as views, not the whole row converted from Arrow (a vision dataset's rows as they are:
        its collator processes them)."""
        return dataset if self.trainer._is_vision_dataset else SFTRows(dataset)

    def prepare_eval_dataset(self, dataset: RowsLike) -> Sequence:
        """Raw data prepared like ``train_dataset`` (TRL's ``evaluate`` does too); prepared examples as they are; a
        vision dataset as it is (its collator processes the rows)."""
        trainer = self.trainer
        if trainer._is_vision_dataset:
            return dataset
        if not is_prepared(dataset):
            dataset = trainer._prepare_sft_dataset(dataset)
        rows = SFTRows(dataset)
        trainer._pad_to_fit(rows)
        return rows

    def step_loss(self) -> tuple[Callable, None] | None:
        """The built-in loss with TRL's ``loss_type="dft"``, the router's load-balancing loss (MoE models,
        ``router_aux_loss_coef``) and TRL's ``entropy`` and ``mean_token_accuracy`` metrics, each row's first token
        scored from the last virtual token of a prompt-tuning or P-tuning adapter, as TRL with ``peft`` scores it
        (:func:`~torchlike.training.loss_selection.with_virtual_tokens`; NEFTune is added by the base
        :meth:`Trainer._loss`); the Trainer's with ``compute_loss_func``."""
        trainer = self.trainer
        if trainer._compute_loss_func is not None or trainer._loss_fn is not None:
            return None
        model = trainer._trainable_model
        return with_virtual_tokens(model, sft_loss.sft_step_loss(
            model.family, loss_type=trainer.args.loss_type, router_aux_loss_coef=trainer._router_loss_weight(),
            with_metrics=True)), None

    def neftune_length(self) -> Callable:
        """TRL's collator's batch length: the longest row, or every token of a padding-free batch (one flattened row),
        rounded up to ``pad_to_multiple_of``."""
        return functools.partial(neftune.batch_length, padding_free=self.trainer.padding_free,
                                 pad_to_multiple_of=self.trainer.args.pad_to_multiple_of)

    def metrics_length(self, lengths: np.ndarray) -> int | None:
        """TRL's collator pads each batch to its longest example, rounded up to ``pad_to_multiple_of``; torchlike
        pads every batch to one length. ``compute_metrics`` sees TRL's length (a custom ``data_collator``: the
        batch as it made it; padding-free batches: torchlike's rows, which TRL flattens into one)."""
        trainer = self.trainer
        if not trainer._pads_like_trl or trainer.padding_free:
            return None
        return round_up_to_multiple(int(lengths.max()), trainer.args.pad_to_multiple_of)


class SFTTrainer(OfflineTrainer):
    """``trl.SFTTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (``dtype`` as a string, torch dtype or ``"auto"``; float32 by default, as TRL).
        args: :class:`~torchlike.trl.SFTConfig` (default: one with ``output_dir="<model>-SFT"``); a
            :class:`~torchlike.TrainingArguments` becomes ``SFTConfig(**args.to_dict())`` (its values kept), as in TRL.
        data_collator: replaces the fixed-shape padding collator.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL
            SFT format (``text``, ``prompt``/``completion``, ``messages``, pre-tokenised ``input_ids``);
            ``eval_dataset`` may be a dict of them (a ``datasets.DatasetDict``), each prepared alike and evaluated
            with its own metric names (``eval_<name>_loss``). ``trainer.train_dataset`` / ``eval_dataset`` are the
            prepared ``datasets.Dataset`` TRL makes (its columns plus ``input_ids`` and ``labels``; packed:
            ``input_ids``, ``labels``, ``seq_lengths``), or the data as given with ``skip_prepare_dataset``.
        processing_class: the tokenizer (default: loaded from the model's path).
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a LoRA adapter (QLoRA when the model
            was loaded with ``quantization_config`` or the config sets ``quantize_base``); or a
            ``PromptTuningConfig``, ``PromptEncoderConfig`` or ``PrefixTuningConfig``: train only the prompt
            parameters (prompt tuning and P-tuning refuse padding-free batches: ``padding_free=True``, or packing
            with ``"bfd"``/``"bfd_split"``, as ``peft`` drops their ``position_ids``).
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        formatting_func: ``example -> str``, as in TRL.
        compute_loss_func: transformers' ``(outputs, labels, num_items_in_batch) -> loss`` on the batch's
            ``labels`` (see :class:`~torchlike.Trainer`).
        compute_metrics, preprocess_logits_for_metrics: as in TRL: ``compute_metrics`` receives an
            ``EvalPrediction`` of the logits ``[N, T, V]`` and TRL's collator ``labels`` (``-100`` off the loss and on
            padding), each batch cut to the length TRL pads it to (its longest example, rounded up to
            ``pad_to_multiple_of``) and padded with ``-100`` across batches (see :class:`~torchlike.Trainer`).
        optimizer_cls_and_kwargs: a torch optimizer class; refused with a message when set.
    """

    algorithm_class = SFT
    _counts_step_tokens = True  # TRL's SFT logs the running total of training tokens
    _config_class = SFTConfig
    _output_suffix = "SFT"
    _tag_names = ["trl", "sft"]

    def __init__(self, model: ModelLike, args: SFTConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_loss_func: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), optimizer_cls_and_kwargs: tuple | None = None,
                 preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: QuantizationConfig | None = None, peft_config: PeftConfigLike | None = None,
                 formatting_func: Callable | None = None):
        if optimizer_cls_and_kwargs is not None:
            raise ValueError("optimizer_cls_and_kwargs is a torch hook and cannot run on JAX; pass optimizers=(optax "
                             "transformation, None) for a custom optimizer.")
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        check_single_dataset(train_dataset, "train_dataset")
        self._is_vision_dataset = is_vision_dataset(train_dataset)
        if self._is_vision_dataset:
            check_vision_settings(args, data_collator)
        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
        if self.padding_free and data_collator is not None:
            raise ValueError("Passing a custom data collator is not supported when using padding-free.")
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ValueError("When `padding_free=True` without packing, `max_length` is not enforced. Either enable "
                             "packing (e.g., `packing=True, packing_strategy='bfd'`), provide already truncated "
                             "inputs, or set `max_length=None`.")
        if args.loss_type == "dft" and compute_loss_func is not None:
            raise ValueError("You passed a `compute_loss_func` together with `loss_type='dft'` to the `SFTTrainer`. "
                             "When using `loss_type='dft'`, the loss function is internally set to the DFT loss, so "
                             "passing a `compute_loss_func` is not allowed.")
        # As TRL, a vision-language model given without processing_class gets its processor, for vision or text data.
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config,
                                                  load_processor=True)
        if self._is_vision_dataset:
            self._init_vision(model, args, train_dataset, eval_dataset, processing_class, compute_loss_func,
                              compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics)
            return
        check_text_dataset(train_dataset)
        # Text is read by a processor's tokenizer, as TRL's _tokenize does; the trainer keeps the processor.
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if args.chat_template_path is not None:
            load_chat_template(tokenizer, args.chat_template_path)
        self.pad_token_id = self._pad_token_id(tokenizer, args.pad_token if data_collator is None else None,
                                               args.eos_token)
        skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        eval_packing = args.packing if args.eval_packing is None else args.eval_packing

        def prepare(dataset, packing: bool = eval_packing):
            if dataset is None:
                return None
            if skip_prepare:
                examples = unprepared_sft_examples(dataset)  # checks the rows as TRL does
                return dataset if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") else examples
            if isinstance(dataset, datasets.Dataset) and dataset.format["type"] == "custom":
                raise ValueError(
                    "SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform()`. The preparation "
                    "pipeline calls `Dataset.map()`, which reads through the transform and can bake a random or "
                    "stateful transform into the tokenized columns. Pass `dataset_kwargs={'skip_prepare_dataset': "
                    "True}` and make the transform return trainer-ready examples, including tokenized fields, or "
                    "materialize deterministic transforms with `Dataset.map()` before constructing the trainer.")
            return prepare_sft_dataset(
                dataset, tokenizer, dataset_text_field=args.dataset_text_field, max_length=args.max_length,
                truncation_mode=args.truncation_mode, completion_only_loss=args.completion_only_loss,
                assistant_only_loss=args.assistant_only_loss, eos_token=args.eos_token,
                formatting_func=formatting_func, packing=packing, packing_strategy=args.packing_strategy,
                shuffle_seed=args.seed if args.shuffle_dataset else None)

        train_prepared = prepare(train_dataset, args.packing)
        largest = max([self.pad_token_id, *(int(np.max(row["input_ids"], initial=0))
                                            for row in SFTRows(train_prepared))])
        self._check_token_ids(largest, tokenizer, {"model": model})
        self._prepare_sft_dataset = prepare
        eval_prepared = map_datasets(eval_dataset, prepare)
        self.padded_length = 1
        self._pads_like_trl = data_collator is None
        collator = data_collator or (lambda rows: collate_sft_batch(rows, self.pad_token_id, self.padded_length,
                                                                    position_ids=self.padding_free))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_prepared,
                         eval_dataset=eval_prepared, processing_class=processing_class,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._pad_to_fit(SFTRows(train_prepared))
        for dataset in each_dataset(eval_prepared):
            self._pad_to_fit(SFTRows(dataset))
        self._setup_router_loss(model, args)

    def _init_vision(self, model, args: SFTConfig, train_dataset, eval_dataset, processor, compute_loss_func,
                     compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics) -> None:
        """The trainer on a vision dataset, as TRL builds it: no preparation, the rows processed batch by batch by
        the model's processor (:class:`~torchlike.trl.data.sft_vision.VisionLanguageCollator`)."""
        family = model.family
        processor = vision_processor(model, processor)
        config = model.config
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.padding_free, self._pads_like_trl, self.padded_length = False, False, 1
        collator = VisionLanguageCollator(
            processor, ModelImages(family, config), max_length=args.max_length,
            completion_only_loss=args.completion_only_loss, dataset_text_field=args.dataset_text_field,
            pad_to_multiple_of=args.pad_to_multiple_of)
        self._prepare_sft_dataset = lambda dataset, packing=False: dataset
        TRLTrainer.__init__(self, model=model, args=args, data_collator=collator, train_dataset=train_dataset,
                            eval_dataset=eval_dataset, processing_class=processor,
                            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                            optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._setup_router_loss(model, args)

    def _pad_to_fit(self, rows: Iterable[dict]) -> None:
        """Grows the one padded length of every batch (so XLA compiles each step once) to fit ``rows``: the longest
        prepared example or packed row (already truncated to max_length; TRL pads each batch to its longest), rounded
        up as pad_to_multiple_of asks."""
        longest = max((len(row["input_ids"]) for row in rows), default=1)
        self.padded_length = max(self.padded_length, round_up_to_multiple(longest, self.args.pad_to_multiple_of))
