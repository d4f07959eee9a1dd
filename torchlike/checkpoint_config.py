"""What ``from_pretrained`` reads from a Hugging Face checkpoint directory besides the weights: ``config.json``,
``generation_config.json``, the stored dtype, and the loading options that do not apply to a JAX model."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

_ACCEPTED_ATTENTION = (None, "eager", "sdpa")


def check_loading_options(attn_implementation, device_map) -> None:
    """Warns about loading options that have no effect on a JAX model."""
    if attn_implementation not in _ACCEPTED_ATTENTION:
        warnings.warn(f"attn_implementation={attn_implementation!r} has no effect: torchlike uses the Tunix JAX "
                      "attention (XLA-compiled).", stacklevel=3)
    if device_map not in (None, "auto", "cpu"):
        warnings.warn(f"device_map={device_map!r} has no effect: place the model with mesh=make_mesh(...).",
                      stacklevel=3)


def read_config(model_dir: Path, overrides: dict, trust_remote_code: bool = False):
    """The transformers config of a checkpoint directory, with ``overrides`` set on it.

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

    from .adapters.families import UnknownArchitectureError, family_for_config, supported_architectures

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
        family_for_config(SimpleNamespace(architectures=raw.get("architectures"), model_type=raw.get("model_type")),
                          source=str(config_path))
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
    return config


def custom_code_message(model_dir: Path, raw: dict, trust_remote_code: bool) -> str:
    """transformers' refusal of a repository with custom code (its words), with why torchlike cannot run that code
    even with ``trust_remote_code=True``."""
    from .adapters.families import supported_architectures

    code = ", ".join(f"{name}: {path}" for name, path in sorted(raw["auto_map"].items()) if isinstance(path, str))
    head = (f"The repository {model_dir} contains custom code which must be executed to correctly load the model. "
            f"You can inspect the repository content at {model_dir} .")
    if not trust_remote_code:
        head += " (transformers asks for `trust_remote_code=True` here.)"
    return (f"{head} torchlike cannot run it, with or without trust_remote_code=True: the custom modelling code "
            f"({code}) is PyTorch, and the architecture {raw.get('architectures')} (model_type="
            f"{raw.get('model_type')!r}) has no JAX implementation. torchlike loads these architectures: "
            f"{', '.join(supported_architectures())}.")


def read_generation_config(model_dir: Path, config):
    """``generation_config.json`` when the directory has one, else the generation settings of ``config``."""
    from transformers import GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir)
    return GenerationConfig.from_model_config(config)


def first_tensor_dtype(files: list[Path]):
    """The dtype of the first floating-point tensor of a safetensors checkpoint (``dtype="auto"``), else ``None``."""
    if files and files[0].suffix == ".safetensors":
        from .adapters.checkpoint.safetensors_io import SafetensorsReader

        with SafetensorsReader(files[0]) as reader:
            # bfloat16 (ml_dtypes) has numpy kind "V"; integer buffers never set the model dtype.
            floating = [info.dtype for info in reader.tensors.values() if info.dtype.kind in "fV"]
            return floating[0] if floating else None
    return None
