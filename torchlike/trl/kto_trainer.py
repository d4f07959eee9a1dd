"""``KTOTrainer``: TRL 1.16's Kahneman-Tversky Optimization trainer and constructor on torchlike's ``Trainer``.

Each step scores the completions of a batch of unpaired examples (and, for ``loss_type="kto"``, the mismatched KL
completions, in a second forward pass without gradient) and applies TRL's KTO loss (``adapters.kto_loss``) with TRL's
metrics. The reference log-probabilities of both are computed once, before training, by a jitted forward of the
reference (``ref_model``; else the base weights with the LoRA adapter off when the adapter is new; else the initial
weights) and stored with each example. TRL computes them in every step by default; the values are the same, since the
reference is frozen and has no dropout, and no second copy of the model is kept for full fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
import jax
import jax.numpy as jnp

from ..adapters import kto_loss, reference_policy, train_step
from ..training.batches import check_single_dataset, each_dataset, map_datasets
from .base_trainer import TRLTrainer, check_causal_lm, check_text_dataset
from .kto_config import KTOConfig
from .kto_data import check_desirability_balance, collate_unpaired_batch, padded_length, prepare_unpaired_examples

__all__ = ["KTOTrainer"]


class KTOTrainer(TRLTrainer):
    """``trl.KTOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL).
        ref_model: the reference model (a :class:`~torchlike.CausalLM`, used on its own mesh when it has one, else
            placed on the trainer's). ``None``: with a new LoRA adapter the base weights (adapter off), otherwise the
            initial weights of ``model``.
        args: :class:`~torchlike.trl.KTOConfig` (default: one with ``output_dir="<model>-KTO"``).
        data_collator: replaces the fixed-shape collator; it receives prepared examples (``prompt_ids``,
            ``completion_ids``, ``label``, ``KL_completion_ids`` for ``loss_type="kto"``, and ``ref_logps`` /
            ``ref_KL_logps`` once computed) and must return ``collate_unpaired_batch``'s columns with one row per
            example.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL unpaired
            preference format (``prompt``/``completion``/``label``), or paired preference data
            (``prompt``/``chosen``/``rejected``, or ``chosen``/``rejected`` with an implicit prompt) that is unpaired
            as TRL does; strings or message lists. ``train_dataset`` is required; ``eval_dataset`` may be a dict of
            datasets, each prepared and scored by the reference alike and evaluated with its own loss name
            (``eval_<name>_loss``; TRL's own metrics stay ``eval_rewards/chosen``..., as TRL logs them).
        processing_class: the tokenizer (default: loaded from the model's path).
        compute_metrics: deprecated in TRL (its logits take an extra forward pass); refused with a message when set.
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

    _config_class = KTOConfig
    _output_suffix = "KTO"
    _tag_names = ["trl", "kto"]

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Callable | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None):
        args = self._trl_args(model, args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: unpaired preference examples ('prompt', 'completion', "
                             "'label'), or preference pairs ('prompt', 'chosen', 'rejected').")
        check_single_dataset(train_dataset, "train_dataset")
        self._check_settings(args, train_dataset, eval_dataset)
        if compute_metrics is not None:
            raise ValueError("compute_metrics is deprecated in TRL's KTOTrainer and not supported by torchlike's: "
                             "evaluate() reports TRL's KTO metrics (eval_rewards/chosen, eval_kl, eval_logps/chosen, "
                             "...); compute others from trainer.evaluate()'s result or a callback's on_evaluate.")
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                             "`ref_model` and the initial model will be the reference.")
        if ref_model is not None:
            check_causal_lm(ref_model, "ref_model", "KTOTrainer")
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
        self.ref_model = ref_model
        self.pad_token_id = self._pad_token_id(processing_class, None)
        for config in (model.config, model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        self.loss_settings = kto_loss.KTOLossSettings(beta=args.beta, loss_type=args.loss_type,
                                                      desirable_weight=args.desirable_weight,
                                                      undesirable_weight=args.undesirable_weight)
        train_examples = self._tokenize(train_dataset, processing_class, args, model)
        check_desirability_balance([example["label"] for example in train_examples], args.desirable_weight,
                                   args.undesirable_weight)
        eval_examples = map_datasets(eval_dataset, lambda dataset: self._tokenize(dataset, processing_class, args,
                                                                                  model))
        every_eval_example = [example for examples in each_dataset(eval_examples) for example in examples]
        # One padded length for training and evaluation, so XLA compiles each step once.
        self.padded_length = padded_length([*train_examples, *every_eval_example], args.max_length,
                                           args.pad_to_multiple_of)
        collator = data_collator or (lambda rows: collate_unpaired_batch(rows, self.pad_token_id, self.padded_length,
                                                                         args.max_length))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        # Without ref_model: the base weights of a new adapter (valid all run long), else the initial weights (only
        # until the first step; a frozen copy with sync_ref_model).
        self._init_reference(ref_model, adapter_off=reference_policy.lora_is_new(self._module))
        if args.sync_ref_model:
            self._start_reference_sync()
        else:  # with sync_ref_model each batch is scored by the current reference instead
            self._add_reference_log_probs(train_examples, args.per_device_train_batch_size)
        for examples in each_dataset(eval_examples):
            self._add_reference_log_probs(examples, args.per_device_eval_batch_size)
        # What TRL users read: a datasets.Dataset with TRL's columns (prompt_ids, completion_ids, label,
        # KL_completion_ids and the precomputed ref_logps / ref_KL_logps).
        self.train_dataset = datasets.Dataset.from_list(train_examples)

    # ------------------------------------------------------------------ data
    @staticmethod
    def _check_settings(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
        """TRL's checks of the datasets and reference settings, with its wording."""
        if args.precompute_ref_log_probs and any(isinstance(dataset, datasets.IterableDataset) for dataset in
                                                 [train_dataset, *each_dataset(eval_dataset)]):
            raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
        check_text_dataset(train_dataset)
        if args.sync_ref_model and args.precompute_ref_log_probs:
            raise ValueError("You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                             "`precompute_ref_log_probs=True` assumes a fixed reference model, but with "
                             "`sync_ref_model=True` the reference model is periodically updated during training, "
                             "making any precomputed reference log-probs stale. Set `precompute_ref_log_probs=False` "
                             "or disable `sync_ref_model`.")

    def _tokenize(self, dataset: Any, tokenizer: Any, args: Any, model: Any) -> list[dict]:
        """Prepared examples of ``dataset`` (KL completions paired within chunks of ``per_device_train_batch_size``,
        for evaluation data too, as TRL does), checked against the vocabulary of the models that will read them."""
        examples = prepare_unpaired_examples(
            dataset, tokenizer, max_length=args.max_length, num_proc=args.dataset_num_proc,
            kl_chunk_size=args.per_device_train_batch_size if args.estimates_kl else None)
        largest = max([self.pad_token_id, *(max(e[key], default=0) for e in examples
                                            for key in ("prompt_ids", "completion_ids"))])
        self._check_token_ids(largest, tokenizer, {"model": model, "ref_model": self.ref_model})
        return examples

    # ------------------------------------------------------------------ reference
    def _reference_pass(self) -> Callable:
        """``(module, batch) -> (ref_logps [B], ref_KL_logps [B])`` (``ref_logps`` alone without a KL term) of
        ``self.reference``."""
        return kto_loss.reference_pass(self.reference.family, self.reference.lora, self.reference.mesh,
                                       self.loss_settings)

    def _add_reference_log_probs(self, examples: list[dict], per_device_batch_size: int) -> None:
        """Adds ``ref_logps`` (and ``ref_KL_logps``) to every example (TRL's ``compute_ref_log_probs``)."""
        self._add_reference_columns(examples, self._reference_pass(), kto_loss.reference_columns(self.loss_settings),
                                    per_device_batch_size)

    def _start_reference_sync(self) -> None:
        """``sync_ref_model``: TRL's ``SyncRefModelCallback`` mixes the policy into the reference (``ref_model``'s
        module, else a copy of the initial model); each training batch is scored by it as it is used (so batches are
        not prepared ahead), and each evaluation again."""
        from flax import nnx

        self._allow_prefetch = False
        pass_ = self._reference_pass()
        compute_dtype = self._compute_dtype()

        @nnx.jit
        def group_log_probs(module, micro_batches):
            module = train_step.cast_floating(module, compute_dtype)
            count = jax.tree.leaves(micro_batches)[0].shape[0]
            outputs = [pass_(module, {key: value[index] for key, value in micro_batches.items()})
                       for index in range(count)]
            return tuple(jnp.stack(values) for values in zip(*outputs, strict=True))

        self._group_reference_log_probs = group_log_probs

    def _batches(self, epoch: int, skip: int = 0):
        """The Trainer's batches; with ``sync_ref_model``, each scored by the current reference when it is used."""
        names = kto_loss.reference_columns(self.loss_settings)
        for group in super()._batches(epoch, skip):
            if self.args.sync_ref_model:
                group = {**group, **dict(zip(names, self._group_reference_log_probs(self.reference.module, group),
                                             strict=True))}
            yield group

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation with TRL's metric values (:func:`adapters.kto_loss.finish_metrics`); with
        ``sync_ref_model`` the examples are first scored by the current reference, as TRL's reference forward in
        each evaluation step."""
        if self.args.sync_ref_model:
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return kto_loss.finish_metrics(super()._evaluation_loop(examples, metric_key_prefix))

    # ------------------------------------------------------------------ Trainer hooks
    def _loss(self) -> tuple[Callable, None]:
        return kto_loss.kto_step_loss(self.model.family, self.loss_settings), None

    def _signature_columns(self) -> None:
        """Every column: the prepared examples hold only token ids, labels and reference log-probabilities."""
        return None

    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` with TRL's values: each metric TRL records only for some micro-batches as the mean over
        those (:func:`adapters.kto_loss.finish_metrics`), and ``num_tokens`` as TRL's running total of training
        tokens.

        The step metrics arrive averaged over micro-batches and over the steps since the previous log, so the tokens
        of those steps are that mean times both counts; the total so far is read back from ``state.log_history``,
        which a resumed run restores.
        """
        logs = kto_loss.finish_metrics(logs)
        previous = next((entry for entry in reversed(self.state.log_history) if "num_tokens" in entry),
                        {"step": 0, "num_tokens": 0})
        if "num_tokens" in logs:
            steps = self.state.global_step - previous["step"]
            added = round(logs["num_tokens"] * self.args.gradient_accumulation_steps * steps)
            logs = {**logs, "num_tokens": previous["num_tokens"] + added}
        elif "eval_num_tokens" in logs:  # TRL reports the training total in evaluation too
            logs = {**logs, "eval_num_tokens": previous["num_tokens"]}
        super().log(logs)

    def _prepare_eval_dataset(self, dataset: Any) -> list[dict]:
        """Raw KTO data prepared and scored by the reference (TRL's ``evaluate`` does too); examples that carry
        reference log-probabilities already (the trainer's ``eval_dataset``) as they are."""
        if "ref_logps" in next(iter(dataset), {}):
            return super()._prepare_eval_dataset(dataset)
        examples = self._tokenize(dataset, self.processing_class, self.args, self.model)
        self.padded_length = max(self.padded_length, padded_length(examples, self.args.max_length,
                                                                   self.args.pad_to_multiple_of))
        self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return examples

    def _step_metric_prefix(self, metric_key_prefix: str) -> str:
        """``"eval"``: TRL logs its metrics (``rewards/chosen``...) as ``eval_<metric>`` whatever the dataset, so with a
        dict of eval datasets only the loss, runtime and speed carry the dataset's name."""
        return "eval"
