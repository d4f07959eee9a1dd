"""``LoraConfig`` with PEFT's field names and defaults, and its ``adapter_config.json`` form."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
QUANTIZATION_TYPES = ("nf4", "int4", "int8", "fp8")


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The contents of ``adapter_config.json`` in ``directory``, ``{}`` when there is none (the LoRA reader then says
    what is missing)."""
    path = Path(directory) / ADAPTER_CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


class TaskType:
    """PEFT's task names served here: causal language modelling and sequence classification."""

    CAUSAL_LM = "CAUSAL_LM"
    SEQ_CLS = "SEQ_CLS"


CLASSIFIER_MODULE_NAMES = ("classifier", "score")
"""The heads PEFT adds to ``modules_to_save`` for ``SEQ_CLS`` (torchlike's classifiers name theirs ``score``)."""


@dataclass
class LoraConfig:
    """LoRA settings, spelled as in ``peft.LoraConfig``.

    Args:
        r: LoRA rank.
        lora_alpha: scaling numerator: the update is ``(lora_alpha / r) * B @ A``.
        lora_dropout: dropout on the adapter input, applied only in training steps.
        target_modules: HF module names (``["q_proj", "v_proj"]``), a regex matched against the
            full module name (``r".*\\.(q|v)_proj"``), or ``"all-linear"``.
        bias: only ``"none"``.
        task_type: ``"CAUSAL_LM"`` (or ``None``), or ``"SEQ_CLS"`` for a
            :class:`~torchlike.SequenceClassifier`: ``get_peft_model`` then adds ``"classifier"`` and ``"score"``
            to ``modules_to_save``, as ``peft`` does.
        modules_to_save: modules trained in full beside the adapter and saved in it; only the classifier head
            (``"score"``; ``"classifier"`` is accepted and matches nothing, as in ``peft``).
        use_rslora: scale by ``lora_alpha / sqrt(r)`` (rank-stabilised LoRA).
        init_lora_weights: ``True``: ``B = 0`` so the adapted model starts equal to the base.
        inference_mode: recorded in ``adapter_config.json``, as PEFT does.
        base_model_name_or_path: recorded in ``adapter_config.json``.
        quantize_base: torchlike extension for QLoRA: quantise the adapted modules' base weights
            with Qwix (``"nf4"``, ``"int8"``...). ``from_pretrained(quantization_config=...)``
            sets it too.
        quantization_tile_size: Qwix sub-channel tile size for ``quantize_base`` (must divide the
            contraction dimension of every adapted weight).

    Raises:
        ValueError: for PEFT options this backend does not implement (``use_dora``, ``modules_to_save``
            other than the classifier head, biases, per-layer patterns...), saying what to use instead.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    bias: str = "none"
    task_type: str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool = False
    init_lora_weights: bool | str = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    exclude_modules: list[str] | str | None = None
    inference_mode: bool = False
    base_model_name_or_path: str | None = None
    revision: str | None = None
    peft_type: str = "LORA"
    quantize_base: str | None = None
    quantization_tile_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive int, got {self.r!r}.")
        if not 0.0 <= float(self.lora_dropout) < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}.")
        refusals = {
            "use_dora": (self.use_dora, "DoRA is not implemented on Qwix; use plain LoRA (use_dora=False)."),
            "modules_to_save": (bool(set(self.modules_to_save or ()) - set(CLASSIFIER_MODULE_NAMES)),
                                "only a sequence classifier's head ('score') can be trained in full next to LoRA; "
                                "drop the other modules or fine-tune the full model."),
            "bias": (self.bias != "none", "only bias='none' is supported (Qwix LoRA adapts weights only)."),
            "fan_in_fan_out": (self.fan_in_fan_out, "fan_in_fan_out is for GPT-2 Conv1D layers, which the "
                               "supported families do not have."),
            "init_lora_weights": (self.init_lora_weights not in (True, "gaussian"),
                                  "only init_lora_weights=True (B=0, the adapted model starts as the base) is "
                                  "supported."),
            "layers_to_transform": (self.layers_to_transform is not None or self.layers_pattern is not None,
                                    "select layers with a target_modules regex instead, e.g. "
                                    r"r'model\.layers\.(0|1)\.self_attn\.q_proj'."),
            "exclude_modules": (self.exclude_modules is not None,
                                "express exclusions in a target_modules regex instead."),
            "task_type": (self.task_type not in (None, TaskType.CAUSAL_LM, TaskType.SEQ_CLS),
                          "only CAUSAL_LM and SEQ_CLS models are served by torchlike."),
            "peft_type": (self.peft_type != "LORA", "only LoRA adapters are supported."),
            "quantize_base": (self.quantize_base not in (None, *QUANTIZATION_TYPES),
                              f"use one of {QUANTIZATION_TYPES}."),
        }
        for name, (refused, why) in refusals.items():
            if refused:
                raise ValueError(f"LoraConfig.{name}={getattr(self, name)!r} is not supported: {why}")

    def check_patterns(self, adapted_modules: list[str]) -> None:
        """Refuses a ``rank_pattern``/``alpha_pattern`` entry that reaches one of ``adapted_modules`` (HF module names):
        one ``r`` and ``lora_alpha`` apply to every target. An entry that reaches none is ignored with PEFT's
        warning (``peft`` writes such entries for some mixture-of-experts model types).

        Raises:
            ValueError: naming the field, the entry and a module it reaches.
        """
        for name in ("rank_pattern", "alpha_pattern"):
            for pattern in getattr(self, name) or {}:
                reached = [module for module in adapted_modules if re.match(rf"(.*\.)?({pattern})$", module)]
                if reached:
                    raise ValueError(f"LoraConfig.{name}={getattr(self, name)!r} is not supported: per-module ranks/"
                                     f"alphas are not supported ({pattern!r} reaches {reached[0]}); one r and "
                                     "lora_alpha apply to all targets.")
                warnings.warn(f"LoraConfig.{name}: {pattern!r} matches no targeted module and is ignored (as peft "
                              "ignores it).", stacklevel=3)

    @property
    def scale(self) -> float:
        """The multiplier of ``B @ A``: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        """The ``adapter_config.json`` contents (PEFT's keys; torchlike extensions only when set)."""
        data = asdict(self)
        for extension in ("quantize_base", "quantization_tile_size"):
            if data[extension] is None:
                del data[extension]
        data["task_type"] = data["task_type"] or TaskType.CAUSAL_LM
        return data

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        Path(save_directory, ADAPTER_CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> LoraConfig:
        """Reads ``adapter_config.json`` written by PEFT or torchlike; PEFT fields left at their
        defaults are accepted, the rest must be ones torchlike implements."""
        path = Path(directory) / ADAPTER_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: an adapter directory needs adapter_config.json "
                                    "(written by PeftModel.save_pretrained).")
        data = json.loads(path.read_text())
        # Initialisation only matters for a new adapter; a loaded one takes the saved factors.
        data["init_lora_weights"] = True
        known = {f.name for f in fields(cls)}
        peft_defaults_we_ignore = {"auto_mapping", "megatron_config", "megatron_core", "loftq_config",
                                   "use_qalora", "qalora_group_size", "layer_replication", "runtime_config",
                                   "lora_bias", "target_parameters", "trainable_token_indices", "eva_config",
                                   "corda_config", "alora_invocation_tokens", "arrow_config", "ensure_weight_tying",
                                   "peft_version", "lora_ga_config", "use_bdlora"}
        unknown = {k: v for k, v in data.items() if k not in known and k not in peft_defaults_we_ignore
                   and v not in (None, False, {}, [])}
        if unknown:
            raise ValueError(f"{path}: options {sorted(unknown)} are not supported by torchlike's LoRA.")
        return cls(**{k: v for k, v in data.items() if k in known})
