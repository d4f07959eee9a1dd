"""Which loss the train step runs, and so which example columns it reads.

Three conventions, in this order: transformers' ``compute_loss_func(outputs, labels, num_items_in_batch)``, a
JAX-native ``loss_fn(model, batch)``, and, for a torchlike causal LM given neither, the built-in next-token loss over
``loss_mask``. Each becomes a step loss ``(module, batch, num_items_in_batch) -> (value, weight, aux)`` from
``adapters.training.train_step``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ..adapters.losses import sft as sft_loss
from ..adapters.model import prompt_learning, tunix_model
from ..adapters.training import train_step
from ..peft.prompt_model import PromptLearningModel
from .model_interface import TrainableModel

__all__ = ["select_loss", "select_outputs", "signature_columns", "with_virtual_tokens"]


def _model_call(model: TrainableModel) -> Callable:
    """``call(module, inputs) -> outputs``: a :class:`~torchlike.CausalLMOutput` with ``logits`` for a torchlike causal
    LM (``inputs`` without ``input_ids``/``attention_mask`` are not read), ``module(**inputs)`` for a plain NNX
    module."""
    family = model.family
    if family is None:
        return lambda module, inputs: module(**inputs)
    from ..modeling import CausalLMOutput

    def call(module, inputs):
        return CausalLMOutput(logits=tunix_model.causal_lm_logits(family, module, inputs))

    return call


def select_loss(model: TrainableModel, compute_loss_func: Callable | None, loss_fn: Callable | None,
                label_names: tuple[str, ...]) -> tuple[Callable, Callable | None]:
    """The step loss for ``model`` and, for ``compute_loss_func``, the item counter that gives ``num_items_in_batch``.

    Args:
        model: the trained model; its ``family`` gives the built-in loss (and the logits ``compute_loss_func`` sees).
        compute_loss_func: transformers' loss on the model's outputs, or ``None``.
        loss_fn: a JAX-native ``(module, batch) -> loss | (loss, aux)``, or ``None``.
        label_names: the batch columns holding the labels (``args.label_names``).

    Raises:
        ValueError: a plain NNX module was given neither loss.
    """
    family = model.family
    if compute_loss_func is not None:
        call_model = _model_call(model)
        count = train_step.label_count(shift=family is not None, label_name=label_names[0])
        return train_step.transformers_loss(compute_loss_func, call_model, count, label_names), count
    if loss_fn is not None:
        return train_step.mean_loss(loss_fn), None
    if family is None:
        raise ValueError("a plain NNX module needs loss_fn=(model, batch) -> loss | (loss, aux), or "
                         "compute_loss_func=(outputs, labels, num_items_in_batch) -> loss.")
    return with_virtual_tokens(model, sft_loss.sft_step_loss(family)), None


def with_virtual_tokens(model: TrainableModel, loss: Callable) -> Callable:
    """The built-in causal-LM ``loss`` as a ``peft`` prompt-tuning or P-tuning model computes it with transformers'
    labels (the first token scored from the last virtual token:
    :func:`adapters.model.prompt_learning.with_virtual_tokens`); ``loss`` itself for any other model."""
    if isinstance(model, PromptLearningModel) and model.prepends_virtual_tokens:
        return prompt_learning.with_virtual_tokens(loss)
    return loss


def select_outputs(model: TrainableModel, loss_fn: Callable | None,
                   label_names: tuple[str, ...]) -> Callable[[object, dict], object]:
    """``outputs(module, batch)``: the predictions transformers' ``prediction_step`` hands ``compute_metrics`` (the
    model's outputs but the loss).

    A torchlike causal LM gives its logits ``[B, T, V]``, a plain NNX module ``module(**inputs)`` on the batch without
    its label columns: each value but ``"loss"`` of a returned dict, in order (one value on its own), else what it
    returned.

    Raises:
        ValueError: a JAX-native ``loss_fn``, which does not expose the model's outputs.
    """
    if loss_fn is not None:
        raise ValueError("compute_metrics receives the model's outputs, which a JAX-native loss_fn does not expose; "
                         "return the metrics from loss_fn as (loss, {name: value}) instead (they are logged as "
                         "eval_<name>), or use compute_loss_func=(outputs, labels, num_items_in_batch) -> loss.")
    call = _model_call(model)
    if model.family is not None:
        # Packed rows carry position_ids, which keep each sequence's attention to itself.
        inputs = ("input_ids", "attention_mask", "position_ids")
        return lambda module, batch: call(module, {key: batch[key] for key in inputs if key in batch}).logits

    def outputs(module, batch):
        found = call(module, {key: value for key, value in batch.items() if key not in (*label_names, "shift_labels")})
        if isinstance(found, dict):
            found = tuple(value for key, value in found.items() if key != "loss")
            return found[0] if len(found) == 1 else found
        return found

    return outputs


def signature_columns(model: TrainableModel | None, compute_loss_func: Callable | None, loss_fn: Callable | None,
                      label_names: tuple[str, ...]) -> set[str] | None:
    """The example columns the training loss reads, which ``remove_unused_columns=True`` keeps (transformers'
    ``_set_signature_columns_if_needed``); ``None`` keeps every column.

    A torchlike causal LM with the built-in loss reads ``input_ids``, ``attention_mask`` and ``loss_mask``; with
    ``compute_loss_func`` the model reads ``input_ids`` and ``attention_mask`` (a plain NNX module: the parameters of
    its ``__call__``) and the loss the label columns. A JAX-native ``loss_fn`` may read any column, so every column is
    kept for it, as for a module whose ``__call__`` takes ``**kwargs``.
    """
    if loss_fn is not None:
        return None
    family = model.family if model is not None else None
    if compute_loss_func is None:
        return {"input_ids", "attention_mask", "loss_mask"} if family is not None else None
    if family is not None:
        inputs = {"input_ids", "attention_mask"}
    else:
        parameters = inspect.signature(model.module.__call__).parameters.values()
        if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
            return None
        inputs = {parameter.name for parameter in parameters}
    return inputs | set(label_names) | {"shift_labels"}
