"""The trainers room, TRL's ``trl.trainer``: ``from trl.trainer import X`` -> ``from torchlike.trl.trainer import X``.

It holds, as TRL's does, each stable trainer's config (``<name>_config``) and trainer (``<name>_trainer``), with the
field tables that say which TRL fields each config honours (``<name>_fields``), the shared bases and loops
(``base_config``, ``base_trainer``, ``online_trainer``, ``policy_gradient_trainer``), TRL's callbacks (``callbacks``)
and ``utils`` (TRL's ``disable_dropout_in_model``, ``ensure_master_addr_port``, ``add_fused_lm_head``). The names are
``torchlike.trl``'s own objects, loaded on first use.
"""

from importlib import import_module
from typing import Any

from torchlike.trl.registry import entries_in

#: The names ``trl.trainer`` shares with ``trl``: each stable trainer and config, the callbacks, the model-config
#: helpers.
_FROM_TRL_PACKAGE = (*(name for entry in entries_in("torchlike.trl") for name in (entry.config, entry.trainer)),
                     "BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback",
                     "WeaveCallback", "ModelConfig", "get_peft_config", "get_quantization_config")
_UTILS = ("add_fused_lm_head", "disable_dropout_in_model", "ensure_master_addr_port")

__all__ = sorted((*_FROM_TRL_PACKAGE, *_UTILS))


def __getattr__(name: str) -> Any:
    if name in _FROM_TRL_PACKAGE:
        return getattr(import_module("torchlike.trl"), name)
    if name in _UTILS:
        return getattr(import_module("torchlike.trl.trainer.utils"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
