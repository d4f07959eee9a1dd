"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 and its kin): Pixtral's encoder and Mistral 3's
projector (:mod:`adapters.model.pixtral_vision`) in front of a Mistral text decoder on the native decoder.

Checkpoints as ``transformers`` 5 saves them: ``language_model.model.`` / ``language_model.lm_head``,
``vision_tower.``, ``multi_modal_projector.``; in memory ``model.language_model.`` / ``model.vision_tower.`` /
``model.multi_modal_projector.`` / ``lm_head``, which load too. The processor's ``pixel_values`` are
``[images, C, H, W]`` padded to the batch's largest, with ``image_sizes``; each image's tokens are ``[IMG]`` per merged
patch with ``[IMG_BREAK]`` after each row and ``[IMG_END]`` last.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.clip_vision import CLIP_ACTIVATIONS
from ..model.pixtral_vision import Mistral3Decoder, PixtralSpec
from . import mistral
from .base import DECODER_IGNORED_KEYS, Layout, TinyConfig, WeightRule, images_by_row, reprefixed, require
from .llava import feature_blocks
from .native import linear_rows, llama_rows, lora_targets_of, native_family, norm_rows


class PatchConvKernel(Layout):
    """HF ``nn.Conv2d`` weight ``(out, C, P, P)`` <-> NNX ``(C, P, P, out)`` (patches read channel-major)."""

    def to_nnx(self, hf, nnx_shape):
        return hf.transpose(1, 2, 3, 0)

    def to_hf(self, nnx):
        return nnx.transpose(3, 0, 1, 2)

    def hf_shape(self, nnx_shape):
        return (nnx_shape[3], *nnx_shape[:3])


PATCH_CONV_KERNEL = PatchConvKernel()
TEXT_PREFIX = "language_model.model."
VISION_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "multi_modal_projector."


def vision_spec(hf_config, dtype) -> PixtralSpec:
    """The encoder's and projector's spec of a ``Mistral3Config``."""
    vision = hf_config.vision_config
    require(vision.model_type == "pixtral", f"mistral3: vision_config.model_type={vision.model_type!r} is not "
                                            "supported (Pixtral's 'pixtral').")
    rope = vision.rope_parameters
    require(rope.get("rope_type", "default") == "default",
            f"mistral3: vision_config.rope_parameters.rope_type={rope.get('rope_type')!r}; Pixtral's is 'default'.")
    for field, value in (("vision_config.hidden_act", vision.hidden_act),
                         ("projector_hidden_act", hf_config.projector_hidden_act)):
        require(value in CLIP_ACTIVATIONS, f"mistral3: {field}={value!r} is not supported; supported: "
                                           f"{sorted(CLIP_ACTIVATIONS)}.")
    head_dim = getattr(vision, "head_dim", None) or vision.hidden_size // vision.num_attention_heads
    require(head_dim == vision.hidden_size // vision.num_attention_heads and head_dim % 4 == 0,
            f"mistral3: vision head_dim={head_dim} must be hidden_size // num_attention_heads and a multiple of 4.")
    return PixtralSpec(
        width=vision.hidden_size, num_heads=vision.num_attention_heads, intermediate_size=vision.intermediate_size,
        blocks=feature_blocks(hf_config), patch_size=vision.patch_size, in_channels=vision.num_channels,
        max_patches_per_side=vision.image_size // vision.patch_size, rope_theta=float(rope["rope_theta"]),
        activation=vision.hidden_act, projector_activation=hf_config.projector_hidden_act,
        spatial_merge_size=hf_config.spatial_merge_size,
        projector_norm_eps=float(hf_config.text_config.rms_norm_eps),
        text_hidden_size=hf_config.text_config.hidden_size,
        projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", False)),
        image_token_id=int(hf_config.image_token_id), dtype=jnp.dtype(dtype))


