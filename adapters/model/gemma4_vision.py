"""Gemma 4's vision side as NNX modules: the vision encoder (``transformers``' ``Gemma4VisionModel``: patch
embedder, encoder with 2-D rope, position pooler, standardization) and ``embed_vision`` (``Gemma4MultimodalEmbedder``),
which together turn a row's images into the soft tokens that replace its image tokens.

Images arrive as Gemma 4's image processor gives them, already cut into patches: each image is ``max_patches`` rows of
``3 * patch_size ** 2`` pixel values with each patch's ``(x, y)`` place in the image's patch grid, padding patches
after the real ones. On the host each row's images become slots (:class:`Gemma4VisionSpec` documents the layout): a
``patch_mask`` says which patches are real, so the zeros that pad a batch of rows are padding here too. Every slot
runs; each pooled cell that holds a real patch is one soft token, and a row's image tokens take its slots' soft tokens
in order.

The modules are named as ``transformers`` names them (``vision_tower.encoder.layers.0.self_attn.q_proj.linear``...),
so the weight table is one row per tensor; the clipping bounds of ``Gemma4ClippableLinear`` and the
``std_bias``/``std_scale`` of the standardization are :class:`~.nnx_state.Buffer` s (saved, never trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from .clip_vision import MASKED, vision_linear
from .native_decoder import ACTIVATIONS, Norm
from .nnx_state import Buffer


@dataclass(frozen=True)
class Gemma4VisionSpec:
    """The encoder and ``embed_vision`` of a ``Gemma4VisionConfig``.

    The module's ``images`` are a dict of per-row arrays (``N`` image slots of a row, ``P`` patches each):
    ``patches`` ``[B, N, P, 3 * patch_size ** 2]`` float32 pixel values in ``[0, 1]``, ``positions`` ``[B, N, P, 2]``
    int32 ``(x, y)`` patch places, ``patch_mask`` ``[B, N, P]`` bool (``False``: a padding patch or an empty slot).

    Args:
        width, num_heads, num_kv_heads, head_dim, intermediate_size, blocks: the encoder's sizes.
        patch_size: pixels a patch side.
        position_embedding_size: rows of each axis's learned position table (the most patches a side).
        pooling_kernel_size: the side of the square of patches pooled into one soft token.
        rope_theta: the 2-D rope's base.
        norm_eps: every RMS norm's epsilon (``rms_norm_eps``).
        activation: the MLP's (``ACTIVATIONS`` key).
        clipped_linears: ``use_clipped_linears``: each linear clamps its input and output to saved bounds.
        standardize: the pooled features are standardized with the saved ``std_bias`` and ``std_scale``.
        text_hidden_size: ``embed_vision``'s output width.
        image_token_id: the placeholder the soft tokens replace.
        dtype: the parameters' and the computation's dtype.
    """

    width: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    blocks: int
    patch_size: int
    position_embedding_size: int
    pooling_kernel_size: int
    rope_theta: float
    norm_eps: float
    activation: str
    clipped_linears: bool
    standardize: bool
    text_hidden_size: int
    image_token_id: int
    dtype: jnp.dtype = jnp.float32

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch (three channels)."""
        return 3 * self.patch_size ** 2


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x ** 2) + eps)`` over the last axis in float32, cast back (``Gemma4RMSNorm`` without a
    scale: the vision values' ``v_norm`` and ``embed_vision``'s ``embedding_pre_projection_norm``)."""
    values = x.astype(jnp.float32)
    return (values * jax.lax.rsqrt(jnp.mean(values * values, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class ClippableLinear(nnx.Module):
    """``Gemma4ClippableLinear``: a linear map without bias (``linear``), its input and output clamped to the saved
    ``input_min``/``input_max`` and ``output_min``/``output_max`` when the config clips."""

    def __init__(self, spec: Gemma4VisionSpec, inputs: int, outputs: int, rngs: nnx.Rngs):
        self.linear = vision_linear(spec, inputs, outputs, rngs, bias=False)
        if spec.clipped_linears:
            for name, bound in (("input_min", -jnp.inf), ("input_max", jnp.inf), ("output_min", -jnp.inf),
                                ("output_max", jnp.inf)):
                setattr(self, name, Buffer(jnp.asarray(bound, spec.dtype)))
        self.clipped = spec.clipped_linears

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.clipped:
            x = jnp.clip(x, self.input_min.get_value(), self.input_max.get_value())
        x = self.linear(x)
        if self.clipped:
            x = jnp.clip(x, self.output_min.get_value(), self.output_max.get_value())
        return x


class PatchEmbedder(nnx.Module):
    """``Gemma4VisionPatchEmbedder``: pixels rescaled to ``[-1, 1]``, ``input_proj``, plus the sum of the patch's
    column and row embeddings (``position_embedding_table`` ``[2, position_embedding_size, width]``; none on padding
    patches)."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.input_proj = vision_linear(spec, spec.patch_values, spec.width, rngs, bias=False)
        self.position_embedding_table = nnx.Param(jnp.ones((2, spec.position_embedding_size, spec.width),
                                                           spec.dtype))

    def __call__(self, patches: jax.Array, positions: jax.Array, patch_mask: jax.Array) -> jax.Array:
        x = self.input_proj((2.0 * (patches - 0.5)).astype(self.input_proj.kernel.get_value().dtype))
        table = self.position_embedding_table.get_value()
        embedded = table[0][positions[..., 0]] + table[1][positions[..., 1]]
        return x + jnp.where(patch_mask[..., None], embedded, 0.0).astype(x.dtype)


