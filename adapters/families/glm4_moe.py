"""GLM-4 MoE / GLM-4.5 (``Glm4MoeForCausalLM``) on the native decoder: grouped-query attention with biases on the
query, key and value projections, optional per-head QK norms, partial rotary (half of each head), and DeepSeek-V3's
mixture of experts (:mod:`.routed_experts`). The multi-token-prediction layers published after the last layer
(``num_nextn_predict_layers``) are not part of the model: loading reports them as unused."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    llama_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)
from .routed_experts import ALL_LINEAR_REFUSED, MLP_REFUSED, NOT_LINEAR, ROUTER_ROWS, expert_rows, routed_spec


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a GLM-4 MoE config."""
    check_native_config(hf_config, "glm4_moe")
    rope = rope_of(hf_config, "glm4_moe")
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers,
                       windows=(None,) * hf_config.num_hidden_layers, norm_eps=hf_config.rms_norm_eps,
                       activation=hf_config.hidden_act, attention_bias=bool(hf_config.attention_bias),
                       qk_norm="head" if hf_config.use_qk_norm else "none",
                       routed=routed_spec(hf_config, "glm4_moe"))


# Every bias row is listed: a config without attention biases has no bias parameter for them to fill.
WEIGHTS = llama_rows(attention_bias=True) + ROUTER_ROWS + norm_rows(
    f"{LAYER}.self_attn.q_norm", f"{NNX_LAYER}.attn.q_norm") + norm_rows(
    f"{LAYER}.self_attn.k_norm", f"{NNX_LAYER}.attn.k_norm")

TINY_CONFIGS = {
    # GLM-4 MoE: the first layer dense, then 8 experts of 32 in 4 groups (2 chosen within the best 2 groups), a shared
    # expert, per-head QK norms, biases on q/k/v, half of each head rotated.
    "glm4_moe": TinyConfig("Glm4MoeConfig", dict(
        rope_theta=10000.0, tie_word_embeddings=False, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architectures=("Glm4MoeForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    config_weights=expert_rows,
    lora_targets=lora_targets_of(),
    lora_not_linear=NOT_LINEAR,
    lora_refused=MLP_REFUSED,
    all_linear_refused=ALL_LINEAR_REFUSED,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    tiny_configs=TINY_CONFIGS,
)
