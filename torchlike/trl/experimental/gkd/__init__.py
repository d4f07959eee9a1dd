"""torchlike.trl.experimental.gkd: TRL 1.16's ``trl.experimental.gkd`` (``GKDConfig``, ``GKDTrainer``)."""

from importlib import import_module
from typing import Any

from torchlike.trl.experimental.gkd.gkd_config import GKDConfig

__all__ = ["GKDConfig", "GKDTrainer"]


def __getattr__(name: str) -> Any:
    if name == "GKDTrainer":
        return import_module("torchlike.trl.experimental.gkd.gkd_trainer").GKDTrainer
    raise AttributeError(f"module 'torchlike.trl.experimental.gkd' has no attribute {name!r}")
