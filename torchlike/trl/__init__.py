"""torchlike.trl: TRL's trainers, configs and script helpers (``from trl import X`` -> ``from torchlike.trl import X``).

Configs import eagerly (they are light); trainers and the script helpers (which import transformers) load on first
use. Reward functions live in ``torchlike.trl.rewards``, as in ``trl.rewards``.
"""

from importlib import import_module
from typing import Any

from torchlike.trl.distillation_config import DistillationConfig
from torchlike.trl.dpo_config import DPOConfig
from torchlike.trl.grpo_config import GRPOConfig
from torchlike.trl.kto_config import KTOConfig
from torchlike.trl.reward_config import RewardConfig
from torchlike.trl.rloo_config import RLOOConfig
from torchlike.trl.sft_config import SFTConfig

_SCRIPT_UTILS = ("DatasetConfig", "DatasetMixtureConfig", "ModelConfig", "ScriptArguments", "TrlParser", "get_dataset",
                 "get_kbit_device_map", "get_peft_config", "get_quantization_config", "init_zero_verbose")
_LAZY = {"SFTTrainer": "sft_trainer", "GRPOTrainer": "grpo_trainer", "DPOTrainer": "dpo_trainer",
         "RLOOTrainer": "rloo_trainer", "DistillationTrainer": "distillation_trainer",
         "KTOTrainer": "kto_trainer", "RewardTrainer": "reward_trainer", **dict.fromkeys(_SCRIPT_UTILS, "script_utils")}

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "DatasetConfig",
    "DatasetMixtureConfig",
    "DistillationConfig",
    "DistillationTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "ModelConfig",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
    "init_zero_verbose",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"torchlike.trl.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'torchlike.trl' has no attribute {name!r}")
