"""Qwen2-VL and Qwen2.5-VL as Qwen publishes them (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): Qwen's vision tower (:mod:`adapters.model.qwen_vision`) in front of a Qwen2
text decoder on the native decoder, rotated by M-RoPE (``rope_parameters["mrope_section"]``).

Checkpoints as published (and as ``transformers`` 5 saves them): the text decoder under ``model.``, the tower under
``visual.``, the head ``lm_head``; ``transformers`` names them ``model.language_model.`` and ``model.visual.`` in
memory, which load too (and which PEFT adapters use). Export writes the published names.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.native_decoder import DecoderSpec
from ..model.qwen_vision import QwenVisionSpec, QwenVLDecoder, VisualItem, vision_inputs
from .base import DECODER_IGNORED_KEYS, Layout, TinyConfig, WeightRule, require
from .native import (
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

TEXT_PREFIX = "model."
IN_MEMORY_TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "visual."
IN_MEMORY_VISION_PREFIX = "model.visual."


class Conv3dKernel(Layout):
    """HF ``nn.Conv3d`` weight ``(out, C, T, P, P)`` <-> NNX ``(C, T, P, P, out)`` (a linear map of a patch)."""

    def to_nnx(self, hf, nnx_shape):
        return hf.transpose(1, 2, 3, 4, 0)

    def to_hf(self, nnx):
        return nnx.transpose(4, 0, 1, 2, 3)

    def hf_shape(self, nnx_shape):
        return (nnx_shape[4], *nnx_shape[:4])


CONV3D_KERNEL = Conv3dKernel()


def text_spec(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Qwen2-VL / Qwen2.5-VL config's ``text_config``: Qwen2's layout (biases on the query,
    key and value projections) with the multimodal rope."""
    text = hf_config.text_config
    family = hf_config.model_type
    check_native_config(text, family)
    require(not getattr(text, "use_sliding_window", False),
            f"{family}: text_config.use_sliding_window=True is not supported (Qwen's VL checkpoints leave it off).")
    section = tuple(int(value) for value in (text.rope_parameters.get("mrope_section") or ()))
    rope = rope_of(text, family)
    require(bool(section) and sum(section) == len(rope.inv_freq),
            f"{family}: text_config.rope_parameters.mrope_section={list(section)} must sum to head_dim // 2 = "
            f"{len(rope.inv_freq)}.")
    rope = dataclasses.replace(rope, mrope_section=section)
    fields = sizes(text, dtype)
    fields["tie_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", fields["tie_embeddings"]))
    return DecoderSpec(**fields, ropes=(rope,) * text.num_hidden_layers, windows=layer_types_windows(text, family),
                       norm_eps=text.rms_norm_eps, activation=text.hidden_act, attention_bias=True)


