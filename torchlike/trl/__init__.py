"""torchlike.trl: TRL's trainers and configs (``from trl import ...`` -> ``from torchlike.trl import ...``).

Configs import eagerly (they are light); trainers load on first use.
"""

from importlib import import_module
from typing import Any

from torchlike.trl.dpo_config import DPOConfig
from torchlike.trl.grpo_config import GRPOConfig
from torchlike.trl.sft_config import SFTConfig

_TRAINERS = {"SFTTrainer": "sft_trainer", "GRPOTrainer": "grpo_trainer", "DPOTrainer": "dpo_trainer"}

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer"]


def __getattr__(name: str) -> Any:
    if name in _TRAINERS:
        return getattr(import_module(f"torchlike.trl.{_TRAINERS[name]}"), name)
    raise AttributeError(f"module 'torchlike.trl' has no attribute {name!r}")
