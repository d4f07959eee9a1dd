"""What ``compute_metrics`` receives, built as transformers' ``Trainer.evaluation_loop`` builds it.

The eval step returns, beside the loss, the model's outputs (a causal LM's logits), the labels and the input ids of
each batch. On the host they become what transformers hands ``compute_metrics``: torch tensors per batch (what
``preprocess_logits_for_metrics`` and ``batch_eval_metrics=True`` see), concatenated over the batches into numpy
arrays by transformers' own ``EvalLoopContainer`` (sequences of unequal length padded with ``-100``, logits
included), then one ``EvalPrediction``. Predictions move to the host after every batch, so the devices never hold
more than one batch of logits (``eval_accumulation_steps`` has nothing left to bound).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from ..training_args import TrainingArguments

__all__ = ["PredictionGatherer", "causal_lm_found", "causal_lm_labels", "prefixed_metrics", "with_predictions"]


def causal_lm_labels(batch: Mapping[str, Any], label_names: tuple[str, ...]) -> Any:
    """The labels transformers' ``prediction_step`` takes from a batch.

    The ``label_names`` columns when the batch has them all (one array, or a tuple for several names), else, for a
    torchlike causal-LM batch, the labels TRL's collator builds: ``input_ids`` where ``loss_mask`` is 1, ``-100``
    elsewhere (unshifted: position ``t`` holds the token predicted from ``t - 1``). ``None`` when there are neither,
    as transformers has no labels then (and does not call ``compute_metrics``).

    Args:
        batch: one collated batch (numpy or JAX arrays).
        label_names: ``args.label_names`` (default ``("labels",)``).
    """
    if all(name in batch for name in label_names):
        found = tuple(batch[name] for name in label_names)
        return found[0] if len(found) == 1 else found
    if "loss_mask" in batch and "input_ids" in batch:
        return jnp.where(jnp.asarray(batch["loss_mask"]) != 0, jnp.asarray(batch["input_ids"]), -100)
    return None


def causal_lm_found(outputs: Callable, label_names: tuple[str, ...]) -> Callable:
    """``(module, batch) -> found``: what ``compute_metrics`` reads of a batch, as transformers' ``prediction_step``
    gives it.

    Args:
        outputs: ``(module, batch) -> predictions`` (:func:`~torchlike.training.loss_selection.select_outputs`).
        label_names: ``args.label_names``, for :func:`causal_lm_labels`.

    Returns:
        A function whose dict holds ``predictions``, ``labels`` (when there are), ``input_ids`` and ``lengths`` (the
        real tokens of each row, from ``attention_mask``).
    """

    def found(module, batch):
        found = {"predictions": outputs(module, batch)}
        labels = causal_lm_labels(batch, label_names)
        if labels is not None:
            found["labels"] = labels
        if "input_ids" in batch:
            found["input_ids"] = batch["input_ids"]
        if "attention_mask" in batch:
            found["lengths"] = batch["attention_mask"].sum(-1)
        return found

    return found


def with_predictions(loss: Callable, found_for_metrics: Callable, whole_batch: bool) -> Callable:
    """The step loss ``loss`` extended with what ``compute_metrics`` reads: ``(value, weight, aux, found)``.

    Args:
        loss: a step loss ``(module, batch, num_items_in_batch) -> (value, weight, aux)``.
        found_for_metrics: ``(module, batch) -> found`` (:func:`causal_lm_found`, or a trainer's own).
        whole_batch: also return the batch itself (``batch_eval_metrics`` with ``include_for_metrics=["inputs"]``:
            transformers passes that batch's inputs).

    Returns:
        A step loss whose ``found`` dict holds what ``found_for_metrics`` gives and, with ``whole_batch``,
        ``inputs``.
    """

    def step_loss(module, batch, num_items_in_batch=None):
        value, weight, aux = loss(module, batch, num_items_in_batch)
        found = found_for_metrics(module, batch)
        if whole_batch:
            found["inputs"] = dict(batch)
        return value, weight, aux, found

    return step_loss


def _as_torch(tree: Any) -> Any:  # Any: a pytree of host arrays (in tuples, lists and dicts)
    """Host arrays (nested in tuples, lists and dicts) as CPU torch tensors in the dtypes transformers' tensors have:
    integers as int64 (torch's ``long``, what collators build), bfloat16 as bfloat16 (the compute dtype)."""
    import torch

    def convert(array):
        if isinstance(array, torch.Tensor):
            return array
        array = np.asarray(array)
        if array.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own (ml_dtypes'), torch cannot read it
            return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
        if np.issubdtype(array.dtype, np.integer):
            return torch.from_numpy(array.astype(np.int64))
        return torch.from_numpy(np.array(array))  # a writable copy: host copies of device arrays are read-only

    return jax.tree.map(convert, tree, is_leaf=lambda node: isinstance(node, torch.Tensor))


def _cut(tree: Any, rows: int, length: int | None) -> Any:  # Any: a pytree of host arrays
    """The first ``rows`` rows of each array (the rest pad the last batch) and, when ``length`` is given, its first
    ``length`` positions (axis 1)."""
    def cut(array):
        array = np.asarray(array)[:rows]
        return array[:, :length] if length is not None and array.ndim >= 2 else array

    return jax.tree.map(cut, tree)


class PredictionGatherer:
    """Collects the evaluation batches' predictions and calls ``compute_metrics`` as transformers'
    ``evaluation_loop`` does.

    Per batch, labels and predictions become torch tensors; ``preprocess_logits_for_metrics(logits, labels)`` runs on
    them. With ``args.batch_eval_metrics`` each batch goes straight to ``compute_metrics(EvalPrediction(...),
    compute_result=<last batch>)`` (torch tensors, ``inputs`` the batch's columns) and the last call's dict is the
    result; otherwise the batches are concatenated (``args.eval_do_concat_batches``) into numpy arrays and
    ``compute_metrics`` runs once. ``args.include_for_metrics`` adds ``inputs`` (the input ids) and ``losses`` (each
    example's batch loss, repeated per example).

    Args:
        args: the ``TrainingArguments``.
        compute_metrics: ``EvalPrediction -> dict`` (with ``compute_result`` under ``batch_eval_metrics``).
        preprocess_logits_for_metrics: ``(logits, labels) -> predictions`` on torch tensors, or ``None``.
    """

    def __init__(self, args: TrainingArguments, compute_metrics: Callable,
                 preprocess_logits_for_metrics: Callable | None):
        from transformers.trainer_pt_utils import EvalLoopContainer

        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.per_batch = bool(args.batch_eval_metrics)
        self.include = set(args.include_for_metrics or ())
        concat = args.eval_do_concat_batches
        self.losses, self.predictions, self.labels, self.inputs = (
            EvalLoopContainer(concat, padding_index=-100) for _ in range(4))
        self.batch_metrics: dict | None = None

    def add(self, found: Mapping[str, Any], batch_loss: float, rows: int, length: int | None, last: bool) -> None:
        """Takes one batch.

        Args:
            found: the host copy of :func:`with_predictions`' dict for the batch.
            batch_loss: the batch's mean loss (what transformers' ``prediction_step`` returns).
            rows: how many leading rows are real examples.
            length: the positions transformers' collator would have given the batch (``None``: all of them).
            last: whether this is the last batch (``compute_result`` under ``batch_eval_metrics``).
        """
        import torch

        predictions = _as_torch(_cut(found["predictions"], rows, length))
        labels = _as_torch(_cut(found["labels"], rows, length)) if "labels" in found else None
        losses = torch.full((rows,), batch_loss, dtype=torch.float32) if "loss" in self.include else None
        if losses is not None:
            self.losses.add(losses)
        if "inputs" in self.include and "input_ids" in found and not self.per_batch:
            self.inputs.add(_as_torch(_cut(found["input_ids"], rows, length)))
        if self.preprocess_logits_for_metrics is not None:
            predictions = _as_torch(self.preprocess_logits_for_metrics(predictions, labels))
        if not self.per_batch:
            self.predictions.add(predictions)
            if labels is not None:
                self.labels.add(labels)
        elif labels is not None:
            from transformers import EvalPrediction

            inputs = _as_torch(_cut(found["inputs"], rows, length)) if "inputs" in self.include else None
            self.batch_metrics = self.compute_metrics(
                EvalPrediction(predictions=predictions, label_ids=labels, losses=losses, inputs=inputs),
                compute_result=last)

    def metrics(self) -> dict:
        """``compute_metrics``' result (``{}`` without labels, where transformers does not call it)."""
        from transformers import EvalPrediction

        if self.per_batch:
            return dict(self.batch_metrics or {})
        predictions, labels = self.predictions.get_arrays(), self.labels.get_arrays()
        if predictions is None or labels is None:
            return {}
        return dict(self.compute_metrics(EvalPrediction(
            predictions=predictions, label_ids=labels,
            losses=self.losses.get_arrays() if "loss" in self.include else None,
            inputs=self.inputs.get_arrays() if "inputs" in self.include else None)))


def prefixed_metrics(metrics: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``metrics`` as plain Python numbers (transformers' ``denumpify_detensorize``), each key starting with
    ``prefix + "_"`` (added where missing), as ``evaluation_loop`` returns them."""
    from transformers.trainer_utils import denumpify_detensorize

    metrics = denumpify_detensorize(dict(metrics))
    return {key if key.startswith(f"{prefix}_") else f"{prefix}_{key}": value for key, value in metrics.items()}
