"""What every TRL trainer does with its ``model`` argument before training: the default ``output_dir`` and loading
a path or hub id with ``args.model_init_kwargs`` (float32 unless they set ``dtype``, as TRL's
``create_model_from_path``)."""

from __future__ import annotations

import warnings
from typing import Any


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
