"""IBM Granite (``GraniteForCausalLM``) on the native decoder: the Llama layout with Granite's multipliers (embeddings,
attention scale, residual branches) and its logits divisor. ``transformers`` has no Granite sequence classifier."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig
from .native import check_native_config, llama_rows, lora_targets_of, native_family, rope_of, sizes


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Granite config."""
    check_native_config(hf_config, "granite")
    rope = rope_of(hf_config, "granite")
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers,
                       windows=(None,) * hf_config.num_hidden_layers, norm_eps=hf_config.rms_norm_eps,
                       activation=hf_config.hidden_act, attention_bias=bool(hf_config.attention_bias),
                       output_bias=bool(hf_config.attention_bias), mlp_bias=bool(hf_config.mlp_bias),
                       attention_scale=float(hf_config.attention_multiplier),
                       embedding_multiplier=float(hf_config.embedding_multiplier),
                       residual_multiplier=float(hf_config.residual_multiplier),
                       logits_divisor=float(hf_config.logits_scaling))



# Every bias row is listed: a config without biases has no bias parameter for them to fill.
WEIGHTS = llama_rows(attention_bias=True, output_bias=True, mlp_bias=True)

TINY_CONFIGS = {
    # Granite: Granite 3's multipliers (embeddings x12, attention scale 1/64, residual branches x0.22, logits / 8).
    "granite": TinyConfig("GraniteConfig", dict(
        rope_theta=10000.0, tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.015625,
        residual_multiplier=0.22, logits_scaling=8.0)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="granite",
    model_types=("granite",),
    architectures=("GraniteForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    tiny_configs=TINY_CONFIGS,
)
