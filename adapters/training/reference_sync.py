"""Moving a reference model towards the policy (TR-DPO's reference update, TRL's ``sync_ref_model``).

TRL's ``SyncRefModelCallback`` mixes the policy's parameters into the reference model's every
``ref_model_sync_steps`` optimizer steps; :func:`mix_into` is that update on two NNX modules of the same structure.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


@functools.partial(jax.jit, static_argnums=2)
def _mixed(reference: nnx.State, policy: nnx.State, alpha: float) -> nnx.State:
    return jax.tree.map(lambda ref, new: ref * (1.0 - alpha) + new.astype(ref.dtype) * alpha, reference, policy)


def mix_into(reference: nnx.Module, policy: nnx.Module, alpha: float, variables: type = nnx.Param) -> None:
    """Sets every parameter of ``reference`` to ``alpha * policy + (1 - alpha) * reference``, in place.

    TRL's ``SyncRefModelCallback.sync_target_model`` (``target.mul_(1 - alpha).add_(policy, alpha=alpha)``), in the
    reference's dtype. Only ``nnx.Param`` variables are mixed (LoRA factors are ``nnx.LoRAParam``, which TRL refuses to
    sync as well); both modules must hold the same parameters with the same shapes, on the same devices.

    Args:
        reference: the reference module, updated in place.
        policy: the module being trained; read only.
        alpha: ``ref_model_mixup_alpha``, the policy's share.
        variables: the variables mixed (``nnx.LoRAParam``: the LoRA factors alone, TRL's EMA teacher adapter).

    Raises:
        ValueError: the two modules do not hold the same parameters.
    """
    reference_state = nnx.state(reference, variables)
    policy_state = nnx.state(policy, variables)
    if jax.tree.structure(reference_state) != jax.tree.structure(policy_state):
        raise ValueError("sync_ref_model: the reference model and the policy do not hold the same parameters (a "
                         "ref_model of another architecture?); the reference can only be mixed with a policy of its "
                         "own shape.")
    nnx.update(reference, _mixed(reference_state, policy_state, float(alpha)))
