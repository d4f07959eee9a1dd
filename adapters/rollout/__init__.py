"""Rollout engines: the boundary online trainers and ``generate`` sample through, with the static engine that is
their default (:mod:`.engine`), the paged, continuously batched engine that ``rollout_engine="paged"`` picks
(:mod:`.paged`) and its page bookkeeping (:mod:`.pages`)."""

from .engine import (
    RequestOutput,
    RolloutEngine,
    RolloutRequest,
    StaticEngine,
    completion_mask,
    derived_seed,
    request_seed,
    requests_from_rows,
    rows_from_outputs,
    weights_snapshot,
)
from .paged import EngineStats, PagedEngine, PagedEngineConfig

ENGINES: dict[str, type[RolloutEngine]] = {"static": StaticEngine, "paged": PagedEngine}
"""The rollout engines by the name ``rollout_engine`` takes (the one list ``generate`` and the configs accept)."""

__all__ = ["ENGINES", "EngineStats", "PagedEngine", "PagedEngineConfig", "RequestOutput", "RolloutEngine",
           "RolloutRequest", "StaticEngine", "completion_mask", "derived_seed", "request_seed", "requests_from_rows",
           "rows_from_outputs", "weights_snapshot"]
