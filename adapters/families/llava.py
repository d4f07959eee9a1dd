"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision encoder and a two-layer projector
(:mod:`adapters.model.clip_vision`) in front of a Llama or Mistral text decoder on the native decoder.

Checkpoints as llava-hf publishes them: ``language_model.model.`` / ``language_model.lm_head`` for the decoder,
``vision_tower.vision_model.`` for CLIP, ``multi_modal_projector.``; ``transformers`` 5 saves the tower without
``vision_model.`` and names everything ``model.language_model.`` / ``model.vision_tower.`` /
``model.multi_modal_projector.`` / ``lm_head`` in memory, which load too. Export writes llava-hf's names. The tower's
blocks after ``vision_feature_layer`` and its ``post_layernorm``, which LLaVA never runs, are kept as they are.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.clip_vision import CLIP_ACTIVATIONS, ClipVisionSpec, LlavaDecoder, LlavaNextDecoder
from ..model.native_decoder import DecoderSpec
from . import mistral
from .base import CONV_KERNEL, DECODER_IGNORED_KEYS, TinyConfig, WeightRule, images_by_row, reprefixed, require
from .gemma3_multimodal import images_per_row
from .native import (
    check_native_config,
    linear_rows,
    llama_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)

TEXT_PREFIX = "language_model.model."
HEAD = "language_model.lm_head.weight"
VISION_PREFIX = "vision_tower.vision_model."
VISION_ALIASES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIX = "multi_modal_projector."
TEXT_MODEL_TYPES = ("llama", "mistral")


def feature_blocks(hf_config) -> int:
    """How many of Mistral 3's Pixtral blocks run: up to ``vision_feature_layer`` (one layer; a list of layers is
    refused there; LLaVA's CLIP reads lists, :func:`feature_layers`)."""
    layer = hf_config.vision_feature_layer
    family = hf_config.model_type
    require(isinstance(layer, int), f"{family}: vision_feature_layer={layer!r} (several feature layers) is not "
                                    "supported; any single layer is.")
    total = hf_config.vision_config.num_hidden_layers
    blocks = total + 1 + layer if layer < 0 else layer
    require(0 <= blocks <= total, f"{family}: vision_feature_layer={layer} is outside the {total}-block tower.")
    return blocks


def feature_layers(hf_config) -> tuple[int, ...]:
    """The tower's hidden states LLaVA (and LLaVA-NeXT) reads, as non-negative indices (0: the embeddings, ``i``:
    block ``i``'s output): ``vision_feature_layer``, one layer or a list whose hidden states are concatenated, as
    ``transformers``' ``get_image_features`` does."""
    layer = hf_config.vision_feature_layer
    layers = [layer] if isinstance(layer, int) else list(layer)
    total = hf_config.vision_config.num_hidden_layers
    require(layers and all(isinstance(index, int) for index in layers),
            f"{hf_config.model_type}: vision_feature_layer={layer!r} must be a layer index or a list of them.")
    read = tuple(total + 1 + index if index < 0 else index for index in layers)
    require(all(0 <= index <= total for index in read),
            f"{hf_config.model_type}: vision_feature_layer={layer!r} reaches outside the {total}-block tower's "
            f"{total + 1} hidden states.")
    return read


def vision_spec(hf_config, dtype) -> ClipVisionSpec:
    """The tower's and projector's spec of a ``LlavaConfig``."""
    vision = hf_config.vision_config
    require(vision.model_type == "clip_vision_model",
            f"llava: vision_config.model_type={vision.model_type!r} is not supported (CLIP's 'clip_vision_model').")
    strategy = hf_config.vision_feature_select_strategy
    require(strategy in ("default", "full"),
            f"llava: vision_feature_select_strategy={strategy!r}; choose 'default' or 'full'.")
    for field, value in (("vision_config.hidden_act", vision.hidden_act),
                         ("projector_hidden_act", hf_config.projector_hidden_act)):
        require(value in CLIP_ACTIVATIONS, f"llava: {field}={value!r} is not supported; supported: "
                                           f"{sorted(CLIP_ACTIVATIONS)}.")
    require(vision.image_size % vision.patch_size == 0,
            f"llava: image_size={vision.image_size} is not a multiple of patch_size={vision.patch_size}.")
    return ClipVisionSpec(
        width=vision.hidden_size, num_heads=vision.num_attention_heads, intermediate_size=vision.intermediate_size,
        blocks=max(feature_layers(hf_config)), image_size=vision.image_size, patch_size=vision.patch_size,
        in_channels=vision.num_channels, layer_norm_eps=float(vision.layer_norm_eps), activation=vision.hidden_act,
        projector_activation=hf_config.projector_hidden_act, keep_class_token=strategy == "full",
        text_hidden_size=hf_config.text_config.hidden_size,
        projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
        image_token_id=int(image_token_id(hf_config)), dtype=jnp.dtype(dtype),
        feature_layers=feature_layers(hf_config))