def vision_spec(hf_config, dtype) -> QwenVisionSpec:
    """The tower's spec of a ``Qwen2VLConfig`` (LayerNorm, ``fc1``/``fc2``, ``embed_dim`` wide, ``hidden_size`` out)
    or ``Qwen2_5_VLConfig`` (RMS norm, gated MLP, windows)."""
    vision = hf_config.vision_config
    qwen2 = hf_config.model_type == "qwen2_vl"
    width = vision.embed_dim if qwen2 else vision.hidden_size
    require(width % vision.num_heads == 0 and (width // vision.num_heads) % 4 == 0,
            f"{hf_config.model_type}: the vision head size {width}/{vision.num_heads} must be a multiple of 4.")
    if not qwen2 and vision.window_size:
        side = vision.spatial_merge_size * vision.patch_size
        require(vision.window_size % side == 0 and vision.window_size >= side,
                f"{hf_config.model_type}: vision_config.window_size={vision.window_size} must be a multiple of "
                f"spatial_merge_size * patch_size = {side}.")
    return QwenVisionSpec(
        depth=vision.depth, width=width, num_heads=vision.num_heads,
        intermediate_size=int(width * vision.mlp_ratio) if qwen2 else vision.intermediate_size,
        out_hidden_size=vision.hidden_size if qwen2 else vision.out_hidden_size,
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size, in_channels=vision.in_channels,
        spatial_merge_size=vision.spatial_merge_size, norm="layer" if qwen2 else "rms",
        mlp="plain" if qwen2 else "gated", activation=vision.hidden_act,
        window_size=0 if qwen2 else int(vision.window_size),
        fullatt_block_indexes=() if qwen2 else tuple(vision.fullatt_block_indexes),
        image_token_id=int(hf_config.image_token_id), video_token_id=int(hf_config.video_token_id),
        dtype=jnp.dtype(dtype))


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> QwenVLDecoder:
    """The native decoder of ``text_config`` with the vision tower of ``vision_config``."""
    from ..model.qwen_vision import VISION_ACTIVATIONS

    activation = hf_config.vision_config.hidden_act
    require(activation in VISION_ACTIVATIONS, f"{hf_config.model_type}: vision_config.hidden_act={activation!r} is "
                                              f"not supported; supported: {sorted(VISION_ACTIVATIONS)}.")
    return QwenVLDecoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def _vision_rows(qwen2: bool) -> tuple[WeightRule, ...]:
    block, nnx_block = "blocks.{layer}", "visual.blocks.{layer}"
    rows = [WeightRule("patch_embed.proj.weight", "visual.patch_embed", CONV3D_KERNEL)]
    rows += linear_rows(f"{block}.attn.qkv", f"{nnx_block}.attn.qkv", bias=True)
    rows += linear_rows(f"{block}.attn.proj", f"{nnx_block}.attn.proj", bias=True)
    for name in (("fc1", "fc2") if qwen2 else ("gate_proj", "up_proj", "down_proj")):
        rows += linear_rows(f"{block}.mlp.{name}", f"{nnx_block}.mlp.{name}", bias=True)
    for name in ("norm1", "norm2"):
        rows += norm_rows(f"{block}.{name}", f"{nnx_block}.{name}", bias=qwen2)
    rows += norm_rows("merger.ln_q", "visual.merger.ln_q", bias=qwen2)
    rows += linear_rows("merger.mlp.0", "visual.merger.mlp_in", bias=True)
    rows += linear_rows("merger.mlp.2", "visual.merger.mlp_out", bias=True)
    return tuple(rows)


def _with_prefix(rows, prefix: str, alias: str) -> tuple[WeightRule, ...]:
    out = []
    for rule in rows:
        out.append(dataclasses.replace(rule, hf=prefix + rule.hf))
        out.append(dataclasses.replace(rule, hf=alias + rule.hf, load_only=True))
    return tuple(out)


def weights(qwen2: bool) -> tuple[WeightRule, ...]:
    """The table: the text rows (published ``model.``, in memory ``model.language_model.``), the head, the tower
    (published ``visual.``, in memory ``model.visual.``)."""
    text = llama_rows(attention_bias=True)
    inside = tuple(rule for rule in text if rule.hf.startswith(TEXT_PREFIX))
    head = tuple(rule for rule in text if not rule.hf.startswith(TEXT_PREFIX))
    stripped = tuple(dataclasses.replace(rule, hf=rule.hf[len(TEXT_PREFIX):]) for rule in inside)
    return (_with_prefix(stripped, TEXT_PREFIX, IN_MEMORY_TEXT_PREFIX) + head
            + _with_prefix(_vision_rows(qwen2), VISION_PREFIX, IN_MEMORY_VISION_PREFIX))


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None = None,
           image_grid_thw: np.ndarray | None = None, pixel_values_videos: np.ndarray | None = None,
           video_grid_thw: np.ndarray | None = None, second_per_grid_ts: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    """The processor's outputs as the model takes them (:func:`~adapters.model.qwen_vision.vision_inputs`).

    Args:
        pixel_values: ``[patches, C * T * P * P]`` every image's patches, image after image (``image_grid_thw``
            ``[images, 3]`` gives each one's grid).
        pixel_values_videos, video_grid_thw: the same for videos; ``second_per_grid_ts`` ``[videos]`` (Qwen2.5-VL):
            seconds per temporal patch, which spaces the frames' M-RoPE positions.

    Raises:
        ValueError: pixels without their grid, a grid that does not match the patches, or tokens that do not match
            the images and videos (named).
    """
    return qwen_images(vision_spec(hf_config, jnp.float32), hf_config, input_ids, pixel_values, image_grid_thw,
                       pixel_values_videos, video_grid_thw, second_per_grid_ts)


def qwen_images(spec: QwenVisionSpec, hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None,
                image_grid_thw: np.ndarray | None, pixel_values_videos: np.ndarray | None,
                video_grid_thw: np.ndarray | None, second_per_grid_ts: np.ndarray | None) -> dict[str, np.ndarray]:
    """:func:`images` for a tower of ``spec`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): frames of a video sit
    ``tokens_per_second * seconds`` positions apart on Qwen2.5-VL only."""
    spaced = hf_config.model_type == "qwen2_5_vl"
    tokens_per_second = int(getattr(hf_config.vision_config, "tokens_per_second", 1)) if spaced else 1
    seconds = None if second_per_grid_ts is None else np.asarray(second_per_grid_ts, np.float64).reshape(-1)

    def items(pixels, grids, kind, interval_of):
        if pixels is None:
            if grids is not None and len(np.asarray(grids)):
                raise ValueError(f"{kind}_grid_thw was given without its pixels.")
            return []
        if grids is None:
            raise ValueError(f"{hf_config.model_type} needs {kind}_grid_thw with its pixels (the processor returns "
                             "both): each item's (frames, rows, columns) of patches.")
        pixels = np.asarray(pixels, np.float32)
        grids = np.asarray(grids, np.int64).reshape(-1, 3)
        if pixels.ndim != 2 or pixels.shape[1] != spec.patch_values:
            raise ValueError(f"{kind} pixels must be [patches, {spec.patch_values}] (C * temporal_patch_size * "
                             f"patch_size ** 2) as the processor returns them; got {pixels.shape}.")
        if int(grids.prod(-1).sum()) != len(pixels):
            raise ValueError(f"{kind}_grid_thw counts {int(grids.prod(-1).sum())} patches but the pixels hold "
                             f"{len(pixels)}.")
        if np.any(grids[:, 1:] % spec.spatial_merge_size):
            raise ValueError(f"{kind}_grid_thw {grids.tolist()}: rows and columns must be multiples of "
                             f"spatial_merge_size={spec.spatial_merge_size}.")
        out, start = [], 0
        for index, grid in enumerate(grids):
            count = int(grid.prod())
            out.append(VisualItem(pixels[start:start + count], tuple(int(v) for v in grid), interval_of(index)))
            start += count
        return out

    video_interval = (lambda index: 1) if not spaced else (
        lambda index: tokens_per_second * int(1 if seconds is None else seconds[index]))
    return vision_inputs(spec, input_ids, items(pixel_values, image_grid_thw, "image", lambda index: 1),
                         items(pixel_values_videos, video_grid_thw, "video", video_interval),
                         spec.window_size, spec.patch_size)


TINY_CONFIGS = {
    # The text decoders of torchlike.testing.tiny_multimodal_config("qwen2_5_vl" / "qwen2_vl"): Qwen2's layout, its
    # 8 rotary frequencies per head split 2/3/3 over time, rows and columns.
    "qwen2_5_vl": TinyConfig("Qwen2_5_VLTextConfig", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})),
    "qwen2_vl": TinyConfig("Qwen2VLTextConfig", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})),
}

