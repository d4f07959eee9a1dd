"""``SFTTrainer``: TRL's supervised fine-tuning trainer, with TRL's constructor, on torchlike's ``Trainer``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..training import Trainer
from ..training.batches import check_single_dataset, each_dataset, map_datasets
from .base_config import round_up_to_multiple
from .sft_data import (
    collate_sft_batch,
    is_prepared,
    load_chat_template,
    pad_token_id_for,
    prepare_sft_examples,
    unprepared_sft_examples,
)

__all__ = ["SFTTrainer"]


class SFTTrainer(Trainer):
    """``trl.SFTTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (``dtype`` as a string, torch dtype or ``"auto"``; float32 by default, as TRL).
        args: :class:`~torchlike.trl.SFTConfig` (default: one with ``output_dir="<model>-SFT"``).
        data_collator: replaces the fixed-shape padding collator.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL
            SFT format (``text``, ``prompt``/``completion``, ``messages``, pre-tokenised ``input_ids``);
            ``eval_dataset`` may be a dict of them (a ``datasets.DatasetDict``), each prepared alike and evaluated
            with its own metric names (``eval_<name>_loss``).
        processing_class: the tokenizer (default: loaded from the model's path).
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a LoRA adapter (QLoRA when the model
            was loaded with ``quantization_config`` or the config sets ``quantize_base``).
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

    def __init__(self, model: Any, args: Any = None, data_collator: Callable | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), optimizer_cls_and_kwargs: tuple | None = None,
                 preprocess_logits_for_metrics: Callable | None = None, quantization_config: Any = None,
                 peft_config: Any = None, formatting_func: Callable | None = None):
        from .. import AutoTokenizer
        from ..field_support import check_unsupported
        from ..peft import get_peft_model
        from .sft_config import SFTConfig
        from .trainer_setup import default_output_dir, load_model

        if optimizer_cls_and_kwargs is not None:
            raise ValueError("optimizer_cls_and_kwargs is a torch hook and cannot run on JAX; pass optimizers=(optax "
                             "transformation, None) for a custom optimizer.")
        check_single_dataset(train_dataset, "train_dataset")
        if args is None:
            args = SFTConfig(output_dir=default_output_dir(model, "SFT"))
        check_unsupported(args)
        model = load_model(model, args, quantization_config, "SFTTrainer")
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.name_or_path)
        if peft_config is not None:
            model = get_peft_model(model, peft_config, seed=args.seed)  # TRL seeds before creating the adapter
        if args.chat_template_path is not None:
            load_chat_template(processing_class, args.chat_template_path)
        if data_collator is None and args.pad_token is not None:
            if args.pad_token not in processing_class.get_vocab():
                raise ValueError(f"pad_token={args.pad_token!r} is not in the vocabulary of the processing_class "
                                 f"({type(processing_class).__name__}); pass a token it has.")
            processing_class.pad_token = args.pad_token
        self.pad_token_id = pad_token_id_for(processing_class, args.eos_token)
        skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))

        def prepare(dataset):
            if dataset is None:
                return None
            if skip_prepare:
                return unprepared_sft_examples(dataset)
            return prepare_sft_examples(
                dataset, processing_class, dataset_text_field=args.dataset_text_field, max_length=args.max_length,
                truncation_mode=args.truncation_mode, completion_only_loss=args.completion_only_loss,
                assistant_only_loss=args.assistant_only_loss, eos_token=args.eos_token,
                formatting_func=formatting_func)

        train_examples = prepare(train_dataset)
        if args.shuffle_dataset and train_examples:
            order = np.random.default_rng(args.seed).permutation(len(train_examples))
            train_examples = [train_examples[int(i)] for i in order]
        vocab_size = getattr(model.config, "vocab_size", None)
        largest = max([self.pad_token_id, *(max(e["input_ids"], default=0) for e in train_examples or [])])
        if vocab_size is not None and largest >= vocab_size:
            raise ValueError(f"token id {largest} is outside the model's vocab_size={vocab_size} (the tokenizer has "
                             f"{len(processing_class)} tokens; pad token {processing_class.pad_token!r}). Use the "
                             "tokenizer that belongs to the model, or set tokenizer.pad_token to a token the "
                             "model knows.")
        self._prepare_sft_dataset = prepare
        eval_examples = map_datasets(eval_dataset, prepare)
        self.padded_length = 1
        self._pads_like_trl = data_collator is None
        collator = data_collator or (lambda rows: collate_sft_batch(rows, self.pad_token_id, self.padded_length))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._pad_to_fit([*(train_examples or []), *(example for examples in each_dataset(eval_examples)
                                                      for example in examples)])

    def _pad_to_fit(self, examples: list[dict]) -> None:
        """Grows the one padded length of every batch (so XLA compiles each step once) to fit ``examples``: the
        longest prepared example (already truncated to max_length; TRL pads each batch to its longest), rounded up as
        pad_to_multiple_of asks."""
        longest = max((len(example["input_ids"]) for example in examples), default=1)
        self.padded_length = max(self.padded_length, round_up_to_multiple(longest, self.args.pad_to_multiple_of))

    def _signature_columns(self) -> None:
        """Every column: the prepared examples hold only SFT's columns (``input_ids``, ``loss_mask``, ``seq_len``)."""
        return None

    def _prepare_eval_dataset(self, dataset: Any) -> list[dict]:
        """Raw data prepared like ``train_dataset`` (TRL's ``evaluate`` does too); prepared examples as they are."""
        if is_prepared(dataset):
            return super()._prepare_eval_dataset(dataset)
        examples = self._prepare_sft_dataset(dataset)
        self._pad_to_fit(examples)
        return examples

    def _metrics_length(self, lengths: np.ndarray) -> int | None:
        """TRL's collator pads each batch to its longest example, rounded up to ``pad_to_multiple_of``; torchlike
        pads every batch to one length. ``compute_metrics`` sees TRL's length (a custom ``data_collator``: the
        batch as it made it)."""
        if not self._pads_like_trl:
            return None
        return round_up_to_multiple(int(lengths.max()), self.args.pad_to_multiple_of)

