"""``OfflineTrainer``: the loop of the offline trainers without a reference model (SFT, Reward, ORPO, CPO, TPO), on
torchlike's ``TRLTrainer``.

An offline trainer prepares its examples once (tokenised, one padded length for training and evaluation so XLA
compiles each step once), then runs the Trainer's steps over them. What differs between SFT, Reward and the pairwise
preference trainers is an :class:`OfflineAlgorithm` (``algorithm_class``, beside each trainer): the model it loads,
how examples are tokenised, padded, batched and evaluated, the step loss, and what ``compute_metrics`` receives. A
trainer on this loop redefines only ``__init__`` (TRL's signature), which prepares the data and calls
``Trainer.__init__``; the loop's methods below each hand their job to the algorithm, and a hook an algorithm leaves at
``None`` keeps the base Trainer's behaviour.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...adapters.training import reference_policy, train_step
from ...type_aliases import EvalRowsLike, ModelLike, ProcessingClass, QuantizationConfig, RowsLike, TRLArgs
from ..models import check_causal_lm
from .base_config import round_up_to_multiple
from .base_trainer import TRLTrainer, check_text_dataset, converted_if_transformers

if TYPE_CHECKING:
    import numpy as np

    from ...modeling import CausalLM

__all__ = ["OfflineAlgorithm", "OfflineTrainer", "PrecomputedReferenceTrainer", "ReferenceAlgorithm",
           "ReferenceFreePreference", "StackedRowsMetrics", "rows_trl_gathers"]


class OfflineAlgorithm:
    """What one offline algorithm decides on :class:`OfflineTrainer`'s loop. A hook returning ``None`` leaves the
    base Trainer's choice; a subclass overrides what it changes.

    Args:
        trainer: the trainer it runs in (its ``args``, model, tokenizer and the attributes its ``__init__`` set).
    """

    #: Whether the step loss's own metrics carry the evaluated dataset's name (``eval_<name>_<metric>``, as
    #: transformers names them); TRL's preference and reward trainers log theirs as ``eval_<metric>`` whatever it is.
    metrics_named_by_dataset: bool = False

    def __init__(self, trainer: OfflineTrainer):
        self.trainer = trainer

    # ------------------------------------------------------------------ model
    def load_model(self, model: ModelLike, args: TRLArgs,
                   quantization_config: QuantizationConfig | None) -> CausalLM | None:
        """The trainer's model from a path or hub id, or the loaded model checked; ``None``: a causal LM, as
        :func:`~torchlike.trl.trainer.base_trainer.load_model` loads it."""
        return None

    def check_new_adapter(self, model: CausalLM) -> None:
        """Called with the model once ``peft_config`` has added its adapter (warnings about it go here)."""

    # ------------------------------------------------------------------ data
    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """The prepared examples of ``dataset`` (for :meth:`TRLTrainer._prepare_examples`)."""
        raise NotImplementedError(f"{type(self).__name__} prepares its examples in its trainer's __init__")

    def padded_length(self, examples: list[dict]) -> int:
        """The one length every batch is padded to, fitting ``examples``."""
        raise NotImplementedError(f"{type(self).__name__} sets its trainer's padded_length itself")

    def prepare_eval_dataset(self, dataset: RowsLike) -> Sequence | None:
        """One dataset given to ``evaluate()`` as the examples the collator reads: raw data prepared as the training
        data, prepared examples as they are (``evaluate()`` passes every dataset through it). ``None``: the
        Trainer's (the rows as they are)."""
        return None

    def train_rows(self, dataset: Sequence) -> Sequence:
        """What the training batches read of the prepared ``train_dataset``: the dataset itself."""
        return dataset

    def train_order(self, epoch: int) -> np.ndarray | None:
        """The example order of ``epoch`` (indices), or ``None`` for the Trainer's (a seeded shuffle)."""
        return None

    def step_batch(self, batch: dict) -> dict:
        """The batch a training step runs on, from the collated ``batch``: as it is."""
        return batch

    # ------------------------------------------------------------------ step
    def step_loss(self) -> tuple[Callable, Callable | None] | None:
        """``(step loss, item counter or None)`` (see :meth:`Trainer._step_loss`); ``None``: the Trainer's."""
        return None

    def neftune_length(self) -> Callable | None:
        """``batch -> L`` for NEFTune's noise, the length TRL's collator pads the batch to; ``None``: the
        Trainer's (the longest row's real tokens)."""
        return None

    # ------------------------------------------------------------------ compute_metrics
    def found_for_metrics(self) -> Callable | None:
        """``(module, batch) -> found``: what ``compute_metrics`` reads of a batch, as TRL's ``prediction_step``
        gives it; ``None``: the Trainer's (the causal LM's logits and labels)."""
        return None

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """``(found, rows)`` of one evaluation batch on the host, rearranged as TRL's ``compute_metrics`` sees its
        rows: as they are."""
        return found, rows

    def metrics_length(self, lengths: np.ndarray) -> int | None:
        """The positions TRL's collator pads an evaluation batch to; ``None`` keeps the batch as collated."""
        return None

    # ------------------------------------------------------------------ logs and checkpoints
    def finish_logs(self, logs: dict[str, float]) -> None:
        """Updates ``logs`` in place before they are recorded: as they are."""

    def save_extras(self, folder: Path) -> None:
        """Writes the algorithm's own files into a checkpoint being written: none."""

    def resumed(self, folder: Path) -> None:
        """Restores the algorithm's own state from the checkpoint folder the run resumed from: none."""