def image_token_id(hf_config) -> int:
    value = getattr(hf_config, "image_token_id", None)
    return int(value if value is not None else hf_config.image_token_index)


def text_spec(hf_config, dtype):
    """The Llama or Mistral decoder of ``text_config`` (:func:`.mistral.spec_from_config`)."""
    text = hf_config.text_config
    require(text.model_type in TEXT_MODEL_TYPES, f"llava: text_config.model_type={text.model_type!r} is not "
                                                 f"supported; supported: {list(TEXT_MODEL_TYPES)}.")
    if text.model_type == "mistral":
        spec = mistral.spec_from_config(text, dtype)
    else:  # Llama: no sliding window; attention and MLP biases as the config sets them
        check_native_config(text, "llava (llama)")
        layers = text.num_hidden_layers
        spec = DecoderSpec(**sizes(text, dtype), ropes=(rope_of(text, "llava (llama)"),) * layers,
                           windows=(None,) * layers, norm_eps=text.rms_norm_eps, activation=text.hidden_act,
                           attention_bias=bool(getattr(text, "attention_bias", False)),
                           output_bias=bool(getattr(text, "attention_bias", False)),
                           mlp_bias=bool(getattr(text, "mlp_bias", False)))
    return dataclasses.replace(spec, tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings",
                                                                 spec.tie_embeddings)))


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> LlavaDecoder:
    """The native decoder of ``text_config`` with CLIP's tower up to the feature layer and the projector."""
    return LlavaDecoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def _vision_rows() -> tuple[WeightRule, ...]:
    layer, nnx_layer = "encoder.layers.{layer}", "vision_tower.layers.{layer}"
    rows = [WeightRule("embeddings.patch_embedding.weight", "vision_tower.patch_embedding", CONV_KERNEL),
            WeightRule("embeddings.class_embedding", "vision_tower.class_embedding"),
            WeightRule("embeddings.position_embedding.weight", "vision_tower.position_embedding")]
    rows += norm_rows("pre_layrnorm", "vision_tower.pre_layrnorm", bias=True)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        rows += linear_rows(f"{layer}.self_attn.{name}", f"{nnx_layer}.self_attn.{name}", bias=True)
    for name in ("fc1", "fc2"):
        rows += linear_rows(f"{layer}.mlp.{name}", f"{nnx_layer}.mlp.{name}", bias=True)
    for name in ("layer_norm1", "layer_norm2"):
        rows += norm_rows(f"{layer}.{name}", f"{nnx_layer}.{name}", bias=True)
    return tuple(rows)


def _weights() -> tuple[WeightRule, ...]:
    text = llama_rows()  # a Llama or Mistral text config without biases (refused otherwise by the weight plan)
    inside = tuple(rule for rule in text if rule.hf.startswith("model."))
    head = tuple(rule for rule in text if not rule.hf.startswith("model."))
    return (reprefixed(inside, "model.", TEXT_PREFIX, aliases=("model.language_model.",))
            + reprefixed(head, "lm_head.", "language_model.lm_head.", aliases=("lm_head.",))
            + reprefixed(_vision_rows(), "", VISION_PREFIX, VISION_ALIASES)
            + reprefixed(linear_rows("linear_1", "multi_modal_projector.linear_1", bias=True)
                         + linear_rows("linear_2", "multi_modal_projector.linear_2", bias=True),
                         "", PROJECTOR_PREFIX, ("model.multi_modal_projector.",)))


