"""``RewardTrainer``: TRL 1.16's outcome reward model trainer and constructor on torchlike's ``Trainer``.

The model is a sequence classifier with one label (:class:`~torchlike.SequenceClassifier`: a decoder and a ``score``
head read at each sequence's last non-pad token). Each step scores the chosen and rejected sequences of a batch of
preference pairs in one forward pass and applies TRL's Bradley-Terry loss, with the data's ``margin`` and
``center_rewards_coefficient`` (``adapters.losses.reward``), logging TRL's metrics (``accuracy``, ``margin``,
``min_reward``/``mean_reward``/``max_reward``, ``num_tokens``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...adapters.losses import reward as reward_losses
from ...training.batches import check_single_dataset
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
from ..data.reward_data import collate_reward_batch, padded_length, prepare_reward_examples
from ..data_utils import load_chat_template
from .base_trainer import check_text_dataset
from .offline_trainer import OfflineAlgorithm, OfflineTrainer
from .reward_config import RewardConfig

if TYPE_CHECKING:
    from ...modeling import CausalLM
    from ...sequence_classification import SequenceClassifier

__all__ = ["Reward", "RewardTrainer", "load_reward_model"]

#: The notices of loading a causal LM as a classifier (a new ``score`` head, an unused ``lm_head``), which TRL
#: silences.
_CROSS_ARCHITECTURE_NOTICES = (
    r"Some weights of \S+ were not initialized from the model checkpoint at \S+ and are newly initialized: ",
    r"Some weights of \S+ were not used by the \S+ model: \['lm_head.weight'\]\.$",
)


def load_reward_model(model: ModelLike, args: RewardConfig, quantization_config: QuantizationConfig | None
                      ) -> SequenceClassifier:
    """``model`` as a one-label torchlike sequence classifier, as TRL's ``RewardTrainer`` loads it.

    Args:
        model: a path or hub id, loaded with ``AutoModelForSequenceClassification.from_pretrained`` with
            ``args.model_init_kwargs``, ``num_labels=1`` and ``float32`` unless they set ``dtype`` (a causal-LM
            checkpoint gets a new ``score`` head, seeded with ``args.seed``); or a loaded
            :class:`~torchlike.SequenceClassifier` (or its ``PeftModel``), which must have ``num_labels=1``.
        args: the :class:`RewardConfig`.
        quantization_config: a ``BitsAndBytesConfig``-like request for a path or hub id.

    Returns:
        The loaded (or given) classifier.

    Raises:
        ValueError: a loaded model with ``num_labels != 1`` (TRL's message), or ``quantization_config`` given in two
            places or with a loaded model.
        TypeError: a loaded model that is not a sequence classifier.
    """
    from ... import AutoModelForSequenceClassification, SequenceClassifier
    from ...adapters.checkpoint.hf_source import is_transformers_model

    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError("You set `quantization_config` both as a trainer argument and in "
                                 "`args.model_init_kwargs`. Please set it in only one place, preferably as a trainer "
                                 "argument.")
            init_kwargs["quantization_config"] = quantization_config
        init_kwargs["num_labels"] = 1  # the only output of the model is the reward score
        init_kwargs.setdefault("dtype", "float32")
        init_kwargs.setdefault("seed", args.seed)
        with warnings.catch_warnings():
            for notice in _CROSS_ARCHITECTURE_NOTICES:
                warnings.filterwarnings("ignore", message=notice)
            return AutoModelForSequenceClassification.from_pretrained(model, **init_kwargs)
    if quantization_config is not None:
        raise ValueError("quantization_config only applies when the model is loaded from a path or hub id (a str); "
                         "the model passed is already loaded. Pass its path, or omit quantization_config.")
    if is_transformers_model(model):  # as TRL's reward.py passes AutoModelForSequenceClassification's model
        model = AutoModelForSequenceClassification.from_pretrained(model, dtype=model.dtype)
    if not isinstance(model, SequenceClassifier):
        raise TypeError(f"RewardTrainer's model must be a sequence classifier; got {type(model).__name__}. Load it "
                        "with torchlike.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1), or "
                        "pass the path.")
    if args.model_init_kwargs is not None:
        warnings.warn("You passed `model_init_kwargs` to the `RewardConfig`, but your model is already instantiated. "
                      "The `model_init_kwargs` will be ignored.", UserWarning, stacklevel=3)
    if getattr(model.config, "num_labels", None) != 1:
        raise ValueError(f"The model has `num_labels={model.config.num_labels}`, but reward models require "
                         "`num_labels=1` to output a single scalar reward per sequence. Please instantiate your model "
                         "with `num_labels=1` or pass a model name as a string to have it configured automatically.")
    return model


class Reward(OfflineAlgorithm):
    """What reward modelling decides on the offline loop (:class:`RewardTrainer` prepares the pairs): the one-label
    classifier, the pairs tokenised and padded, TRL's Bradley-Terry step loss, and what TRL's ``compute_metrics``
    receives."""

    # ------------------------------------------------------------------ model
    def load_model(self, model: ModelLike, args: TRLArgs,
                   quantization_config: QuantizationConfig | None) -> SequenceClassifier:
        """The one-label classifier (:func:`load_reward_model`)."""
        return load_reward_model(model, args, quantization_config)

    def check_new_adapter(self, model: CausalLM) -> None:
        if "score" not in model.modules_to_save:
            warnings.warn("The LoRA adapter does not train the score head (peft_config has neither "
                          "task_type='SEQ_CLS' nor 'score' in modules_to_save), so the reward head keeps its "
                          "loaded (possibly newly initialised) weights, as in TRL. Pass task_type='SEQ_CLS' to "
                          "train it.", UserWarning, stacklevel=5)

    # ------------------------------------------------------------------ data
    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared pairs of ``dataset``, checked against the model's vocabulary."""
        examples = prepare_reward_examples(dataset, tokenizer, max_length=args.max_length,
                                           num_proc=args.dataset_num_proc)
        largest = max([self.trainer.pad_token_id, *(max(e[key], default=0) for e in examples
                                                    for key in ("chosen_ids", "rejected_ids"))])
        self.trainer._check_token_ids(largest, tokenizer, {"model": model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        """The longest sequence, rounded up to ``pad_to_multiple_of``."""
        return padded_length(examples, self.trainer.args.pad_to_multiple_of)

    def prepare_eval_dataset(self, dataset: RowsLike) -> list[dict]:
        """Evaluation data prepared as the training data (TRL's ``evaluate`` prepares what it is given; prepared
        pairs pass through unchanged), with the padded length widened when it holds longer sequences."""
        trainer = self.trainer
        examples = self.tokenize(dataset, trainer.processing_class, trainer.args, trainer.model)
        trainer.padded_length = max(trainer.padded_length, self.padded_length(examples))
        return examples

    # ------------------------------------------------------------------ step
    def step_loss(self) -> tuple[Callable, None]:
        """TRL's reward-model loss (:func:`adapters.losses.reward.reward_step_loss`) with the config's settings."""
        settings = reward_losses.RewardLossSettings.from_config(self.trainer.args)
        return reward_losses.reward_step_loss(self.trainer.model.scores_function, settings), None

    def neftune_length(self) -> Callable:
        """NEFTune's ``L`` for a pair batch: the width TRL's collator pads the stacked pairs to."""
        multiple = self.trainer.args.pad_to_multiple_of
        return lambda batch: reward_losses.reward_batch_length(batch, multiple)

    # ------------------------------------------------------------------ compute_metrics
    def found_for_metrics(self) -> Callable:
        """What transformers' ``prediction_step`` hands TRL's ``compute_metrics``: the rewards of the chosen rows on
        top of the rejected ones (``[2B, 1]``, the model's logits) and no labels (an empty array)."""
        import jax.numpy as jnp

        scores = self.trainer.model.scores_function

        def found(module, batch):
            input_ids, attention_mask = reward_losses.pair_inputs(batch)
            return {"predictions": scores(module, input_ids, attention_mask), "labels": jnp.zeros((0,), jnp.float32)}

        return found

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """The batch's rows as accelerate's ``gather_for_metrics`` leaves them:
        all of a full batch; of a short last batch its first ``rows``, its chosen ones."""
        import numpy as np

        total = found["predictions"].shape[0]
        kept = total if rows == total // 2 else rows
        return {"predictions": np.asarray(found["predictions"])[:kept], "labels": np.asarray(found["labels"])}, kept


class RewardTrainer(OfflineTrainer):
    """``trl.RewardTrainer`` with TRL 1.16's signature, training a torchlike reward model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.SequenceClassifier` with ``num_labels=1`` (or its ``PeftModel``), or a path / hub
            id loaded with ``AutoModelForSequenceClassification.from_pretrained(num_labels=1)`` and
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL; a causal-LM checkpoint gets a
            new ``score`` head).
        args: :class:`~torchlike.trl.RewardConfig` (default: one with ``output_dir="<model>-Reward"``).
        data_collator: replaces the fixed-shape pair collator; it receives prepared examples (``chosen_ids``,
            ``rejected_ids`` and optionally ``margin``) and must return ``collate_reward_batch``'s columns with one
            row per pair.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL preference
            format (``prompt``/``chosen``/``rejected`` or implicit-prompt ``chosen``/``rejected``, strings or message
            lists; or tokenised ``chosen_ids``/``rejected_ids``), optionally with a ``margin`` column.
            ``train_dataset`` is required; ``eval_dataset`` may be a dict of datasets (a ``datasets.DatasetDict``),
            each evaluated with its own loss name (``eval_<name>_loss``; TRL's own metrics stay ``eval_accuracy``...,
            as TRL logs them).
        processing_class: the tokenizer (default: loaded from the model's path). Its pad token (else its eos token)
            becomes the model config's ``pad_token_id``, where the score is read.
        compute_metrics: ``EvalPrediction -> dict``, given what transformers' ``prediction_step`` gives TRL's: each
            eval batch's rewards ``[rows, 1]``, its chosen rows then its rejected ones (of a short last batch only its
            first rows, as accelerate cuts it to the examples left), and empty ``label_ids``.
        preprocess_logits_for_metrics: applied to each batch's rewards first, as transformers does.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        optimizer_cls_and_kwargs: a torch hook; refused (pass ``optimizers``).
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter. With ``task_type="SEQ_CLS"``
            the ``score`` head is trained in full beside it and saved with it (PEFT's ``modules_to_save``).

    Example:

    ```python
    >>> from torchlike.trl import RewardConfig, RewardTrainer
    >>> data = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}] * 64
    >>> trainer = RewardTrainer(model="path/to/qwen2", args=RewardConfig("out"), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = Reward
    _config_class = RewardConfig
    _output_suffix = "Reward"
    _tag_names = ["trl", "reward-trainer"]
    _counts_step_tokens = True

    def __init__(self, model: ModelLike, args: RewardConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 optimizer_cls_and_kwargs: tuple | None = None, preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: QuantizationConfig | None = None, peft_config: PeftConfigLike | None = None):
        if optimizer_cls_and_kwargs is not None:
            raise ValueError("optimizer_cls_and_kwargs is a torch hook and cannot run on JAX; pass optimizers=(optax "
                             "transformation, None) for a custom optimizer.")
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: preference pairs ('chosen' and 'rejected', with an "
                             "optional 'prompt' and 'margin').")
        check_single_dataset(train_dataset, "train_dataset")
        check_text_dataset(train_dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
        self.pad_token_id = self._special_tokens(model, processing_class, args)
        # One padded length for training and evaluation, so XLA compiles each step once.
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        collator = data_collator or (lambda rows: collate_reward_batch(rows, self.pad_token_id, self.padded_length))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, compute_metrics=compute_metrics,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        # What TRL users read: a datasets.Dataset with TRL's columns (chosen_ids, rejected_ids, margin).
        self._show_prepared_datasets(train_examples, eval_examples)

    # ------------------------------------------------------------------ tokenizer
    def _special_tokens(self, model: CausalLM, tokenizer: Tokenizer, args: TRLArgs) -> int:
        """Applies TRL's ``eos_token``, ``chat_template_path`` and pad-token settings to the tokenizer and the model
        config (whose ``pad_token_id`` marks where the score is read); returns the pad token id."""
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise ValueError(f"The specified `eos_token` ('{args.eos_token}') is not found in the vocabulary of "
                                 f"the given `processing_class` ({type(tokenizer).__name__}). Ensure that the "
                                 "`eos_token` exists in the vocabulary before using it as an EOS token.")
            tokenizer.eos_token = args.eos_token
            model.config.eos_token_id = tokenizer.eos_token_id
        if args.chat_template_path is not None:
            load_chat_template(tokenizer, args.chat_template_path)
        pad_token_id = self._pad_token_id(tokenizer, args.pad_token)
        if tokenizer.pad_token is None:  # TRL sets the eos token as the pad token
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_token_id)
        model.config.pad_token_id = pad_token_id
        return pad_token_id
