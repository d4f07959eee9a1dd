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
    versions_from_outputs,
    weights_snapshot,
)
from .images import row_of
from .paged import EngineStats, PagedEngine, PagedEngineConfig, RolloutStream, StreamTicket
from .registry import BUILT_IN, EngineContext, build_engine, engine_names, register_engine, unregister_engine

__all__ = ["BUILT_IN", "EngineContext", "EngineStats", "PagedEngine", "PagedEngineConfig", "RequestOutput",
           "RolloutEngine", "RolloutRequest", "RolloutStream", "StaticEngine", "StreamTicket", "build_engine",
           "completion_mask", "derived_seed", "engine_names", "register_engine", "request_seed", "requests_from_rows",
           "row_of", "rows_from_outputs", "unregister_engine", "versions_from_outputs", "weights_snapshot"]
