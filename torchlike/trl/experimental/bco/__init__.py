"""torchlike.trl.experimental.bco: TRL 1.0.0's ``trl.experimental.bco`` (``BCOConfig``, ``BCOTrainer``), which TRL
1.16 no longer ships, loaded on first use."""

from torchlike.trl.registry import package_exports

__all__, __getattr__, __dir__ = package_exports(__name__)
