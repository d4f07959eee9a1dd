"""torchlike.trl: TRL's trainers and configs (``from trl import ...`` -> ``from torchlike.trl import ...``)."""

from torchlike.trl.dpo_config import DPOConfig
from torchlike.trl.grpo_config import GRPOConfig
from torchlike.trl.sft_config import SFTConfig

__all__ = ["DPOConfig", "GRPOConfig", "SFTConfig"]
