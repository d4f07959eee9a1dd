"""Qwix LoRA on Tunix modules: apply it, switch dropout/adapter per trace, and convert the factors
to and from the PEFT layout (``lora_A (r, in)``, ``lora_B (out, r)``) or merge them into the weights.

Qwix keeps LoRA dropout on in every pass and offers no way to bypass the adapter. Here a
context variable read at trace time does both: dropout only in ``"train"`` mode, no LoRA
delta in ``"disabled"`` mode. Callers pass the mode as a static jit argument so each mode
gets its own trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import numpy as np
import qwix
from flax import nnx
from qwix._src.utils import flax_util

from .families import Family

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
    and gets a zero cotangent (so this is for LoRA training only). Forward plus
    backward of one ``[2048, 256] x [256, 512]`` layer on 2 CPU cores: 2.0-2.1 ms, against 3.2-3.3 ms
    through differentiated merged weights and 3.3-3.4 ms for full fine-tuning's ``dx, dW``.
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


@dataclass(frozen=True)
class LoraTarget:
    """One adaptable module: its NNX path (``/``-joined, as Qwix matches) and the HF module names it serves."""

    nnx_module: str
    weight: str
    hf_modules: tuple[str, ...]


def adaptable_modules(family: Family, module: nnx.Module) -> list[LoraTarget]:
    """Every linear module LoRA can target, with its HF module name(s) (``model.layers.0.self_attn.q_proj``)."""
    found: dict[str, LoraTarget] = {}
    for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        nnx_path = ".".join(str(part) for part in path)
        for hf_name, _rule in family.nnx_to_hf(nnx_path):
            hf_module = hf_name.removesuffix(".weight")
            if hf_module.rsplit(".", 1)[-1] not in family.lora_targets or not hf_name.endswith(".weight"):
                continue
            module_path = "/".join(str(part) for part in path[:-1])
            previous = found.get(module_path)
            modules = (previous.hf_modules if previous else ()) + (hf_module,)
            found[module_path] = LoraTarget(module_path, str(path[-1]), modules)
    return list(found.values())


def default_target_modules(family: Family) -> list[str]:
    """The HF module names PEFT adapts when ``target_modules`` is ``None`` (its per-``model_type`` table).

    Raises:
        ValueError: the family has no default, naming the family and the valid names.
    """
    if not family.default_lora_targets:
        raise ValueError(f"the {family.name} family has no default LoRA target_modules; set "
                         f"LoraConfig(target_modules=...) (or --lora_target_modules) to e.g. "
                         f"{sorted(family.lora_targets)} or 'all-linear'.")
    return list(family.default_lora_targets)


def _names(hf_module: str, target_modules: list[str] | str) -> bool:
    """Whether PEFT's ``target_modules`` names ``hf_module``: a listed name equals it or is its last
    dotted part(s); a string is a regex matched against the full name."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, hf_module) is not None
    return any(hf_module == name or hf_module.endswith("." + name) for name in target_modules)


def select_targets(family: Family, module: nnx.Module, target_modules) -> list[LoraTarget]:
    """The modules PEFT would adapt for ``target_modules``.

    Args:
        target_modules: a list of HF module names (a module matches when its name equals an
            entry or ends with ``"." + entry``), a regex string (``re.fullmatch`` on the full HF
            module name), ``"all-linear"`` (every linear layer except the LM head), or ``None``
            (the family's :func:`default_target_modules`).

    Raises:
        ValueError: nothing matched, naming the valid module names.
    """
    if target_modules is None:
        target_modules = default_target_modules(family)
    candidates = adaptable_modules(family, module)
    known = sorted(family.lora_targets)
    if not isinstance(target_modules, str):
        unknown = [n for n in target_modules if not any(_names(m, [n]) for t in candidates for m in t.hf_modules)]
        if unknown:
            raise ValueError(f"target_modules {unknown} match no module of this {family.name} model; valid names: "
                             f"{known} (or full names like 'model.layers.0.self_attn.q_proj', a regex, 'all-linear').")
    chosen = [t for t in candidates if any(_names(m, target_modules) for m in t.hf_modules)]
    if not chosen:
        raise ValueError(f"target_modules={target_modules!r} matches no module; valid names: {known}.")
    return chosen


