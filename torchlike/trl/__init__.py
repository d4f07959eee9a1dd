"""torchlike.trl: TRL's trainers and configs (``from trl import ...`` -> ``from torchlike.trl import ...``)."""

from torchlike.trl.sft_config import SFTConfig

__all__ = ["SFTConfig"]
