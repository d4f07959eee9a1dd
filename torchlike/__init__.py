"""torchlike: the transformers/TRL/PEFT API over JAX (Flax NNX, Tunix, Qwix, Optax, Orbax).

Heavy parts are imported on first use so ``import torchlike`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Before XLA starts its threads: CPU train steps reuse their host buffers instead of page-faulting, and XLA:CPU
# schedules for memory so gradient checkpointing saves memory.
from .adapters.runtime import host_memory as _host_memory  # noqa: E402
from .adapters.runtime import xla_cpu as _xla_cpu  # noqa: E402
from .version import __version__  # noqa: E402

_host_memory.keep_freed_host_memory()
_xla_cpu.prefer_memory_scheduler()

_EXPORTS = {
    "AutoModelForCausalLM": "torchlike.modeling",
    "AutoModelForImageTextToText": "torchlike.modeling",
    "AutoModelForSequenceClassification": "torchlike.sequence_classification",
    "SequenceClassifier": "torchlike.sequence_classification",
    "SequenceClassifierOutput": "torchlike.sequence_classification",
    "CausalLM": "torchlike.modeling",
    "CausalLMOutput": "torchlike.modeling",
    "AutoTokenizer": "torchlike.tokenization",
    "AutoProcessor": "torchlike.processing",
    "make_mesh": "torchlike.modeling",
    "save": "torchlike.serialization",
    "load": "torchlike.serialization",
    "LazyCheckpoint": "torchlike.serialization",
    "Trainer": "torchlike.training",
    "TrainOutput": "torchlike.training",
    "TrainingArguments": "torchlike.training_args",
    "register_rollout_engine": "torchlike.generation",
    "unregister_rollout_engine": "torchlike.generation",
}

if TYPE_CHECKING:
    from .generation import register_rollout_engine, unregister_rollout_engine
    from .modeling import AutoModelForCausalLM, AutoModelForImageTextToText, CausalLM, CausalLMOutput, make_mesh
    from .processing import AutoProcessor
    from .sequence_classification import (
        AutoModelForSequenceClassification,
        SequenceClassifier,
        SequenceClassifierOutput,
    )
    from .serialization import LazyCheckpoint, load, save
    from .tokenization import AutoTokenizer
    from .training import Trainer, TrainOutput
    from .training_args import TrainingArguments


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchlike' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForSequenceClassification",
    "AutoProcessor",
    "AutoTokenizer",
    "CausalLM",
    "CausalLMOutput",
    "LazyCheckpoint",
    "SequenceClassifier",
    "SequenceClassifierOutput",
    "TrainOutput",
    "Trainer",
    "TrainingArguments",
    "__version__",
    "load",
    "make_mesh",
    "register_rollout_engine",
    "save",
    "unregister_rollout_engine",
]
