"""What every TRL trainer does with its ``model`` argument before training: the default ``output_dir``, loading
a path or hub id with ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as TRL's
``create_model_from_path``), TRL's shared input checks, and the reference-sync callback (TR-DPO)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..adapters import reference_sync


def default_output_dir(model: Any, suffix: str) -> str:
    """TRL's default ``output_dir``: ``"<last part of the model id>-<suffix>"`` (e.g. ``"Qwen2.5-0.5B-SFT"``)."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or "model"
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


def check_causal_lm(model: Any, name: str, trainer: str) -> None:
    """Raises ``TypeError`` unless ``model`` is a torchlike causal LM (``CausalLM`` or ``PeftModel``)."""
    if getattr(model, "family", None) is None:
        raise TypeError(f"{trainer}'s {name} must be a torchlike causal LM; got {type(model).__name__}. Load it "
                        "with torchlike.AutoModelForCausalLM.from_pretrained(...).")


def load_model(model: Any, args: Any, quantization_config: Any, trainer: str) -> Any:
    """``model`` as a torchlike model.

    Args:
        model: a loaded torchlike model, or a path / hub id.
        args: the trainer config (its ``model_init_kwargs`` apply to a path or hub id).
        quantization_config: a ``BitsAndBytesConfig``-like request for a path or hub id.
        trainer: the trainer's name, for messages.

    Returns:
        The loaded (or given) model.
    """
    from .. import AutoModelForCausalLM

    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError("quantization_config was given both to the trainer and in args.model_init_kwargs; "
                                 "set it in one place, preferably the trainer argument.")
            init_kwargs["quantization_config"] = quantization_config
        init_kwargs.setdefault("dtype", "float32")
        return AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
    if quantization_config is not None:
        raise ValueError("quantization_config only applies when the model is loaded from a path or hub id (a str); "
                         "the model passed is already loaded. Pass its path, or omit quantization_config.")
    if args.model_init_kwargs is not None:
        warnings.warn("args.model_init_kwargs is ignored: the model is already loaded (pass a path or hub id to "
                      "load it with these arguments).", UserWarning, stacklevel=3)
    check_causal_lm(model, "model", trainer)
    return model


def check_text_dataset(dataset: Any) -> None:
    """TRL's refusal of vision data (an ``image`` or ``images`` column) for a text model: torchlike's models are
    text-only."""
    if dataset is None:
        return
    names = getattr(dataset, "column_names", None)
    if names is None:  # a list of rows; a plain iterator is not read, so that no row is consumed
        first = dataset[0] if isinstance(dataset, list) and dataset else None
        names = list(first) if isinstance(first, dict) else []
    if "image" in names or "images" in names:
        raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys), but the "
                         "provided model does not seem to be a vision-language model. Please check your model and "
                         "dataset. (torchlike's model families are text-only.)")


def check_reference_sync(args: Any, model: Any, trainer: str) -> None:
    """TRL's refusal of ``sync_ref_model`` with a LoRA adapter (the reference is the adapter switched off, so there
    is no reference model to update)."""
    if args.sync_ref_model and hasattr(model, "peft_config"):
        raise NotImplementedError(
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
            f"{trainer} does not keep a separate reference model in memory; instead, it recovers reference behavior "
            "by temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to "
            "synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference "
            "model.")


class SyncRefModelCallback(TrainerCallback):
    """TRL's ``SyncRefModelCallback`` (TR-DPO): after every ``ref_model_sync_steps``-th optimizer step the reference
    becomes ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``.

    Args:
        reference: the reference NNX module, updated in place.
        policy: returns the NNX module being trained.
    """

    def __init__(self, reference: Any, policy: Callable[[], Any]):
        self.reference = reference
        self.policy = policy

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            reference_sync.mix_into(self.reference, self.policy(), args.ref_model_mixup_alpha)
