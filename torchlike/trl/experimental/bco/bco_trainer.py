"""``BCOTrainer``: TRL 1.0.0's Binary Classifier Optimization trainer (``trl.experimental.bco``) and constructor on
torchlike's ``Trainer``.

Each step scores the completions of a batch of unpaired examples and applies TRL's BCO loss
(``adapters.losses.bco``): the implied rewards shifted by ``delta``, the running mean of every reward seen in
training (TRL's ``RunningMoments``, updated with each micro-batch's rewards before its loss reads it, saved as
``running.json`` in each checkpoint and restored on resume). The rewards that update it are computed before each
step by a forward pass without gradient at the step's weights, so the compiled step reads each micro-batch's
``delta`` as an input. The reference log-probabilities are computed once, before training, as for KTO.

With ``embedding_func`` and ``embedding_tokenizer``, underlying distribution matching (UDM,
:mod:`.bco_udm`) weighs each undesirable example by the density ratio a logistic-regression classifier of prompt
embeddings gives it, fitted at construction as TRL fits it; the classifier is saved as ``clf.pkl`` in each checkpoint
and restored on resume.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ....adapters.losses import bco as bco_losses
from ....adapters.training import step_metrics
from ....training_args import TrainingArguments
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
    TRLArgs,
)
from ...trainer.offline_trainer import PrecomputedReferenceTrainer, ReferenceAlgorithm
from . import bco_udm
from .bco_config import BCOConfig
from .bco_data import collate_bco_batch, padded_length, prepare_bco_examples

if TYPE_CHECKING:
    from ....modeling import CausalLM

__all__ = ["BCO", "BCOTrainer"]


class BCO(ReferenceAlgorithm):
    """TRL 1.0.0's BCO on the reference loop: unpaired examples tokenised as TRL's BCO does and read in order, the
    reference's log-probabilities as a column, and TRL's BCO loss (``adapters.losses.bco``), whose ``delta`` (the
    running mean of the rewards, :class:`~torchlike.adapters.losses.bco.RunningMoments` on the trainer's ``running``)
    is updated with each micro-batch's rewards before its step, logged as TRL's ``log`` computes the metrics, and saved
    in checkpoints with the UDM classifier (``clf``)."""

    reference_columns = ("ref_logps",)

    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared examples of ``dataset`` (TRL 1.0.0's BCO tokenisation), checked against the vocabulary of the
        models that will read them."""
        trainer = self.trainer
        examples = prepare_bco_examples(dataset, tokenizer, max_length=args.max_length, num_proc=args.dataset_num_proc,
                                        embedding_tokenizer=trainer.embedding_tokenizer)
        largest = max([trainer.pad_token_id, *(max(e[key], default=0) for e in examples
                                               for key in ("prompt_ids", "completion_ids"))])
        trainer._check_token_ids(largest, tokenizer, {"model": model, "ref_model": trainer.ref_model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        return padded_length(examples)

    def reference_pass(self) -> Callable:
        """``(module, batch) -> (ref_logps [B],)`` of the trainer's reference."""
        reference = self.trainer.reference
        return bco_losses.reference_pass(reference.family, reference.lora, reference.mesh)

    def step_loss(self) -> tuple[Callable, None]:
        """TRL's BCO loss (:func:`adapters.losses.bco.bco_step_loss`) with the config's settings."""
        config = self.trainer.model.config
        vocab_size = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
        return bco_losses.bco_step_loss(self.trainer.model.family, self.trainer.loss_settings, vocab_size), None

    # ------------------------------------------------------------------ compute_metrics
    def found_for_metrics(self) -> Callable:
        """What TRL 1.0.0's ``prediction_step`` hands ``compute_metrics`` for a batch: the batch's
        ``logits/chosen_sum`` and ``logits/rejected_sum`` metrics (each only when the batch has such examples) as its
        "logits", and zeros as its labels."""
        import jax.numpy as jnp

        loss = self.step_loss()[0]

        def found(module, batch):
            _, _, metrics = loss(module, batch)
            names = ("logits/chosen", "logits/rejected")
            return {"predictions": jnp.stack([metrics[name] for name in names]),
                    "present": jnp.stack([metrics[step_metrics.PRESENCE_PREFIX + name] for name in names]) > 0}

        return found

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """The batch's sums TRL has; of a short last batch the first ``rows`` of them (accelerate's
        ``gather_for_metrics`` cuts the tensor to the examples left)."""
        from ....adapters.distributed import mesh as mesh_lib

        trainer = self.trainer
        values = np.asarray(found["predictions"])[np.asarray(found["present"])]
        full = trainer.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(trainer.mesh)
        kept = len(values) if rows >= full else min(rows, len(values))
        return {"predictions": values[:kept], "labels": np.zeros(kept, np.float32)}, kept

    def metrics_length(self, lengths: np.ndarray) -> None:
        """The sums are one value per kind: nothing to cut."""
        return None

    def train_order(self, epoch: int) -> np.ndarray:
        """Dataset order, every epoch: TRL's BCO reads its training data with a ``SequentialSampler``."""
        return np.arange(len(self.trainer.train_dataset))

    def step_batch(self, batch: dict) -> dict:
        """Updates the running reward moments with each micro-batch's rewards at the step's weights (TRL updates them
        in each micro-batch's loss) and gives the step each micro-batch's ``delta``."""
        import jax

        trainer = self.trainer
        rewards, real = (np.asarray(values) for values in jax.device_get(self._group_rewards(trainer._module, batch)))
        deltas = np.empty(real.shape, np.float32)
        for index in range(real.shape[0]):
            if real[index].any():
                trainer.running.update(rewards[index][real[index]])
            deltas[index] = trainer.running.mean
        return {**batch, "delta": jax.device_put(deltas, batch["delta"].sharding)}

    @functools.cached_property
    def _group_rewards(self) -> Callable:
        """``(module, micro-batch group) -> (rewards [A, B], real rows [A, B])``: the policy's rewards of each
        micro-batch, jitted (TRL computes them in each micro-batch's forward pass)."""
        import jax.numpy as jnp
        from flax import nnx

        from ....adapters.training import train_step

        rewards = bco_losses.policy_rewards(self.trainer.model.family, self.trainer.loss_settings)
        compute_dtype = self.trainer._compute_dtype()

        @nnx.jit
        def group_rewards(module, micro_batches):
            module = train_step.cast_floating(module, compute_dtype)
            count = micro_batches["input_ids"].shape[0]
            values = [rewards(module, {key: value[index] for key, value in micro_batches.items()})
                      for index in range(count)]
            return jnp.stack(values), micro_batches["attention_mask"].any(-1)

        return group_rewards

    def new_eval_examples(self, examples: list[dict]) -> None:
        """Raw data passed to ``evaluate()`` is weighed by the UDM classifier, as the trainer's own evaluation data."""
        trainer = self.trainer
        if trainer.match_underlying_distribution:
            trainer._weigh_by_density_ratio(examples, trainer.args.per_device_eval_batch_size)

    def finish_logs(self, logs: dict[str, float]) -> None:
        """TRL's values: the reward, log-prob and logit sums divided by their example counts over the micro-batches
        since the last log, and ``rewards/margins`` (chosen minus rejected) when both were seen, as TRL's
        ``BCOTrainer.log`` computes them (``logs`` itself is updated, as TRL's ``log`` updates it)."""
        finished = step_metrics.finish_metrics(logs)
        for prefix in ("", "eval_"):
            chosen, rejected = finished.get(f"{prefix}rewards/chosen"), finished.get(f"{prefix}rewards/rejected")
            if chosen is not None and rejected is not None:
                finished[f"{prefix}rewards/margins"] = chosen - rejected
        logs.clear()
        logs.update(finished)

    def save_extras(self, folder: Path) -> None:
        """As TRL saves them with the optimizer state (so not with ``save_only_model``): the running reward moments
        (``running.json``) and, under UDM, the classifier (``clf.pkl``), written by process 0 before the checkpoint
        counts as one."""
        trainer = self.trainer
        if trainer.args.save_only_model or not trainer.state.is_world_process_zero:
            return
        folder.mkdir(parents=True, exist_ok=True)
        trainer.running.save_to_json(folder / bco_losses.RUNNING_NAME)
        if trainer.match_underlying_distribution:
            import joblib

            joblib.dump(trainer.clf, folder / bco_udm.CLF_NAME, compress=True)

    def resumed(self, folder: Path) -> None:
        """When the checkpoint folder has them, the running reward moments and, under UDM, the classifier (whose
        weights then replace those of the fitted one)."""
        trainer = self.trainer
        if (folder / bco_losses.RUNNING_NAME).is_file():
            trainer.running = bco_losses.RunningMoments.load_from_json(folder / bco_losses.RUNNING_NAME)
        if trainer.match_underlying_distribution and (folder / bco_udm.CLF_NAME).is_file():
            import joblib

            trainer.clf = joblib.load(folder / bco_udm.CLF_NAME)
            trainer._add_density_ratio_weights()
            trainer._show_prepared_datasets(*trainer._prepared)


class BCOTrainer(PrecomputedReferenceTrainer):
    """``trl.experimental.bco.BCOTrainer`` (TRL 1.0.0) with its signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``).
        ref_model: the reference model (a ``transformers`` model object is converted as ``model`` is). ``None``:
            with a new LoRA adapter the base weights (adapter off), otherwise the initial weights of ``model``.
        args: :class:`BCOConfig` (default: one with ``output_dir="<model>-BCO"``).
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in TRL's unpaired
            preference format (``prompt``/``completion``/``label``), or paired preference data unpaired as TRL does;
            strings or message lists. ``train_dataset`` is required and read in order, as TRL's BCO reads it.
        processing_class: the tokenizer (required, as in TRL).
        data_collator: replaces the fixed-shape collator; it receives prepared examples (``prompt_ids``,
            ``completion_ids``, ``label``, ``ref_logps``, and ``udm_weight`` under UDM) and must return
            ``collate_bco_batch``'s columns with one row per example.
        model_init: refused (pass the model).
        compute_metrics: ``EvalPrediction -> dict``, given what TRL 1.0.0's ``prediction_step`` gives it: each eval
            batch's sum of the chosen rows' logits and of the rejected rows' (each only when the batch has such
            rows; a short last batch's cut to its examples, as accelerate cuts it) and zeros as labels.
        preprocess_logits_for_metrics: applied to each batch's sums first, as transformers does.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.
        model_adapter_name, ref_adapter_name: refused (a torchlike model holds one adapter; the reference of a LoRA
            model is its base weights).
        embedding_func: ``(input_ids=, attention_mask=) -> [B, D]`` prompt embeddings for UDM, called with torch
            ``int64`` tensors as TRL calls it (see :mod:`.bco_udm`); needs ``embedding_tokenizer``.
        embedding_tokenizer: the tokenizer of ``embedding_func``.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.

    Example:

    ```python
    >>> from torchlike.trl.experimental.bco import BCOConfig, BCOTrainer
    >>> data = [{"prompt": "The sky is", "completion": " blue.", "label": True},
    ...         {"prompt": "The sky is", "completion": " green.", "label": False}] * 32
    >>> trainer = BCOTrainer(model="path/to/qwen2", args=BCOConfig("out"), train_dataset=data,
    ...                      processing_class=tokenizer)
    >>> trainer.train()
    ```
    """

    algorithm_class = BCO
    _config_class = BCOConfig
    _output_suffix = "BCO"
    _tag_names = ["trl", "bco"]
    _evaluation_rows_key = "attention_mask"

    def __init__(self, model: ModelLike = None, ref_model: ModelLike | None = None, args: BCOConfig | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, data_collator: Callable | None = None,
                 model_init: Callable | None = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None,
                 compute_metrics: Callable | None = None, model_adapter_name: str | None = None,
                 ref_adapter_name: str | None = None, embedding_func: Callable | None = None,
                 embedding_tokenizer: ProcessingClass | None = None,
                 quantization_config: QuantizationConfig | None = None):
        if embedding_func is not None:
            bco_udm.require_udm_libraries()
        if type(args) is TrainingArguments:
            raise ValueError("Please use `BCOConfig` instead `TrainingArguments`.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if not isinstance(model, str) and model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
                             "same as `model`, you must mass a copy of it, or `None` if you use peft.")
        args = self._trl_args(model, args)
        if args.model_init_kwargs is not None and not isinstance(model, str):
            raise ValueError("You passed model_kwargs to the BCOTrainer. But your model is already instantiated.")
        self._refuse_unsupported(model_init=model_init, model_adapter_name=model_adapter_name,
                                 ref_adapter_name=ref_adapter_name)
        if processing_class is None:
            raise ValueError("max_length or a processing_class must be specified when using the default "
                             "DPODataCollatorWithPadding")
        if embedding_func is not None and embedding_tokenizer is None:
            raise ValueError("embedding_func needs embedding_tokenizer: underlying distribution matching embeds the "
                             "prompts as that tokenizer tokenises them. Pass both, or neither.")
        if embedding_func is not None and embedding_tokenizer.pad_token_id is None:
            raise ValueError("embedding_tokenizer has no pad token: underlying distribution matching pads each batch "
                             "of prompts with it, as TRL does. Set embedding_tokenizer.pad_token first.")
        ref_model = self._check_reference_settings(args, model, ref_model, train_dataset, eval_dataset)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
        self._setup_model_router_loss(model)
        self.ref_model = ref_model
        self.embedding_func, self.embedding_tokenizer = embedding_func, embedding_tokenizer
        self.pad_token_id = self._pad_token_id(processing_class, None)
        self.running = bco_losses.RunningMoments()
        self.clf = None
        self.loss_settings = bco_losses.BCOLossSettings.from_config(args,
                                                                    router_aux_loss_coef=self._router_loss_weight())
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        collator = data_collator or (lambda rows: collate_bco_batch(rows, self.pad_token_id, self.padded_length,
                                                                    self.running.mean))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, compute_metrics=compute_metrics,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._start_reference(ref_model, train_examples, eval_examples)
        self._prepared = (train_examples, eval_examples)
        if self.match_underlying_distribution:
            self._embed = bco_udm.PromptEmbedder(embedding_func, self.pad_token_id, embedding_tokenizer.pad_token_id)
            self.clf = bco_udm.fit_density_ratio_classifier(train_examples, self._embed,
                                                            args.per_device_train_batch_size,
                                                            args.prompt_sample_size, args.seed)
            self._add_density_ratio_weights()
        # What TRL users read: a datasets.Dataset with the prepared columns (and ref_logps, udm_weight).
        self._show_prepared_datasets(train_examples, eval_examples)

    @staticmethod
    def _refuse_unsupported(**given: Any) -> None:
        reasons = {"model_init": "pass the model itself",
                   "model_adapter_name": "a torchlike model holds one adapter",
                   "ref_adapter_name": "a torchlike model holds one adapter; the reference of a LoRA model is its "
                                       "base weights"}
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"BCOTrainer does not support {name} in torchlike: {reasons[name]}.")

    @property
    def match_underlying_distribution(self) -> bool:
        """Whether UDM weighs the undesirable examples (TRL's property): ``embedding_func`` and
        ``embedding_tokenizer`` are both given."""
        return self.embedding_func is not None and self.embedding_tokenizer is not None

    def _setup_model_router_loss(self, model: CausalLM) -> None:
        """TRL 1.0.0's BCO rule for a mixture-of-experts model: the router loss is added when the model config sets
        ``output_router_logits``, times its ``router_aux_loss_coef``."""
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.aux_loss_enabled = bool(getattr(text_config, "output_router_logits", False))
        self.router_aux_loss_coef = getattr(text_config, "router_aux_loss_coef", 0.0)

    def _add_density_ratio_weights(self) -> None:
        """Sets ``udm_weight`` on the training and evaluation examples from ``self.clf``, in the batches TRL embeds."""
        from ....training.batches import each_dataset

        train_examples, eval_examples = self._prepared
        self._weigh_by_density_ratio(train_examples, self.args.per_device_train_batch_size)
        for examples in each_dataset(eval_examples):
            self._weigh_by_density_ratio(examples, self.args.per_device_eval_batch_size)

    def _weigh_by_density_ratio(self, examples: list[dict], batch_size: int) -> None:
        """Sets ``udm_weight`` on ``examples`` from ``self.clf``, their prompts embedded ``batch_size`` at a time."""
        bco_udm.add_density_ratio_weights(examples, self.clf, self._embed, batch_size, self.args.min_density_ratio,
                                          self.args.max_density_ratio)
