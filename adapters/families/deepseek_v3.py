"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) on the native decoder: multi-head latent attention (low-rank queries, a
shared key/value latent with one rotary key for every head, interleaved rope, YaRN's attention scale) and the routed
mixture of experts of :mod:`.routed_experts`. The multi-token-prediction layers published after the last layer
(``num_nextn_predict_layers``) are not part of the model: loading reports them as unused."""

from __future__ import annotations

import math

from ..model.native_decoder import DecoderSpec, LatentAttentionSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    linear_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)
from .routed_experts import ALL_LINEAR_REFUSED, MLP_REFUSED, NOT_LINEAR, ROUTER_ROWS, expert_rows, routed_spec


def attention_scale(hf_config) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2`` when the rope is scaled and ``mscale_all_dim`` is set (as
    ``transformers``' ``DeepseekV3Attention``)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    parameters = hf_config.rope_parameters
    mscale_all_dim = parameters.get("mscale_all_dim", 0)
    factor = parameters.get("factor", 1.0)
    if parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a DeepSeek-V3 config."""
    check_native_config(hf_config, "deepseek_v3")
    rope = rope_of(hf_config, "deepseek_v3", interleaved=bool(hf_config.rope_interleave))
    latent = LatentAttentionSpec(q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
                                 qk_nope_head_dim=hf_config.qk_nope_head_dim,
                                 qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim)
    bias = bool(hf_config.attention_bias)
    return DecoderSpec(**{**sizes(hf_config, dtype), "num_kv_heads": hf_config.num_attention_heads},
                       ropes=(rope,) * hf_config.num_hidden_layers, windows=(None,) * hf_config.num_hidden_layers,
                       norm_eps=hf_config.rms_norm_eps, activation=hf_config.hidden_act, attention_bias=bias,
                       output_bias=bias, latent_attention=latent, attention_scale=attention_scale(hf_config),
                       routed=routed_spec(hf_config, "deepseek_v3"))


ATTENTION, NNX_ATTENTION = f"{LAYER}.self_attn", f"{NNX_LAYER}.attn"

# Every bias row is listed: a config without attention biases has no bias parameter for them to fill.
WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("model.embed_tokens.weight", "embedder.input_embedding"),
    *linear_rows(f"{ATTENTION}.q_proj", f"{NNX_ATTENTION}.q_proj"),
    *linear_rows(f"{ATTENTION}.q_a_proj", f"{NNX_ATTENTION}.q_a_proj", bias=True),
    *norm_rows(f"{ATTENTION}.q_a_layernorm", f"{NNX_ATTENTION}.q_a_layernorm"),
    *linear_rows(f"{ATTENTION}.q_b_proj", f"{NNX_ATTENTION}.q_b_proj"),
    *linear_rows(f"{ATTENTION}.kv_a_proj_with_mqa", f"{NNX_ATTENTION}.kv_a_proj_with_mqa", bias=True),
    *norm_rows(f"{ATTENTION}.kv_a_layernorm", f"{NNX_ATTENTION}.kv_a_layernorm"),
    *linear_rows(f"{ATTENTION}.kv_b_proj", f"{NNX_ATTENTION}.kv_b_proj"),
    *linear_rows(f"{ATTENTION}.o_proj", f"{NNX_ATTENTION}.o_proj", bias=True),
    *(row for projection in ("gate_proj", "up_proj", "down_proj")
      for row in linear_rows(f"{LAYER}.mlp.{projection}", f"{NNX_LAYER}.mlp.{projection}")),
    *ROUTER_ROWS,
    *norm_rows(f"{LAYER}.input_layernorm", f"{NNX_LAYER}.input_layernorm"),
    *norm_rows(f"{LAYER}.post_attention_layernorm", f"{NNX_LAYER}.post_attention_layernorm"),
    *norm_rows("model.norm", "final_norm"),
    *linear_rows("lm_head", "lm_head"),
)

TINY_CONFIGS = {
    # DeepSeek-V3: latent attention (query rank 32, key/value latent 16, 16 + 8 rotated query/key features, values of
    # 16), interleaved YaRN rope with its attention scale, DeepSeek-V3's router on the second layer.
    "deepseek_v3": TinyConfig("DeepseekV3Config", dict(
        tie_word_embeddings=False, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    architectures=("DeepseekV3ForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    config_weights=expert_rows,
    lora_targets=lora_targets_of(attention=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                            "o_proj")),
    lora_not_linear=NOT_LINEAR,
    lora_refused=MLP_REFUSED,
    all_linear_refused=ALL_LINEAR_REFUSED,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    sequence_classification={"deepseek_v3": "DeepseekV3ForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
