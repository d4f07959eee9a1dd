"""Prompt-learning configs with PEFT's names, fields and defaults: ``PromptTuningConfig``, ``PromptEncoderConfig``
(P-tuning) and ``PrefixTuningConfig``, and their ``adapter_config.json`` form."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..adapters.model.prompt_learning import P_TUNING, PREFIX_TUNING, PROMPT_TUNING
from .config import ADAPTER_CONFIG_NAME, TaskType

__all__ = ["PrefixTuningConfig", "PromptEncoderConfig", "PromptEncoderReparameterizationType", "PromptLearningConfig",
           "PromptTuningConfig", "PromptTuningInit", "prompt_config_from_dict"]


class PromptTuningInit(enum.StrEnum):
    """peft's ``PromptTuningInit``: how ``PromptTuningConfig`` initialises the virtual tokens."""

    TEXT = "TEXT"
    SAMPLE_VOCAB = "SAMPLE_VOCAB"
    RANDOM = "RANDOM"


class PromptEncoderReparameterizationType(enum.StrEnum):
    """peft's P-tuning encoder types."""

    MLP = "MLP"
    LSTM = "LSTM"


@dataclass
class PromptLearningConfig:
    """The fields every prompt-learning config shares (``peft.PromptLearningConfig``).

    Args:
        num_virtual_tokens: the number of virtual tokens (required).
        token_dim: the model's hidden size; ``get_peft_model`` fills it (prefix tuning: ``num_key_value_heads *
            head_dim``, as ``peft`` does for grouped-query attention).
        num_transformer_submodules: 1 for a decoder; ``get_peft_model`` fills it.
        num_attention_heads: ``get_peft_model`` fills it (prefix tuning: ``num_key_value_heads``).
        num_layers: ``get_peft_model`` fills it with ``num_hidden_layers``.
        modules_to_save: only ``None``.
        task_type: ``"CAUSAL_LM"`` (or ``None``).
        inference_mode: recorded in ``adapter_config.json``; a loaded adapter is frozen, as in ``peft``.
        base_model_name_or_path, revision: recorded in ``adapter_config.json``.

    Raises:
        ValueError: for options torchlike does not implement (another ``task_type``, ``modules_to_save``, an
            encoder-decoder's ``num_transformer_submodules=2``), saying why.
    """

    task_type: str | None = None
    peft_type: str | None = None
    auto_mapping: dict | None = None
    base_model_name_or_path: str | None = None
    revision: str | None = None
    inference_mode: bool = False
    num_virtual_tokens: int | None = None
    token_dim: int | None = None
    num_transformer_submodules: int | None = None
    num_attention_heads: int | None = None
    num_layers: int | None = None
    modules_to_save: list[str] | None = None

    _peft_type = ""

    def __post_init__(self) -> None:
        self.peft_type = self._peft_type
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens <= 0:
            raise ValueError(f"{type(self).__name__}.num_virtual_tokens must be a positive int, got "
                             f"{self.num_virtual_tokens!r}.")
        self._refuse({
            "task_type": (self.task_type not in (None, TaskType.CAUSAL_LM),
                          "prompt learning is implemented for causal language models only (CAUSAL_LM)."),
            "modules_to_save": (bool(self.modules_to_save), "only the prompt parameters are trained beside a "
                                "prompt-learning adapter; fine-tune the modules separately."),
            "num_transformer_submodules": (self.num_transformer_submodules not in (None, 1),
                                           "the supported models are decoders (one transformer submodule)."),
        })

    def _refuse(self, refusals: dict[str, tuple[bool, str]]) -> None:
        for name, (refused, why) in refusals.items():
            if refused:
                raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} is not supported: {why}")

    @property
    def is_prompt_learning(self) -> bool:
        """``True``, as on every ``peft`` prompt-learning config."""
        return True

    def to_dict(self) -> dict[str, Any]:
        """The ``adapter_config.json`` contents, with PEFT's keys (enums as their strings)."""
        data = {key: value.value if isinstance(value, enum.Enum) else value for key, value in asdict(self).items()}
        data["task_type"] = data["task_type"] or TaskType.CAUSAL_LM
        return data

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Writes ``adapter_config.json`` into ``save_directory``."""
        Path(save_directory, ADAPTER_CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))


@dataclass
class PromptTuningConfig(PromptLearningConfig):
    """``peft.PromptTuningConfig``: ``num_virtual_tokens`` trained embeddings prepended to the input embeddings.

    Args:
        prompt_tuning_init: ``"RANDOM"`` (``N(0, 1)``, as torch's ``nn.Embedding``), ``"TEXT"`` (the embeddings of
            ``prompt_tuning_init_text``, repeated or cut to ``num_virtual_tokens``) or ``"SAMPLE_VOCAB"`` (the
            embeddings of random vocabulary tokens).
        prompt_tuning_init_text: the text for ``"TEXT"``.
        tokenizer_name_or_path: the tokenizer for ``"TEXT"`` (loaded with ``transformers.AutoTokenizer``).
        tokenizer_kwargs: passed to ``AutoTokenizer.from_pretrained`` for ``"TEXT"`` (``trust_remote_code``
            dropped, as in ``peft``).
        See :class:`PromptLearningConfig` for the shared fields.

    Raises:
        ValueError: ``"TEXT"`` without a tokenizer or text, or ``tokenizer_kwargs`` without ``"TEXT"`` (peft's checks).
    """

    prompt_tuning_init: PromptTuningInit | str = PromptTuningInit.RANDOM
    prompt_tuning_init_text: str | None = None
    tokenizer_name_or_path: str | None = None
    tokenizer_kwargs: dict | None = None

    _peft_type = PROMPT_TUNING

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prompt_tuning_init = PromptTuningInit(self.prompt_tuning_init)
        text = self.prompt_tuning_init == PromptTuningInit.TEXT
        if text and not self.tokenizer_name_or_path:
            raise ValueError(f"When prompt_tuning_init='TEXT', tokenizer_name_or_path can't be "
                             f"{self.tokenizer_name_or_path}.")
        if text and self.prompt_tuning_init_text is None:
            raise ValueError("When prompt_tuning_init='TEXT', prompt_tuning_init_text can't be None.")
        if self.tokenizer_kwargs and not text:
            raise ValueError("tokenizer_kwargs only valid when using prompt_tuning_init='TEXT'.")


@dataclass
class PromptEncoderConfig(PromptLearningConfig):
    """``peft.PromptEncoderConfig`` (P-tuning): the virtual-token embeddings are the output of an MLP over a trained
    table.

    Args:
        encoder_reparameterization_type: ``"MLP"`` (peft's default: Linear, ReLU, Linear, ReLU, Linear). ``"LSTM"``
            is refused for a new adapter (a loaded one holds only the encoder's output, so it loads).
        encoder_hidden_size: the MLP's hidden size; ``get_peft_model`` fills it with ``token_dim``.
        encoder_num_layers: ignored for ``"MLP"`` with a warning, as in ``peft`` (always three layers).
        encoder_dropout: used by peft's LSTM only.
        See :class:`PromptLearningConfig` for the shared fields.
    """

    encoder_reparameterization_type: PromptEncoderReparameterizationType | str = PromptEncoderReparameterizationType.MLP
    encoder_hidden_size: int | None = None
    encoder_num_layers: int = 2
    encoder_dropout: float = 0.0

    _peft_type = P_TUNING

    def __post_init__(self) -> None:
        super().__post_init__()
        self.encoder_reparameterization_type = PromptEncoderReparameterizationType(self.encoder_reparameterization_type)
        lstm = self.encoder_reparameterization_type == PromptEncoderReparameterizationType.LSTM
        self._refuse({"encoder_reparameterization_type": (
            lstm and not self.inference_mode,
            "peft's bidirectional LSTM encoder is not implemented; use 'MLP' (peft's default). A saved LSTM adapter "
            "loads (it holds the encoder's output only).")})


@dataclass
class PrefixTuningConfig(PromptLearningConfig):
    """``peft.PrefixTuningConfig``: every layer attends to ``num_virtual_tokens`` trained keys and values.

    Args:
        init_weights: ``None`` (``N(0, 1)``, as torch's ``nn.Embedding``) or ``"zero"``.
        encoder_hidden_size: the hidden size of the ``prefix_projection`` MLP; ``get_peft_model`` fills it with
            ``token_dim``.
        prefix_projection: train a table of ``token_dim`` embeddings projected to the keys and values by an MLP
            (Linear, tanh, Linear) instead of the keys and values themselves.
        See :class:`PromptLearningConfig` for the shared fields.
    """

    init_weights: str | None = None
    encoder_hidden_size: int | None = None
    prefix_projection: bool = False

    _peft_type = PREFIX_TUNING

    def __post_init__(self) -> None:
        super().__post_init__()
        self._refuse({"init_weights": (self.init_weights not in (None, "zero"), "use None (random) or 'zero'.")})


CONFIG_CLASSES: dict[str, type[PromptLearningConfig]] = {
    PROMPT_TUNING: PromptTuningConfig, P_TUNING: PromptEncoderConfig, PREFIX_TUNING: PrefixTuningConfig}


def prompt_config_from_dict(data: dict[str, Any], source: str) -> PromptLearningConfig:
    """The config of a saved prompt-learning ``adapter_config.json`` (PEFT's or torchlike's), with
    ``inference_mode=True``: a loaded prompt-learning adapter is frozen, as in ``peft`` (so a saved P-tuning LSTM
    adapter, which holds the encoder output only, loads). ``peft_version`` is ignored, other unknown keys are refused.

    Args:
        data: the file's contents (``peft_type`` one of ``PROMPT_TUNING``, ``P_TUNING``, ``PREFIX_TUNING``).
        source: the file, for messages.
    """
    config_class = CONFIG_CLASSES[data["peft_type"]]
    known = {f.name for f in fields(config_class)}
    unknown = sorted(key for key, value in data.items() if key not in known and key != "peft_version"
                     and value not in (None, False, {}, []))
    if unknown:
        raise ValueError(f"{source}: options {unknown} are not supported by torchlike's {config_class.__name__}.")
    return config_class(**{key: value for key, value in data.items() if key in known} | {"inference_mode": True})
