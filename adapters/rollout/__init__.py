"""Rollout engines: the boundary online trainers and ``generate`` sample through, with the static engine that is
their default (:mod:`.engine`), the paged, continuously batched engine that ``rollout_engine="paged"`` picks
(:mod:`.paged`) and its page bookkeeping (:mod:`.pages`)."""

from .engine import (
    RequestOutput,
    RolloutEngine,
    RolloutRequest,
    StaticEngine,
    request_seed,
    requests_from_rows,
    rows_from_outputs,
    weights_snapshot,
)
from .paged import EngineStats, PagedEngine, PagedEngineConfig

__all__ = ["EngineStats", "PagedEngine", "PagedEngineConfig", "RequestOutput", "RolloutEngine", "RolloutRequest",
           "StaticEngine", "request_seed", "requests_from_rows", "rows_from_outputs", "weights_snapshot"]