def unnamed_fused_modules(targets: list[LoraTarget], target_modules: list[str] | str) -> list[str]:
    """The HF modules that ``targets`` adapt although ``target_modules`` does not name them: partners the
    Tunix model fuses with a named module into one (Gemma 3's ``k_proj``/``v_proj`` share ``kv_einsum``),
    so one LoRA pair serves both.

    Returns:
        Sorted names. For a list, each is spelled like the entry that named its partner (``"k_proj"``
        beside ``"v_proj"``, a full name beside a full name), so adding them names exactly these
        modules; for a regex, full module names.
    """
    found = set()
    for target in targets:
        named = [m for m in target.hf_modules if _names(m, target_modules)]
        for module in target.hf_modules:
            if module in named:
                continue
            if isinstance(target_modules, str):
                found.add(module)
                continue
            entry = next(n for n in target_modules if _names(named[0], [n]))
            found.add(".".join(module.split(".")[-len(entry.split(".")):]))
    return sorted(found)


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
        return qwix.apply_lora_to_model(module, provider, **module.get_model_input(), rngs=nnx.Rngs(seed))


def set_dropout_rng(module: nnx.Module, key: jax.Array) -> None:
    """Gives every LoRA module the ``dropout`` RNG Qwix needs in training mode."""
    module.set_attributes(qwix_rngs=nnx.Rngs(dropout=key), raise_if_not_found=False)


def lora_factors(module: nnx.Module) -> dict[str, tuple[str, jax.Array, jax.Array]]:
    """``{dotted module path: (weight attribute, A, B)}`` for every LoRA pair in ``module``."""
    pairs = {}
    for path, child in nnx.iter_modules(module):
        for name, value in vars(child).items():
            if name.endswith("_lora_a") and isinstance(value, nnx.LoRAParam):
                weight = name.removesuffix("_lora_a")
                pairs[".".join(str(p) for p in path)] = (weight, value.get_value(),
                                                         getattr(child, weight + "_lora_b").get_value())
    return pairs


def _hf_factors(a: np.ndarray, b: np.ndarray, stack: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """NNX factors ``a (contract..., r)``, ``b (r, remain...)`` as PEFT's ``A (r, in)``, ``B (out, r)``."""
    rank = a.shape[-1]
    if stack is not None:
        b = b[:, stack[0]]
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def peft_state(
    family: Family, module: nnx.Module, prefix: str = "base_model.model."
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(PEFT key, array)`` pairs: ``base_model.model.<hf module>.lora_A.weight`` and ``.lora_B.weight``."""
    for module_path, (weight, a, b) in lora_factors(module).items():
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        for hf_name, rule in family.nnx_to_hf(f"{module_path}.{weight}"):
            hf_module = hf_name.removesuffix(".weight")
            lora_a, lora_b = _hf_factors(a, b, rule.stack)
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
    targets: dict[str, nnx.Module] = {".".join(str(p) for p in path): child for path, child in nnx.iter_modules(module)}
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
            expected_a, expected_b = _hf_factors(np.zeros(a.shape), np.zeros(b.shape), rule.stack)
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


def merge_factors(family: Family, weight_path: str, weight, a, b, scale: float) -> jax.Array:
    """``weight + scale * B @ A`` for one weight (dotted NNX path), in float32, cast once to the weight's
    dtype and placed in its sharding (a numpy weight stays on the default device)."""
    a32, b32 = np.asarray(jax.device_get(a), np.float32), np.asarray(jax.device_get(b), np.float32)
    total = np.array(jax.device_get(weight), np.float32)
    rules = family.nnx_to_hf(weight_path)
    if not rules:
        raise ValueError(f"{weight_path} has no entry in the {family.name} table; cannot merge LoRA into it.")
    for _hf_name, rule in rules:
        lora_a, lora_b = _hf_factors(a32, b32, rule.stack)
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
    children = {".".join(str(p) for p in path): child for path, child in nnx.iter_modules(module)}
    for module_path, (weight_name, a, b) in lora_factors(module).items():
        weight = getattr(children[module_path], weight_name)
        weight_value = weight.get_value()
        if not isinstance(weight_value, jax.Array):
            raise ValueError(f"{module_path}.{weight_name} is quantised (QLoRA); merging into quantised weights is "
                             "not supported. Load the base model in full precision, load the adapter, then merge.")
        path = f"{module_path}.{weight_name}"
        merged[path] = merge_factors(family, path, weight_value, a, b, scale)
    return merged


def mergeable(module: nnx.Module) -> bool:
    """Whether ``module`` has LoRA pairs and every adapted base weight is a plain (not quantised) array, so
    :func:`merged_lora` can form ``W + s * A @ B``; layers whose layout :func:`lora_linear` does not cover
    fall back to Qwix's factored ops inside the merged step."""
    children = {".".join(str(p) for p in path): child for path, child in nnx.iter_modules(module)}
    pairs = lora_factors(module)
    for module_path, (weight, _a, _b) in pairs.items():
        kernel = getattr(children[module_path], weight, None)
        if not isinstance(kernel, nnx.Variable) or not isinstance(kernel.get_value(), jax.Array):
            return False
    return bool(pairs)