IMAGE_KEYS = ("image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The processor's outputs beside ``pixel_values`` that :func:`images` reads."""


PATCH_EMBED = r"(model\.)?visual\.patch_embed\.proj"
CONV_REASON = ("the patch embedding is a Conv3d in transformers (PEFT adapts it as a convolution, torchlike does not); "
               "name the tower's attention output 'attn.proj' instead of 'proj'")


def _lora_targets(qwen2: bool) -> dict[str, str]:
    """HF module name -> NNX module regex: the text decoder's projections, the tower's (``transformers`` names the
    tower's MLP as the text's on Qwen2.5-VL, so ``gate_proj`` adapts both, as in PEFT) and the merger's MLP
    (``mlp.0``, ``mlp.2``; ``"all-linear"`` reaches them)."""
    mlp = ("fc1", "fc2") if qwen2 else ("gate_proj", "up_proj", "down_proj")
    targets = lora_targets_of()
    targets.update({"qkv": r"visual/blocks/\d+/attn/qkv", "proj": r"visual/blocks/\d+/attn/proj",
                    "0": "visual/merger/mlp_in", "2": "visual/merger/mlp_out"})
    for name in mlp:
        text = targets.get(name)
        targets[name] = rf"visual/blocks/\d+/mlp/{name}" if text is None else rf"({text}|visual/blocks/\d+/mlp/{name})"
    return targets


def _family(name: str, model_type: str, architecture: str):
    qwen2 = model_type == "qwen2_vl"
    return native_family(
        name=name, model_types=(model_type,), architectures=(architecture,), spec_from_config=text_spec,
        weights=weights(qwen2), build_model=build_model, lora_targets=_lora_targets(qwen2),
        default_lora_targets=(),  # PEFT has no default for this model type
        ignored_hf_keys=DECODER_IGNORED_KEYS, images=images, image_keys=IMAGE_KEYS,
        lora_not_linear={PATCH_EMBED: CONV_REASON}, lora_refused={PATCH_EMBED: CONV_REASON},
        in_memory_prefixes=((VISION_PREFIX, IN_MEMORY_VISION_PREFIX), (TEXT_PREFIX, IN_MEMORY_TEXT_PREFIX)),
        prompt_learning=False, tiny_configs={model_type: TINY_CONFIGS[model_type]},
        # transformers exempts nn.LayerNorm modules and norm-like names from weight decay: Qwen2-VL's merger norm is a
        # LayerNorm named ln_q; Qwen2.5-VL's tower norms are RMS norms named norm1/norm2, which it decays.
        decay_overrides={r"visual\.merger\.ln_q\.scale": False} if qwen2 else
        {r"visual\.blocks\.\d+\.norm[12]\.scale": True})


QWEN2_VL = _family("qwen2_vl", "qwen2_vl", "Qwen2VLForConditionalGeneration")
QWEN2_5_VL = _family("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")
FAMILIES = (QWEN2_VL, QWEN2_5_VL)
FAMILY = QWEN2_5_VL
