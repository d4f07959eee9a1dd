"""A Hugging Face model source opened in one call: a checkpoint directory, a hub id or a ``transformers`` model
object, read into an :class:`HFSource` (config, family table, tensor files, dtype hint, generation config).

Everything ``from_pretrained`` reads besides the weights is read here: ``config.json`` (checked on its raw JSON
before ``transformers`` builds the config, so a repository with custom code or an unknown architecture is refused in
words rather than by a failing config class), ``generation_config.json``, the weight files (single or sharded, with
their index) and the dtype of the first floating-point tensor in a safetensors header (what ``dtype="auto"`` loads
in when ``config.json`` names none). The family table is resolved once per source.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..families import Family, UnknownArchitectureError, family_table, supported_architectures
from . import hf_checkpoint, hf_hub
from .safetensors_io import SafetensorsReader

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class HFSource:
    """An opened Hugging Face model source: what a model is built from and where its tensors come from.

    Args:
        config: the ``transformers`` config, with the caller's overrides set on it.
        family: the family table for ``config`` (with the rows the config adds).
        location: where the weights come from, for messages: the checkpoint directory, or the class name of a
            ``transformers`` model object.
        name_or_path: the model's ``name_or_path``: the directory, or the object's ``config._name_or_path``.
        files: the weight files, in order (sharded safetensors as their index lists them); empty for a model object.
        dtype_hint: the checkpoint's own dtype (``config.dtype``, else the first floating-point tensor's in the
            first safetensors header; a model object's first tensor's), or ``None`` when unknown.
        directory: the checkpoint directory; ``None`` for a model object.
        model: the ``transformers`` model object the source was opened from, or ``None``.
    """

    config: PretrainedConfig
    family: Family
    location: str
    name_or_path: str
    files: tuple[Path, ...] = ()
    dtype_hint: Any = None
    directory: Path | None = None
    model: PreTrainedModel | None = field(default=None, repr=False)

    def tensors(self) -> Iterable[tuple[str, np.ndarray, Path | str]]:
        """The source's tensors, streamed as ``(HF name, array, file or class name)`` one at a time (a
        :class:`~.hf_checkpoint.CheckpointTensors` for files, whose read buffers are recycled)."""
        if self.model is None:
            return hf_checkpoint.iter_checkpoint_tensors(list(self.files))
        return ((name, array, self.location)
                for name, array in hf_checkpoint.iter_torch_state_dict(self.model.state_dict()))

    @functools.cached_property
    def generation_config(self) -> GenerationConfig | None:
        """``generation_config.json`` when the directory has one, else the generation settings of ``config``; a model
        object's own ``generation_config`` (a copy), or ``None`` when it has none."""
        from transformers import GenerationConfig

        if self.model is not None:
            return copy.deepcopy(getattr(self.model, "generation_config", None))
        if (self.directory / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(self.directory)
        return GenerationConfig.from_model_config(self.config)


def is_transformers_model(value: object) -> bool:
    """Whether ``value`` is a ``transformers.PreTrainedModel`` (checked by class name: torch is not imported)."""
    return any(klass.__name__ == "PreTrainedModel" for klass in type(value).__mro__)


def open_hf_source(
    location: str | os.PathLike | PreTrainedModel,
    overrides: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> HFSource:
    """Opens a checkpoint directory, hub id or ``transformers`` model object as an :class:`HFSource`.

    A directory left mid-swap by an interrupted ``save_pretrained`` is finished first
    (:func:`~.hf_checkpoint.finish_interrupted_save`); a hub id is downloaded (:func:`~.hf_hub.resolve_model_dir`).

    Args:
        location: a directory with ``config.json`` and weights, a hub repo id, or a ``transformers`` model.
        overrides: config fields to set (``from_pretrained``'s extra keywords, e.g. ``num_hidden_layers=2``).
        trust_remote_code: as ``transformers`` takes it; only changes the wording of the refusal of a repository
            whose architecture exists only as its own (PyTorch) modelling code.
        revision, cache_dir, token, local_files_only: hub download options.

    Returns:
        The :class:`HFSource`.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: ``config.json`` is not JSON, or a repository with custom modelling code for an architecture
            torchlike does not implement.
        UnknownArchitectureError: an architecture torchlike has no family for.
        TypeError: an override that is not a field of the config.
        CheckpointFileError: no weights, or an index naming a missing shard.
    """
    overrides = dict(overrides or {})
    if is_transformers_model(location):
        config = copy.deepcopy(location.config)
        for key, value in overrides.items():
            setattr(config, key, value)
        name = type(location).__name__
        family = family_table(getattr(config, "architectures", None), getattr(config, "model_type", None), name)
        first = next(iter(location.state_dict().values()))
        return HFSource(config, family.for_config(config), name, getattr(config, "_name_or_path", ""),
                        dtype_hint=first.dtype, model=location)
    hf_checkpoint.finish_interrupted_save(location)
    directory = hf_hub.resolve_model_dir(location, revision=revision, cache_dir=cache_dir, token=token,
                                         local_files_only=local_files_only)
    config, family = read_config(directory, overrides, trust_remote_code)
    files = hf_checkpoint.find_weight_files(directory)
    dtype_hint = getattr(config, "dtype", None) or first_tensor_dtype(files)
    return HFSource(config, family, str(directory), str(directory), tuple(files), dtype_hint, directory)


def read_config(model_dir: Path, overrides: Mapping[str, Any], trust_remote_code: bool = False
                ) -> tuple[PretrainedConfig, Family]:
    """The transformers config of a checkpoint directory, with ``overrides`` set on it, and its family table.

    ``trust_remote_code`` changes nothing for an architecture torchlike implements (as in transformers, where it
    matters only for a repository with custom code); a repository whose architecture exists only as its own
    (PyTorch) modelling code is refused with transformers' words about custom code, and the reason passing
    ``trust_remote_code=True`` does not help.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: a repository with custom modelling code for an architecture torchlike does not implement.
        UnknownArchitectureError: an architecture torchlike has no family for (checked on the raw JSON).
        TypeError: an override that is not a field of the config.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a checkpoint directory needs config.json (write it with "
                                "config.save_pretrained(dir) or model.save_pretrained(dir)).")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); fix or re-download it.") from None
    # Decide on the raw JSON: building another architecture's transformers config can fail first, on
    # fields its class does not accept (a Qwen-style layer_types on MambaConfig).
    try:
        family = family_table(raw.get("architectures"), raw.get("model_type"), source=str(config_path))
    except UnknownArchitectureError:
        if raw.get("auto_map"):
            raise ValueError(custom_code_message(model_dir, raw, trust_remote_code)) from None
        raise
    if raw.get("model_type") not in CONFIG_MAPPING:
        raise UnknownArchitectureError(
            f"{config_path}: model_type {raw.get('model_type')!r} (architectures {raw.get('architectures')}) is not "
            f"supported. Supported architectures: {', '.join(supported_architectures())}."
        )
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise TypeError(f"from_pretrained got an unexpected keyword argument {key!r} (not an option and not a "
                            f"field of {type(config).__name__}).")
        setattr(config, key, value)
    return config, family.for_config(config)


def custom_code_message(model_dir: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> str:
    """transformers' refusal of a repository with custom code (its words), with why torchlike cannot run that code
    even with ``trust_remote_code=True``."""
    code = ", ".join(f"{name}: {path}" for name, path in sorted(raw["auto_map"].items()) if isinstance(path, str))
    head = (f"The repository {model_dir} contains custom code which must be executed to correctly load the model. "
            f"You can inspect the repository content at {model_dir} .")
    if not trust_remote_code:
        head += " (transformers asks for `trust_remote_code=True` here.)"
    return (f"{head} torchlike cannot run it, with or without trust_remote_code=True: the custom modelling code "
            f"({code}) is PyTorch, and the architecture {raw.get('architectures')} (model_type="
            f"{raw.get('model_type')!r}) has no JAX implementation. torchlike loads these architectures: "
            f"{', '.join(supported_architectures())}.")


def first_tensor_dtype(files: list[Path]) -> np.dtype | None:
    """The dtype of the first floating-point tensor of a safetensors checkpoint (``dtype="auto"``), else ``None``."""
    if files and files[0].suffix == ".safetensors":
        with SafetensorsReader(files[0]) as reader:
            # bfloat16 (ml_dtypes) has numpy kind "V"; integer buffers never set the model dtype.
            floating = [info.dtype for info in reader.tensors.values() if info.dtype.kind in "fV"]
            return floating[0] if floating else None
    return None
