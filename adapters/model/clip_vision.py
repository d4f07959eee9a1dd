"""LLaVA's vision side as NNX modules: the CLIP vision encoder (``transformers``' ``CLIPVisionModel``) up to the layer
LLaVA reads its features from, and the multimodal projector; :class:`LlavaDecoder` puts the projected features in
place of the ``<image>`` tokens of the native decoder's input.

The encoder: a patch embedding (a convolution with stride equal to its kernel, no bias, computed as a linear map of
each patch), a class embedding before the patches, learned position embeddings, ``pre_layrnorm``, pre-norm blocks
with bidirectional attention and a quick-GELU (or the config's) MLP. LLaVA takes the hidden states after
``vision_feature_layer`` (``-2``: all but the last block) and drops the class position (``"default"`` strategy), so
only the blocks up to that layer are built; the rest of the checkpoint's tower (the last block, ``post_layernorm``)
is kept as it is and written back on export, as ``transformers`` never trains it either (no gradient reaches it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .native_decoder import ACTIVATIONS, DecoderSpec, NativeDecoder, Norm

MASKED = -2.3819763e38

CLIP_ACTIVATIONS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x), **ACTIVATIONS}
"""``transformers``' ``ACT2FN`` names the CLIP encoder and LLaVA's projector use."""


@dataclass(frozen=True)
class ClipVisionSpec:
    """The CLIP encoder LLaVA runs, and its projector.

    Args:
        width, num_heads, intermediate_size: the blocks' sizes.
        blocks: how many blocks run (``num_hidden_layers + 1 + vision_feature_layer`` for a negative layer).
        image_size, patch_size, in_channels: the images and their patches.
        layer_norm_eps: the encoder's LayerNorm epsilon.
        activation, projector_activation: the blocks' and the projector's (``CLIP_ACTIVATIONS`` keys).
        keep_class_token: the ``"full"`` feature strategy (the class position is an image token too).
        text_hidden_size: the projector's output width.
        projector_bias: the projector's linear layers have biases.
        image_token_id: the placeholder the features replace.
        dtype: the parameters' dtype.
        feature_layers: the hidden states LLaVA reads, concatenated along the features (0: the embeddings after
            ``pre_layrnorm``, ``i``: block ``i``'s output; a list ``vision_feature_layer``); empty: block ``blocks``'s
            output alone.
    """

    width: int
    num_heads: int
    intermediate_size: int
    blocks: int
    image_size: int
    patch_size: int
    in_channels: int
    layer_norm_eps: float
    activation: str
    projector_activation: str
    keep_class_token: bool
    text_hidden_size: int
    projector_bias: bool
    image_token_id: int
    dtype: jnp.dtype = jnp.float32
    feature_layers: tuple[int, ...] = ()

    @property
    def read_layers(self) -> tuple[int, ...]:
        """The hidden states the features concatenate (:attr:`feature_layers`, or the last block's)."""
        return self.feature_layers or (self.blocks,)

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.patches + (1 if self.keep_class_token else 0)


def vision_linear(spec: Any, inputs: int, outputs: int, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    """A tower's ``nn.Linear`` (kernel ``[inputs, outputs]``, normal(0.02) at init) in ``spec.dtype`` (CLIP's,
    SigLIP's and Pixtral's towers build theirs with it)."""
    return nnx.Linear(inputs, outputs, use_bias=bias, param_dtype=spec.dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class ClipAttention(nnx.Module):
    """``q_proj``/``k_proj``/``v_proj``/``out_proj`` (biases), every patch seeing every patch (every real one, with
    ``keys``: SigLIP's padding patches are no keys)."""

    def __init__(self, spec: ClipVisionSpec, rngs: nnx.Rngs):
        self.num_heads = spec.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, vision_linear(spec, spec.width, spec.width, rngs))

    def __call__(self, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
        batch, length, width = x.shape
        q, k, v = (getattr(self, name)(x).reshape(batch, length, self.num_heads, -1)
                   for name in ("q_proj", "k_proj", "v_proj"))
        scores = jnp.einsum("BPND,BQND->BNPQ", q, k) * (q.shape[-1] ** -0.5)
        if keys is not None:
            scores = jnp.where(keys[:, None, None, :], scores, MASKED)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        return self.out_proj(jnp.einsum("BNPQ,BQND->BPND", probs, v).reshape(batch, length, width))


class ClipMLP(nnx.Module):
    def __init__(self, spec: ClipVisionSpec, rngs: nnx.Rngs):
        self.activation = CLIP_ACTIVATIONS[spec.activation]
        self.fc1 = vision_linear(spec, spec.width, spec.intermediate_size, rngs)
        self.fc2 = vision_linear(spec, spec.intermediate_size, spec.width, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.activation(self.fc1(x)))


class ClipBlock(nnx.Module):
    """A pre-norm block: ``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp`` (CLIP's and SigLIP's alike)."""

    def __init__(self, spec: ClipVisionSpec, rngs: nnx.Rngs):
        self.layer_norm1 = Norm(spec.width, "layer", spec.layer_norm_eps, True, spec.dtype, rngs)
        self.self_attn = ClipAttention(spec, rngs)
        self.layer_norm2 = Norm(spec.width, "layer", spec.layer_norm_eps, True, spec.dtype, rngs)
        self.mlp = ClipMLP(spec, rngs)

    def __call__(self, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), keys)
        return x + self.mlp(self.layer_norm2(x))


class ClipVisionTower(nnx.Module):
    """``patch_embedding`` (kernel ``[P, P, C, width]``), ``class_embedding``, ``position_embedding``,
    ``pre_layrnorm`` and the blocks LLaVA reads."""

    def __init__(self, spec: ClipVisionSpec, rngs: nnx.Rngs):
        self.spec = spec
        normal = nnx.initializers.normal(0.02)
        self.patch_embedding = nnx.Param(normal(rngs.params(), (spec.patch_size, spec.patch_size, spec.in_channels,
                                                                 spec.width), spec.dtype))
        self.class_embedding = nnx.Param(normal(rngs.params(), (spec.width,), spec.dtype))
        self.position_embedding = nnx.Param(normal(rngs.params(), (spec.patches + 1, spec.width), spec.dtype))
        self.pre_layrnorm = Norm(spec.width, "layer", spec.layer_norm_eps, True, spec.dtype, rngs)
        self.layers = nnx.List([ClipBlock(spec, rngs) for _ in range(spec.blocks)])

    def __call__(self, images: jax.Array) -> jax.Array:
        """The features ``[N, tokens_per_image, width]`` of images ``[N, H, W, C]``."""
        spec = self.spec
        kernel = self.patch_embedding.get_value()
        side = spec.image_size // spec.patch_size
        count = images.shape[0]
        patches = images.astype(kernel.dtype).reshape(count, side, spec.patch_size, side, spec.patch_size,
                                                      spec.in_channels)
        x = jnp.einsum("NhiwjC,ijCW->NhwW", patches, kernel).reshape(count, side * side, spec.width)
        cls = jnp.broadcast_to(self.class_embedding.get_value()[None, None], (count, 1, spec.width))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding.get_value()[None]
        states = [self.pre_layrnorm(x)]
        for block in self.layers:
            states.append(block(states[-1]))
        x = jnp.concatenate([states[layer] for layer in spec.read_layers], axis=-1)
        return x if spec.keep_class_token else x[:, 1:]


class LlavaProjector(nnx.Module):
    """``linear_1``, the projector's activation, ``linear_2``."""

    def __init__(self, spec: ClipVisionSpec, rngs: nnx.Rngs):
        self.activation = CLIP_ACTIVATIONS[spec.projector_activation]
        self.linear_1 = vision_linear(spec, spec.width * len(spec.read_layers), spec.text_hidden_size, rngs,
                                      spec.projector_bias)
        self.linear_2 = vision_linear(spec, spec.text_hidden_size, spec.text_hidden_size, rngs, spec.projector_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(self.activation(self.linear_1(x)))


class LlavaDecoder(NativeDecoder):
    """The native decoder with LLaVA's ``vision_tower`` and ``multi_modal_projector``: a call with ``images``
    ``[B, N, H, W, C]`` (each row's images in token order, zero slots after) puts each image's projected features in
    place of its ``<image>`` tokens, in order."""

    def __init__(self, spec: DecoderSpec, vision: ClipVisionSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, rngs=rngs)
        self.vision_tower = ClipVisionTower(vision, rngs)
        self.multi_modal_projector = LlavaProjector(vision, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict | None, attention_mask: jax.Array,
                 images: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        x = self.embedder.encode(tokens)
        if images is not None:
            batch, slots = images.shape[:2]
            features = self.multi_modal_projector(self.vision_tower(images.reshape(batch * slots, *images.shape[2:])))
            features = features.reshape(batch, slots * features.shape[1], features.shape[-1])
            is_image = tokens == self.vision_tower.spec.image_token_id
            rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
            gathered = jnp.take_along_axis(features, rank[..., None], axis=1).astype(x.dtype)
            x = jnp.where(is_image[..., None], gathered, x)
        return self.decode_embeddings(x, positions, cache, attention_mask)

    def get_model_input(self) -> dict:
        """Qwix's tracing call (:meth:`NativeDecoder.get_model_input`) with one zero image per row, so the tower
        and the projector run too."""
        inputs = super().get_model_input()
        vision = self.vision_tower.spec
        inputs["tokens"] = jnp.full((2, 1), vision.image_token_id, jnp.int32)
        inputs["images"] = jnp.zeros((2, 1, vision.image_size, vision.image_size, vision.in_channels), jnp.float32)
        return inputs


class LlavaNextDecoder(LlavaDecoder):
    """LLaVA-NeXT: :class:`LlavaDecoder` with ``image_newline``; a call's ``images`` are a dict of ``tiles``
    ``[B, T, H, W, C]`` (each row's images' tiles: the base view, then the high-resolution grid) and
    ``feature_index`` ``[B, N]``: for each image token of the row, in order, the flat position of its feature among
    the row's tiles' features (``tile * tokens_per_image + patch``), or ``-1`` for the newline after each row of the
    unpadded grid (:func:`~adapters.families.llava.next_images` lays them out as ``transformers`` packs them)."""

    def __init__(self, spec: DecoderSpec, vision: ClipVisionSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, vision, rngs=rngs)
        self.image_newline = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (spec.hidden_size,), spec.dtype))

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict | None, attention_mask: jax.Array,
                 images: dict | None = None) -> tuple[jax.Array, dict | None]:
        x = self.embedder.encode(tokens)
        if images is not None:
            tiles, index = images["tiles"], images["feature_index"]
            batch, count = tiles.shape[:2]
            features = self.multi_modal_projector(self.vision_tower(tiles.reshape(batch * count, *tiles.shape[2:])))
            features = features.reshape(batch, count * features.shape[1], features.shape[-1])
            is_image = tokens == self.vision_tower.spec.image_token_id
            rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, index.shape[1] - 1)
            position = jnp.take_along_axis(index, rank, axis=1)  # [B, T]
            gathered = jnp.take_along_axis(features, jnp.maximum(position, 0)[..., None], axis=1).astype(x.dtype)
            gathered = jnp.where((position < 0)[..., None], self.image_newline.get_value().astype(x.dtype), gathered)
            x = jnp.where(is_image[..., None], gathered, x)
        return self.decode_embeddings(x, positions, cache, attention_mask)

    def get_model_input(self) -> dict:
        """Qwix's tracing call with one tile per row (see :meth:`LlavaDecoder.get_model_input`)."""
        inputs = super().get_model_input()
        inputs["images"] = {"tiles": inputs["images"], "feature_index": jnp.zeros((2, 1), jnp.int32)}
        return inputs
