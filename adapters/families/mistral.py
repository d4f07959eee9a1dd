"""Mistral and Ministral (``MistralForCausalLM``, ``MinistralForCausalLM``) on the native decoder: the Llama layout with
a sliding window (on every Mistral layer when ``sliding_window`` is set; on Ministral's ``sliding_attention``
layers)."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig, require
from .native import (
    check_native_config,
    layer_types_windows,
    layer_windows,
    llama_rows,
    lora_targets_of,
    native_family,
    rope_of,
    sizes,
)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Mistral or Ministral config."""
    family = hf_config.model_type
    check_native_config(hf_config, family)
    require(not getattr(hf_config, "attention_bias", False), f"{family}: attention_bias=True is not supported.")
    if getattr(hf_config, "layer_types", None):
        windows = layer_types_windows(hf_config, family)
    else:
        windows = layer_windows(hf_config, family, lambda layer: hf_config.sliding_window is not None)
    rope = rope_of(hf_config, family)
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers, windows=windows,
                       norm_eps=hf_config.rms_norm_eps, activation=hf_config.hidden_act)


TINY_CONFIGS = {
    # The families on torchlike's native decoder. Mistral: every layer slides, a window (8) shorter than a typical
    # test row. Ministral: sliding and full layers taking turns.
    "mistral": TinyConfig("MistralConfig", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    spec_from_config=spec_from_config,
    weights=llama_rows(),
    lora_targets=lora_targets_of(),
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "mistral"
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    sequence_classification={"mistral": "MistralForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
