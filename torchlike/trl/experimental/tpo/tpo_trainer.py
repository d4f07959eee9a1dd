"""``TPOTrainer``: TRL 1.16's ``trl.experimental.tpo.TPOTrainer`` and constructor on torchlike's ``Trainer``.

Triple Preference Optimization trains without a reference model: each step scores a batch's chosen, rejected and gold
(``reference``) sequences in one forward pass, and minimises a preference loss on the policy's own log-probabilities of
the chosen and rejected responses plus ``tpo_alpha`` times the gold responses' NLL
(``torchlike.adapters.losses.tpo``), logging TRL's metrics. The data are TRL's triple-preference formats
(:mod:`.tpo_data`), batched by DPO's fixed-shape collator with the gold columns added.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ....adapters.losses.tpo import TPOLossSettings, check_loss_type, responses_scored, tpo_step_loss
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    RowsLike,
    TRLArgs,
)
from ...data.dpo_data import collate_preference_batch, padded_length
from ...trainer.offline_trainer import OfflineTrainer, ReferenceFreePreference, StackedRowsMetrics, rows_trl_gathers
from .tpo_config import TPOConfig
from .tpo_data import prepare_triple_examples

if TYPE_CHECKING:
    from ....modeling import CausalLM

__all__ = ["TPO", "TPOTrainer"]


class TPO(StackedRowsMetrics, ReferenceFreePreference):
    """TRL 1.16's TPO on the offline loop (:class:`TPOTrainer` prepares the triples): TRL's triple formats tokenised
    and padded with the gold responses, the loss (:func:`adapters.losses.tpo.tpo_step_loss`) with the config's
    settings, and the stacked rows TRL's ``compute_metrics`` receives (no deprecation warning: TRL's TPO gives
    none)."""

    logits_for_metrics_deprecated = False

    # ------------------------------------------------------------------ data
    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared triples of ``dataset``, checked against the model's vocabulary."""
        examples = prepare_triple_examples(dataset, tokenizer, num_proc=args.dataset_num_proc)
        largest = max([self.trainer.pad_token_id, *(max(example[key], default=0) for example in examples
                                                    for key in example)])
        self.trainer._check_token_ids(largest, tokenizer, {"model": model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        args = self.trainer.args
        return padded_length(examples, args.max_length, args.truncation_mode, args.pad_to_multiple_of,
                             self.trainer._responses)

    # ------------------------------------------------------------------ step
    def step_loss(self) -> tuple[Callable, None]:
        return tpo_step_loss(self.trainer.model.family, self.trainer._settings), None

    # ------------------------------------------------------------------ compute_metrics
    def metrics_rows(self, batch: dict) -> tuple[Any, Any]:
        """TRL's rows: the chosen sequences, then the rejected ones, then (unless ``tpo_alpha`` is 0) the gold ones."""
        import jax.numpy as jnp

        return tuple(jnp.concatenate([batch[f"{response}_{name}"] for response in self.trainer._responses])
                     for name in ("input_ids", "attention_mask"))

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        return rows_trl_gathers(found, rows, len(self.trainer._responses))


class TPOTrainer(OfflineTrainer):
    """``trl.experimental.tpo.TPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with ``args.model_init_kwargs``
            (float32 unless they set ``dtype``).
        args: :class:`TPOConfig` (default: one with ``output_dir="<model>-TPO"``).
        data_collator: replaces the fixed-shape triple collator; it receives prepared examples (``prompt_ids``,
            ``chosen_ids``, ``rejected_ids``, ``reference_ids``) and must return
            ``dpo_data.collate_preference_batch``'s columns for the responses scored (``chosen_*``, ``rejected_*``
            and, unless ``tpo_alpha`` is 0, ``reference_*``), one row per example.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts with ``chosen``,
            ``rejected`` and ``reference`` (and ``prompt``, else an implicit one), strings or message lists;
            ``train_dataset`` is required, ``eval_dataset`` may be a dict of datasets.
        processing_class: the tokenizer (default: loaded from the model's path); without a pad token its eos token
            pads, as in TRL, and a processor (a vision-language model's) is refused with TRL's message.
        compute_metrics: ``EvalPrediction -> dict``: the logits of each batch's chosen rows, then its rejected and
            gold rows, with their ``input_ids`` as ``label_ids`` (each batch right-padded to its longest row), as
            TRL's ``prediction_step`` gives them.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.

    Example:

    ```python
    >>> from torchlike.trl.experimental.tpo import TPOConfig, TPOTrainer
    >>> data = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "reference": " blue today."}] * 64
    >>> trainer = TPOTrainer(model="path/to/qwen2", args=TPOConfig("out", loss_type="tpo-l"), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = TPO
    _config_class = TPOConfig
    _output_suffix = "TPO"
    _tag_names = ["trl", "tpo"]
    _counts_step_tokens = True
    _evaluation_rows_key = "chosen_attention_mask"

    def __init__(self, model: ModelLike, args: TPOConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 peft_config: PeftConfigLike | None = None):
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if args.model_init_kwargs is not None and not isinstance(model, str):
            warnings.warn("You passed `model_init_kwargs` to the `TPOConfig`, but your model is already "
                          "instantiated. The `model_init_kwargs` will be ignored.", UserWarning, stacklevel=2)
        settings = TPOLossSettings.from_config(args)
        check_loss_type(settings.loss_type)  # TRL raises it in the first step
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, None)
        if not hasattr(processing_class, "convert_tokens_to_ids"):
            raise TypeError("The `processing_class` must be a `PreTrainedTokenizerBase`. `TPOTrainer` does not "
                            "currently support vision-language models.")
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        self.pad_token_id = self._pad_token_id(processing_class, None)
        for config in (model.config, model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        if settings.loss_type in ("hinge", "ipo") and settings.label_smoothing > 0:
            warnings.warn(f"You are using the {settings.loss_type} loss type that does not support label smoothing. "
                          "The `label_smoothing` parameter will be ignored. Set `label_smoothing` to `0.0` to remove "
                          "this warning.", UserWarning, stacklevel=2)
        # TRL's attributes.
        self.beta, self.loss_type, self.label_smoothing = args.beta, args.loss_type, args.label_smoothing
        self.tpo_alpha, self.tpo_l_gamma = args.tpo_alpha, args.tpo_l_gamma
        self._settings = settings
        self._responses = responses_scored(settings)
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        collator = data_collator or (lambda rows: collate_preference_batch(
            rows, self.pad_token_id, self.padded_length, args.max_length, args.truncation_mode, self._responses))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self._show_prepared_datasets(train_examples, eval_examples)
