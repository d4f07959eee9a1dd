"""Gemma 3 as Google publishes it (``Gemma3ForConditionalGeneration``): the Gemma 3 text decoder with Tunix's SigLIP
vision encoder and the embedder's multimodal projection (``tunix.models.gemma3.vision``).

The text rows are Gemma 3's (:mod:`.gemma3`) under the published prefix ``language_model.model.``; ``transformers``
names the same tensors ``model.language_model.`` in memory, which load too. The vision rows read Google's layout
(``vision_tower.vision_model.``) and the one ``transformers`` 5 saves (``vision_tower.``); export writes Google's.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from tunix.models.gemma3 import model as tunix_gemma3
from tunix.models.gemma3 import vision as tunix_vision

from . import gemma3
from .base import (
    CONV_KERNEL,
    LEADING_UNIT_AXIS,
    TRANSPOSED,
    Family,
    WeightRule,
    decoder_forward,
    decoder_hidden_states,
    reprefixed,
    require,
)

TEXT_PREFIX = "language_model.model."
"""Where Google's checkpoints keep the text decoder (``model.`` of ``Gemma3ForCausalLM``)."""
TEXT_ALIASES = ("model.language_model.", "model.")
"""``transformers``' in-memory names, and a text-only checkpoint's (which loads leniently into this model)."""
VISION_PREFIX = "vision_tower.vision_model."
VISION_ALIASES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIX = "multi_modal_projector."
PROJECTOR_ALIASES = ("model.multi_modal_projector.",)

_ENCODER = "vision_encoder.siglip_encoder"
_BLOCK = f"{_ENCODER}.transformer.blocks.{{layer}}"
_HF_BLOCK = "encoder.layers.{layer}"