def kept_keys(hf_config) -> tuple[str, ...]:
    """The tower's tensors LLaVA never runs (its blocks after the feature layer, ``post_layernorm``), under any of
    its prefixes."""
    first = max(feature_layers(hf_config))
    unused = "|".join(str(block) for block in range(first, hf_config.vision_config.num_hidden_layers))
    prefixes = "|".join(re.escape(prefix) for prefix in (VISION_PREFIX, *VISION_ALIASES))
    patterns = [rf"({prefixes})post_layernorm\..*"]
    if unused:
        patterns.append(rf"({prefixes})encoder\.layers\.({unused})\..*")
    return tuple(patterns)


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None) -> np.ndarray:
    """The processor's ``pixel_values`` ``[N, C, H, W]`` as each row's image slots ``[B, N, H, W, C]``
    (:func:`.gemma3_multimodal.images_per_row`, one image per ``tokens_per_image`` image tokens)."""
    spec = vision_spec(hf_config, jnp.float32)
    if pixel_values is None or np.ndim(pixel_values) != 4:
        raise ValueError(f"pixel_values must be (num_images, channels, height, width) as LLaVA's processor returns "
                         f"them; got shape {np.shape(pixel_values)}.")
    if tuple(np.shape(pixel_values)[2:]) != (spec.image_size, spec.image_size):
        raise ValueError(f"pixel_values are {np.shape(pixel_values)[2]}x{np.shape(pixel_values)[3]} but the vision "
                         f"tower takes {spec.image_size}x{spec.image_size} images (vision_config.image_size): resize "
                         "them with the model's processor.")
    return images_per_row(input_ids, pixel_values, spec.image_token_id, spec.tokens_per_image)


def _lora_targets() -> dict[str, str]:
    targets = lora_targets_of()
    targets.update({"out_proj": r"vision_tower/layers/\d+/self_attn/out_proj",
                    "fc1": r"vision_tower/layers/\d+/mlp/fc1", "fc2": r"vision_tower/layers/\d+/mlp/fc2",
                    "linear_1": "multi_modal_projector/linear_1", "linear_2": "multi_modal_projector/linear_2"})
    for name in ("q_proj", "k_proj", "v_proj"):
        targets[name] = rf"({targets[name]}|vision_tower/layers/\d+/self_attn/{name})"
    return targets


