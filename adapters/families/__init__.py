"""The registry of model families: pick one from an HF config's ``architectures``/``model_type``."""

from __future__ import annotations

import importlib

from .base import Family, UnsupportedConfigError

_FAMILY_MODULES = ("qwen2", "qwen3", "llama3", "gemma2", "gemma3", "gemma4", "qwen3_moe")


class UnknownArchitectureError(ValueError):
    """No family reads this checkpoint."""


def all_families() -> list[Family]:
    """Every registered family, importing each module on first use."""
    return [importlib.import_module(f"{__name__}.{name}").FAMILY for name in _FAMILY_MODULES]


def supported_architectures() -> list[str]:
    return [arch for family in all_families() for arch in family.architectures]


def family_for_config(hf_config, source: str = "config.json") -> Family:
    """The family for an HF config, matched on ``architectures`` first, then ``model_type``, with the table rows the
    config adds (:meth:`Family.for_config`).

    Raises:
        UnknownArchitectureError: listing the supported architectures.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    families = all_families()
    for family in families:
        if any(arch in family.architectures for arch in architectures):
            return family.for_config(hf_config)
    for family in families:
        if model_type in family.model_types:
            return family.for_config(hf_config)
    raise UnknownArchitectureError(
        f"{source}: architecture {architectures or None} (model_type={model_type!r}) is not supported. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )


__all__ = ["Family", "UnknownArchitectureError", "UnsupportedConfigError", "all_families",
           "family_for_config", "supported_architectures"]