def text_spec(hf_config, dtype):
    text = hf_config.text_config
    require(text.model_type == "mistral", f"mistral3: text_config.model_type={text.model_type!r} is not supported "
                                          "(Mistral's 'mistral').")
    spec = mistral.spec_from_config(text, dtype)
    return dataclasses.replace(spec, tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings",
                                                                 spec.tie_embeddings)))


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> Mistral3Decoder:
    return Mistral3Decoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None,
           image_sizes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The processor's ``pixel_values`` ``[images, C, H, W]`` (padded) and ``image_sizes`` as the model takes them:
    each row's patches (channel-major), their rows and columns, image ids, and per merged token the patches of its
    block, images in the order of their ``[IMG]`` tokens.

    Raises:
        ValueError: pixels without sizes, a size not a multiple of ``patch_size * spatial_merge_size``, or image
            tokens that do not match the images (named).
    """
    spec = vision_spec(hf_config, jnp.float32)
    if pixel_values is None or np.ndim(pixel_values) != 4 or image_sizes is None:
        raise ValueError("Mistral 3 takes pixel_values [images, channels, height, width] with image_sizes [images, 2], "
                         f"as its processor returns them; got pixel_values of shape {np.shape(pixel_values)}.")
    pixels = np.asarray(pixel_values, np.float32)
    sizes = np.asarray(image_sizes, np.int64).reshape(-1, 2)
    if len(sizes) != len(pixels):
        raise ValueError(f"image_sizes has {len(sizes)} entries for {len(pixels)} images.")
    unit, merge = spec.patch_size * spec.spatial_merge_size, spec.spatial_merge_size
    items = []
    for image, (height, width) in zip(pixels, sizes, strict=True):
        if height % unit or width % unit or height > image.shape[1] or width > image.shape[2]:
            raise ValueError(f"an image of {height}x{width} pixels: Mistral 3 takes sizes that are multiples of "
                             f"patch_size * spatial_merge_size = {unit}, within its pixel_values; resize with the "
                             "model's processor.")
        rows, cols = height // spec.patch_size, width // spec.patch_size
        grid = image[:, :height, :width].reshape(spec.in_channels, rows, spec.patch_size, cols, spec.patch_size)
        patches = grid.transpose(1, 3, 0, 2, 4).reshape(rows * cols, -1)
        rows_cols = np.stack(np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), -1).reshape(-1, 2)
        index = np.arange(rows * cols).reshape(rows // merge, merge, cols // merge, merge)
        blocks = index.transpose(0, 2, 1, 3).reshape(-1, merge * merge)  # per merged token: (row, col) in its block
        items.append((patches, rows_cols, blocks))
    per_row = images_by_row(input_ids, spec.image_token_id, items, lambda item: len(item[2]), "[IMG]")
    counts = [sum(len(blocks) for _, _, blocks in taken) for taken in per_row]
    cells = merge * merge
    most = max([sum(len(p) for p, _, _ in taken) for taken in per_row] + [cells])
    most_tokens = max([int(count) for count in counts] + [1])
    out = {"patches": np.zeros((len(per_row), most, spec.patch_values), np.float32),
           "rows_cols": np.zeros((len(per_row), most, 2), np.int32),
           "image_ids": np.zeros((len(per_row), most), np.int32),
           "blocks": np.zeros((len(per_row), most_tokens, cells), np.int32)}
    for row, taken in enumerate(per_row):
        patch, token = 0, 0
        for image_id, (patches, rows_cols, blocks) in enumerate(taken, start=1):
            out["patches"][row, patch:patch + len(patches)] = patches
            out["rows_cols"][row, patch:patch + len(patches)] = rows_cols
            out["image_ids"][row, patch:patch + len(patches)] = image_id
            out["blocks"][row, token:token + len(blocks)] = blocks + patch
            patch += len(patches)
            token += len(blocks)
    return out


def _vision_rows() -> tuple[WeightRule, ...]:
    layer, nnx_layer = "transformer.layers.{layer}", "vision_tower.layers.{layer}"
    rows = [WeightRule("patch_conv.weight", "vision_tower.patch_conv", PATCH_CONV_KERNEL)]
    rows += norm_rows("ln_pre", "vision_tower.ln_pre")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rows += linear_rows(f"{layer}.attention.{name}", f"{nnx_layer}.attention.{name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        rows += linear_rows(f"{layer}.feed_forward.{name}", f"{nnx_layer}.feed_forward.{name}")
    for name in ("attention_norm", "ffn_norm"):
        rows += norm_rows(f"{layer}.{name}", f"{nnx_layer}.{name}")
    return tuple(rows)


def _projector_rows(bias: bool) -> tuple[WeightRule, ...]:
    return (norm_rows("norm", "multi_modal_projector.norm")
            + linear_rows("patch_merger.merging_layer", "multi_modal_projector.merging_layer")
            + linear_rows("linear_1", "multi_modal_projector.linear_1", bias=bias)
            + linear_rows("linear_2", "multi_modal_projector.linear_2", bias=bias))


def _weights() -> tuple[WeightRule, ...]:
    text = llama_rows()
    inside = tuple(rule for rule in text if rule.hf.startswith("model."))
    head = tuple(rule for rule in text if not rule.hf.startswith("model."))
    return (reprefixed(inside, "model.", TEXT_PREFIX, aliases=("model.language_model.",))
            + reprefixed(head, "lm_head.", "language_model.lm_head.", aliases=("lm_head.",))
            + reprefixed(_vision_rows(), "", VISION_PREFIX, ("model.vision_tower.",)))


def config_weights(hf_config) -> tuple[WeightRule, ...]:
    """The projector's rows (its linear layers have biases where the config says so)."""
    return reprefixed(_projector_rows(bool(getattr(hf_config, "multimodal_projector_bias", False))), "",
                      PROJECTOR_PREFIX, ("model.multi_modal_projector.",))


