"""LoRA factors to and from PEFT's on-disk layout: ``<prefix><hf module>.lora_A.weight (r, in)``, ``lora_B (out, r)``.

The prefix is ``base_model.model.``: the layout ``peft.PeftModel.from_pretrained`` and vLLM ``--lora-modules``
read. The NNX factors are Qwix's ``a (contract..., r)`` and ``b (r, remain...)``; the family table names each
weight's HF module, and a weight Tunix stacks (Gemma 3's ``kv_einsum``) has one PEFT pair per stacked part.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from ..families import Family
from ..multihost import gather_to_host
from ..nnx_state import modules_by_path
from .runtime import lora_factors


def hf_factors(a: np.ndarray, b: np.ndarray, stack: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """NNX factors ``a (contract..., r)``, ``b (r, remain...)`` as PEFT's ``A (r, in)``, ``B (out, r)``."""
    rank = a.shape[-1]
    if stack is not None:
        b = b[:, stack[0]]
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def peft_state(
    family: Family, module: nnx.Module, prefix: str = "base_model.model."
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(PEFT key, array)`` pairs: ``base_model.model.<hf module>.lora_A.weight`` and ``.lora_B.weight``
    (factors sharded over several processes are gathered: every process must iterate it)."""
    for module_path, (weight, a, b) in lora_factors(module).items():
        a, b = gather_to_host(a), gather_to_host(b)
        for hf_name, rule in family.nnx_to_hf(f"{module_path}.{weight}"):
            hf_module = hf_name.removesuffix(".weight")
            lora_a, lora_b = hf_factors(a, b, rule.stack)
            yield f"{prefix}{hf_module}.lora_A.weight", np.ascontiguousarray(lora_a)
            yield f"{prefix}{hf_module}.lora_B.weight", np.ascontiguousarray(lora_b)


_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


def load_peft_state(family: Family, module: nnx.Module, tensors: dict[str, np.ndarray], source: str) -> list[str]:
    """Sets the LoRA factors from PEFT-layout tensors; returns the PEFT keys that matched no module.

    A module stacked in Tunix (Gemma's ``kv_einsum``) may get factors for only some of its parts
    (PEFT's default targets ``v_proj`` but not ``k_proj``): the other parts' ``B`` stays zero.

    Raises:
        ValueError: a factor's shape disagrees (names the key, both shapes, the likely cause), or
            a module stacked in Tunix (Gemma's ``kv_einsum``) got different ``lora_A`` for its parts.
    """
    by_module: dict[str, dict[str, np.ndarray]] = {}
    unused = []
    for key, value in tensors.items():
        match = _PEFT_KEY.match(key)
        if not match:
            unused.append(key)
            continue
        by_module.setdefault(match["module"], {})[match["factor"]] = (key, np.asarray(value))
    targets = modules_by_path(module)
    for module_path, (weight, a, b) in lora_factors(module).items():
        child = targets[module_path]
        new_a, new_b = np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)
        seen_a = None
        parts = [(rule, by_module.pop(hf_name.removesuffix(".weight"), None), hf_name)
                 for hf_name, rule in family.nnx_to_hf(f"{module_path}.{weight}")]
        for rule, factors, hf_name in parts:
            if factors is None and rule.stack and any(other for _, other, _ in parts):
                continue  # a fused partner the adapter does not adapt: its part of B stays zero
            if factors is None or set(factors) != {"A", "B"}:
                raise ValueError(f"{source}: no lora_A/lora_B pair for {hf_name.removesuffix('.weight')}; the adapter "
                                 "was trained with other target_modules.")
            (key_a, lora_a), (key_b, lora_b) = factors["A"], factors["B"]
            rank = a.shape[-1]
            expected_a, expected_b = hf_factors(np.zeros(a.shape), np.zeros(b.shape), rule.stack)
            for key, got, want in ((key_a, lora_a, expected_a), (key_b, lora_b, expected_b)):
                if got.shape != want.shape:
                    raise ValueError(f"{source}: {key} has shape {got.shape}, the model expects {want.shape} "
                                     f"(LoRA rank {got.shape[0] if key == key_a else got.shape[-1]} in the adapter, "
                                     f"{rank} in the model?).")
            if seen_a is not None and not np.array_equal(seen_a, lora_a):
                raise ValueError(f"{source}: {key_a} differs from the lora_A of the other projection that Tunix fuses "
                                 f"into {module_path}; such adapters cannot be loaded into the fused module.")
            seen_a = lora_a
            new_a = lora_a.T.reshape(a.shape)
            part = lora_b.T.reshape((rank, *(b.shape[2:] if rule.stack else b.shape[1:])))
            if rule.stack:
                new_b[:, rule.stack[0]] = part
            else:
                new_b = part
        getattr(child, weight + "_lora_a").set_value(jax.device_put(new_a.astype(a.dtype), a.sharding))
        getattr(child, weight + "_lora_b").set_value(jax.device_put(new_b.astype(b.dtype), b.sharding))
    unused.extend(key for factors in by_module.values() for key, _ in factors.values())
    return unused