def _vision_rows() -> tuple[WeightRule, ...]:
    """SigLIP's tensors (relative to the vision prefix) <-> Tunix's ``ViTModel``."""
    rows = [
        WeightRule("embeddings.patch_embedding.weight", f"{_ENCODER}.embedding.kernel", CONV_KERNEL),
        WeightRule("embeddings.patch_embedding.bias", f"{_ENCODER}.embedding.bias"),
        WeightRule("embeddings.position_embedding.weight", f"{_ENCODER}.pos_embedding", LEADING_UNIT_AXIS),
        WeightRule("post_layernorm.weight", f"{_ENCODER}.transformer.encoder_norm.scale"),
        WeightRule("post_layernorm.bias", f"{_ENCODER}.transformer.encoder_norm.bias"),
    ]
    linears = {"self_attn.q_proj": "attn.query_proj", "self_attn.k_proj": "attn.key_proj",
               "self_attn.v_proj": "attn.value_proj", "self_attn.out_proj": "attn.out_proj",
               "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for hf, nnx_name in linears.items():
        rows.append(WeightRule(f"{_HF_BLOCK}.{hf}.weight", f"{_BLOCK}.{nnx_name}.kernel", TRANSPOSED))
        rows.append(WeightRule(f"{_HF_BLOCK}.{hf}.bias", f"{_BLOCK}.{nnx_name}.bias"))
    for hf, nnx_name in (("layer_norm1", "ln1"), ("layer_norm2", "ln2")):
        rows.append(WeightRule(f"{_HF_BLOCK}.{hf}.weight", f"{_BLOCK}.{nnx_name}.scale"))
        rows.append(WeightRule(f"{_HF_BLOCK}.{hf}.bias", f"{_BLOCK}.{nnx_name}.bias"))
    return tuple(rows)


WEIGHTS: tuple[WeightRule, ...] = (
    reprefixed(gemma3.TEXT_WEIGHTS, "model.", TEXT_PREFIX, TEXT_ALIASES)
    + reprefixed(_vision_rows(), "", VISION_PREFIX, VISION_ALIASES)
    + reprefixed((
        # Both sides apply the RMS norm as (1 + w) with eps 1e-6 (the vision config's layer_norm_eps, checked).
        WeightRule("mm_soft_emb_norm.weight", "embedder.mm_soft_embedding_norm.scale"),
        WeightRule("mm_input_projection_weight", "embedder.mm_input_projection.w"),
    ), "", PROJECTOR_PREFIX, PROJECTOR_ALIASES)
)

IGNORED_KEYS: tuple[str, ...] = (r"lm_head\.weight", r"language_model\.lm_head\.weight")
"""The decoder is tied (checked): a saved head is a copy of the embedding."""

KEPT_KEYS: tuple[str, ...] = tuple(rf"{prefix.replace('.', chr(92) + '.')}head\..*"
                                   for prefix in (VISION_PREFIX, *VISION_ALIASES))
"""SigLIP's attention-pooling head, which Gemma 3 never runs (it takes the last hidden state) but a checkpoint saved
with ``vision_use_head`` left on carries: passed through unchanged."""


def image_token_id(hf_config) -> int:
    """The placeholder id that image features replace (``image_token_id``; older configs: ``image_token_index``)."""
    value = getattr(hf_config, "image_token_id", None)
    return int(value if value is not None else hf_config.image_token_index)


def _check_vision_config(hf_config) -> None:
    """Refuses a vision config Tunix's SigLIP computes differently from ``transformers``."""
    vision = hf_config.vision_config
    require(vision is not None, "gemma3 multimodal: config.vision_config is missing.")
    activation = getattr(vision, "hidden_act", "gelu_pytorch_tanh")
    require(activation == "gelu_pytorch_tanh",
            f"gemma3 vision: hidden_act={activation!r} is not supported (Tunix's SigLIP uses the tanh GELU).")
    require(float(vision.layer_norm_eps) == 1e-6,
            f"gemma3 vision: layer_norm_eps={vision.layer_norm_eps} is not supported (Tunix fixes 1e-6).")
    require(vision.image_size % vision.patch_size == 0,
            f"gemma3 vision: image_size={vision.image_size} is not a multiple of patch_size={vision.patch_size}.")
    require(vision.hidden_size % vision.num_attention_heads == 0,
            f"gemma3 vision: hidden_size={vision.hidden_size} is not a multiple of num_attention_heads="
            f"{vision.num_attention_heads}.")
    side = vision.image_size // vision.patch_size
    tokens_side = int(round(hf_config.mm_tokens_per_image ** 0.5))
    require(tokens_side ** 2 == hf_config.mm_tokens_per_image and side % tokens_side == 0,
            f"gemma3 vision: mm_tokens_per_image={hf_config.mm_tokens_per_image} must be a square whose side divides "
            f"the {side}x{side} patch grid (transformers average-pools the patches to it).")


def siglip_config(hf_config) -> tunix_vision.SigLIPConfig:
    """Tunix's ``SigLIPConfig`` for a ``Gemma3Config``'s vision tower and projector."""
    vision = hf_config.vision_config
    side = vision.image_size // vision.patch_size
    return tunix_vision.SigLIPConfig(
        num_mm_tokens_per_image_prepool=side * side,
        num_mm_tokens_per_image=hf_config.mm_tokens_per_image,
        image_height=vision.image_size,
        image_width=vision.image_size,
        image_channels=vision.num_channels,
        soft_token_placeholder=image_token_id(hf_config),
        patch_size=(vision.patch_size, vision.patch_size),
        width=vision.hidden_size,
        depth=vision.num_hidden_layers,
        mlp_dim=vision.intermediate_size,
        num_heads=vision.num_attention_heads,
    )


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> tunix_gemma3.Gemma3:
    """A Tunix ``Gemma3`` with its SigLIP vision encoder, for a ``Gemma3Config``.

    The encoder's output is not cut from the gradient (Tunix's ``apply_stop_gradient`` default), so full
    fine-tuning trains the vision tower as ``transformers`` does.

    Raises:
        UnsupportedConfigError: for what :func:`.gemma3.build_model` refuses, or a vision config Tunix's SigLIP
            computes differently.
    """
    _check_vision_config(hf_config)
    model = gemma3.build_model(hf_config.text_config, dtype, rngs, vision_config=siglip_config(hf_config))
    model.vision_encoder.apply_stop_gradient = False
    return model


def forward(module: tunix_gemma3.Gemma3, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
            images: jax.Array | None = None) -> jax.Array:
    """Float32 logits; ``images`` ``[B, N, H, W, C]`` (:func:`images_per_row`) replace each row's image tokens."""
    return decoder_forward(module, tokens, positions, attention_mask, images=images)


def hidden_states(module: tunix_gemma3.Gemma3, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                  images: jax.Array | None = None) -> jax.Array:
    """The final-norm hidden states :func:`forward` decodes (images as there)."""
    return decoder_hidden_states(module, tokens, positions, attention_mask, images=images)


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray) -> np.ndarray:
    """:func:`images_per_row` with the config's image token and tokens per image."""
    if np.ndim(pixel_values) != 4:
        raise ValueError(f"pixel_values must be (num_images, channels, height, width) as Gemma 3's processor returns "
                         f"them; got shape {np.shape(pixel_values)}.")
    side = hf_config.vision_config.image_size
    if tuple(np.shape(pixel_values)[2:]) != (side, side):
        raise ValueError(f"pixel_values are {np.shape(pixel_values)[2]}x{np.shape(pixel_values)[3]} but the vision "
                         f"tower takes {side}x{side} images (vision_config.image_size): resize them with the model's "
                         "processor.")
    return images_per_row(input_ids, pixel_values, image_token_id(hf_config), hf_config.mm_tokens_per_image)