class OfflineTrainer(TRLTrainer):
    """The loop of torchlike's offline trainers without a reference model (see the module docstring): a trainer on
    it sets ``algorithm_class``, ``_config_class``, ``_output_suffix`` and ``_tag_names``, and its ``__init__``
    prepares the examples and calls ``Trainer.__init__``."""

    algorithm_class: type[OfflineAlgorithm]
    """The algorithm the loop trains with."""

    @functools.cached_property
    def algorithm(self) -> OfflineAlgorithm:
        """The trainer's algorithm (made on first use: the constructor loads and tokenises before the Trainer's
        set-up)."""
        return self.algorithm_class(self)

    # ------------------------------------------------------------------ model
    def _load_model(self, model: ModelLike, args: TRLArgs,
                    quantization_config: QuantizationConfig | None) -> CausalLM:
        loaded = self.algorithm.load_model(model, args, quantization_config)
        return super()._load_model(model, args, quantization_config) if loaded is None else loaded

    def _check_new_adapter(self, model: CausalLM) -> None:
        self.algorithm.check_new_adapter(model)

    # ------------------------------------------------------------------ data
    def _tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        return self.algorithm.tokenize(dataset, tokenizer, args, model)

    def _padded_length(self, examples: list[dict]) -> int:
        return self.algorithm.padded_length(examples)

    def _prepare_eval_dataset(self, dataset: RowsLike) -> Sequence:
        prepared = self.algorithm.prepare_eval_dataset(dataset)
        return super()._prepare_eval_dataset(dataset) if prepared is None else prepared

    def _train_rows(self) -> Sequence:
        return self.algorithm.train_rows(self.train_dataset)

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        order = self.algorithm.train_order(epoch)
        return super()._get_train_sampler(epoch) if order is None else order

    def _signature_columns(self) -> None:
        """Every column: the prepared examples hold only what the algorithm's collator reads."""
        return None

    # ------------------------------------------------------------------ step
    def _step_loss(self) -> tuple[Callable, Callable | None]:
        chosen = self.algorithm.step_loss()
        return super()._step_loss() if chosen is None else chosen

    def _neftune_length(self) -> Callable:
        length = self.algorithm.neftune_length()
        return super()._neftune_length() if length is None else length

    def _run_step(self, step_fn: Callable, batch: dict, step: int) -> dict:
        return super()._run_step(step_fn, self.algorithm.step_batch(batch), step)

    # ------------------------------------------------------------------ compute_metrics and evaluation
    def _found_for_metrics(self) -> Callable:
        found = self.algorithm.found_for_metrics()
        return super()._found_for_metrics() if found is None else found

    def _host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        return self.algorithm.host_found(found, rows)

    def _metrics_length(self, lengths: np.ndarray) -> int | None:
        return self.algorithm.metrics_length(lengths)

    def _step_metric_prefix(self, metric_key_prefix: str) -> str:
        """The evaluated dataset's own prefix where the algorithm's metrics carry its name, else ``"eval"``."""
        return metric_key_prefix if self.algorithm.metrics_named_by_dataset else "eval"

    # ------------------------------------------------------------------ logs and checkpoints
    def log(self, logs: dict[str, float]) -> None:
        self.algorithm.finish_logs(logs)
        super().log(logs)

    def _save_checkpoint_extras(self, folder: Path) -> None:
        super()._save_checkpoint_extras(folder)
        self.algorithm.save_extras(folder)

    def _resume(self, checkpoint: str | bool) -> int:
        step = super()._resume(checkpoint)
        self.algorithm.resumed(self._resumed_from)
        return step


