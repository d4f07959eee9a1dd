"""The registry of model families: pick one from an HF config's ``architectures``/``model_type``."""

from __future__ import annotations

import importlib

from .base import Family, TinyConfig, UnsupportedConfigError

_FAMILY_MODULES = ("qwen2", "qwen3", "llama3", "gemma2", "gemma3", "gemma4", "qwen3_moe", "gemma3_multimodal",
                   "gemma4_multimodal", "mistral", "ministral", "phi3", "smollm3", "olmo2",
                   "gpt_neox", "granite", "cohere2", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5",
                   "lfm2", "nemotron_h", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "mistral3", "idefics3")


class UnknownArchitectureError(ValueError):
    """No family reads this checkpoint."""


def all_families() -> list[Family]:
    """Every registered family, importing each module on first use (a module's ``FAMILY``, or its ``FAMILIES`` where
    it holds several: Qwen3.5's text and published classes, dense and MoE)."""
    families = []
    for name in _FAMILY_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        families.extend(getattr(module, "FAMILIES", None) or (module.FAMILY,))
    return families


def supported_architectures() -> list[str]:
    """Every architecture name a registered family reads (``Qwen2ForCausalLM``...)."""
    return [arch for family in all_families() for arch in family.architectures]


def family_table(architectures: list[str] | None, model_type: str | None, source: str = "config.json") -> Family:
    """The family table of a checkpoint's ``architectures``/``model_type`` (from ``config.json`` or a config object),
    matched on ``architectures`` first, then ``model_type``; without the rows a config adds (:meth:`Family.for_config`).

    Args:
        architectures: the config's ``architectures`` (``None``: none named).
        model_type: the config's ``model_type``.
        source: where the names come from, for the message.

    Raises:
        UnknownArchitectureError: listing the supported architectures.
    """
    architectures = list(architectures or [])
    families = all_families()
    for family in families:
        if any(arch in family.architectures for arch in architectures):
            return family
    for family in families:
        if model_type in family.model_types:
            return family
    raise UnknownArchitectureError(
        f"{source}: architecture {architectures or None} (model_type={model_type!r}) is not supported. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )


def family_for_config(hf_config, source: str = "config.json") -> Family:
    """The family for an HF config (:func:`family_table`), with the table rows the config adds
    (:meth:`Family.for_config`).

    Raises:
        UnknownArchitectureError: listing the supported architectures.
    """
    family = family_table(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None), source)
    return family.for_config(hf_config)


def tiny_configs() -> dict[str, TinyConfig]:
    """Every family's tiny test configs by name (``Family.tiny_configs``), in registry order."""
    return {name: config for family in all_families() for name, config in family.tiny_configs.items()}


__all__ = ["Family", "TinyConfig", "UnknownArchitectureError", "UnsupportedConfigError", "all_families", "tiny_configs",
           "family_for_config", "family_table", "supported_architectures"]
