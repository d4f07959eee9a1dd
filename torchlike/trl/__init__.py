"""torchlike.trl: TRL's trainers, configs and script helpers (``from trl import X`` -> ``from torchlike.trl import X``).

The configs and trainers are those of :data:`torchlike.trl.registry.TRAINERS` under ``torchlike.trl``; each loads on
first use (a trainer imports transformers and its adapters), as do the script helpers. Reward functions live in
``torchlike.trl.rewards``, as in ``trl.rewards``.
"""

from importlib import import_module
from typing import Any

from torchlike.trl.registry import package_exports

_SCRIPT_UTILS = ("DatasetConfig", "DatasetMixtureConfig", "ModelConfig", "ScriptArguments", "TrlParser", "get_dataset",
                 "get_kbit_device_map", "get_peft_config", "get_quantization_config", "init_zero_verbose")

#: TRL's data utilities at its top level (``from trl import is_conversational``), with TRL's signatures and results.
_DATA_UTILS = ("apply_chat_template", "extract_prompt", "is_conversational", "is_conversational_from_value",
               "maybe_apply_chat_template", "maybe_convert_to_chatml", "maybe_extract_prompt",
               "maybe_unpair_preference_dataset", "prepare_multimodal_messages", "unpair_preference_dataset")

#: TRL's callbacks at its top level.
_CALLBACKS = ("BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback", "WeaveCallback")

#: TRL's model helpers at its top level.
_MODEL_UTILS = ("create_reference_model",)

__all__, _trainer_attribute, __dir__ = package_exports(
    __name__, extra=_SCRIPT_UTILS + _DATA_UTILS + _MODEL_UTILS + _CALLBACKS)


def __getattr__(name: str) -> Any:
    if name in _SCRIPT_UTILS:
        return getattr(import_module("torchlike.trl.script_utils"), name)
    if name in _DATA_UTILS:
        return getattr(import_module("torchlike.trl.data_utils"), name)
    if name in _CALLBACKS:
        return getattr(import_module("torchlike.trl.callbacks"), name)
    if name in _MODEL_UTILS:
        return getattr(import_module("torchlike.trl.base_trainer"), name)
    return _trainer_attribute(name)
