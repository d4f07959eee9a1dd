"""Qwen3-VL as Qwen publishes it (``Qwen3VLForConditionalGeneration``): Qwen3-VL's vision tower
(:mod:`adapters.model.qwen_vision`: a learned position table interpolated to each image, LayerNorm blocks, DeepStack
mergers whose features join the first text layers) in front of a Qwen3 text decoder on the native decoder, rotated by
interleaved M-RoPE. Checkpoints, in memory and on disk: ``model.language_model.``, ``model.visual.``, ``lm_head``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.native_decoder import DecoderSpec
from ..model.qwen_vision import VISION_ACTIVATIONS, QwenVisionSpec, QwenVLDecoder
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    layer_types_windows,
    linear_rows,
    llama_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)
from .qwen2_vl import CONV3D_KERNEL, CONV_REASON, IMAGE_KEYS, qwen_images

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
PATCH_EMBED = r"model\.visual\.patch_embed\.proj"


def multimodal_rope(text_config, family: str, default_section: tuple[int, int, int] = (24, 20, 20)):
    """The text config's rope with its interleaved ``mrope_section`` (Qwen3-VL, Qwen3.5; ``transformers``'
    default where the config has none, as its rotary embedding reads it)."""
    section = tuple(int(value) for value in (text_config.rope_parameters.get("mrope_section") or default_section))
    require(len(section) == 3, f"{family}: text_config.rope_parameters.mrope_section={list(section)} must have three "
                               "entries (time, rows, columns).")
    return dataclasses.replace(rope_of(text_config, family), mrope_section=section, mrope_interleaved=True)


def text_spec(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Qwen3-VL config's ``text_config``: Qwen3's layout (per-head RMS norms of queries and
    keys) with interleaved M-RoPE."""
    text = hf_config.text_config
    family = hf_config.model_type
    check_native_config(text, family)
    rope = multimodal_rope(text, family)
    fields = sizes(text, dtype)
    fields["tie_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", fields["tie_embeddings"]))
    return DecoderSpec(**fields, ropes=(rope,) * text.num_hidden_layers, windows=layer_types_windows(text, family),
                       norm_eps=text.rms_norm_eps, activation=text.hidden_act,
                       attention_bias=bool(getattr(text, "attention_bias", False)), qk_norm="head")


