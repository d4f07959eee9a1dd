"""The LoRA runtime on Tunix modules: apply Qwix LoRA, choose per trace how adapted layers run, read the factors.

Qwix keeps LoRA dropout on in every pass and offers no way to bypass the adapter. Here a
context variable read at trace time does both: dropout only in ``"train"`` mode, no LoRA
delta in ``"disabled"`` mode. Callers pass the mode as a static jit argument so each mode
gets its own trace. In ``"merged"`` mode (:func:`merged_lora`) an adapted layer runs as one
matmul on ``W + scale * A @ B`` with the factors' gradients from thin products (:func:`lora_linear`).
The hooks into Qwix's provider are listed in ``adapters.upstream``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src.utils import flax_util

from ..model.nnx_state import modules_by_path
from .targets import LoraTarget

TRAIN, EVAL, DISABLED, MERGED = "train", "eval", "disabled", "merged"
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("torchlike_lora_mode", default=EVAL)
_MERGED_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("torchlike_lora_merged_scale", default=1.0)


@contextlib.contextmanager
def lora_mode(mode: str) -> Iterator[None]:
    """Within the block, traced LoRA ops apply dropout (``"train"``), skip it (``"eval"``) or skip
    the adapter entirely (``"disabled"``)."""
    if mode not in (TRAIN, EVAL, DISABLED):
        raise ValueError(f"lora mode must be 'train', 'eval' or 'disabled', got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def adapter_disabled() -> bool:
    """Whether the code being traced runs inside ``lora_mode("disabled")`` (the base model without its adapter)."""
    return _MODE.get() == DISABLED


@contextlib.contextmanager
def merged_lora(scale: float) -> Iterator[None]:
    """Within the block, adapted layers run as :func:`lora_linear` on merged weights with LoRA scale ``scale``
    (layers of another layout keep Qwix's factored ops); no dropout."""
    mode, factor = _MODE.set(MERGED), _MERGED_SCALE.set(float(scale))
    try:
        yield
    finally:
        _MERGED_SCALE.reset(factor)
        _MODE.reset(mode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def lora_linear(scale: float, x, w, a, b):
    """``x @ (W + scale * A @ B)`` for ``x [T, I]``, ``W [I, O]``, ``A [I, r]``, ``B [r, O]``: a LoRA layer as
    one matmul.

    The backward pass gives ``dx = dy @ W'^T`` and the factors' gradients from thin products,
    ``dA = scale * ((dy @ B^T)^T @ x)^T`` and ``dB = scale * (x @ A)^T @ dy``, written so that only
    ``[T, r]`` operands are transposed (XLA:CPU materialises the transpose of a dot's operand
    contracted on its first axis). It never forms the layer's ``[I, O]`` weight gradient: ``W`` is frozen
    and gets a zero cotangent (so this is for LoRA training only), which makes it cheaper than differentiating
    the merged weights and than full fine-tuning's ``dx, dW`` (``benchmarks/sft_step.py`` measures the step).
    """
    return x @ _merged_weight(scale, w, a, b)


def _merged_weight(scale, w, a, b):
    return w + (scale * (a @ b)).astype(w.dtype)


def _lora_linear_forward(scale, x, w, a, b):
    merged = _merged_weight(scale, w, a, b)
    return x @ merged, (x, merged, a, b)


def _lora_linear_backward(scale, residuals, dy):
    x, merged, a, b = residuals
    dy = dy.astype(x.dtype)
    through_b = dy @ b.T
    da = (scale * (through_b.T @ x)).T
    db = scale * ((x @ a).T @ dy)
    return dy @ merged.T, jax.numpy.zeros_like(merged), da.astype(a.dtype), db.astype(b.dtype)


lora_linear.defvjp(_lora_linear_forward, _lora_linear_backward)


def _contracted_dims(base: tuple, x, w) -> int | None:
    """How many trailing dims of ``x`` the layer contracts with the leading dims of ``w`` (so the layer is
    ``x.reshape(-1, I) @ w.reshape(I, O)``), or ``None`` for another layout."""
    kind, spec = base
    if kind == "dot_general":
        return 1 if spec == (((x.ndim - 1,), (0,)), ((), ())) and w.ndim == 2 else None
    inputs, _, out = spec.replace(" ", "").partition("->")
    x_spec, _, w_spec = inputs.partition(",")
    contract = "".join(c for c in w_spec if c in x_spec)
    batch = "".join(c for c in x_spec if c not in w_spec)
    remain = "".join(c for c in w_spec if c not in x_spec)
    ok = "." not in spec and x_spec == batch + contract and w_spec == contract + remain and out == batch + remain
    return len(contract) if ok and contract else None


def _merged_call(base: tuple, x, rhs):
    """:func:`lora_linear` for the current module's adapted weight ``rhs``, or ``None`` when ``rhs`` is not one
    or its layer has another layout (the caller then runs Qwix's factored ops)."""
    module = flax_util.get_current_module()
    name = flax_util.find_param(rhs)
    lora_a = getattr(module, f"{name}_lora_a", None) if name else None
    if not isinstance(lora_a, nnx.LoRAParam):
        return None
    contracted = _contracted_dims(base, x, rhs)
    a, b = lora_a.get_value(), getattr(module, f"{name}_lora_b").get_value()
    if contracted is None or a.shape[:-1] != rhs.shape[:contracted] or b.shape[1:] != rhs.shape[contracted:]:
        return None
    inner, outer = int(np.prod(rhs.shape[:contracted])), int(np.prod(rhs.shape[contracted:]))
    rank = a.shape[-1]
    out = lora_linear(_MERGED_SCALE.get(), x.reshape(-1, inner), rhs.reshape(inner, outer), a.reshape(inner, rank),
                      b.reshape(rank, outer))
    return out.reshape(*x.shape[:x.ndim - contracted], *rhs.shape[contracted:])


class ModeAwareLoraProvider(qwix.LoraProvider):
    """``qwix.LoraProvider`` whose LoRA rule follows :func:`lora_mode`.

    Qwix looks the rule up twice per op: once for the (optional) base-weight quantisation
    and once, with ``repeated_call=True``, for the LoRA delta. Only the second lookup is
    changed, so QLoRA's quantised base weights keep working when the adapter is disabled.
    Under :func:`merged_lora` an adapted layer of the plain ``x @ W`` layout runs as
    :func:`lora_linear` instead of Qwix's base op plus delta.
    """

    def _get_current_rule_and_op_id(self, op_name, *, only_rule=False, repeated_call=False):
        rule, op_id = super()._get_current_rule_and_op_id(op_name, only_rule=only_rule, repeated_call=repeated_call)
        if repeated_call and isinstance(rule, qwix.LoraRule):
            mode = _MODE.get()
            if mode == DISABLED:
                return None, op_id
            if mode != TRAIN and rule.dropout > 0:
                rule = dataclasses.replace(rule, dropout=0.0)
        return rule, op_id

    def einsum(self, einsum_str, *operands, **kwargs):
        if _MODE.get() == MERGED and len(operands) == 2 and not kwargs:
            out = _merged_call(("einsum", einsum_str), *operands)
            if out is not None:
                return out
        return super().einsum(einsum_str, *operands, **kwargs)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None):
        if _MODE.get() == MERGED and precision is None and preferred_element_type is None and out_sharding is None:
            numbers = tuple(tuple(tuple(axes) for axes in pair) for pair in dimension_numbers)
            out = _merged_call(("dot_general", numbers), lhs, rhs)
            if out is not None:
                return out
        return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                   out_sharding=out_sharding)


