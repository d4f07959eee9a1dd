"""SmolVLM's and Idefics3's vision side as NNX modules: their SigLIP encoder (``transformers``'
``Idefics3VisionTransformer``: patches of images padded to the batch's largest, learned positions bucketed to each
image's own patch grid, attention over the image's real patches) and the connector (a pixel shuffle of
``scale_factor x scale_factor`` patches, then ``modality_projection``); :class:`Idefics3Decoder` puts each image's
features in place of its ``<image>`` tokens.

The processor gives each row its images (the tiles of a split image, then the whole image) in slots padded with zero
images; the host computes each slot's patch mask and position ids (as ``Idefics3VisionEmbeddings`` does), so the
program runs every slot and the gather reads only the real images' tokens (a row's images come first).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from .clip_vision import ClipBlock, vision_linear
from .native_decoder import DecoderSpec, NativeDecoder, Norm


@dataclass(frozen=True)
class SiglipSpec:
    """The encoder and the connector.

    Args:
        width, num_heads, intermediate_size, blocks: the encoder's sizes.
        image_size, patch_size, in_channels: the largest image and its patches (the position table is
            ``(image_size // patch_size) ** 2``).
        layer_norm_eps, activation: the blocks' norms and MLP activation (``CLIP_ACTIVATIONS`` keys; the blocks are
            :class:`~.clip_vision.ClipBlock`, which reads these fields).
        scale_factor: the pixel shuffle's side.
        text_hidden_size: the connector's output width.
        image_token_id: the placeholder the features replace.
        dtype: the parameters' dtype.
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
    scale_factor: int
    text_hidden_size: int
    image_token_id: int
    dtype: jnp.dtype = jnp.float32

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.side ** 2 // self.scale_factor ** 2


class SiglipEncoder(nnx.Module):
    """``patch_embedding`` (kernel ``[P, P, C, width]``) and its bias, ``position_embedding``, ``layers``,
    ``post_layernorm``."""

    def __init__(self, spec: SiglipSpec, rngs: nnx.Rngs):
        self.spec = spec
        normal = nnx.initializers.normal(0.02)
        self.patch_embedding = nnx.Param(normal(rngs.params(), (spec.patch_size, spec.patch_size, spec.in_channels,
                                                                 spec.width), spec.dtype))
        self.patch_embedding_bias = nnx.Param(jnp.zeros((spec.width,), spec.dtype))
        self.position_embedding = nnx.Param(normal(rngs.params(), (spec.side ** 2, spec.width), spec.dtype))
        self.layers = nnx.List([ClipBlock(spec, rngs) for _ in range(spec.blocks)])  # SigLIP's blocks are CLIP's
        self.post_layernorm = Norm(spec.width, "layer", spec.layer_norm_eps, True, spec.dtype, rngs)

    def __call__(self, images: jax.Array, position_ids: jax.Array, patch_mask: jax.Array) -> jax.Array:
        """``[N, side * side, width]`` for images ``[N, H, W, C]`` (``image_size`` square, zero-padded), their
        patches' ``position_ids`` and ``patch_mask`` ``[N, side * side]``."""
        spec = self.spec
        kernel = self.patch_embedding.get_value()
        count = images.shape[0]
        patches = images.astype(kernel.dtype).reshape(count, spec.side, spec.patch_size, spec.side, spec.patch_size,
                                                      spec.in_channels)
        x = jnp.einsum("NhiwjC,ijCW->NhwW", patches, kernel).reshape(count, spec.side ** 2, spec.width)
        x = x + self.patch_embedding_bias.get_value() + self.position_embedding.get_value()[position_ids]
        for block in self.layers:
            x = block(x, patch_mask)
        return self.post_layernorm(x)


class Idefics3Connector(nnx.Module):
    """The pixel shuffle (``scale_factor x scale_factor`` neighbouring patches into one vector, as ``transformers``
    orders them) and ``modality_projection`` (no bias)."""

    def __init__(self, spec: SiglipSpec, rngs: nnx.Rngs):
        self.scale = spec.scale_factor
        self.modality_projection = vision_linear(spec, spec.width * spec.scale_factor ** 2, spec.text_hidden_size,
                                                 rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        count, length, width = x.shape
        side, scale = int(round(length ** 0.5)), self.scale
        x = x.reshape(count, side, side // scale, width * scale).transpose(0, 2, 1, 3)
        x = x.reshape(count, side // scale, side // scale, width * scale * scale).transpose(0, 2, 1, 3)
        return self.modality_projection(x.reshape(count, length // scale ** 2, width * scale * scale))


class Idefics3Decoder(NativeDecoder):
    """The native decoder with the SigLIP ``vision_model`` and the ``connector``: a call with ``images`` (``pixels``
    ``[B, N, H, W, C]``, ``position_ids`` and ``patch_mask`` ``[B, N, side * side]``) puts each row's images'
    features in place of its ``<image>`` tokens, in order."""

    def __init__(self, spec: DecoderSpec, vision: SiglipSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, rngs=rngs)
        self.vision_model = SiglipEncoder(vision, rngs)
        self.connector = Idefics3Connector(vision, rngs)

    def __call__(self, tokens, positions, cache, attention_mask, images: dict | None = None):
        x = self.embedder.encode(tokens)
        if images is not None:
            pixels = images["pixels"]
            batch, slots = pixels.shape[:2]
            flat = lambda array: array.reshape(batch * slots, *array.shape[2:])  # noqa: E731
            features = self.connector(self.vision_model(flat(pixels), flat(images["position_ids"]),
                                                        flat(images["patch_mask"])))
            features = features.reshape(batch, slots * features.shape[1], features.shape[-1])
            is_image = tokens == self.vision_model.spec.image_token_id
            rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
            gathered = jnp.take_along_axis(features, rank[..., None], axis=1).astype(x.dtype)
            x = jnp.where(is_image[..., None], gathered, x)
        return self.decode_embeddings(x, positions, cache, attention_mask)

    def get_model_input(self) -> dict:
        """Qwix's tracing call with one image per row, so the encoder and the connector run too."""
        inputs = super().get_model_input()
        vision = self.vision_model.spec
        patches = vision.side ** 2
        inputs["tokens"] = jnp.full((2, 1), vision.image_token_id, jnp.int32)
        inputs["images"] = {"pixels": jnp.zeros((2, 1, vision.image_size, vision.image_size, vision.in_channels),
                                                jnp.float32),
                            "position_ids": jnp.broadcast_to(jnp.arange(patches, dtype=jnp.int32), (2, 1, patches)),
                            "patch_mask": jnp.ones((2, 1, patches), bool)}
        return inputs
