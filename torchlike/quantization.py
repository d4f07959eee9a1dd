"""Quantisation requests as transformers takes them (``BitsAndBytesConfig``, ``load_in_4bit``/``load_in_8bit``),
turned into the Qwix weight type QLoRA applies."""

from __future__ import annotations

import warnings


def requested_quantization(kwargs: dict) -> str | None:
    """The Qwix weight type asked for by ``quantization_config`` (a ``BitsAndBytesConfig`` or dict) or
    ``load_in_4bit``/``load_in_8bit``; pops those keys from ``kwargs``.

    Raises:
        ValueError: a quantisation method that has no Qwix equivalent (GPTQ, AWQ...). bitsandbytes'
            ``fp4`` becomes ``nf4`` with a warning.
    """
    config = kwargs.pop("quantization_config", None)
    load_in_4bit, load_in_8bit = kwargs.pop("load_in_4bit", False), kwargs.pop("load_in_8bit", False)
    if config is not None:
        if isinstance(config, dict):
            fields = config
        else:
            fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        method = str(fields.get("quant_method", "bitsandbytes")).lower()
        if "bitsandbytes" not in method.replace("_", ""):
            raise ValueError(f"quantization_config with quant_method={method!r} is not supported; use "
                             "BitsAndBytesConfig(load_in_4bit=True) (nf4) or load_in_8bit=True, applied by Qwix.")
        load_in_4bit = load_in_4bit or bool(fields.get("load_in_4bit"))
        load_in_8bit = load_in_8bit or bool(fields.get("load_in_8bit"))
        quant_type = fields.get("bnb_4bit_quant_type", "nf4")
        if load_in_4bit and quant_type != "nf4":
            warnings.warn(f"bnb_4bit_quant_type={quant_type!r} has no Qwix equivalent; the 4-bit base weights use "
                          "nf4 (QLoRA's usual type). Pass bnb_4bit_quant_type='nf4' to silence this.", stacklevel=4)
    if load_in_4bit:
        return "nf4"
    return "int8" if load_in_8bit else None


def announce_quantization(quantization: str | None) -> str | None:
    """Warns that ``quantization`` applies only once a LoRA adapter is added (QLoRA); returns it unchanged."""
    if quantization:
        warnings.warn(f"quantization requested ({quantization}): the weights load in full precision and Qwix "
                      "quantises the adapted modules' base weights when a LoRA adapter is added (QLoRA, "
                      "torchlike.peft.get_peft_model). A model without an adapter stays in full precision.",
                      stacklevel=3)
    return quantization
