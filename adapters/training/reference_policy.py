"""The reference policy of a preference or RL trainer (TRL's ``ref_model``), in one place for every TRL trainer.

TRL's trainers score the data with a frozen reference: a separate ``ref_model``, the base weights with the LoRA
adapter switched off, or a frozen copy of the initial policy. :func:`choose` picks one of these and says how to read
it (which NNX module, on which mesh, with the adapter in which mode); the trainer runs its own log-prob pass on it,
either once before training (precomputed columns, as DPO and KTO do) or live in each rollout (GRPO, RLOO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from flax import nnx

from ..distributed import multihost
from ..distributed.mesh import shard_module
from ..families import Family
from ..lora import runtime as lora_runtime
from ..model.prompt_learning import has_prompt_encoder

#: ``ReferencePolicy.kind`` values.
SEPARATE, BASE, COPY, INITIAL = "model", "base", "copy", "initial"


@dataclass
class ReferencePolicy:
    """Where the reference log-probabilities come from.

    Attributes:
        module: the NNX module to run.
        family: its model family (the forward pass).
        mesh: the mesh its weights are placed on.
        lora: the LoRA mode to run it in (``lora_runtime.DISABLED`` for the adapter-off base).
        kind: ``"model"`` (a separate ``ref_model``), ``"base"`` (the policy with its adapter off), ``"copy"`` (a
            frozen copy of the initial policy, which ``sync_ref_model`` may move) or ``"initial"`` (the policy's own
            weights, valid only until the first optimizer step: its log-probs must be precomputed).
    """

    module: nnx.Module
    family: Family
    mesh: Any
    lora: str
    kind: str

    @property
    def outlives_training(self) -> bool:
        """Whether the reference still exists once training has changed the policy (not ``"initial"``)."""
        return self.kind != INITIAL


def lora_is_new(module: nnx.Module) -> bool:
    """Whether every LoRA ``B`` factor of ``module`` is zero (a new adapter: the model equals its base weights)."""
    factors = lora_runtime.lora_factors(module)
    return bool(factors) and all(not np.any(multihost.gather_to_host(b)) for _, _, b in factors.values())


def choose(policy: nnx.Module, family: Family, mesh: Any, *, ref_model: Any = None, adapter_off: bool = False,
           copy: bool = False) -> ReferencePolicy:
    """The reference for a policy, TRL's rules in order.

    Args:
        policy: the module being trained.
        family: the policy's model family.
        mesh: the trainer's mesh.
        ref_model: a separate reference (anything with ``module``, ``family`` and ``mesh``); one without a mesh is
            placed on ``mesh``.
        adapter_off: the policy has a LoRA adapter whose base weights are the reference (switch it off). A policy
            with a prompt-learning adapter always has its base model as the reference, as TRL with ``peft``.
        copy: keep a frozen copy of the policy's current weights (full fine-tuning with a live reference, or a
            reference that ``sync_ref_model`` moves); otherwise the policy's own weights serve until step one.

    Returns:
        The :class:`ReferencePolicy`.
    """
    if ref_model is not None:
        if ref_model.mesh is None:
            shard_module(ref_model.module, mesh)
            ref_model.mesh = mesh
        return ReferencePolicy(ref_model.module, ref_model.family, ref_model.mesh, lora_runtime.EVAL, SEPARATE)
    if adapter_off or has_prompt_encoder(policy):  # TRL's reference for a peft prompt-learning model: adapter off
        return ReferencePolicy(policy, family, mesh, lora_runtime.DISABLED, BASE)
    if copy:
        return ReferencePolicy(nnx.clone(policy), family, mesh, lora_runtime.EVAL, COPY)
    return ReferencePolicy(policy, family, mesh, lora_runtime.EVAL, INITIAL)
