"""GPT-NeoX and Pythia (``GPTNeoXForCausalLM``) on the native decoder: LayerNorms with biases, a fused
``query_key_value`` laid out per head (``[q, k, v]`` of each head in turn), partial rotary, and the parallel residual
(``x + attn(ln1(x)) + mlp(ln2(x))``) or the sequential one (``use_parallel_residual=False``)."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import TinyConfig, WeightRule
from .native import check_native_config, linear_rows, lora_targets_of, native_family, norm_rows, rope_of, sizes

LAYER, NNX_LAYER = "gpt_neox.layers.{layer}", "layers.{layer}"


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a GPT-NeoX config."""
    check_native_config(hf_config, "gpt_neox")
    rope = rope_of(hf_config, "gpt_neox")
    bias = bool(hf_config.attention_bias)
    # Multi-head attention: as many key/value heads as query heads, whatever else the config holds.
    return DecoderSpec(**{**sizes(hf_config, dtype), "num_kv_heads": hf_config.num_attention_heads},
                       ropes=(rope,) * hf_config.num_hidden_layers, windows=(None,) * hf_config.num_hidden_layers,
                       norm="layer", norm_bias=True, norm_eps=hf_config.layer_norm_eps,
                       block="parallel" if hf_config.use_parallel_residual else "sequential",
                       qkv="fused_per_head", qkv_name="query_key_value", output_name="dense", mlp="plain",
                       activation=hf_config.hidden_act, attention_bias=bias, output_bias=bias, mlp_bias=True)


# Every bias row is listed: a config without attention biases has no bias parameter for them to fill.
WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("gpt_neox.embed_in.weight", "embedder.input_embedding"),
    *norm_rows(f"{LAYER}.input_layernorm", f"{NNX_LAYER}.input_layernorm", bias=True),
    *norm_rows(f"{LAYER}.post_attention_layernorm", f"{NNX_LAYER}.post_attention_layernorm", bias=True),
    *linear_rows(f"{LAYER}.attention.query_key_value", f"{NNX_LAYER}.attn.query_key_value", bias=True),
    *linear_rows(f"{LAYER}.attention.dense", f"{NNX_LAYER}.attn.dense", bias=True),
    *linear_rows(f"{LAYER}.mlp.dense_h_to_4h", f"{NNX_LAYER}.mlp.up_proj", bias=True),
    *linear_rows(f"{LAYER}.mlp.dense_4h_to_h", f"{NNX_LAYER}.mlp.down_proj", bias=True),
    *norm_rows("gpt_neox.final_layer_norm", "final_norm", bias=True),
    *linear_rows("embed_out", "lm_head"),
)

TINY_CONFIGS = {
    # GPT-NeoX / Pythia: multi-head attention, a quarter of each head rotated, parallel residual, LayerNorm biases.
    "gpt_neox": TinyConfig("GPTNeoXConfig", dict(
        num_key_value_heads=4, layer_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    architectures=("GPTNeoXForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(attention=("query_key_value", "dense"), mlp=("dense_h_to_4h", "dense_4h_to_h"),
                                 renamed={"dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj"}),
    default_lora_targets=("query_key_value",),  # PEFT's default for model_type "gpt_neox"
    ignored_hf_keys=(r"gpt_neox\.rotary_emb\..*", r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)",
                     r"gpt_neox\.layers\.\d+\.attention\.rotary_emb\..*"),
    sequence_classification={"gpt_neox": "GPTNeoXForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