def images_per_row(input_ids: np.ndarray, pixel_values: np.ndarray, image_token: int, tokens_per_image: int
                   ) -> np.ndarray:
    """``transformers``' ``pixel_values`` ``[num_images, C, H, W]`` (every image of the batch, in the order their
    tokens appear, row after row) as Tunix takes images: ``[B, N, H, W, C]``, each row's own images first and zero
    images after them (N is the most images any row has).

    Raises:
        ValueError: the image tokens are not whole images, or their count differs from the images given.
    """
    counts = (np.asarray(input_ids) == image_token).sum(axis=1)
    if np.any(counts % tokens_per_image):
        raise ValueError(f"a row has {counts.tolist()} image tokens (id {image_token}); each image takes exactly "
                         f"{tokens_per_image} (mm_tokens_per_image): build the prompts with the model's processor.")
    per_row = counts // tokens_per_image
    if int(per_row.sum()) != len(pixel_values):
        raise ValueError(f"the batch has {int(per_row.sum())} images' worth of image tokens (id {image_token}) but "
                         f"pixel_values holds {len(pixel_values)} images: give one image per <start_of_image> in the "
                         "text, as the processor does.")
    images = np.transpose(np.asarray(pixel_values), (0, 2, 3, 1))
    out = np.zeros((len(per_row), max(int(per_row.max(initial=0)), 1), *images.shape[1:]), images.dtype)
    start = 0
    for row, count in enumerate(per_row):
        out[row, :count] = images[start:start + count]
        start += count
    return out


FAMILY = Family(
    name="gemma3_multimodal",
    model_types=("gemma3",),
    architectures=("Gemma3ForConditionalGeneration",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=forward,
    hidden_states=hidden_states,
    logits_from_hidden=gemma3.logits_from_hidden,
    ignored_hf_keys=IGNORED_KEYS,
    lora_targets={**gemma3.FAMILY.lora_targets, "out_proj": "", "fc1": "", "fc2": ""},
    default_lora_targets=(),  # PEFT has none for model_type "gemma3"
    norms_scale_by_one_plus_weight=True,
    kept_hf_keys=KEPT_KEYS,
    images=images,
    decoder="gemma3",
    in_memory_prefixes=((TEXT_PREFIX, TEXT_ALIASES[0]), (VISION_PREFIX, VISION_ALIASES[1]),
                        (PROJECTOR_PREFIX, PROJECTOR_ALIASES[0])),
)
