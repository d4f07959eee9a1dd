"""TRL's ``trl.models`` for torchlike: ``from trl.models import X`` -> ``from torchlike.trl.models import X``.

``create_reference_model`` and ``unwrap_model_for_generation`` do what TRL's do on torchlike models. The others wrap a
torch model for DeepSpeed or FSDP, or patch its activation memory; a JAX model has no such wrappers, so they raise a
``ValueError`` naming torchlike's way (a device mesh, ``gradient_checkpointing``), as MIGRATION.md lists.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flax import nnx

    from ...modeling import CausalLM

__all__ = ["check_causal_lm", "create_reference_model", "enable_selective_activation_checkpointing",
           "frozen_copy_model", "get_act_offloading_ctx_manager", "prepare_deepspeed", "prepare_fsdp",
           "unwrap_model_for_generation"]

_USE_MESH = ("torchlike has no DeepSpeed or FSDP wrappers: parameters are sharded over a JAX device mesh instead. Set "
             "mesh_shape / mesh_axis_names in the config (parameters are sharded over the 'fsdp' axis by default).")
_USE_REMAT = ("torchlike's way to cut activation memory is gradient_checkpointing (on by default), which recomputes "
              "each decoder layer's activations in the backward pass; activations stay on the device.")


def check_causal_lm(model: object, name: str, trainer: str) -> None:
    """Raises ``TypeError`` unless ``model`` is a torchlike causal LM (``CausalLM`` or ``PeftModel``)."""
    if getattr(model, "family", None) is None:
        raise TypeError(f"{trainer}'s {name} must be a torchlike causal LM; got {type(model).__name__}. Load it "
                        "with torchlike.AutoModelForCausalLM.from_pretrained(...).")


def frozen_copy_model(policy: CausalLM, module: nnx.Module) -> CausalLM:
    """The ``CausalLM`` a TRL user finds in ``trainer.ref_model`` when the reference is a frozen copy of ``policy``:
    ``module`` (the copy's weights) with the policy's configs and path, in eval mode."""
    from ...modeling import CausalLM

    model = CausalLM(module, copy.deepcopy(policy.config), policy.family, copy.deepcopy(policy.generation_config),
                     policy.mesh, policy.name_or_path, kept_weights=policy.kept_weights)
    return model.eval()


def create_reference_model(model: CausalLM, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> CausalLM:
    """TRL's ``create_reference_model``: a frozen copy of ``model`` (its weights now, its configs and path, every
    parameter frozen, in eval mode), which a trainer takes as ``ref_model``; training ``model`` leaves it as it is.

    Args:
        model: a :class:`~torchlike.CausalLM`.
        num_shared_layers, pattern: TRL's layers shared between the model and the copy (frozen in both); refused: a
            JAX copy shares no parameter objects with the model it was copied from.

    Returns:
        The frozen copy.
    """
    from flax import nnx

    check_causal_lm(model, "model", "create_reference_model")
    if num_shared_layers is not None or pattern is not None:
        raise ValueError("create_reference_model's num_shared_layers and pattern are not supported in torchlike: a JAX "
                         "copy shares no parameters with its model. Omit them for a whole frozen copy.")
    if hasattr(model, "peft_config"):
        raise ValueError("create_reference_model got a PeftModel: a trainer's reference for a LoRA model is its base "
                         "weights with the adapter switched off, no copy needed. Pass ref_model=None, or copy the "
                         "base model before get_peft_model.")
    reference = frozen_copy_model(model, nnx.clone(model.module))
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def unwrap_model_for_generation(model: CausalLM, accelerator: object = None, gather_deepspeed3_params: bool = True,
                                generation_kwargs: dict | None = None,
                                gradient_checkpointing_kwargs: dict | None = None) -> Iterator[CausalLM]:
    """TRL's ``unwrap_model_for_generation``: the model to generate with inside the ``with`` block.

    A torchlike model is never wrapped (no DDP, DeepSpeed or FSDP engine) and its generation never rematerialises, so
    the model itself is yielded; with transformers 5, TRL's leaves the generation config as it is too.

    Args:
        model: a torchlike model.
        accelerator, gather_deepspeed3_params, generation_kwargs, gradient_checkpointing_kwargs: TRL's; nothing to
            gather, unwrap or switch off on a JAX model.

    Yields:
        ``model``.
    """
    yield model


def prepare_deepspeed(model: object, accelerator: object) -> None:
    """TRL's ``prepare_deepspeed``: refused (torch's DeepSpeed engine).

    Raises:
        ValueError: always, naming torchlike's device mesh.
    """
    raise ValueError(f"prepare_deepspeed wraps a torch model in a DeepSpeed engine. {_USE_MESH}")


def prepare_fsdp(model: object, accelerator: object) -> None:
    """TRL's ``prepare_fsdp``: refused (torch's FSDP wrapper).

    Raises:
        ValueError: always, naming torchlike's device mesh.
    """
    raise ValueError(f"prepare_fsdp wraps a torch model in FSDP. {_USE_MESH}")


def get_act_offloading_ctx_manager(model: object, use_pin_memory: bool = True, use_streams: bool = True,
                                   min_offload_size: int = 1024, max_fwd_stash_size: int = 5,
                                   warn_if_no_head: bool = True) -> None:
    """TRL's ``get_act_offloading_ctx_manager`` (activation offloading to pinned CPU memory): refused.

    Raises:
        ValueError: always, naming ``gradient_checkpointing``.
    """
    raise ValueError(f"get_act_offloading_ctx_manager offloads a torch model's activations to CPU memory. {_USE_REMAT}")


def enable_selective_activation_checkpointing(model: object) -> None:
    """TRL's ``enable_selective_activation_checkpointing``: refused (torch's checkpoint wrappers).

    Raises:
        ValueError: always, naming ``gradient_checkpointing``.
    """
    raise ValueError(f"enable_selective_activation_checkpointing wraps a torch model's layers. {_USE_REMAT}")
