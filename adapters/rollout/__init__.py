"""Rollout engines: the boundary online trainers and ``generate`` sample through (:mod:`.engine`), the default paged,
continuously batched engine (:mod:`.paged`) and its page bookkeeping (:mod:`.pages`)."""

from .engine import RequestOutput, RolloutEngine, RolloutRequest
from .paged import EngineStats, PagedEngine, PagedEngineConfig

__all__ = ["EngineStats", "PagedEngine", "PagedEngineConfig", "RequestOutput", "RolloutEngine", "RolloutRequest"]
