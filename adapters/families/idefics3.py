"""SmolVLM and Idefics3 (``SmolVLMForConditionalGeneration``, ``Idefics3ForConditionalGeneration``): their SigLIP
encoder and pixel-shuffle connector (:mod:`adapters.model.siglip_vision`) in front of a Llama text decoder (SmolLM2,
Llama 3) on the native decoder. Checkpoints as published and in memory: ``model.text_model.``,
``model.vision_model.``, ``model.connector.``, ``lm_head``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.clip_vision import CLIP_ACTIVATIONS
from ..model.native_decoder import DecoderSpec
from ..model.siglip_vision import Idefics3Decoder, SiglipSpec
from .base import CONV_KERNEL, DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
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

TEXT_PREFIX = "model.text_model."
VISION_PREFIX = "model.vision_model."


def vision_spec(hf_config, dtype) -> SiglipSpec:
    vision = hf_config.vision_config
    family = hf_config.model_type
    require(vision.hidden_act in CLIP_ACTIVATIONS, f"{family}: vision_config.hidden_act={vision.hidden_act!r} is not "
                                                   f"supported; supported: {sorted(CLIP_ACTIVATIONS)}.")
    side = vision.image_size // vision.patch_size
    require(vision.image_size % vision.patch_size == 0 and side % hf_config.scale_factor == 0,
            f"{family}: image_size={vision.image_size} must be patch_size={vision.patch_size} times a multiple of "
            f"scale_factor={hf_config.scale_factor}.")
    return SiglipSpec(width=vision.hidden_size, num_heads=vision.num_attention_heads,
                      intermediate_size=vision.intermediate_size, blocks=vision.num_hidden_layers,
                      image_size=vision.image_size, patch_size=vision.patch_size, in_channels=vision.num_channels,
                      layer_norm_eps=float(vision.layer_norm_eps), activation=vision.hidden_act,
                      scale_factor=hf_config.scale_factor, text_hidden_size=hf_config.text_config.hidden_size,
                      image_token_id=int(hf_config.image_token_id), dtype=jnp.dtype(dtype))


def text_spec(hf_config, dtype) -> DecoderSpec:
    """The Llama decoder of ``text_config``."""
    text = hf_config.text_config
    family = f"{hf_config.model_type} (text)"
    require(text.model_type == "llama", f"{hf_config.model_type}: text_config.model_type={text.model_type!r} is not "
                                        "supported (Llama's 'llama').")
    check_native_config(text, family)
    require(not getattr(text, "attention_bias", False) and not getattr(text, "mlp_bias", False),
            f"{family}: attention_bias / mlp_bias are not supported.")
    layers = text.num_hidden_layers
    fields = sizes(text, dtype)
    fields["tie_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", fields["tie_embeddings"]))
    return DecoderSpec(**fields, ropes=(rope_of(text, family),) * layers, windows=(None,) * layers,
                       norm_eps=text.rms_norm_eps, activation=text.hidden_act)


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> Idefics3Decoder:
    return Idefics3Decoder(text_spec(hf_config, dtype), vision_spec(hf_config, dtype), rngs=rngs)


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None,
           pixel_attention_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The processor's ``pixel_values`` ``[B, N, C, H, W]`` (each row's images, zero images after) and
    ``pixel_attention_mask`` ``[B, N, H, W]`` as the model takes them: the pixels ``[B, N, H, W, C]`` and, per slot,
    each patch's position id and whether it holds image (``Idefics3VisionEmbeddings``' bucketing).

    Raises:
        ValueError: pixels of another layout or size, or image tokens that do not match the images (named).
    """
    import torch

    spec = vision_spec(hf_config, jnp.float32)
    pixels = None if pixel_values is None else np.asarray(pixel_values, np.float32)
    if pixels is None or pixels.ndim != 5 or pixels.shape[3:] != (spec.image_size, spec.image_size):
        raise ValueError(f"{hf_config.model_type} takes pixel_values [batch, images, channels, {spec.image_size}, "
                         f"{spec.image_size}] as its processor returns them; got shape {np.shape(pixel_values)}.")
    batch, slots = pixels.shape[:2]
    if len(pixels) != len(input_ids):
        raise ValueError(f"pixel_values has {len(pixels)} rows for {len(input_ids)} rows of input_ids.")
    mask = (np.ones((batch, slots, spec.image_size, spec.image_size), bool) if pixel_attention_mask is None
            else np.asarray(pixel_attention_mask).astype(bool))
    real = ~np.all(pixels == 0.0, axis=(2, 3, 4))
    counts = (np.asarray(input_ids) == spec.image_token_id).sum(axis=1)
    for row in range(batch):
        expected = int(real[row].sum()) * spec.tokens_per_image
        if counts[row] != expected or (real[row].any() and not real[row][:real[row].sum()].all()):
            raise ValueError(f"row {row} has {int(counts[row])} image tokens (id {spec.image_token_id}) but its "
                             f"{int(real[row].sum())} images take {expected} ({spec.tokens_per_image} each): build "
                             "the prompts with the model's processor.")
    patch = spec.patch_size
    patch_mask = mask.reshape(batch, slots, spec.side, patch, spec.side, patch).any(axis=(3, 5))
    boundaries = torch.arange(1 / spec.side, 1.0, 1 / spec.side)
    position_ids = np.zeros((batch, slots, spec.side ** 2), np.int32)
    for row in range(batch):
        for slot in range(slots):
            grid = patch_mask[row, slot]
            rows, cols = max(int(grid[:, 0].sum()), 1), max(int(grid[0, :].sum()), 1)
            coords = [torch.clamp(torch.arange(spec.side, dtype=torch.float32) * (1.0 / count), max=1.0 - 1e-6)
                      for count in (torch.tensor(float(rows)), torch.tensor(float(cols)))]
            buckets = [torch.bucketize(coord, boundaries, right=True).numpy() for coord in coords]
            ids = (buckets[0][:, None] * spec.side + buckets[1][None, :]).reshape(-1)
            position_ids[row, slot] = np.where(grid.reshape(-1), ids, 0)
    return {"pixels": np.transpose(pixels, (0, 1, 3, 4, 2)), "position_ids": position_ids,
            "patch_mask": patch_mask.reshape(batch, slots, -1)}


