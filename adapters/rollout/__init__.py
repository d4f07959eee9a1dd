"""Rollout engines: the boundary online trainers and ``generate`` sample through: the static engine (:mod:`.engine`),
the paged, continuously batched engine (:mod:`.paged`) and its page bookkeeping (:mod:`.pages`), the vLLM server's
(:mod:`.vllm_server`), and the registry that builds them by name, each backend's default included (:mod:`.registry`:
the paged engine on the CPU)."""

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
from .registry import (
    BUILT_IN,
    DEFAULT_ENGINES,
    EngineContext,
    build_engine,
    default_engine,
    engine_names,
    register_engine,
    unregister_engine,
)

__all__ = ["BUILT_IN", "DEFAULT_ENGINES", "EngineContext", "EngineStats", "PagedEngine", "PagedEngineConfig",
           "RequestOutput", "RolloutEngine", "RolloutRequest", "RolloutStream", "StaticEngine", "StreamTicket",
           "build_engine", "completion_mask", "default_engine", "derived_seed", "engine_names", "register_engine",
           "request_seed", "requests_from_rows", "row_of", "rows_from_outputs", "unregister_engine",
           "versions_from_outputs", "weights_snapshot"]
