"""``torchlike.peft``: PEFT's LoRA API (``LoraConfig``, ``get_peft_model``, ``PeftModel``) on Qwix, and its
prompt-learning configs (``PromptTuningConfig``, ``PromptEncoderConfig``, ``PrefixTuningConfig``)."""

from .config import LoraConfig, TaskType
from .model import PeftModel, get_peft_model
from .prompt_config import (
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptEncoderReparameterizationType,
    PromptTuningConfig,
    PromptTuningInit,
)
from .prompt_model import PromptLearningModel

__all__ = ["LoraConfig", "PeftModel", "PrefixTuningConfig", "PromptEncoderConfig",
           "PromptEncoderReparameterizationType", "PromptLearningModel", "PromptTuningConfig", "PromptTuningInit",
           "TaskType", "get_peft_model"]
