"""Rotary position embeddings computed from a Hugging Face ``rope_parameters`` dict.

Tunix's decoders do not apply a checkpoint's rope as given (``adapters.upstream`` lists which
ignore ``rope_theta`` and that none implements ``rope_scaling``). Here the inverse
frequencies are computed the way ``transformers``' ``ROPE_INIT_FUNCTIONS`` does for the
supported types, and :func:`with_rope` swaps them into an unchanged copy of the Tunix
method, so the rest of Tunix's attention code is used as shipped.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.abstract_models import register_derived_class

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRopeScalingError(ValueError):
    """The checkpoint's ``rope_scaling``/``rope_parameters`` type is not implemented."""


def rope_inverse_frequencies(
    rope_parameters: Mapping, head_dim: int, config_name: str = "config.json"
) -> tuple[float, ...]:
    """Inverse frequencies ``1 / theta**(2i/d)`` for ``i < d/2``, adjusted for the rope type.

    Args:
        rope_parameters: ``config.rope_parameters`` (transformers >= 5), with ``rope_theta``
            and ``rope_type`` (``default``, ``linear`` or ``llama3``) and that type's fields.
        head_dim: the rotated dimension (the whole head).
        config_name: where the parameters came from, for error messages.

    Returns:
        A tuple of ``head_dim // 2`` float32 values (hashable, so it can key a cache).

    Raises:
        UnsupportedRopeScalingError: for any other rope type or a partial rotary factor.
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeScalingError(
            f"{config_name}: rope_scaling type {rope_type!r} is not supported; supported types are "
            f"{list(SUPPORTED_ROPE_TYPES)}. Use a checkpoint without that rope scaling or remove it "
            "from config.json if the model was not trained with it."
        )
    if float(rope_parameters.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedRopeScalingError(f"{config_name}: partial_rotary_factor != 1 is not supported.")
    inv_freq = default_inverse_frequencies(float(rope_parameters["rope_theta"]), head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope_parameters["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_parameters)
    return tuple(float(x) for x in inv_freq.astype(np.float32))


def default_inverse_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """``1 / theta ** (2i / rotary_dim)`` for ``i < rotary_dim / 2``, float32, computed as ``transformers``' default
    rope does (integer exponents cast to float32 before the division)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, params: Mapping) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq: tuple[float, ...]) -> jax.Array:
    """``positions[..., None] * inv_freq`` in float32 at full precision: ``[B, T, d/2]``."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)


def apply_rope(inputs: jax.Array, positions: jax.Array, *, inv_freq: tuple[float, ...], **_ignored) -> jax.Array:
    """Rotates ``inputs [B, T, N, H]`` by ``positions [B, T]`` (half-split layout, as HF's ``rotate_half``).

    Drop-in for Tunix's ``apply_rope(inputs, positions, head_dim, rope_theta=...)``; the
    Tunix keyword arguments are ignored because ``inv_freq`` already encodes them.
    """
    angles = rope_angles(positions, inv_freq)[..., None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(inputs, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(inputs.dtype)


def sin_cos(positions: jax.Array, features: int, rope_theta: float, *, inv_freq: tuple[float, ...]):
    """Drop-in for Tunix Qwen2's ``_generate_pos_embeddings``: ``(sin, cos)`` of ``[B, T, d/2]``."""
    angles = rope_angles(positions, inv_freq)
    return jnp.sin(angles), jnp.cos(angles)


@functools.cache
def with_rope(
    cls: type, method_name: str, global_name: str, rope_function: Callable, inv_freq: tuple[float, ...]
) -> type:
    """A subclass of ``cls`` whose ``method_name`` runs Tunix's own code with ``global_name``
    bound to ``rope_function`` at ``inv_freq``.

    The subclass keeps the class name, so module trees and parameter paths do not change.
    Cached, so every model with the same rope shares one class (and one jit cache entry).
    """
    method = getattr(cls, method_name)
    namespace = dict(method.__globals__)
    namespace[global_name] = functools.partial(rope_function, inv_freq=inv_freq)
    patched = types.FunctionType(method.__code__, namespace, method.__name__, method.__defaults__, method.__closure__)
    patched.__kwdefaults__ = method.__kwdefaults__
    patched.__qualname__ = method.__qualname__
    derived = type(cls.__name__, (cls,), {method_name: patched, "__module__": cls.__module__})
    register_derived_class(derived, with_rope, (cls, method_name, global_name, rope_function, inv_freq))
    return derived


def attention_with_rope(attention_class: type, rope_parameters: Mapping, head_dim: int, *, pages: bool = False) -> type:
    """Tunix's ``attention_class`` with its ``block`` applying Hugging Face's rope: the frequencies of
    ``rope_parameters`` (``rope_theta`` and any scaling, :func:`rope_inverse_frequencies`) at ``head_dim``.

    Args:
        attention_class: a Tunix attention class whose ``block`` calls the module-level ``apply_rope``.
        rope_parameters: the HF config's ``rope_parameters``.
        head_dim: the attention head size.
        pages: whether the class also reads the paged engine's pages in place (:func:`reading_pages`: Qwen3's and
            Llama 3's attention, whose projections it knows).

    Returns:
        The cached subclass (:func:`with_rope`, with :func:`reading_pages` where ``pages``); assign it to each
        layer's ``attn.__class__``.
    """
    inv_freq = rope_inverse_frequencies(rope_parameters, head_dim)
    derived = with_rope(attention_class, "block", "apply_rope", apply_rope, inv_freq)
    return reading_pages(derived, inv_freq) if pages else derived


@functools.cache
def reading_pages(cls: type, inv_freq: tuple[float, ...]) -> type:
    """A subclass of the Tunix attention ``cls`` whose ``block`` takes the paged engine's cache entry
    (:func:`.paged_attention.is_paged`): the fed token's query, key and value are projected as Tunix's ``block``
    projects them, and :func:`.paged_attention.attend` writes the key and value to their page and reads the row's pages
    in place. Any other cache runs Tunix's ``block`` unchanged. Keeps the class name (module trees and parameter paths
    do not change); cached and registered as :func:`with_rope`'s classes are.

    Qwen3's and Llama 3's attention (``q_proj``/``k_proj``/``v_proj``/``o_proj``, optional ``q_norm``/``k_norm``
    before the rope, ``scale``) need nothing more; another class gives ``paged_projections(x) -> (q, k, v)``,
    ``paged_output(heads)`` and ``paged_settings() -> attend's keywords`` (Gemma 2's: its einsums, query scalar, window
    and soft cap)."""
    from . import paged_attention

    def paged_block(self, x, segment_pos, cache, *_, **__):  # the mask (and Qwen3's segment_ids) are not read
        if hasattr(self, "paged_projections"):
            query, key, value = self.paged_projections(x)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if hasattr(self, "q_norm"):
                query, key = self.q_norm(query), self.k_norm(key)
        query = apply_rope(query, segment_pos, inv_freq=inv_freq)
        key = apply_rope(key, segment_pos, inv_freq=inv_freq)
        settings = self.paged_settings() if hasattr(self, "paged_settings") else {"scale": self.scale}
        out, cache = paged_attention.attend(query, key, value, cache, **settings)
        return cache, self.paged_output(out) if hasattr(self, "paged_output") else self.o_proj(out)

    return paged_attention.reading_pages_subclass(cls, paged_block, 2, reading_pages, (cls, inv_freq))