class ReferenceFreePreference(OfflineAlgorithm):
    """What the reference-free preference algorithms (ORPO, CPO, TPO) share: raw data passed to ``evaluate()``
    tokenised as the training data (prepared examples, which hold ``chosen_ids``, as they are), and TRL's metrics
    logged as ``eval_<metric>`` whatever the dataset's name. A subclass implements :meth:`tokenize` and
    :meth:`padded_length`."""

    def prepare_eval_dataset(self, dataset: RowsLike) -> list[dict] | None:
        """Raw data tokenised as the training data (TRL's ``evaluate`` prepares it too), the padded length widened to
        fit it; prepared examples as they are."""
        if "chosen_ids" in next(iter(dataset), {}):
            return None
        trainer = self.trainer
        examples = self.tokenize(dataset, trainer.processing_class, trainer.args, trainer.model)
        trainer.padded_length = max(trainer.padded_length, self.padded_length(examples))
        return examples


class StackedRowsMetrics:
    """``compute_metrics`` for an :class:`OfflineAlgorithm` whose batches TRL's collator builds as stacked rows (DPO's
    chosen rows on top of its rejected ones, TPO's three responses): TRL's ``prediction_step`` hands it the model's
    logits on those rows' ``input_ids`` and the ids as labels, each batch right-padded to its longest row. An
    algorithm using it defines :meth:`metrics_rows`."""

    trainer: OfflineTrainer
    #: Whether TRL's trainer deprecates the logits it passes (DPO, KTO, BCO: with a ``FutureWarning``; TPO does not).
    logits_for_metrics_deprecated: bool = True

    def metrics_rows(self, batch: dict) -> tuple[Any, Any]:
        """``(input_ids, attention_mask)`` of the rows TRL's collator builds from ``batch``."""
        raise NotImplementedError

    def found_for_metrics(self) -> Callable:
        """The logits of :meth:`metrics_rows` and their ids as labels (with TRL's ``FutureWarning`` where it
        deprecates them)."""
        import jax.numpy as jnp

        from ...training.loss_selection import select_outputs

        if self.logits_for_metrics_deprecated:
            warnings.warn("`return_outputs=True`, and the logits it passes to `compute_metrics`, are deprecated and "
                          "will be removed in v2.0.0. The fused LM head does not build the logits, so they are "
                          "recomputed with an extra forward pass.", FutureWarning, stacklevel=3)
        logits = select_outputs(self.trainer._trainable_model, None, ())
        metrics_rows = self.metrics_rows

        def found(module, batch):
            ids, mask = metrics_rows(batch)
            ids, mask = jnp.asarray(ids), jnp.asarray(mask)
            return {"predictions": logits(module, {"input_ids": ids, "attention_mask": mask}), "labels": ids,
                    "input_ids": ids, "lengths": mask.sum(-1)}

        return found

    def metrics_length(self, lengths: np.ndarray) -> int | None:
        """TRL's collator pads each batch to its longest row, rounded up to ``pad_to_multiple_of``."""
        return round_up_to_multiple(int(lengths.max()), self.trainer.args.pad_to_multiple_of)


def rows_trl_gathers(found: dict, rows: int, branches: int) -> tuple[dict, int]:
    """``(found, rows)`` of an evaluation batch of ``branches`` stacked row groups (DPO: 2, TPO: 3) as TRL's
    ``compute_metrics`` sees them: all of a full batch; of a short last batch (``rows`` real examples where each group
    holds more) only its first ``rows`` rows, since accelerate's ``gather_for_metrics`` cuts the last batch to the
    examples left, not to their ``branches * rows`` rows."""
    import jax
    import numpy as np

    total = found["labels"].shape[0]
    if rows == total // branches:
        return found, total
    kept = jax.tree.map(lambda array: np.asarray(array)[:rows], found)
    # TRL's collator pads the whole batch before accelerate cuts it: the rows kept are as long as its longest row.
    kept["lengths"] = np.full(rows, np.asarray(found["lengths"]).max())
    return kept, rows


