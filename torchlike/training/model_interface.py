"""The one model interface the training loop reads: a torchlike ``CausalLM`` as it is, a bare NNX module wrapped.

The loop needs ``module`` (the ``flax.nnx.Module`` it trains), ``family`` (the model-family table that gives the
built-in causal-LM loss, ``None`` when there is none), ``mesh`` (where the parameters live, set by the Trainer),
``state_dict()`` / ``load_state_dict()`` (what a checkpoint stores and restores) and ``save_pretrained()`` (what
``save_model`` writes). A :class:`~torchlike.CausalLM` (and so a ``PeftModel``) has all of them; a bare module is
wrapped once, in ``Trainer.__init__``, by :func:`as_trainable_model`. ``trainer.model`` stays the object the user
passed, as in transformers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from ..adapters.model import nnx_state
from ..modeling import CausalLM
from ..peft.config import LoraConfig
from ..peft.model import PeftModel
from ..peft.prompt_config import PromptLearningConfig
from .checkpoints import restore_variables

__all__ = ["PlainModule", "TrainableModel", "active_lora_config", "as_trainable_model"]


class PlainModule:
    """A bare ``flax.nnx.Module`` behind the attributes the training loop reads from a :class:`~torchlike.CausalLM`.

    Attributes:
        module: the wrapped module, trained in place (the user's object sees every update).
        family: always ``None``: without a model-family table there is no built-in loss, so the Trainer needs
            ``loss_fn`` or ``compute_loss_func``.
        mesh: the mesh the Trainer placed the parameters on (``None`` until it does).
    """

    family = None

    def __init__(self, module: nnx.Module):
        self.module = module
        self.mesh = None

    def state_dict(self) -> dict[str, jax.Array]:
        """The ``nnx.Param`` arrays by dotted path (``blocks.0.linear1.kernel``), the module's own arrays."""
        return {name: variable.get_value() for name, variable in nnx_state.flat_variables(self.module).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Writes every parameter from ``state_dict`` (the keys of :meth:`state_dict`; a lazy ``torchlike.load``
        checkpoint reads each array straight into its parameter's sharding).

        Raises:
            RuntimeError: ``state_dict`` lacks a parameter of the module or holds a key the module does not have.
        """
        variables = nnx_state.flat_variables(self.module)
        missing = sorted(set(variables) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(variables))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys "
                               f"{missing[:5]}, unexpected keys {unexpected[:5]}; the checkpoint was saved from a "
                               "module with other parameters.")
        restore_variables(variables, state_dict)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Refused: the Hugging Face format needs a model family's config and weight names.

        Raises:
            NotImplementedError: always, saying how to keep the parameters instead.
        """
        raise NotImplementedError(
            f"save_model() writes the Hugging Face format, which needs a torchlike CausalLM (a config and a family's "
            f"weight names); this Trainer trains a plain {type(self.module).__name__}. Keep its parameters with a "
            "save_strategy (output_dir/checkpoint-<step>/model), or torchlike.save({name: array}) of its nnx.Param "
            "arrays.")


#: What the loop trains: a torchlike causal LM, or a bare module wrapped in :class:`PlainModule`.
TrainableModel = CausalLM | PlainModule


def as_trainable_model(model: CausalLM | nnx.Module | None) -> TrainableModel | None:
    """``model`` seen through the loop's interface: a ``CausalLM`` as it is, a ``flax.nnx.Module`` wrapped.

    Args:
        model: the ``model`` given to the Trainer (``None`` for a Trainer that only orders or collates data).

    Raises:
        TypeError: ``model`` is neither.
    """
    if model is None or isinstance(model, CausalLM):
        return model
    if isinstance(model, nnx.Module):
        return PlainModule(model)
    raise TypeError(f"Trainer got a {type(model).__qualname__} as model; pass a torchlike CausalLM / PeftModel "
                    "(AutoModelForCausalLM.from_pretrained) or a flax.nnx.Module with loss_fn or compute_loss_func.")


def active_lora_config(model: TrainableModel | None) -> LoraConfig | PromptLearningConfig | None:
    """The configuration of the adapter the loop trains (LoRA, or a prompt-learning adapter, whose
    ``PeftModel.trainable_filter`` selects the prompt encoder), or ``None`` when the whole model is trained."""
    return model.active_peft_config if isinstance(model, PeftModel) else None
