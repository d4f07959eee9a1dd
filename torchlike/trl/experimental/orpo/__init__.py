"""torchlike.trl.experimental.orpo: TRL 1.16's ``trl.experimental.orpo`` (``ORPOConfig``, ``ORPOTrainer``)."""

from importlib import import_module
from typing import Any

from torchlike.trl.experimental.orpo.orpo_config import ORPOConfig

__all__ = ["ORPOConfig", "ORPOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "ORPOTrainer":
        return import_module("torchlike.trl.experimental.orpo.orpo_trainer").ORPOTrainer
    raise AttributeError(f"module 'torchlike.trl.experimental.orpo' has no attribute {name!r}")
