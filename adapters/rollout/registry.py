"""Rollout engines by name: the one construction path ``generate`` and every online trainer take.

An engine is registered with a builder ``builder(module, context) -> RolloutEngine``; ``rollout_engine="<name>"``
(``generate``'s argument, ``GRPOConfig``'s and ``RLOOConfig``'s field) picks it, and nothing else in a trainer names an
engine. The static, paged and vLLM-server engines are registered here; another engine (an out-of-tree one, a test's)
registers itself the same way (:func:`register_engine`) and runs GRPO without a change to any trainer.
``rollout_engine=None`` (the default everywhere) is the backend's engine (:func:`default_engine`): the one
``benchmarks/rollout.py`` and ``benchmarks/grpo_step.py`` measured fastest there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from ..distributed import mesh as mesh_lib
from ..lora import runtime as lora_runtime
from .engine import RolloutEngine, StaticEngine
from .paged import PagedEngine, PagedEngineConfig
from .vllm_server import VLLMServerConfig, VLLMServerEngine

__all__ = ["DEFAULT_ENGINES", "EngineContext", "build_engine", "default_engine", "engine_names", "register_engine",
           "unregister_engine"]


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What an engine is built with, besides the module it samples from.

    Args:
        eos_token_ids: the tokens that end a completion.
        pad_token_id: fills completions past their end.
        lora: the LoRA mode the engine runs adapted layers in (``"eval"``: the adapter on, no dropout).
        mesh: the device mesh the module lives on (``None``: one device).
        settings: the caller's engine settings without their ``rollout_`` prefix (a trainer config's
            ``rollout_max_num_seqs`` is ``settings["max_num_seqs"]``; ``generate`` passes none): each engine reads
            its own and ignores the others'.
        repetition_penalty_skips_left_padding: whether ``repetition_penalty`` counts a prompt's left padding (the
            static engine's rule; ``transformers.generate`` counted it before 5.23).
        shard_rows: spread a static batch's rows over the mesh's data axes (the trainers' batches do; ``generate``'s
            rows stay whole).
        hf_weights: returns the sampled model's current weights as ``{Hugging Face name: numpy array}``, a LoRA
            adapter merged (what ``save_pretrained`` of the merged model writes): what an engine outside this process
            loads in its ``update_weights``. ``None`` where the sampled module has no such export (a policy-reference
            mixture, a second model's worker).
        weights_version: returns the version of those weights (the trainer's optimizer steps so far; 0 in
            ``generate``), to tag the completions an engine samples with them.
        save_adapter: writes the sampled policy's LoRA adapter (PEFT's layout) to the folder it is given: what an
            engine that loads adapters at runtime (``"vllm_server"``) syncs. ``None`` where the policy has no LoRA
            adapter (full fine-tuning) or the module is not the policy.
    """

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    lora: str = lora_runtime.EVAL
    mesh: Any = None  # jax.sharding.Mesh
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    repetition_penalty_skips_left_padding: bool = True
    shard_rows: bool = False
    hf_weights: Callable[[], dict[str, Any]] | None = None
    weights_version: Callable[[], int] | None = None
    save_adapter: Callable[[str], None] | None = None


EngineBuilder = Callable[[nnx.Module, EngineContext], RolloutEngine]


def _static(module: nnx.Module, context: EngineContext) -> StaticEngine:
    sharded = context.shard_rows and context.mesh is not None
    return StaticEngine(module, eos_token_ids=context.eos_token_ids, pad_token_id=context.pad_token_id,
                        lora=context.lora,
                        batch_sharding=mesh_lib.batch_sharding(context.mesh) if sharded else None,
                        data_parallel_size=mesh_lib.data_parallel_size(context.mesh) if sharded else 1,
                        repetition_penalty_skips_left_padding=context.repetition_penalty_skips_left_padding)


def _paged(module: nnx.Module, context: EngineContext) -> PagedEngine:
    return PagedEngine(module, PagedEngineConfig.from_mapping(context.settings), eos_token_ids=context.eos_token_ids,
                       pad_token_id=context.pad_token_id, lora=context.lora, mesh=context.mesh)


def _vllm_server(module: nnx.Module, context: EngineContext) -> VLLMServerEngine:
    return VLLMServerEngine(VLLMServerConfig.from_mapping(context.settings), context.save_adapter,
                            context.weights_version, eos_token_ids=context.eos_token_ids)


