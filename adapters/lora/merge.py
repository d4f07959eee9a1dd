"""LoRA merged into the weights: ``W + scale * B @ A`` per adapted weight, in float32, cast once to the weight's dtype.

Reads the same family table as the PEFT export, so a weight Tunix stacks (Gemma 3's ``kv_einsum``) gets each
part's delta in its own slot.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from ..families import Family
from ..model.nnx_state import modules_by_path
from .peft_format import hf_factors
from .runtime import lora_factors


def merge_factors(family: Family, weight_path: str, weight, a, b, scale: float) -> jax.Array:
    """``weight + scale * B @ A`` for one weight (dotted NNX path), in float32, cast once to the weight's
    dtype and placed in its sharding (a numpy weight stays on the default device)."""
    a32, b32 = np.asarray(jax.device_get(a), np.float32), np.asarray(jax.device_get(b), np.float32)
    total = np.array(jax.device_get(weight), np.float32)
    rules = family.nnx_to_hf(weight_path)
    if not rules:
        raise ValueError(f"{weight_path} has no entry in the {family.name} table; cannot merge LoRA into it.")
    for _hf_name, rule in rules:
        lora_a, lora_b = hf_factors(a32, b32, rule.stack)
        part_shape = total.shape[1:] if rule.stack else total.shape
        delta = rule.layout.to_nnx((lora_b @ lora_a) * np.float32(scale), part_shape)
        if rule.stack:
            total[rule.stack[0]] += delta
        else:
            total += delta
    merged = total.astype(np.dtype(weight.dtype))
    return jax.device_put(merged, weight.sharding) if isinstance(weight, jax.Array) else jax.device_put(merged)


def merged_weights(family: Family, module: nnx.Module, scale: float) -> dict[str, jax.Array]:
    """``{dotted weight path: W + scale * B @ A}`` for every LoRA pair; the delta is computed in
    float32 and cast once to the weight's dtype, in the weight's sharding."""
    merged = {}
    children = modules_by_path(module)
    for module_path, (weight_name, a, b) in lora_factors(module).items():
        weight = getattr(children[module_path], weight_name)
        weight_value = weight.get_value()
        if not isinstance(weight_value, jax.Array):
            raise ValueError(f"{module_path}.{weight_name} is quantised (QLoRA); merging into quantised weights is "
                             "not supported. Load the base model in full precision, load the adapter, then merge.")
        path = f"{module_path}.{weight_name}"
        merged[path] = merge_factors(family, path, weight_value, a, b, scale)
    return merged
