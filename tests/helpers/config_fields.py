"""Comparing a torchlike config with the transformers/TRL dataclass it mirrors: raw field defaults, values after
``__post_init__``, and the fields each side has."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import transformers

from torchlike.field_support import check_unsupported
from torchlike.training_args_fields import TRAINING_ARGUMENTS_FIELD_SUPPORT
from torchlike.trl.trainer.sft_fields import SFT_FIELD_SUPPORT as SFT_ROWS

#: The TrainingArguments rows SFTConfig lays its own over.
SFT_FIELD_SUPPORT = {name: row for name, row in SFT_ROWS.items() if name in TRAINING_ARGUMENTS_FIELD_SUPPORT}
#: Every field of TrainingArguments and of trl.SFTConfig, each with its base row.
FIELD_SUPPORT = {**TRAINING_ARGUMENTS_FIELD_SUPPORT,
                 **{name: row for name, row in SFT_ROWS.items() if name not in SFT_FIELD_SUPPORT}}

#: torchlike's own fields.
OWN_FIELDS = {"mesh_shape", "mesh_axis_names", "compilation_cache_dir", "prefetch_batches", "lora_step",
              "on_save_error", "jit_checkpoint_grace_period"}
#: transformers.TrainingArguments fields that some supported version has and another lacks: 5.15 removed the first
#: two and added the next two, 5.23 added the last two (``gradient_checkpointing*`` became their aliases).
OTHER_VERSIONS_FIELDS = {"warmup_ratio", "logging_dir", "dataloader_in_order", "dataloader_multiprocessing_context",
                         "activation_checkpointing", "activation_checkpointing_kwargs"}
#: The fields torchlike's configs have beyond the installed transformers.TrainingArguments: its own, and those only
#: other supported transformers versions have.
TORCHLIKE_FIELDS = OWN_FIELDS | (OTHER_VERSIONS_FIELDS
                                 - {f.name for f in dataclasses.fields(transformers.TrainingArguments)})
#: GRPO's max_prompt_length (removed from TRL in 0.28, still accepted by torchlike with a FutureWarning) and the
#: rollout engine's settings (torchlike only; TRL's vllm_* fields configure vLLM): GRPOConfig's and RLOOConfig's
#: fields beyond TRL's.
TORCHLIKE_GRPO_FIELDS = TORCHLIKE_FIELDS | {"max_prompt_length", "rollout_engine", "rollout_max_num_seqs",
                                            "rollout_page_size", "rollout_kv_cache_tokens",
                                            "rollout_max_num_batched_tokens", "rollout_vllm_adapter_dir",
                                            "rollout_attention", "rollout_gpu_memory_utilization",
                                            "rollout_async_scheduling", "max_staleness"}
#: AsyncGRPOConfig's fields beyond TRL's: torchlike's and the rollout engine's settings (TRL's AsyncGRPO samples
#: through a vLLM server).
TORCHLIKE_ASYNC_GRPO_FIELDS = TORCHLIKE_FIELDS | {"rollout_engine", "rollout_max_num_seqs", "rollout_page_size",
                                                  "rollout_kv_cache_tokens", "rollout_max_num_batched_tokens",
                                                  "rollout_attention", "rollout_gpu_memory_utilization",
                                                  "rollout_async_scheduling"}
#: Raw defaults torchlike takes from transformers 5.23, with the older versions' value (both resolve to it).
NEWER_RAW_DEFAULTS = {"gradient_checkpointing": False}

#: Values transformers derives in __post_init__ that torchlike deliberately leaves alone.
POST_INIT_DIFFERENCES = {
    # transformers turns None into an accelerate.AcceleratorConfig(); torchlike has no Accelerate and keeps None.
    "accelerator_config",
    # transformers sets dataloader_pin_memory=False when use_cpu=True (the TRL side needs use_cpu=True to accept its
    # bf16 default on this CPU-only machine); torchlike has no torch DataLoader, so the field keeps its value.
    "dataloader_pin_memory",
}


def raw_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default as written in the class (``default_factory`` called), ``MISSING`` without one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def plain(value: Any) -> Any:
    """transformers stores enum members (str subclasses); compare their string values."""
    inner = getattr(value, "value", None)
    return inner if isinstance(inner, str) else value


def quiet(factory: Callable[..., Any], **kwargs: Any) -> Any:
    """``factory(**kwargs)`` with its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(**kwargs)


def unsupported_field_warnings(config_class: type, **kwargs: Any) -> list[str]:
    """The UserWarnings ``check_unsupported`` emits for ``config_class(output_dir="out", **kwargs)``."""
    config = quiet(config_class, output_dir="out", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_unsupported(config)
    return [str(w.message) for w in caught if w.category is UserWarning]