_BUILDERS: dict[str, EngineBuilder] = {"static": _static, "paged": _paged, "vllm_server": _vllm_server}
BUILT_IN: tuple[str, ...] = tuple(_BUILDERS)
"""The engines torchlike ships: ``"static"`` (one left-padded batch in one program), ``"paged"`` and
``"vllm_server"`` (a vLLM server's OpenAI API, the policy's LoRA adapter loaded into it)."""


DEFAULT_ENGINES: dict[str, str] = {"cpu": "paged", "gpu": "static", "tpu": "static"}
"""The engine ``rollout_engine=None`` builds on each JAX backend: the one measured fastest there.

- ``cpu``: ``"paged"``. On 2 cores it made 1.44x the static engine's useful tokens/s on ``benchmarks/rollout.py``'s
  ``cpu`` preset, 1.96x on ``cpu-refill``, 2.12x at the issue's full workload (``--preset gpu``), and on the ``deep``
  preset and a GRPO step (``benchmarks/grpo_step.py``) too; MIGRATION.md's rollout section lists the figures.
- ``gpu``: ``"static"``. The one measurement on a device (an H200, before the paged engine read its pages in place
  through JAX's kernel) made the static engine 1.5-3x faster; it changes when ``python -m benchmarks --preset gpu``
  says otherwise.
- ``tpu``: ``"static"``, not measured yet (``python -m benchmarks --preset tpu``).

Another backend gets ``"static"``."""


def default_engine(backend: str | None = None) -> str:
    """The engine ``rollout_engine=None`` picks.

    Args:
        backend: a JAX backend name (``"cpu"``, ``"gpu"``, ``"tpu"``); ``None``: ``jax.default_backend()``.

    Returns:
        The engine's registered name (:data:`DEFAULT_ENGINES`).
    """
    return DEFAULT_ENGINES.get(jax.default_backend() if backend is None else backend, "static")


def register_engine(name: str, builder: EngineBuilder, *, replace: bool = False) -> None:
    """Makes ``rollout_engine=name`` build engines with ``builder(module, context)``.

    Args:
        name: the value of ``rollout_engine`` that picks it.
        builder: returns an object with the :class:`~.engine.RolloutEngine` methods (``generate``,
            ``update_weights``, ``close``) for the module to sample from and an :class:`EngineContext`.
        replace: allow replacing an engine of that name (never a built-in one).

    Raises:
        ValueError: ``name`` is taken (pass ``replace=True`` to replace a registered engine) or is a built-in's.
        TypeError: ``builder`` is not callable or ``name`` not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"An engine's name must be a non-empty string, got {name!r}.")
    if not callable(builder):
        raise TypeError(f"The builder of engine {name!r} must be callable as builder(module, context); got "
                        f"{type(builder).__name__}.")
    if name in BUILT_IN:
        raise ValueError(f"rollout_engine={name!r} is torchlike's built-in engine; register yours under another name.")
    if name in _BUILDERS and not replace:
        raise ValueError(f"A rollout engine named {name!r} is registered already; pass replace=True to replace it, "
                         "or choose another name.")
    _BUILDERS[name] = builder


def unregister_engine(name: str) -> None:
    """Removes the engine :func:`register_engine` registered as ``name`` (built-in engines stay).

    Raises:
        KeyError: no engine of that name was registered.
    """
    if name in BUILT_IN or name not in _BUILDERS:
        registered = sorted(set(_BUILDERS) - set(BUILT_IN))
        raise KeyError(f"No registered rollout engine is named {name!r}; registered: {registered}.")
    del _BUILDERS[name]


def engine_names() -> tuple[str, ...]:
    """The values ``rollout_engine`` takes now: the built-in engines, then the registered ones."""
    return tuple(_BUILDERS)


def build_engine(name: str | None, module: nnx.Module, context: EngineContext) -> RolloutEngine:
    """The engine ``rollout_engine=name`` picks, built for ``module`` (``None``: :func:`default_engine`).

    Raises:
        ValueError: no engine is registered as ``name`` (the message lists those that are).
    """
    if name is None:
        name = default_engine()
    if name not in _BUILDERS:
        raise ValueError(f"rollout_engine={name!r} is not a rollout engine; choose one of {list(_BUILDERS)} or "
                         "register yours with torchlike.register_rollout_engine(name, builder).")
    return _BUILDERS[name](module, context)
