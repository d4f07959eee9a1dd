"""torchlike.trl.experimental.a2po: TRL 1.16's ``trl.experimental.a2po`` (``A2POConfig``, ``A2POTrainer``), loaded on
first use."""

from torchlike.trl.registry import package_exports

__all__, __getattr__, __dir__ = package_exports(__name__)
