"""Qwen3.5, dense and MoE, on the native decoder: Qwen3-Next's hybrid (:mod:`.qwen3_next`: gated DeltaNet and gated
attention layers, ``1 + weight`` norms) with the DeltaNet input projections split (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``); the MoE variant has Qwen's experts and gated shared expert on every layer, its router
always renormalising the chosen experts' probabilities.

Four families: the text classes ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (``model.layers...``) and the
classes Qwen publishes, ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``, whose text
decoder sits under ``model.language_model.`` beside Qwen3-VL's vision tower without DeepStack (``model.visual.``,
:mod:`.qwen3_vl`), the images in place of their tokens and every token rotated by interleaved M-RoPE over the first
``partial_rotary_factor`` of each head. Text positions are the same on all three axes, which is the plain rope.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from ..model.native_decoder import DecoderSpec
from ..model.qwen_vision import QwenVLDecoder
from . import qwen3_vl
from .base import DECODER_IGNORED_KEYS, Family, TinyConfig, reprefixed
from .native import llama_rows, native_family
from .qwen2_vl import CONV_REASON, IMAGE_KEYS
from .qwen3_moe import expert_weights
from .qwen3_next import (
    ATTENTION_ROWS,
    HYBRID_SHAPE,
    LORA_TARGETS,
    NOT_LINEAR,
    SPARSE_MOE_ROWS,
    deltanet_rows,
    hybrid_spec,
    router_logits,
)

SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Qwen3.5 text config (dense or MoE)."""
    moe = getattr(hf_config, "num_experts", 0)
    return hybrid_spec(hf_config, dtype, hf_config.model_type, fused=False, norm_topk_prob=True if moe else None)


TEXT_WEIGHTS = (llama_rows(attention_bias=True, output_bias=True) + ATTENTION_ROWS + deltanet_rows(SPLIT_PROJECTIONS))
MOE_TEXT_WEIGHTS = TEXT_WEIGHTS + SPARSE_MOE_ROWS

TEXT_PREFIX = "model.language_model."
"""Where the published checkpoints keep the text decoder (``model.`` of the ``*ForCausalLM`` classes)."""


NOT_LINEAR_MOE = NOT_LINEAR | {r".*\.mlp\.gate": "the router is not a linear module in transformers "
                                                  "(Qwen3_5MoeTopKRouter)"}

TINY_CONFIGS = {
    # Qwen3.5: the hybrid shape of qwen3_next (DeltaNet, attention, DeltaNet), dense MLPs.
    "qwen3_5": TinyConfig("Qwen3_5TextConfig", dict(HYBRID_SHAPE)),
    # Qwen3.5-MoE: the hybrid shape, 4 experts of 32 with 2 chosen on every layer, a gated shared expert of 32.
    "qwen3_5_moe": TinyConfig("Qwen3_5MoeTextConfig", dict(
        HYBRID_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""


def _text_family(name: str, model_types: tuple[str, ...], architecture: str, weights, moe: bool,
                 classification: dict[str, str], tiny: dict[str, TinyConfig]) -> Family:
    extra = dict(config_weights=expert_weights, router_logits=router_logits) if moe else {}
    return native_family(name=name, model_types=model_types, architectures=(architecture,),
                         spec_from_config=spec_from_config, weights=weights, lora_targets=LORA_TARGETS,
                         lora_not_linear=NOT_LINEAR_MOE if moe else NOT_LINEAR, ignored_hf_keys=DECODER_IGNORED_KEYS,
                         norms_scale_by_one_plus_weight=True, sequence_classification=classification,
                         tiny_configs=tiny, **extra)


def _build_published(hf_config, dtype, rngs: nnx.Rngs) -> QwenVLDecoder:
    """The text decoder of a published Qwen3.5 config (its ``text_config``, rotated by interleaved M-RoPE over its
    ``partial_rotary_factor``) with Qwen3-VL's vision tower (no DeepStack)."""
    spec = spec_from_config(hf_config.text_config, dtype)
    rope = qwen3_vl.multimodal_rope(hf_config.text_config, hf_config.model_type, default_section=(11, 11, 10))
    spec = dataclasses.replace(spec, ropes=tuple(None if old is None else rope for old in spec.ropes))
    return QwenVLDecoder(spec, qwen3_vl.vision_spec(hf_config, dtype), rngs=rngs)


def _published_rows(rows) -> tuple:
    """``rows`` with the text decoder's ``model.`` under ``model.language_model.`` (also read under ``model.``); the
    output head keeps its name."""
    inside = tuple(rule for rule in rows if rule.hf.startswith("model."))
    return reprefixed(inside, "model.", TEXT_PREFIX, aliases=("model.",)) + tuple(
        rule for rule in rows if not rule.hf.startswith("model."))


def _published_expert_weights(hf_config):
    return _published_rows(expert_weights(getattr(hf_config, "text_config", hf_config)))


def _published_family(text: Family, name: str, model_type: str, architecture: str, moe: bool,
                      classification: dict[str, str]) -> Family:
    """A published class: ``text``'s decoder under ``model.language_model.`` (also read under the text class's
    names) and Qwen3-VL's vision tower under ``model.visual.``."""
    extra = dict(config_weights=_published_expert_weights) if moe else {}
    return native_family(name=name, model_types=(model_type,), architectures=(architecture,),
                         spec_from_config=spec_from_config,
                         weights=_published_rows(text.weights) + qwen3_vl.vision_rows(),
                         build_model=_build_published,
                         lora_targets={**qwen3_vl.lora_targets(), **text.lora_targets},
                         lora_not_linear={**text.lora_not_linear, qwen3_vl.PATCH_EMBED: CONV_REASON},
                         lora_refused={**text.lora_refused, qwen3_vl.PATCH_EMBED: CONV_REASON},
                         ignored_hf_keys=text.ignored_hf_keys, norms_scale_by_one_plus_weight=True,
                         router_logits=text.router_logits, images=qwen3_vl.images, image_keys=IMAGE_KEYS,
                         decoder=text.name, sequence_classification=classification, prompt_learning=False, **extra)


TEXT = _text_family("qwen3_5", ("qwen3_5_text",), "Qwen3_5ForCausalLM", TEXT_WEIGHTS, moe=False,
                    classification={"qwen3_5_text": "Qwen3_5TextForSequenceClassification"},
                    tiny={"qwen3_5": TINY_CONFIGS["qwen3_5"]})
# transformers has no sequence-classification class for Qwen3.5-MoE.
MOE_TEXT = _text_family("qwen3_5_moe", ("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM", MOE_TEXT_WEIGHTS, moe=True,
                        classification={}, tiny={"qwen3_5_moe": TINY_CONFIGS["qwen3_5_moe"]})
PUBLISHED = _published_family(TEXT, "qwen3_5_multimodal", "qwen3_5", "Qwen3_5ForConditionalGeneration", moe=False,
                              classification={"qwen3_5": "Qwen3_5ForSequenceClassification"})
MOE_PUBLISHED = _published_family(MOE_TEXT, "qwen3_5_moe_multimodal", "qwen3_5_moe",
                                  "Qwen3_5MoeForConditionalGeneration", moe=True, classification={})

FAMILIES = (TEXT, MOE_TEXT, PUBLISHED, MOE_PUBLISHED)
FAMILY = TEXT
