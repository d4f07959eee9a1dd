"""Mistral 3's vision side as NNX modules: Pixtral's encoder (``transformers``' ``PixtralVisionModel``) and Mistral 3's
projector (an RMS norm, the patch merger, two linear layers); :class:`Mistral3Decoder` puts the projected features in
place of the ``[IMG]`` tokens of the native decoder's input.

Pixtral reads each image at its own size: a patch embedding (a convolution with stride equal to its kernel, no bias,
a linear map of each patch), ``ln_pre``, pre-norm blocks (RMS norms, a gated MLP) whose attention stays within each
image and rotates each head by the patch's row and column (Pixtral's 2-D rope: even frequencies by row, odd by
column). ``transformers`` runs the batch's patches as one sequence with a block mask; here each row's patches are one
padded sequence with an image id per patch, as :mod:`.qwen_vision` does. Mistral 3's patch merger then concatenates
each ``spatial_merge_size x spatial_merge_size`` block of an image's patch grid (``torch.nn.functional.unfold``'s
order: feature-major, then the block's row and column) through ``merging_layer``; the host gives, per merged token,
the four patches of its block (:func:`~adapters.families.mistral3.images`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .clip_vision import CLIP_ACTIVATIONS, vision_linear
from .native_decoder import DecoderSpec, NativeDecoder, Norm

MASKED = -2.3819763e38


@dataclass(frozen=True)
class PixtralSpec:
    """Pixtral's encoder and Mistral 3's projector.

    Args:
        width, num_heads, intermediate_size, blocks: the encoder's sizes (``blocks``: how many run, up to
            ``vision_feature_layer``).
        patch_size, in_channels, max_patches_per_side: patches, and the rope's grid side (``image_size //
            patch_size``).
        rope_theta: the rope's base.
        activation, projector_activation: the blocks' and the projector's (``CLIP_ACTIVATIONS`` keys).
        spatial_merge_size: the merger's block side.
        projector_norm_eps: the projector's RMS norm epsilon (the text config's ``rms_norm_eps``).
        text_hidden_size, projector_bias: the projector's output width and whether its linear layers have biases.
        image_token_id: the placeholder the merged features replace.
        dtype: the parameters' dtype.
    """

    width: int
    num_heads: int
    intermediate_size: int
    blocks: int
    patch_size: int
    in_channels: int
    max_patches_per_side: int
    rope_theta: float
    activation: str
    projector_activation: str
    spatial_merge_size: int
    projector_norm_eps: float
    text_hidden_size: int
    projector_bias: bool
    image_token_id: int
    dtype: jnp.dtype = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.patch_size ** 2


class PixtralAttention(nnx.Module):
    def __init__(self, spec: PixtralSpec, rngs: nnx.Rngs):
        self.num_heads = spec.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, vision_linear(spec, spec.width, spec.width, rngs, bias=False))

    def __call__(self, x, cos, sin, mask):
        batch, length, width = x.shape
        q, k, v = (getattr(self, name)(x).reshape(batch, length, self.num_heads, -1)
                   for name in ("q_proj", "k_proj", "v_proj"))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = jnp.einsum("BPND,BQND->BNPQ", q, k) * (q.shape[-1] ** -0.5)
        scores = jnp.where(mask[:, None], scores, MASKED)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        return self.o_proj(jnp.einsum("BNPQ,BQND->BPND", probs, v).reshape(batch, length, width))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``rotate_half`` over the whole head with ``cos``/``sin`` ``[B, P, D / 2]``, in ``x``'s dtype."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class PixtralFeedForward(nnx.Module):
    def __init__(self, spec: PixtralSpec, rngs: nnx.Rngs):
        self.activation = CLIP_ACTIVATIONS[spec.activation]
        self.gate_proj = vision_linear(spec, spec.width, spec.intermediate_size, rngs, bias=False)
        self.up_proj = vision_linear(spec, spec.width, spec.intermediate_size, rngs, bias=False)
        self.down_proj = vision_linear(spec, spec.intermediate_size, spec.width, rngs, bias=False)

    def __call__(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class PixtralBlock(nnx.Module):
    def __init__(self, spec: PixtralSpec, rngs: nnx.Rngs):
        self.attention_norm = Norm(spec.width, "rms", 1e-5, False, spec.dtype, rngs)
        self.attention = PixtralAttention(spec, rngs)
        self.ffn_norm = Norm(spec.width, "rms", 1e-5, False, spec.dtype, rngs)
        self.feed_forward = PixtralFeedForward(spec, rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralEncoder(nnx.Module):
    """``patch_conv`` (kernel ``[C, P, P, width]``, no bias), ``ln_pre``, ``layers``."""

    def __init__(self, spec: PixtralSpec, rngs: nnx.Rngs):
        self.spec = spec
        self.patch_conv = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (spec.in_channels, spec.patch_size, spec.patch_size, spec.width), spec.dtype))
        self.ln_pre = Norm(spec.width, "rms", 1e-5, False, spec.dtype, rngs)
        self.layers = nnx.List([PixtralBlock(spec, rngs) for _ in range(spec.blocks)])

    def __call__(self, patches: jax.Array, rows_cols: jax.Array, images: jax.Array) -> jax.Array:
        """Each row's patch features ``[B, P, width]``: ``patches`` ``[B, P, C * P * P]`` (channel-major, as the
        convolution reads them), ``rows_cols`` ``[B, P, 2]``, ``images`` ``[B, P]`` (from 1; 0 on padding)."""
        spec = self.spec
        kernel = self.patch_conv.get_value()
        x = jnp.einsum("BPk,kW->BPW", patches.astype(kernel.dtype), kernel.reshape(-1, spec.width))
        x = self.ln_pre(x)
        freqs = 1.0 / (spec.rope_theta ** (np.arange(0, spec.head_dim, 2, dtype=np.float32) / spec.head_dim))
        positions = rows_cols.astype(jnp.float32)
        angles = jnp.concatenate([positions[..., :1] * jnp.asarray(freqs[::2]),
                                  positions[..., 1:] * jnp.asarray(freqs[1::2])], axis=-1)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        mask = (images[:, :, None] == images[:, None, :]) & (images[:, :, None] > 0)
        for block in self.layers:
            x = block(x, cos, sin, mask)
        return x


class Mistral3Projector(nnx.Module):
    """``norm`` (RMS), ``patch_merger.merging_layer`` (no bias), ``linear_1``, the activation, ``linear_2``."""

    def __init__(self, spec: PixtralSpec, rngs: nnx.Rngs):
        self.activation = CLIP_ACTIVATIONS[spec.projector_activation]
        self.norm = Norm(spec.width, "rms", spec.projector_norm_eps, False, spec.dtype, rngs)
        self.merging_layer = vision_linear(spec, spec.width * spec.spatial_merge_size ** 2, spec.width, rngs,
                                           bias=False)
        self.linear_1 = vision_linear(spec, spec.width, spec.text_hidden_size, rngs, spec.projector_bias)
        self.linear_2 = vision_linear(spec, spec.text_hidden_size, spec.text_hidden_size, rngs, spec.projector_bias)

    def __call__(self, features: jax.Array, blocks: jax.Array) -> jax.Array:
        """``[B, N, text width]`` for the merged tokens whose blocks' patches ``blocks`` ``[B, N, k * k]`` name."""
        features = self.norm(features)
        batch, count, cells = blocks.shape
        gathered = jnp.take_along_axis(features, blocks.reshape(batch, count * cells)[..., None], axis=1)
        gathered = gathered.reshape(batch, count, cells, -1)
        merged = jnp.swapaxes(gathered, 2, 3).reshape(batch, count, -1)  # feature-major, as unfold lays them out
        return self.linear_2(self.activation(self.linear_1(self.merging_layer(merged))))