def vision_spec(hf_config, dtype) -> QwenVisionSpec:
    """The tower's spec of a Qwen3-VL (or Qwen3.5) ``vision_config``."""
    vision = hf_config.vision_config
    family = hf_config.model_type
    width = vision.hidden_size
    require(width % vision.num_heads == 0 and (width // vision.num_heads) % 4 == 0,
            f"{family}: the vision head size {width}/{vision.num_heads} must be a multiple of 4.")
    side = int(round(vision.num_position_embeddings ** 0.5))
    require(side * side == vision.num_position_embeddings,
            f"{family}: vision_config.num_position_embeddings={vision.num_position_embeddings} must be a square.")
    require(vision.hidden_act in VISION_ACTIVATIONS, f"{family}: vision_config.hidden_act={vision.hidden_act!r} is "
                                                     f"not supported; supported: {sorted(VISION_ACTIVATIONS)}.")
    deepstack = tuple(getattr(vision, "deepstack_visual_indexes", None) or ())
    require(all(0 <= index < vision.depth for index in deepstack),
            f"{family}: vision_config.deepstack_visual_indexes={list(deepstack)} must be blocks of the {vision.depth}.")
    require(len(deepstack) <= hf_config.text_config.num_hidden_layers,
            f"{family}: {len(deepstack)} DeepStack features for {hf_config.text_config.num_hidden_layers} text layers.")
    return QwenVisionSpec(
        depth=vision.depth, width=width, num_heads=vision.num_heads, intermediate_size=vision.intermediate_size,
        out_hidden_size=vision.out_hidden_size, patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size, in_channels=vision.in_channels,
        spatial_merge_size=vision.spatial_merge_size, norm="layer", mlp="plain", activation=vision.hidden_act,
        window_size=0, fullatt_block_indexes=(), image_token_id=int(hf_config.image_token_id),
        video_token_id=int(hf_config.video_token_id), dtype=jnp.dtype(dtype), patch_bias=True,
        num_position_embeddings=int(vision.num_position_embeddings), deepstack_layers=deepstack, merger="qwen3",
        frames_apart=True)


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> QwenVLDecoder:
    """The native decoder of ``text_config`` with the vision tower of ``vision_config``."""
    return QwenVLDecoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None = None,
           image_grid_thw: np.ndarray | None = None, pixel_values_videos: np.ndarray | None = None,
           video_grid_thw: np.ndarray | None = None, second_per_grid_ts: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    """The processor's outputs as the model takes them (see :func:`.qwen2_vl.images`); each temporal patch of a
    video is an item of its own, as Qwen3-VL writes a timestamp before each."""
    return qwen_images(vision_spec(hf_config, jnp.float32), hf_config, input_ids, pixel_values, image_grid_thw,
                       pixel_values_videos, video_grid_thw, second_per_grid_ts)


def merger_rows(hf: str, nnx_path: str) -> tuple[WeightRule, ...]:
    return (norm_rows(f"{hf}.norm", f"{nnx_path}.norm", bias=True)
            + linear_rows(f"{hf}.linear_fc1", f"{nnx_path}.linear_fc1", bias=True)
            + linear_rows(f"{hf}.linear_fc2", f"{nnx_path}.linear_fc2", bias=True))


def vision_rows(prefix: str = VISION_PREFIX) -> tuple[WeightRule, ...]:
    """The tower's rows (HF names under ``prefix``): the patch embedding and its bias, the position table, the blocks,
    the merger and DeepStack's mergers (their index as ``{layer}``)."""
    block, nnx_block = f"{prefix}blocks.{{layer}}", "visual.blocks.{layer}"
    rows = [WeightRule(f"{prefix}patch_embed.proj.weight", "visual.patch_embed", CONV3D_KERNEL),
            WeightRule(f"{prefix}patch_embed.proj.bias", "visual.patch_embed_bias"),
            WeightRule(f"{prefix}pos_embed.weight", "visual.pos_embed")]
    rows += linear_rows(f"{block}.attn.qkv", f"{nnx_block}.attn.qkv", bias=True)
    rows += linear_rows(f"{block}.attn.proj", f"{nnx_block}.attn.proj", bias=True)
    for name in ("linear_fc1", "linear_fc2"):
        rows += linear_rows(f"{block}.mlp.{name}", f"{nnx_block}.mlp.{name}", bias=True)
    for name in ("norm1", "norm2"):
        rows += norm_rows(f"{block}.{name}", f"{nnx_block}.{name}", bias=True)
    rows += merger_rows(f"{prefix}merger", "visual.merger")
    rows += merger_rows(f"{prefix}deepstack_merger_list.{{layer}}", "visual.deepstack_mergers.{layer}")
    return tuple(rows)


def text_rows() -> tuple[WeightRule, ...]:
    """Qwen3's decoder rows under ``model.language_model.`` (the head keeps its name)."""
    rows = llama_rows() + norm_rows(f"{LAYER}.self_attn.q_norm", f"{NNX_LAYER}.attn.q_norm") + norm_rows(
        f"{LAYER}.self_attn.k_norm", f"{NNX_LAYER}.attn.k_norm")
    return tuple(dataclasses.replace(rule, hf=TEXT_PREFIX + rule.hf[len("model."):]) if rule.hf.startswith("model.")
                 else rule for rule in rows)


def lora_targets() -> dict[str, str]:
    """The text decoder's projections, the tower's and the mergers' (``linear_fc1``/``linear_fc2`` name both the
    blocks' MLPs and the mergers', as in ``transformers``)."""
    targets = lora_targets_of()
    targets.update({"qkv": r"visual/blocks/\d+/attn/qkv", "proj": r"visual/blocks/\d+/attn/proj",
                    "linear_fc1": r"visual/.*/linear_fc1", "linear_fc2": r"visual/.*/linear_fc2"})
    return targets


TINY_CONFIGS = {
    # The text decoder of torchlike.testing.tiny_multimodal_config("qwen3_vl"): Qwen3's layout, its 8 rotary
    # frequencies per head interleaved over time, rows and columns (2/3/3).
    "qwen3_vl": TinyConfig("Qwen3VLTextConfig", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True})),
}

FAMILY = native_family(
    name="qwen3_vl", model_types=("qwen3_vl",), architectures=("Qwen3VLForConditionalGeneration",),
    spec_from_config=text_spec, weights=text_rows() + vision_rows(), build_model=build_model,
    lora_targets=lora_targets(), default_lora_targets=(),  # PEFT has no default for this model type
    ignored_hf_keys=DECODER_IGNORED_KEYS, images=images, image_keys=IMAGE_KEYS,
    lora_not_linear={PATCH_EMBED: CONV_REASON}, lora_refused={PATCH_EMBED: CONV_REASON}, prompt_learning=False,
    tiny_configs=TINY_CONFIGS)
