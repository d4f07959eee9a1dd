"""torchlike.trl.experimental.cpo: TRL 1.16's ``trl.experimental.cpo`` (``CPOConfig``, ``CPOTrainer``),
loaded on first use."""

from typing import Any

from torchlike.trl.registry import entries_in, lazy_attribute

__all__ = sorted(name for entry in entries_in(__name__) for name in (entry.config, entry.trainer))


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
