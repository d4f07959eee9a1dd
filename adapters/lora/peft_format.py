"""LoRA factors to and from PEFT's on-disk layout: ``<prefix><hf module>.lora_A.weight (r, in)``, ``lora_B (out, r)``.

The prefix is ``base_model.model.``: the layout ``peft.PeftModel.from_pretrained`` and vLLM ``--lora-modules``
read. The NNX factors are Qwix's ``a (contract..., r)`` and ``b (r, remain...)``; the family table names each
weight's HF module, and a weight Tunix stacks (Gemma 3's ``kv_einsum``) has one PEFT pair per stacked part.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from flax import nnx

from ..distributed.multihost import gather_to_host
from ..families import Family
from ..model.nnx_state import parameter_slots
from ..model.weight_plan import PEFT_LAYOUTS, Source, apply, slot_targets
from .runtime import lora_factors


def hf_factors(a: np.ndarray, b: np.ndarray, stack: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """NNX factors ``a (contract..., r)``, ``b (r, remain...)`` as PEFT's ``A (r, in)``, ``B (out, r)``."""
    if stack is not None:
        b = b[:, stack[0]]
    return PEFT_LAYOUTS["A"].to_hf(a), PEFT_LAYOUTS["B"].to_hf(b)


def peft_state(
    family: Family, module: nnx.Module, prefix: str = "base_model.model."
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(PEFT key, array)`` pairs: ``base_model.model.<hf module>.lora_A.weight`` and ``.lora_B.weight``
    (factors sharded over several processes are gathered: every process must iterate it)."""
    for module_path, (weight, a, b) in lora_factors(module).items():
        a, b = gather_to_host(a), gather_to_host(b)
        for hf_name, rule in family.nnx_to_hf(f"{module_path}.{weight}"):
            hf_module = family.in_memory_name(hf_name).removesuffix(".weight")  # PEFT names in-memory modules
            lora_a, lora_b = hf_factors(a, b, rule.stack)
            yield f"{prefix}{hf_module}.lora_A.weight", np.ascontiguousarray(lora_a)
            yield f"{prefix}{hf_module}.lora_B.weight", np.ascontiguousarray(lora_b)


def load_peft_state(family: Family, module: nnx.Module, tensors: dict[str, np.ndarray], source: str) -> list[str]:
    """Sets the LoRA factors from PEFT-layout tensors (routed and placed by
    :func:`adapters.model.weight_plan.apply`); returns the PEFT keys that matched no module.

    A module stacked in Tunix (Gemma's ``kv_einsum``) may get factors for only some of its parts
    (PEFT's default targets ``v_proj`` but not ``k_proj``): the other parts' ``B`` stays zero.

    Raises:
        ValueError: a module has no lora_A/lora_B pair, two keys fill one factor, a factor's shape disagrees (names
            the key, both shapes, the likely cause), or a module stacked in Tunix (Gemma's ``kv_einsum``) got
            different ``lora_A`` for its parts.
    """
    slots = {name: slot for name, slot in parameter_slots(module).items() if slot.is_lora}
    first_parts: dict[str, str] = {}

    def check(part: Source, found: tuple[int, ...], wanted: tuple[int, ...], origin: None) -> bool:
        weight, factor = part.target.rsplit("_lora_", 1)
        if found != wanted:
            rank = slots[f"{weight}_lora_a"].get().shape[-1]
            raise ValueError(f"{source}: {part.key} has shape {found}, the model expects {wanted} (LoRA "
                             f"rank {found[0 if factor == 'a' else -1]} in the adapter, {rank} in the model?).")
        first = first_parts.setdefault(part.target, part.key)
        if factor == "a" and not np.array_equal(tensors[part.key], tensors[first]):
            raise ValueError(f"{source}: {part.key} differs from the lora_A of the other projection that Tunix "
                             f"fuses into {weight.rsplit('.', 1)[0]}; such adapters cannot be loaded into the "
                             "fused module.")
        return True

    applied = apply(family, slot_targets(slots), keys=[(key, key) for key in tensors],
                    read=lambda part: np.asarray(tensors[part.key]), check=check, fill_missing_parts=True)
    for weight in [name.removesuffix("_lora_a") for name in slots if name.endswith("_lora_a")]:
        stacks = {factor: {part.stack for part in applied.plan.targets.get(f"{weight}_lora_{factor}", [])}
                  for factor in "ab"}
        for hf_name, rule in family.nnx_to_hf(weight):
            if rule.stack and rule.stack not in stacks["a"] | stacks["b"] and stacks["a"] | stacks["b"]:
                continue  # a fused partner the adapter does not adapt: its part of B stays zero
            if rule.stack not in stacks["a"] & stacks["b"]:
                raise ValueError(f"{source}: no lora_A/lora_B pair for {hf_name.removesuffix('.weight')}; the adapter "
                                 "was trained with other target_modules.")
    for path, value in applied.values.items():
        slots[path].set(value)
    return applied.unexpected
