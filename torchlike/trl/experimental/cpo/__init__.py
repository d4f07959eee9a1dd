"""torchlike.trl.experimental.cpo: TRL 1.16's ``trl.experimental.cpo`` (``CPOConfig``, ``CPOTrainer``)."""

from importlib import import_module
from typing import Any

from torchlike.trl.experimental.cpo.cpo_config import CPOConfig

__all__ = ["CPOConfig", "CPOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "CPOTrainer":
        return import_module("torchlike.trl.experimental.cpo.cpo_trainer").CPOTrainer
    raise AttributeError(f"module 'torchlike.trl.experimental.cpo' has no attribute {name!r}")
