"""torchlike.trl.experimental.async_grpo: TRL 1.16's ``trl.experimental.async_grpo`` (``AsyncGRPOConfig``,
``AsyncGRPOTrainer``), loaded on first use."""

from torchlike.trl.registry import package_exports

__all__, __getattr__, __dir__ = package_exports(__name__)