class ReferenceAlgorithm(StackedRowsMetrics, OfflineAlgorithm):
    """What one offline algorithm with a reference model decides on :class:`PrecomputedReferenceTrainer`'s loop: how
    its examples are tokenised and padded, the reference columns and the pass that computes them, and the step loss. A
    subclass implements those five; the rest are hooks whose defaults are the loop's plain behaviour (the offline
    loop's hooks, and ``compute_metrics`` on the logits of :meth:`metrics_rows`, TRL's deprecated stacked rows).

    Args:
        trainer: the loop it runs in; the algorithm reads its config, tokenizer, models and reference.
    """

    trainer: PrecomputedReferenceTrainer

    @property
    def reference_columns(self) -> tuple[str, ...]:
        """The names of the columns the reference pass adds to each example."""
        raise NotImplementedError

    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """The prepared examples of ``dataset``, checked against the vocabulary of the models that read them."""
        raise NotImplementedError

    def padded_length(self, examples: list[dict]) -> int:
        """The fixed length the collator pads ``examples`` to."""
        raise NotImplementedError

    def reference_pass(self) -> Callable:
        """``(module, batch) -> one [B] array per reference column`` of the trainer's ``reference`` (jitted by the
        loop)."""
        raise NotImplementedError

    def step_loss(self) -> tuple[Callable, None]:
        """``(loss, None)``: the jitted step's loss, ``loss(module, batch, num_items_in_batch) -> (value, weight,
        metrics)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks with the loop's plain behaviour
    def metrics_rows(self, batch: dict) -> tuple[Any, Any]:
        """``(input_ids, attention_mask)`` of the rows TRL's collator builds from ``batch`` (prompt + completion),
        whose logits ``compute_metrics`` gets."""
        return batch["input_ids"], batch["attention_mask"]

    def new_eval_examples(self, examples: list[dict]) -> None:
        """Completes raw data passed to ``evaluate()``, once tokenised and scored by the reference: nothing to add."""


class PrecomputedReferenceTrainer(OfflineTrainer):
    """The loop of the offline trainers with a reference model (DPO, KTO, BCO): the examples are tokenised once,
    their reference log-probabilities are stored as columns before training, or, with ``sync_ref_model``, computed for
    each batch by the reference TRL's ``SyncRefModelCallback`` moves; the logs carry TRL's running ``num_tokens``.

    What each trainer changes is its :class:`ReferenceAlgorithm` (``algorithm_class``, beside the trainer): the
    tokenisation, padding, reference columns and pass, and step loss. A trainer on the loop redefines only
    ``__init__`` (TRL's signature), which calls :meth:`_prepare_examples` and :meth:`_start_reference`.
    """

    algorithm_class: type[ReferenceAlgorithm]
    """The algorithm the loop trains with."""
    _counts_step_tokens = True

    _takes_vision_data = False
    """Whether the trainer trains on TRL's vision datasets (it then refuses them itself for a text-only model)."""

    @property
    def _reference_columns(self) -> tuple[str, ...]:
        return self.algorithm.reference_columns

    def _reference_pass(self) -> Callable:
        return self.algorithm.reference_pass()

    def _check_reference_settings(self, args: TRLArgs, model: CausalLM, ref_model: ModelLike | None,
                                  train_dataset: RowsLike,
                                  eval_dataset: EvalRowsLike | None) -> CausalLM | None:
        """TRL's checks of the datasets and the reference settings, with its wording (vision data refused unless
        the trainer takes it, :attr:`_takes_vision_data`); returns ``ref_model`` as a torchlike model (a
        ``transformers`` model object converted, as :func:`load_model` converts ``model``)."""
        import datasets

        from ...training.batches import check_single_dataset, each_dataset

        check_single_dataset(train_dataset, "train_dataset")
        if args.precompute_ref_log_probs and any(isinstance(dataset, datasets.IterableDataset) for dataset in
                                                 [train_dataset, *each_dataset(eval_dataset)]):
            raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
        if not self._takes_vision_data:
            check_text_dataset(train_dataset)
        if args.sync_ref_model and args.precompute_ref_log_probs:
            raise ValueError("You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                             "`precompute_ref_log_probs=True` assumes a fixed reference model, but with "
                             "`sync_ref_model=True` the reference model is periodically updated during training, "
                             "making any precomputed reference log-probs stale. Set `precompute_ref_log_probs=False` "
                             "or disable `sync_ref_model`.")
        if ref_model is not None:
            if ref_model is model:
                raise ValueError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                                 "`ref_model` and the initial model will be the reference.")
            ref_model = converted_if_transformers(ref_model)
            check_causal_lm(ref_model, "ref_model", self._trainer_name)
        return ref_model

    def _start_reference(self, ref_model: ModelLike | None, train_examples: list[dict],
                         eval_examples: list[dict] | dict[str, list[dict]] | None) -> None:
        """The reference (``ref_model``; else the base weights of a new adapter, valid all run long; else the
        initial weights, valid until the first step, or a frozen copy with ``sync_ref_model``) and its columns on
        the examples (with ``sync_ref_model`` the training batches are scored as they are used instead)."""
        from ...training.batches import each_dataset

        # Full fine-tuning without precomputed log-probs: TRL keeps a second, frozen model (so evaluate() can score
        # new data after training); precomputed, the initial weights serve once, before training.
        adapter_off = reference_policy.lora_is_new(self._module)
        keep = ref_model is None and not adapter_off and not self._is_lora() and not self.args.precompute_ref_log_probs
        self._init_reference(ref_model, adapter_off=adapter_off, copy=keep)
        if self.args.sync_ref_model:
            self._start_reference_sync()
        else:
            self._add_reference_log_probs(train_examples, self.args.per_device_train_batch_size)
        for examples in each_dataset(eval_examples):
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)

    def _add_reference_log_probs(self, examples: list[dict], per_device_batch_size: int) -> None:
        """Adds the reference columns to every example (TRL's ``compute_ref_log_probs``)."""
        self._add_reference_columns(examples, self._reference_pass(), self._reference_columns,
                                    per_device_batch_size)

    def _start_reference_sync(self) -> None:
        """``sync_ref_model``: each training batch is scored by the current reference when it is used (so batches
        are not prepared ahead), and each evaluation again."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self._allow_prefetch = False
        pass_ = self._reference_pass()
        compute_dtype = self._compute_dtype()

        @nnx.jit
        def group_log_probs(module, micro_batches):
            module = train_step.cast_floating(module, compute_dtype)
            count = jax.tree.leaves(micro_batches)[0].shape[0]
            outputs = [pass_(module, jax.tree.map(lambda value, index=index: value[index], micro_batches))
                       for index in range(count)]  # image columns may be dicts of arrays
            return tuple(jnp.stack(values) for values in zip(*outputs, strict=True))

        self._group_reference_log_probs = group_log_probs

    def _batches(self, epoch: int, skip: int = 0):
        """The Trainer's batches; with ``sync_ref_model``, each scored by the current reference when it is used."""
        for group in super()._batches(epoch, skip):
            if self.args.sync_ref_model:
                scored = self._group_reference_log_probs(self.reference.module, group)
                group = {**group, **dict(zip(self._reference_columns, scored, strict=True))}
            yield group

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation; with ``sync_ref_model`` the examples are first scored by the current
        reference, as TRL's reference forward in each evaluation step."""
        if self.args.sync_ref_model:
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return super()._evaluation_loop(examples, metric_key_prefix)

    def _prepare_eval_dataset(self, dataset: RowsLike) -> list[dict]:
        """Raw data prepared and scored by the reference (TRL's ``evaluate`` does too); examples that carry the
        reference columns already (the trainer's ``eval_dataset``) as they are."""
        import datasets

        if all(name in next(iter(dataset), {}) for name in self._reference_columns):
            return super()._prepare_eval_dataset(dataset)
        # TRL's checks of evaluate()'s new data, in its order and words (before tokenising).
        if self.args.precompute_ref_log_probs and not self.reference.outlives_training and \
                self.state.global_step > 0 and not self._is_lora():
            raise ValueError(
                "Cannot compute reference log-probs for a dataset passed to `evaluate()` after training has started, "
                "because `precompute_ref_log_probs=True` and no `ref_model` was provided (full fine-tuning). In this "
                "setup the reference model is not kept in memory, so it is only available before training. Provide "
                "this dataset as `eval_dataset` at initialization, pass an explicit `ref_model`, or set "
                "`precompute_ref_log_probs=False`.")
        if self.args.precompute_ref_log_probs and isinstance(dataset, datasets.IterableDataset):
            raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
        examples = self._tokenize(dataset, self.processing_class, self.args, self.model)
        self.padded_length = max(self.padded_length, self._padded_length(examples))
        self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        self.algorithm.new_eval_examples(examples)
        return examples