class Mistral3Decoder(NativeDecoder):
    """The native decoder with Pixtral's ``vision_tower`` and Mistral 3's ``multi_modal_projector``: a call with
    ``images`` (``patches``, ``rows_cols``, ``image_ids``, ``blocks``) puts the merged features in place of the
    ``[IMG]`` tokens, in order."""

    def __init__(self, spec: DecoderSpec, vision: PixtralSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, rngs=rngs)
        self.vision_tower = PixtralEncoder(vision, rngs)
        self.multi_modal_projector = Mistral3Projector(vision, rngs)

    def __call__(self, tokens, positions, cache, attention_mask, images: dict | None = None):
        x = self.embedder.encode(tokens)
        if images is not None:
            features = self.vision_tower(images["patches"], images["rows_cols"], images["image_ids"])
            merged = self.multi_modal_projector(features, images["blocks"])
            is_image = tokens == self.vision_tower.spec.image_token_id
            rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, merged.shape[1] - 1)
            gathered = jnp.take_along_axis(merged, rank[..., None], axis=1).astype(x.dtype)
            x = jnp.where(is_image[..., None], gathered, x)
        return self.decode_embeddings(x, positions, cache, attention_mask)

    def get_model_input(self) -> dict:
        """Qwix's tracing call with one merged image token per row, so the tower and the projector run too."""
        inputs = super().get_model_input()
        vision = self.vision_tower.spec
        cells = vision.spatial_merge_size ** 2
        inputs["tokens"] = jnp.full((2, 1), vision.image_token_id, jnp.int32)
        inputs["images"] = {"patches": jnp.zeros((2, cells, vision.patch_values), jnp.float32),
                            "rows_cols": jnp.zeros((2, cells, 2), jnp.int32),
                            "image_ids": jnp.ones((2, cells), jnp.int32),
                            "blocks": jnp.broadcast_to(jnp.arange(cells, dtype=jnp.int32), (2, 1, cells))}
        return inputs