TINY_CONFIGS = {
    # The text decoder of torchlike.testing.tiny_multimodal_config("llava"): Llama's layout.
    "llava": TinyConfig("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False)),
}

PATCH_EMBEDDING = r"(vision_tower\.vision_model\.|vision_tower\.|model\.vision_tower\.)embeddings\.patch_embedding"

FAMILY = native_family(
    name="llava", model_types=("llava",), architectures=("LlavaForConditionalGeneration",),
    spec_from_config=text_spec, weights=_weights(), build_model=build_model, lora_targets=_lora_targets(),
    default_lora_targets=(),  # PEFT has no default for model_type "llava"
    ignored_hf_keys=DECODER_IGNORED_KEYS, images=images, prompt_learning=False,
    config_kept_keys=kept_keys, kept_renames=tuple((alias, VISION_PREFIX) for alias in VISION_ALIASES[::-1]),
    lora_not_linear={PATCH_EMBEDDING: "the patch embedding is a Conv2d in transformers"},
    in_memory_prefixes=((TEXT_PREFIX, "model.language_model."), ("language_model.lm_head", "lm_head"),
                        (VISION_PREFIX, "model.vision_tower."), (PROJECTOR_PREFIX, "model.multi_modal_projector.")),
    tiny_configs=TINY_CONFIGS)


# --------------------------------------------------------------------------- LLaVA-NeXT


def build_next_model(hf_config, dtype, rngs: nnx.Rngs) -> LlavaNextDecoder:
    """LLaVA-NeXT: :func:`build_model` with the newline embedding."""
    return LlavaNextDecoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def next_images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None,
                image_sizes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """LLaVA-NeXT's processor outputs as the model takes them: each row's tiles ``[B, T, H, W, C]`` (its images' in
    token order, zeros after) and, for each of its image tokens, where its feature is (:class:`LlavaNextDecoder`),
    laid out by ``transformers``' own ``pack_image_features`` run on feature positions (base view, the grid's rows
    unpadded to the image's aspect ratio, a newline after each).

    Args:
        pixel_values: ``[images, tiles, C, H, W]`` (zero tiles past an image's own, as the processor pads them).
        image_sizes: ``[images, 2]`` each image's original height and width.

    Raises:
        ValueError: pixels without their sizes, or image tokens that do not match the images (named).
    """
    import types

    import torch
    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel, image_size_to_num_patches

    spec = vision_spec(hf_config, jnp.float32)
    if pixel_values is None or image_sizes is None or np.ndim(pixel_values) != 5:
        raise ValueError("LLaVA-NeXT takes pixel_values [images, tiles, channels, height, width] with image_sizes "
                         f"[images, 2], as its processor returns them; got pixel_values of shape "
                         f"{np.shape(pixel_values)} and image_sizes {None if image_sizes is None else 'given'}.")
    sizes = np.asarray(image_sizes, np.int64).reshape(-1, 2)
    pixels = np.asarray(pixel_values, np.float32)
    if len(sizes) != len(pixels):
        raise ValueError(f"image_sizes has {len(sizes)} entries for {len(pixels)} images.")
    strategy = hf_config.vision_feature_select_strategy
    owner = types.SimpleNamespace(config=hf_config)
    per_image = []  # (tiles [t, H, W, C], feature positions relative to its first tile, -1 for a newline)
    for image, size in zip(pixels, sizes, strict=True):
        tiles = image_size_to_num_patches(image_size=size.tolist(), grid_pinpoints=hf_config.image_grid_pinpoints,
                                          patch_size=spec.image_size)
        positions = torch.arange(tiles * spec.tokens_per_image, dtype=torch.float64).reshape(
            tiles, spec.tokens_per_image, 1)
        packed, _ = LlavaNextModel.pack_image_features(owner, [positions], torch.tensor(size[None]), strategy,
                                                       image_newline=torch.tensor([-1.0], dtype=torch.float64))
        packed = packed[0] if isinstance(packed, list | tuple) else packed  # one image's features
        per_image.append((np.transpose(image[:tiles], (0, 2, 3, 1)), packed[:, 0].numpy().astype(np.int64)))
    rows = images_by_row(input_ids, spec.image_token_id, per_image, lambda item: len(item[1]), "<image>")
    counts = [sum(len(index) for _, index in taken) for taken in rows]
    most_tiles = max([sum(len(tiles) for tiles, _ in taken) for taken in rows] + [1])
    most_tokens = max([int(count) for count in counts] + [1])
    out = {"tiles": np.zeros((len(rows), most_tiles, spec.image_size, spec.image_size, spec.in_channels),
                             np.float32),
           "feature_index": np.zeros((len(rows), most_tokens), np.int32)}
    for row, taken in enumerate(rows):
        tile, token = 0, 0
        for tiles, index in taken:
            out["tiles"][row, tile:tile + len(tiles)] = tiles
            out["feature_index"][row, token:token + len(index)] = np.where(
                index < 0, -1, index + tile * spec.tokens_per_image)
            tile += len(tiles)
            token += len(index)
    return out


NEXT_TINY_CONFIGS = {
    # The text decoder of torchlike.testing.tiny_multimodal_config("llava_next"): Mistral's layout.
    "llava_next": TinyConfig("MistralConfig", dict(rope_theta=10000.0, tie_word_embeddings=False,
                                                   sliding_window=None)),
}

NEXT_FAMILY = native_family(
    name="llava_next", model_types=("llava_next",), architectures=("LlavaNextForConditionalGeneration",),
    spec_from_config=text_spec, weights=_weights() + (
        WeightRule("image_newline", "image_newline"), WeightRule("model.image_newline", "image_newline",
                                                                 load_only=True)),
    build_model=build_next_model, lora_targets=_lora_targets(),
    default_lora_targets=(),  # PEFT has no default for model_type "llava_next"
    ignored_hf_keys=DECODER_IGNORED_KEYS, images=next_images, image_keys=("image_sizes",), prompt_learning=False,
    config_kept_keys=kept_keys, kept_renames=tuple((alias, VISION_PREFIX) for alias in VISION_ALIASES[::-1]),
    lora_not_linear={PATCH_EMBEDDING: "the patch embedding is a Conv2d in transformers"},
    in_memory_prefixes=((TEXT_PREFIX, "model.language_model."), ("language_model.lm_head", "lm_head"),
                        (VISION_PREFIX, "model.vision_tower."), (PROJECTOR_PREFIX, "model.multi_modal_projector.")),
    tiny_configs=NEXT_TINY_CONFIGS)

FAMILIES = (FAMILY, NEXT_FAMILY)
