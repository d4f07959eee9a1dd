"""``DPOTrainer``: TRL 1.16's Direct Preference Optimization trainer and constructor on torchlike's ``Trainer``.

Each step scores the chosen and rejected sequences of a batch in one forward pass and applies TRL's DPO loss
(``adapters.rl_math.dpo_loss``: every loss type, f-divergences, LD-DPO) with TRL's metrics. The reference
log-probabilities are computed once, before training, by a jitted forward of the reference (``ref_model``; else the
base weights with the LoRA adapter off when the adapter is new; else the initial weights) and stored with each
example. TRL computes them in every step by default; the values are the same, since the reference is frozen and has no
dropout, and no second copy of the model is kept for full fine-tuning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np

from ..adapters import chunked_logprobs, multihost, rl_math, train_step
from ..adapters import mesh as mesh_lib
from ..adapters.lora import runtime as lora_runtime
from ..training import Trainer
from ..training.batches import check_single_dataset, each_dataset, map_datasets
from .dpo_data import collate_preference_batch, padded_length, prepare_preference_examples
from .sft_data import pad_token_id_for
from .trainer_setup import SyncRefModelCallback, check_reference_sync, check_text_dataset

__all__ = ["DPOTrainer", "preference_loss"]

#: Loss types that read the whole batch (``aot`` sorts within it, ``sft`` is a token mean) rather than one pair.
_BATCH_LOSS_TYPES = ("aot", "aot_unpaired", "sft")
_REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _pair_token_log_probs(family, module, batch: dict, with_metrics: bool = False,
                          block_size: chunked_logprobs.BlockSize = "auto", with_log_sum_sq_probs: bool = False
                          ) -> tuple[chunked_logprobs.TokenScores, jax.Array]:
    """One forward pass over the chosen rows stacked on the rejected rows (``2B``, TRL's layout).

    Returns:
        ``(scores, mask)``: the per-token scores ``[2B, T-1]`` of ``chunked_logprobs.next_token_scores`` (the
        metrics' too with ``with_metrics``, ``log_sum_sq_probs`` with ``with_log_sum_sq_probs``), position ``t``
        predicting token ``t + 1``, with their log-probabilities zeroed outside ``mask``, the shifted completion mask.
    """
    def stacked(name: str) -> jax.Array:
        return jnp.concatenate([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])

    scores = chunked_logprobs.next_token_scores(
        family, module, {"input_ids": stacked("input_ids"), "attention_mask": stacked("attention_mask")},
        with_metrics=with_metrics, block_size=block_size, with_log_sum_sq_probs=with_log_sum_sq_probs)
    mask = stacked("completion_mask")[:, 1:]
    return scores._replace(log_probs=jnp.where(mask.astype(bool), scores.log_probs, 0.0)), mask


def _sequence_log_probs(per_token: jax.Array, mask: jax.Array, ld_alpha: float | None) -> tuple[jax.Array, jax.Array]:
    """``(chosen [B], rejected [B])`` summed completion log-probabilities (LD-DPO weighted with ``ld_alpha``)."""
    chosen, rejected = jnp.split(per_token, 2)
    if ld_alpha is None:
        return chosen.sum(-1), rejected.sum(-1)
    chosen_mask, rejected_mask = jnp.split(mask, 2)
    return rl_math.length_desensitised_log_probs(chosen, rejected, chosen_mask, rejected_mask, ld_alpha)


def _masked_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def _token_metrics(scores: chunked_logprobs.TokenScores, mask: jax.Array) -> dict[str, jax.Array]:
    """TRL's per-token metrics: completion-token means of the entropy, of the logits' vocabulary mean (chosen and
    rejected) and of whether the chosen token is the most likely one."""
    mask = mask.astype(jnp.float32)
    chosen_mask, rejected_mask = jnp.split(mask, 2)
    chosen_logits, rejected_logits = jnp.split(scores.logit_means, 2)
    return {
        "entropy": _masked_mean(scores.entropies, mask),
        "logits/chosen": _masked_mean(chosen_logits, chosen_mask),
        "logits/rejected": _masked_mean(rejected_logits, rejected_mask),
        "mean_token_accuracy": _masked_mean(jnp.split(scores.top1, 2)[0], chosen_mask),
    }


def preference_loss(family, *, beta: float, loss_type: Sequence[str], loss_weights: Sequence[float] | None = None,
                    label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                    f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
                    ld_alpha: float | None = None, use_weighting: bool = False,
                    block_size: chunked_logprobs.BlockSize = "auto") -> Callable:
    """The DPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._loss``).

    ``value`` is TRL's ``DPOTrainer`` loss of the micro-batch: ``sum_i loss_weights[i] * mean over pairs of
    loss_type[i]``, each pair's losses times its WPO weight ``w_chosen * w_rejected`` with ``use_weighting``
    (``rl_math.wpo_weights``). Rows that pad a partial batch (all-zero masks) are left out of the means; ``weight``
    is 1 when the micro-batch holds a pair, so accumulated micro-batches are averaged, as TRL divides by the
    accumulation steps.
    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``, ``entropy``, ``logits/chosen``, ``logits/rejected``,
    ``mean_token_accuracy``, and ``num_tokens`` (the micro-batch's tokens; ``DPOTrainer.log`` makes it a running
    total).

    Args:
        family: the model's adapter family (its forward pass).
        beta, loss_type, loss_weights, label_smoothing, f_divergence_type, f_alpha_divergence_coef, discopop_tau,
            ld_alpha, use_weighting: the ``DPOConfig`` fields of the same names.
        block_size: positions per block of the log-prob computation (``adapters.chunked_logprobs.BlockSize``:
            ``"auto"``, a number, or ``None`` for the whole sequence at once).

    The batch holds ``collate_preference_batch``'s columns with ``ref_chosen_logps``/``ref_rejected_logps``.
    """
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(loss_type)
    settings = dict(beta=beta, label_smoothing=label_smoothing, f_divergence_type=f_divergence_type,
                    f_alpha_divergence_coef=f_alpha_divergence_coef, discopop_tau=discopop_tau)
    per_pair = [(name, weight) for name, weight in zip(loss_type, weights, strict=True)
                if name not in _BATCH_LOSS_TYPES]
    whole_batch = [(name, weight) for name, weight in zip(loss_type, weights, strict=True)
                   if name in _BATCH_LOSS_TYPES]
    # dpo_loss returns the metrics too; a zero-weight sigmoid yields them when every loss type reads the whole batch.
    pair_types, pair_weights = zip(*(per_pair or [("sigmoid", 0.0)]), strict=True)

    def one_pair(chosen, rejected, ref_chosen, ref_rejected, chosen_length, rejected_length):
        return rl_math.dpo_loss(chosen[None], rejected[None], ref_chosen[None], ref_rejected[None],
                                loss_type=list(pair_types), loss_weights=list(pair_weights),
                                chosen_lengths=chosen_length[None], rejected_lengths=rejected_length[None], **settings)

    def loss(module, batch, num_items_in_batch=None):
        scores, mask = _pair_token_log_probs(family, module, batch, with_metrics=True, block_size=block_size,
                                             with_log_sum_sq_probs=use_weighting)
        per_token = scores.log_probs
        chosen, rejected = _sequence_log_probs(per_token, mask, ld_alpha)
        ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        # TRL's ipo and sigmoid_norm divide by the unshifted completion lengths, its sft by the scored tokens.
        chosen_length, rejected_length = (batch[f"{key}_completion_mask"].sum(-1) for key in ("chosen", "rejected"))
        pair_losses, pair_metrics = jax.vmap(one_pair)(chosen, rejected, ref_chosen, ref_rejected, chosen_length,
                                                       rejected_length)
        pair_weights = jnp.ones_like(real)
        if use_weighting:
            chosen_weights, rejected_weights = jnp.split(rl_math.wpo_weights(per_token, scores.log_sum_sq_probs,
                                                                             mask), 2)
            pair_weights = chosen_weights * rejected_weights
        value = _masked_mean(pair_losses * pair_weights, real)
        if whole_batch:  # exact with padding rows for sft (they add no token); aot sorts them in (see the warning)
            names, batch_weights = zip(*whole_batch, strict=True)
            chosen_mask, rejected_mask = jnp.split(mask, 2)
            # sft's loss is one value for every pair, so its weighted mean is that value times the mean weight.
            value += rl_math.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type=list(names),
                                      loss_weights=list(batch_weights), chosen_lengths=chosen_mask.sum(-1),
                                      rejected_lengths=rejected_mask.sum(-1),
                                      sft_chosen_logps=jnp.split(per_token, 2)[0].sum(-1),
                                      **settings)[0] * _masked_mean(pair_weights, real)
        metrics = {key: _masked_mean(values, real) for key, values in pair_metrics.items()}
        tokens = (batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum()).astype(jnp.float32)
        return value, (real.sum() > 0).astype(jnp.float32), {**metrics, **_token_metrics(scores, mask),
                                                             "num_tokens": tokens}

    return loss


def _lora_is_new(model: Any) -> bool:
    """Whether ``model`` has a LoRA adapter whose ``B`` factors are all zero (so it equals its base model)."""
    if not hasattr(model, "peft_config"):
        return False
    factors = lora_runtime.lora_factors(model.module)
    return all(not np.any(multihost.gather_to_host(b)) for _, _, b in factors.values())


class DPOTrainer(Trainer):
    """``trl.DPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as in TRL).
        ref_model: the reference model (a :class:`~torchlike.CausalLM`, used on its own mesh when it has one, else
            placed on the trainer's). ``None``: with a new LoRA adapter the base weights (adapter off), otherwise the
            initial weights of ``model``.
        args: :class:`~torchlike.trl.DPOConfig` (default: one with ``output_dir="<model>-DPO"``).
        data_collator: replaces the fixed-shape pair collator; it receives prepared examples (``prompt_ids``,
            ``chosen_ids``, ``rejected_ids``, and ``ref_chosen_logps``/``ref_rejected_logps`` once computed) and
            must return ``collate_preference_batch``'s columns with one row per example.
        train_dataset, eval_dataset: ``datasets.Dataset``/``IterableDataset`` or lists of dicts in a TRL
            preference format (``prompt``/``chosen``/``rejected``, or implicit prompt ``chosen``/``rejected``;
            strings or message lists). ``train_dataset`` is required; ``eval_dataset`` may be a dict of datasets (a
            ``datasets.DatasetDict``), each prepared and scored by the reference alike and evaluated with its own
            loss name (``eval_<name>_loss``; TRL's own metrics stay ``eval_rewards/chosen``..., as TRL logs them).
        processing_class: the tokenizer (default: loaded from the model's path).
        compute_metrics: deprecated in TRL (its logits take an extra forward pass); refused with a message when set.
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

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Callable | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None):
        from .. import AutoTokenizer
        from ..field_support import check_unsupported
        from ..peft import get_peft_model
        from .dpo_config import DPOConfig
        from .trainer_setup import check_causal_lm, default_output_dir, load_model

        if args is None:
            args = DPOConfig(output_dir=default_output_dir(model, "DPO"))
        check_unsupported(args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: preference pairs ('prompt', 'chosen', 'rejected').")
        check_single_dataset(train_dataset, "train_dataset")
        self._check_settings(args, train_dataset, eval_dataset)
        if compute_metrics is not None:
            raise ValueError("compute_metrics is deprecated in TRL's DPOTrainer and not supported by torchlike's: "
                             "evaluate() reports TRL's preference metrics (eval_rewards/accuracies, eval_logps/chosen, "
                             "...); compute others from trainer.evaluate()'s result or a callback's on_evaluate.")
        if ref_model is not None and ref_model is model:
            raise ValueError("model and ref_model cannot be the same object; omit ref_model to use the initial model "
                             "as the reference.")
        model = load_model(model, args, quantization_config, "DPOTrainer")
        if ref_model is not None:
            check_causal_lm(ref_model, "ref_model", "DPOTrainer")
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.name_or_path)
        if peft_config is not None:
            if hasattr(model, "peft_config"):
                raise ValueError("A PeftModel was passed together with peft_config; merge and unload the existing "
                                 "adapter (model.merge_and_unload()) and pass the base model with peft_config, or "
                                 "omit peft_config to train the existing adapter.")
            model = get_peft_model(model, peft_config, seed=args.seed)  # TRL seeds before creating the adapter
        check_reference_sync(args, model, "DPOTrainer")
        self.ref_model = ref_model
        # The reference when there is no ref_model: the base weights stay valid all run long, the initial ones only
        # until the first step.
        self._reference = "model" if ref_model is not None else "base" if _lora_is_new(model) else "initial"
        self.pad_token_id = self._pad_token_id(processing_class, args.pad_token)
        for config in (model.config, model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        self.loss_settings = dict(beta=args.beta, loss_type=list(args.loss_type), loss_weights=args.loss_weights,
                                  label_smoothing=args.label_smoothing, f_divergence_type=args.f_divergence_type,
                                  f_alpha_divergence_coef=args.f_alpha_divergence_coef,
                                  discopop_tau=args.discopop_tau, ld_alpha=args.ld_alpha,
                                  use_weighting=args.use_weighting)
        train_examples = self._tokenize(train_dataset, processing_class, args, model)
        eval_examples = map_datasets(eval_dataset, lambda dataset: self._tokenize(dataset, processing_class, args,
                                                                                  model))
        every_eval_example = [example for examples in each_dataset(eval_examples) for example in examples]
        # One padded length for training and evaluation, so XLA compiles each step once.
        self.padded_length = padded_length([*train_examples, *every_eval_example], args.max_length,
                                           args.truncation_mode, args.pad_to_multiple_of)
        collator = data_collator or (lambda rows: collate_preference_batch(
            rows, self.pad_token_id, self.padded_length, args.max_length, args.truncation_mode))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        model.add_model_tags(["trl", "dpo"])
        self._synced_reference = None
        if args.sync_ref_model:
            self._start_reference_sync()
        else:  # with sync_ref_model each batch is scored by the current reference instead
            self._add_reference_log_probs(train_examples, args.per_device_train_batch_size)
        for examples in each_dataset(eval_examples):
            self._add_reference_log_probs(examples, args.per_device_eval_batch_size)
        self._warn_if_sorting_loss_sees_padding()
        # What TRL users read: a datasets.Dataset with TRL's columns (prompt_ids, chosen_ids, rejected_ids and the
        # precomputed ref_chosen_logps / ref_rejected_logps).
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
        if args.use_weighting and {"aot", "aot_unpaired"} & set(args.loss_type):
            raise NotImplementedError("WPO-style weighting is not implemented for 'aot' or 'aot_unpaired' because "
                                      "those losses sort samples, which would misalign per-pair weights.")

    @staticmethod
    def _pad_token_id(tokenizer: Any, pad_token: str | None) -> int:
        """TRL's pad token: ``args.pad_token`` (set on the tokenizer), else the tokenizer's pad or eos token."""
        if pad_token is None:
            return pad_token_id_for(tokenizer)
        if pad_token not in tokenizer.get_vocab():
            raise ValueError(f"pad_token={pad_token!r} is not in the vocabulary of the tokenizer "
                             f"({type(tokenizer).__name__}); pass a token it knows, or leave pad_token unset to pad "
                             "with its pad (or eos) token.")
        tokenizer.pad_token = pad_token
        return int(tokenizer.convert_tokens_to_ids(pad_token))

    def _tokenize(self, dataset: Any, tokenizer: Any, args: Any, model: Any) -> list[dict]:
        """Prepared examples of ``dataset``, checked against the vocabulary of the models that will read them."""
        examples = prepare_preference_examples(dataset, tokenizer, max_length=args.max_length,
                                               truncation_mode=args.truncation_mode, num_proc=args.dataset_num_proc)
        largest = max([self.pad_token_id, *(max(e[key], default=0) for e in examples
                                            for key in ("prompt_ids", "chosen_ids", "rejected_ids"))])
        for which, checked in (("model", model), ("ref_model", self.ref_model)):
            vocab_size = getattr(getattr(checked, "config", None), "vocab_size", None)
            if vocab_size is not None and largest >= vocab_size:
                raise ValueError(f"token id {largest} is outside the {which}'s vocab_size={vocab_size} (the tokenizer "
                                 f"has {len(tokenizer)} tokens; pad token {tokenizer.pad_token!r}). Use the tokenizer "
                                 "that belongs to the model, or set tokenizer.pad_token to a token the model knows.")
        return examples

    def _warn_if_sorting_loss_sees_padding(self) -> None:
        sorting = sorted(set(self.loss_settings["loss_type"]) & {"aot", "aot_unpaired"})
        if sorting and len(self.train_dataset) % self._global_batch_size() and not self.args.dataloader_drop_last:
            warnings.warn(f"loss_type {sorting} sorts the pairs of a batch; the last, partial batch is padded with "
                          f"empty pairs that enter the sort ({len(self.train_dataset)} examples, batches of "
                          f"{self._global_batch_size()}). Set dataloader_drop_last=True for TRL's values.",
                          UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ reference
    def _reference_source(self) -> tuple[Any, Any, str]:
        """``(module, model, lora mode)`` of the reference: the module the sync updates with ``sync_ref_model``, else
        ``ref_model``'s or the model's own (the adapter off for a new adapter), placed on a mesh."""
        reference = self.ref_model if self.ref_model is not None else self.model
        if reference.mesh is None:
            mesh_lib.shard_module(reference.module, self.mesh)
            reference.mesh = self.mesh
        if self._synced_reference is not None:
            return self._synced_reference, reference, lora_runtime.EVAL
        return reference.module, reference, lora_runtime.DISABLED if self._reference == "base" else lora_runtime.EVAL

    def _reference_pass(self, family: Any, mode: str, mesh: Any) -> Callable:
        """``(module, batch) -> (chosen [B], rejected [B])`` summed reference log-probabilities, replicated so
        every process reads all rows."""
        ld_alpha = self.loss_settings["ld_alpha"]
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def reference_log_probs(module, batch, num_items_in_batch=None):
            with lora_runtime.lora_mode(mode):
                scores, mask = _pair_token_log_probs(family, module, batch)
            return tuple(jax.lax.with_sharding_constraint(logps, replicated)
                         for logps in _sequence_log_probs(scores.log_probs, mask, ld_alpha))

        return reference_log_probs

    def _add_reference_log_probs(self, examples: list[dict], per_device_batch_size: int) -> None:
        """Adds ``ref_chosen_logps``/``ref_rejected_logps`` to every example: one jitted reference forward per batch
        (TRL's ``compute_ref_log_probs``), on the reference's mesh."""
        if self._reference == "initial" and self._synced_reference is None and self.state.global_step > 0:
            raise ValueError("Cannot compute reference log-probabilities for new data after training has started: "
                             "without ref_model the reference is the initial model, which training has changed "
                             "(full fine-tuning, or an adapter that was not new). Pass this dataset as eval_dataset "
                             "when creating the trainer, or pass a ref_model.")
        module, reference, mode = self._reference_source()
        step = train_step.make_eval_step(self._reference_pass(reference.family, mode, reference.mesh),
                                        self._compute_dtype())
        size = per_device_batch_size * mesh_lib.data_parallel_size(reference.mesh)
        outputs = self._run_in_batches(examples, step, module, reference.mesh, size, "reference")
        for start, (chosen_logps, rejected_logps) in zip(range(0, len(examples), size), outputs, strict=True):
            for offset, example in enumerate(examples[start:start + size]):
                example["ref_chosen_logps"] = float(chosen_logps[offset])
                example["ref_rejected_logps"] = float(rejected_logps[offset])

    def _start_reference_sync(self) -> None:
        """``sync_ref_model``: the reference (``ref_model``'s module, else a copy of the initial model) becomes a
        module TRL's ``SyncRefModelCallback`` mixes the policy into; each training batch is scored by it as it is
        used (so batches are not prepared ahead), and each evaluation again."""
        from flax import nnx

        module, reference, _ = self._reference_source()  # places ref_model on the trainer's mesh when it has none
        self._synced_reference = module if self.ref_model is not None else nnx.clone(self._module)
        self.add_callback(SyncRefModelCallback(self._synced_reference, lambda: self._module))
        self._allow_prefetch = False
        pass_ = self._reference_pass(reference.family, lora_runtime.EVAL, reference.mesh)
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
        for group in super()._batches(epoch, skip):
            if self._synced_reference is not None:
                chosen, rejected = self._group_reference_log_probs(self._synced_reference, group)
                group = {**group, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
            yield group

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation; with ``sync_ref_model`` the examples are first scored by the current
        reference, as TRL's reference forward in each evaluation step."""
        if self._synced_reference is not None:
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return super()._evaluation_loop(examples, metric_key_prefix)

    # ------------------------------------------------------------------ Trainer hooks
    def _loss(self) -> tuple[Callable, None]:
        return preference_loss(self.model.family, **self.loss_settings), None

    def _lora_dropout(self) -> bool:
        return super()._lora_dropout() and not self.args.disable_dropout

    def _signature_columns(self) -> None:
        """Every column: the prepared examples hold only the pair's token ids and reference log-probabilities."""
        return None

    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` with ``num_tokens`` as TRL's running total of training tokens.

        The step metrics arrive averaged over micro-batches and over the steps since the previous log, so the tokens
        of those steps are that mean times both counts; the total so far is read back from ``state.log_history``,
        which a resumed run restores.
        """
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
        """Raw preference data prepared and scored by the reference (TRL's ``evaluate`` does too); examples that
        carry reference log-probabilities already (the trainer's ``eval_dataset``) as they are."""
        if all(key in next(iter(dataset), {}) for key in _REFERENCE_COLUMNS):
            return super()._prepare_eval_dataset(dataset)
        examples = self._tokenize(dataset, self.processing_class, self.args, self.model)
        self.padded_length = max(self.padded_length, padded_length(
            examples, self.args.max_length, self.args.truncation_mode, self.args.pad_to_multiple_of))
        self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return examples

    def _step_metric_prefix(self, metric_key_prefix: str) -> str:
        """``"eval"``: TRL logs its metrics (``rewards/chosen``...) as ``eval_<metric>`` whatever the dataset, so with a
        dict of eval datasets only the loss, runtime and speed carry the dataset's name."""
        return "eval"
