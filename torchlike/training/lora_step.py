"""How a LoRA train step runs the adapted layers: with or without dropout, on factored or merged weights."""

from __future__ import annotations

from jax.sharding import Mesh

from ..adapters.lora import runtime as lora_runtime
from ..peft.config import LoraConfig
from ..peft.prompt_config import PromptLearningConfig

__all__ = ["dropout_in_step", "merged_lora_scale"]


def dropout_in_step(lora: LoraConfig | PromptLearningConfig | None) -> bool:
    """Whether the train step applies LoRA dropout: a LoRA adapter with ``lora_dropout > 0`` (a prompt-learning
    adapter has none)."""
    return isinstance(lora, LoraConfig) and float(lora.lora_dropout or 0.0) > 0.0


def merged_lora_scale(choice: str, lora: LoraConfig | PromptLearningConfig | None, module, mesh: Mesh,
                      dropout: bool) -> float | None:
    """The LoRA scale when the train step runs on merged weights (``args.lora_step``), else ``None``.

    ``"auto"`` merges on CPU meshes, where XLA materialises transposed activations for Qwix's three matmuls per
    adapted layer (:func:`lora_runtime.lora_linear` avoids them); ``"merged"`` asks for it everywhere;
    ``"factored"`` never merges. Neither applies to LoRA dropout or to QLoRA's quantised base weights, which cannot
    be merged.

    Args:
        choice: ``args.lora_step``: ``"auto"``, ``"merged"`` or ``"factored"``.
        lora: the trained adapter's configuration (``None`` or a prompt-learning adapter: nothing to merge).
        module: the NNX module carrying the adapter.
        mesh: the mesh the step runs on.
        dropout: whether the step applies LoRA dropout (:func:`dropout_in_step`, or a trainer's own rule).

    Raises:
        ValueError: ``"merged"`` was asked for a step that cannot merge (dropout, quantised base weights).
    """
    if not isinstance(lora, LoraConfig) or choice == "factored":
        return None
    if dropout:
        if choice == "merged":
            raise ValueError(f"lora_step='merged' cannot apply lora_dropout={lora.lora_dropout}; set "
                             "lora_dropout=0.0 or lora_step='auto'.")
        return None
    if not lora_runtime.mergeable(module):
        if choice == "merged":
            raise ValueError("lora_step='merged': this model's adapted base weights are quantised (QLoRA) and "
                             "cannot be merged; use lora_step='auto' or 'factored'.")
        return None
    if choice == "auto" and {device.platform for device in mesh.devices.flat} != {"cpu"}:
        return None
    return float(lora.scale)
