"""Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``) on the native decoder: fused ``qkv_proj`` (rows ``[q; k; v]``)
and ``gate_up_proj`` (rows ``[gate; up]``) kept as one module each, as PEFT adapts them, partial rotary (Phi-4-mini)
and LongRoPE (the 128k checkpoints), a sliding window on every layer when ``sliding_window`` is set."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    layer_windows,
    linear_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Phi-3 config."""
    check_native_config(hf_config, "phi3")
    require(not getattr(hf_config, "attention_bias", False), "phi3: attention_bias=True is not supported.")
    rope = rope_of(hf_config, "phi3")
    windows = layer_windows(hf_config, "phi3", lambda layer: hf_config.sliding_window is not None)
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers, windows=windows,
                       norm_eps=hf_config.rms_norm_eps, activation=hf_config.hidden_act, qkv="fused",
                       mlp="gated_fused")


WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("model.embed_tokens.weight", "embedder.input_embedding"),
    *linear_rows(f"{LAYER}.self_attn.qkv_proj", f"{NNX_LAYER}.attn.qkv_proj"),
    *linear_rows(f"{LAYER}.self_attn.o_proj", f"{NNX_LAYER}.attn.o_proj"),
    *linear_rows(f"{LAYER}.mlp.gate_up_proj", f"{NNX_LAYER}.mlp.gate_up_proj"),
    *linear_rows(f"{LAYER}.mlp.down_proj", f"{NNX_LAYER}.mlp.down_proj"),
    *norm_rows(f"{LAYER}.input_layernorm", f"{NNX_LAYER}.input_layernorm"),
    *norm_rows(f"{LAYER}.post_attention_layernorm", f"{NNX_LAYER}.post_attention_layernorm"),
    *norm_rows("model.norm", "final_norm"),
    *linear_rows("lm_head", "lm_head"),
)

TINY_CONFIGS = {
    # Phi-3: fused qkv_proj and gate_up_proj, Phi-4-mini's partial rotary (0.75) and tied embeddings, a window of 8.
    "phi3": TinyConfig("Phi3Config", dict(sliding_window=8, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="phi3",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(attention=("qkv_proj", "o_proj"), mlp=("gate_up_proj", "down_proj")),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    sequence_classification={"phi3": "Phi3ForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
