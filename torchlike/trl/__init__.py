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

#: TRL's chat-template utilities at its top level.
_CHAT_TEMPLATE_UTILS = ("add_response_schema", "clone_chat_template", "get_training_chat_template",
                        "supports_tool_calling")

#: TRL's model helpers at its top level.
_MODEL_UTILS = ("create_reference_model",)

#: The module each of those names lives in.
_HOMES = {**dict.fromkeys(_SCRIPT_UTILS, "torchlike.trl.script_utils"),
          **dict.fromkeys(_DATA_UTILS, "torchlike.trl.data_utils"), "pack_dataset": "torchlike.trl.data.packing",
          **dict.fromkeys(_CALLBACKS, "torchlike.trl.trainer.callbacks"),
          **dict.fromkeys(_CHAT_TEMPLATE_UTILS, "torchlike.trl.chat_template_utils"),
          **dict.fromkeys(_MODEL_UTILS, "torchlike.trl.models")}

__all__, _trainer_attribute, __dir__ = package_exports(__name__, extra=tuple(_HOMES))


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    return _trainer_attribute(name)