def rotated_2d(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """``apply_multidimensional_rope`` with ``Gemma4VisionRotaryEmbedding``'s tables: the first half of each head
    rotated by the patch's column, the second half by its row, each half as ``rotate_half`` rope with the
    frequencies ``theta ** (-2i / (head_dim / 2))``.

    Args:
        x: ``[N, P, heads, head_dim]`` queries or keys (``head_dim`` a multiple of 4).
        positions: ``[N, P, 2]`` int ``(x, y)`` patch places.
    """
    half = x.shape[-1] // 2
    frequencies = 1.0 / theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * frequencies  # [N, P, 2, half / 2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None]  # [N, P, 1, 2, half]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    parts = x.reshape(*x.shape[:-1], 2, half)
    turned = jnp.concatenate([-parts[..., half // 2:], parts[..., :half // 2]], axis=-1)
    return (parts * cos + turned * sin).reshape(x.shape)


class VisionAttention(nnx.Module):
    """``Gemma4VisionAttention``: projections, ``q_norm``/``k_norm`` (RMS norms with a scale) and a scale-less RMS
    norm on the values, 2-D rope, attention scaled by 1 over every real patch, ``o_proj``."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.spec = spec
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = ClippableLinear(spec, spec.width, heads * head_dim, rngs)
        self.k_proj = ClippableLinear(spec, spec.width, kv_heads * head_dim, rngs)
        self.v_proj = ClippableLinear(spec, spec.width, kv_heads * head_dim, rngs)
        self.o_proj = ClippableLinear(spec, heads * head_dim, spec.width, rngs)
        self.q_norm = Norm(head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs)
        self.k_norm = Norm(head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, patch_mask: jax.Array) -> jax.Array:
        spec = self.spec
        count, length, _ = x.shape
        heads = lambda array: array.reshape(count, length, -1, spec.head_dim)  # noqa: E731
        q = rotated_2d(self.q_norm(heads(self.q_proj(x))), positions, spec.rope_theta)
        k = rotated_2d(self.k_norm(heads(self.k_proj(x))), positions, spec.rope_theta)
        v = rms_normalized(heads(self.v_proj(x)), spec.norm_eps)
        groups = spec.num_heads // spec.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("NPHD,NQHD->NHPQ", q, k)  # Gemma 4's scaling is 1: the norms set the scale
        scores = jnp.where(patch_mask[:, None, None, :], scores, MASKED)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        return self.o_proj(jnp.einsum("NHPQ,NQHD->NPHD", probs, v).reshape(count, length, -1))


class VisionMLP(nnx.Module):
    """``Gemma4VisionMLP``: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.activation = ACTIVATIONS[spec.activation]
        self.gate_proj = ClippableLinear(spec, spec.width, spec.intermediate_size, rngs)
        self.up_proj = ClippableLinear(spec, spec.width, spec.intermediate_size, rngs)
        self.down_proj = ClippableLinear(spec, spec.intermediate_size, spec.width, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nnx.Module):
    """``Gemma4VisionEncoderLayer``: attention and MLP, each between a pre- and a post-norm (sandwich norms)."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        norm = lambda: Norm(spec.width, "rms", spec.norm_eps, False, spec.dtype, rngs)  # noqa: E731
        self.self_attn = VisionAttention(spec, rngs)
        self.mlp = VisionMLP(spec, rngs)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def __call__(self, x: jax.Array, positions: jax.Array, patch_mask: jax.Array) -> jax.Array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, patch_mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nnx.Module):
    """``Gemma4VisionEncoder``'s ``layers``."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.layers = nnx.List([VisionEncoderLayer(spec, rngs) for _ in range(spec.blocks)])

    def __call__(self, x: jax.Array, positions: jax.Array, patch_mask: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x, positions, patch_mask)
        return x


def pooled_by_positions(hidden: jax.Array, positions: jax.Array, patch_mask: jax.Array, kernel: int
                        ) -> tuple[jax.Array, jax.Array]:
    """``Gemma4VisionPooler._avg_pool_by_positions``: the mean of each ``kernel x kernel`` square of patches, in
    float32, over an image's own patch grid (cell ``x // kernel + (columns // kernel) * (y // kernel)``).

    Args:
        hidden: ``[N, P, W]`` patch features (padding patches weigh nothing).
        positions: ``[N, P, 2]`` ``(x, y)`` patch places.
        patch_mask: ``[N, P]`` real patches.
        kernel: ``pooling_kernel_size``.

    Returns:
        ``([N, P // kernel ** 2, W]`` float32 cell features, ``[N, P // kernel ** 2]`` cells holding a real patch).
    """
    cells = hidden.shape[1] // kernel ** 2
    columns = jnp.max(jnp.where(patch_mask, positions[..., 0], 0), axis=-1, keepdims=True) + 1
    cell = positions[..., 0] // kernel + (columns // kernel) * (positions[..., 1] // kernel)
    weights = jax.nn.one_hot(cell, cells, dtype=jnp.float32) * patch_mask[..., None] / kernel ** 2  # [N, P, cells]
    return jnp.einsum("NPC,NPW->NCW", weights, hidden.astype(jnp.float32)), jnp.any(weights > 0, axis=1)


class Gemma4VisionModel(nnx.Module):
    """``Gemma4VisionModel``: ``patch_embedder``, ``encoder``, the pooler (the cells' means times
    ``sqrt(width)``, in float32) and, with ``standardize``, ``(x - std_bias) * std_scale``."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.spec = spec
        self.patch_embedder = PatchEmbedder(spec, rngs)
        self.encoder = VisionEncoder(spec, rngs)
        if spec.standardize:
            self.std_bias = Buffer(jnp.zeros((spec.width,), spec.dtype))
            self.std_scale = Buffer(jnp.ones((spec.width,), spec.dtype))

    def __call__(self, patches: jax.Array, positions: jax.Array, patch_mask: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
        """``([N, P // kernel ** 2, width]`` soft tokens, ``[N, P // kernel ** 2]`` which are real) of ``N`` image
        slots (``patches`` ``[N, P, 3 * patch_size ** 2]``, ``positions`` ``[N, P, 2]``, ``patch_mask`` ``[N, P]``)."""
        spec = self.spec
        x = self.patch_embedder(patches, positions, patch_mask)
        x = self.encoder(x, positions, patch_mask)
        pooled, real = pooled_by_positions(x, positions, patch_mask, spec.pooling_kernel_size)
        # transformers returns the pooled means in the working dtype before scaling them in float32.
        pooled = pooled.astype(x.dtype).astype(jnp.float32) * spec.width ** 0.5
        if spec.standardize:
            pooled = ((pooled - self.std_bias.get_value().astype(jnp.float32))
                      * self.std_scale.get_value().astype(jnp.float32))
        return pooled.astype(x.dtype), real


class MultimodalEmbedder(nnx.Module):
    """``Gemma4MultimodalEmbedder`` (``embed_vision``): a scale-less RMS norm, then ``embedding_projection`` to the
    text width."""

    def __init__(self, spec: Gemma4VisionSpec, rngs: nnx.Rngs):
        self.eps = spec.norm_eps
        self.embedding_projection = vision_linear(spec, spec.width, spec.text_hidden_size, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embedding_projection(rms_normalized(x, self.eps))


def image_features_in_place(x: jax.Array, is_image: jax.Array, features: jax.Array, real: jax.Array) -> jax.Array:
    """``x`` with each row's image tokens replaced, in order, by the row's real soft tokens (``transformers``'
    ``masked_scatter`` of the image features, row by row).

    Args:
        x: ``[B, T, H]`` embeddings.
        is_image: ``[B, T]`` the image tokens.
        features: ``[B, S, H]`` the soft tokens of a row's slots, slot after slot.
        real: ``[B, S]`` which soft tokens are real (the others are padding cells or empty slots).
    """
    real_first = jnp.argsort(~real, axis=1, stable=True)  # the real soft tokens' indices, in order
    rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    index = jnp.take_along_axis(real_first, rank, axis=1)
    gathered = jnp.take_along_axis(features, index[..., None], axis=1).astype(x.dtype)
    return jnp.where(is_image[..., None], gathered, x)