def _vision_rows() -> tuple[WeightRule, ...]:
    prefix, layer = VISION_PREFIX, f"{VISION_PREFIX}encoder.layers.{{layer}}"
    nnx_layer = "vision_model.layers.{layer}"
    rows = [WeightRule(f"{prefix}embeddings.patch_embedding.weight", "vision_model.patch_embedding", CONV_KERNEL),
            WeightRule(f"{prefix}embeddings.patch_embedding.bias", "vision_model.patch_embedding_bias"),
            WeightRule(f"{prefix}embeddings.position_embedding.weight", "vision_model.position_embedding")]
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        rows += linear_rows(f"{layer}.self_attn.{name}", f"{nnx_layer}.self_attn.{name}", bias=True)
    for name in ("fc1", "fc2"):
        rows += linear_rows(f"{layer}.mlp.{name}", f"{nnx_layer}.mlp.{name}", bias=True)
    for name in ("layer_norm1", "layer_norm2"):
        rows += norm_rows(f"{layer}.{name}", f"{nnx_layer}.{name}", bias=True)
    rows += norm_rows(f"{prefix}post_layernorm", "vision_model.post_layernorm", bias=True)
    rows += linear_rows("model.connector.modality_projection.proj", "connector.modality_projection")
    return tuple(rows)


def _weights() -> tuple[WeightRule, ...]:
    text = tuple(dataclasses.replace(rule, hf=TEXT_PREFIX + rule.hf[len("model."):]) if rule.hf.startswith("model.")
                 else rule for rule in llama_rows())
    return text + _vision_rows()


def _lora_targets() -> dict[str, str]:
    targets = lora_targets_of()
    for name in ("q_proj", "k_proj", "v_proj"):
        targets[name] = rf"({targets[name]}|vision_model/layers/\d+/self_attn/{name})"
    targets.update({"out_proj": r"vision_model/layers/\d+/self_attn/out_proj",
                    "fc1": r"vision_model/layers/\d+/mlp/fc1", "fc2": r"vision_model/layers/\d+/mlp/fc2",
                    "proj": "connector/modality_projection"})
    return targets


PATCH_EMBEDDING = r"model\.vision_model\.embeddings\.patch_embedding"


def _family(name: str, architecture: str):
    return native_family(
        name=name, model_types=(name,), architectures=(architecture,), spec_from_config=text_spec,
        weights=_weights(), build_model=build_model, lora_targets=_lora_targets(),
        default_lora_targets=(),  # PEFT has no default for these model types
        ignored_hf_keys=DECODER_IGNORED_KEYS, images=images, image_keys=("pixel_attention_mask",),
        prompt_learning=False, lora_not_linear={PATCH_EMBEDDING: "the patch embedding is a Conv2d in transformers"},
        tiny_configs={name: TinyConfig("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False))})


SMOLVLM = _family("smolvlm", "SmolVLMForConditionalGeneration")
IDEFICS3 = _family("idefics3", "Idefics3ForConditionalGeneration")
FAMILIES = (SMOLVLM, IDEFICS3)
FAMILY = SMOLVLM