def kept_keys(hf_config) -> tuple[str, ...]:
    """The encoder's blocks after the feature layer, which Mistral 3 never runs."""
    first = feature_blocks(hf_config)
    unused = "|".join(str(block) for block in range(first, hf_config.vision_config.num_hidden_layers))
    if not unused:
        return ()
    prefixes = "|".join(re.escape(prefix) for prefix in (VISION_PREFIX, "model.vision_tower."))
    return (rf"({prefixes})transformer\.layers\.({unused})\..*",)


def _lora_targets() -> dict[str, str]:
    targets = lora_targets_of()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        targets[name] = rf"({targets[name]}|vision_tower/layers/\d+/attention/{name})"
    for name in ("gate_proj", "up_proj", "down_proj"):
        targets[name] = rf"({targets[name]}|vision_tower/layers/\d+/feed_forward/{name})"
    targets.update({"merging_layer": "multi_modal_projector/merging_layer",
                    "linear_1": "multi_modal_projector/linear_1", "linear_2": "multi_modal_projector/linear_2"})
    return targets


TINY_CONFIGS = {
    # The text decoder of torchlike.testing.tiny_multimodal_config("mistral3"): Mistral's layout, no window.
    "mistral3": TinyConfig("MistralConfig", dict(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)),
}

PATCH_CONV = r"(model\.)?vision_tower\.patch_conv"

FAMILY = native_family(
    name="mistral3", model_types=("mistral3",), architectures=("Mistral3ForConditionalGeneration",),
    spec_from_config=text_spec, weights=_weights(), config_weights=config_weights, build_model=build_model,
    lora_targets=_lora_targets(), default_lora_targets=(),  # PEFT has no default for model_type "mistral3"
    ignored_hf_keys=DECODER_IGNORED_KEYS, images=images, image_keys=("image_sizes",), prompt_learning=False,
    config_kept_keys=kept_keys, kept_renames=(("model.vision_tower.", VISION_PREFIX),),
    lora_not_linear={PATCH_CONV: "the patch embedding is a Conv2d in transformers"},
    in_memory_prefixes=((TEXT_PREFIX, "model.language_model."), ("language_model.lm_head", "lm_head"),
                        (VISION_PREFIX, "model.vision_tower."), (PROJECTOR_PREFIX, "model.multi_modal_projector.")),
    tiny_configs=TINY_CONFIGS)