def apply_lora(
    module: nnx.Module,
    targets: list[LoraTarget],
    rank: int,
    scale: float,
    dropout: float = 0.0,
    weight_qtype: str | None = None,
    tile_size: int | None = None,
    seed: int = 0,
    unquantized_targets: list[LoraTarget] = (),
) -> nnx.Module:
    """A copy of ``module`` (arrays shared) with LoRA factors on ``targets``.

    Args:
        rank: LoRA rank ``r``.
        scale: the multiplier of ``B @ A`` (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA).
        dropout: LoRA dropout rate (applied only under ``lora_mode("train")``).
        weight_qtype: quantise the targets' base weights (``"nf4"``, ``"int8"``...) for QLoRA.
        unquantized_targets: targets that get LoRA but keep full-precision base weights.

    Returns:
        The LoRA ``nnx.Module`` (B starts at zero, so outputs equal the base model's).
    """
    def rule(chosen, qtype):
        path = "|".join(re.escape(t.nnx_module) for t in chosen)
        # Qwix divides alpha by the rank; pass the alpha that yields the requested scale.
        return qwix.LoraRule(module_path=path, rank=rank, alpha=scale * rank, dropout=dropout,
                             weight_qtype=qtype, tile_size=tile_size if qtype else None)

    rules = [rule(targets, weight_qtype)] if targets else []
    if unquantized_targets:
        rules.append(rule(list(unquantized_targets), None))
    provider = ModeAwareLoraProvider(rules)
    with lora_mode(EVAL):
        return qwix.apply_lora_to_model(module, provider, **model_input(module), rngs=nnx.Rngs(seed))


def model_input(module: nnx.Module) -> dict:
    """The dummy call Qwix traces a Tunix model with (its ``get_model_input``), with images of the model's own size:
    Tunix's Gemma3 sizes them for its published vision tower (896 x 896), which a smaller position table cannot add
    to (``adapters.upstream``)."""
    inputs = module.get_model_input()
    vision = getattr(getattr(module, "config", None), "vision_config", None)
    if "images" in inputs and vision is not None:
        batch, count = inputs["images"].shape[:2]
        inputs["images"] = jnp.ones((batch, count, vision.image_height, vision.image_width, vision.image_channels),
                                    jnp.float32)
    return inputs


def set_dropout_rng(module: nnx.Module, key: jax.Array) -> None:
    """Gives every LoRA module the ``dropout`` RNG Qwix needs in training mode."""
    module.set_attributes(qwix_rngs=nnx.Rngs(dropout=key), raise_if_not_found=False)


def lora_factors(module: nnx.Module) -> dict[str, tuple[str, jax.Array, jax.Array]]:
    """``{dotted module path: (weight attribute, A, B)}`` for every LoRA pair in ``module``."""
    pairs = {}
    for module_path, child in modules_by_path(module).items():
        for name, value in vars(child).items():
            if name.endswith("_lora_a") and isinstance(value, nnx.LoRAParam):
                weight = name.removesuffix("_lora_a")
                pairs[module_path] = (weight, value.get_value(), getattr(child, weight + "_lora_b").get_value())
    return pairs


def mergeable(module: nnx.Module) -> bool:
    """Whether ``module`` has LoRA pairs and every adapted base weight is a plain (not quantised) array, so
    :func:`merged_lora` can form ``W + s * A @ B``; layers whose layout :func:`lora_linear` does not cover
    fall back to Qwix's factored ops inside the merged step."""
    children = modules_by_path(module)
    pairs = lora_factors(module)
    for module_path, (weight, _a, _b) in pairs.items():
        kernel = getattr(children[module_path], weight, None)
        if not isinstance(kernel, nnx.Variable) or not isinstance(kernel.get_value(), jax.Array):
            return False
    return bool(pairs)
