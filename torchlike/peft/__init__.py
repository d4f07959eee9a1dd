"""``torchlike.peft``: PEFT's LoRA API (``LoraConfig``, ``get_peft_model``, ``PeftModel``) on Qwix."""

from .config import LoraConfig, TaskType
from .model import PeftModel, get_peft_model

__all__ = ["LoraConfig", "PeftModel", "TaskType", "get_peft_model"]
