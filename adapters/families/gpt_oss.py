"""GPT-OSS (``GptOssForCausalLM``) on the native decoder: attention with a bias on every projection and a learned sink
per head, sliding and full layers by ``layer_types``, YaRN rope, and a mixture-of-experts MLP whose router has a bias
(:class:`~adapters.model.native_decoder.GptOssExperts`), with ``transformers``' load-balancing loss. The published
MXFP4 experts are dequantised on import (:mod:`adapters.checkpoint.mxfp4`) and exported in bfloat16."""

from __future__ import annotations

from ..checkpoint import mxfp4
from ..losses.router import RouterRecord
from ..model.experts import run_recording_router_logits
from ..model.native_decoder import DecoderSpec, GptOssExperts
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    layer_types_windows,
    linear_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a GPT-OSS config."""
    check_native_config(hf_config, "gpt_oss", activation_field=None)  # the experts' clamped SwiGLU is fixed
    experts, top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok
    require(0 < top_k <= experts, f"gpt_oss: num_experts_per_tok={top_k} must be between 1 and num_local_experts="
                                  f"{experts}.")
    rope = rope_of(hf_config, "gpt_oss")
    bias = bool(hf_config.attention_bias)
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers,
                       windows=layer_types_windows(hf_config, "gpt_oss"), norm_eps=hf_config.rms_norm_eps,
                       attention_bias=bias, output_bias=bias, attention_sinks=True, mlp="gpt_oss_experts",
                       num_experts=experts, num_experts_per_tok=top_k)


EXPERTS, NNX_EXPERTS = f"{LAYER}.mlp.experts", f"{NNX_LAYER}.mlp"

# Every bias row is listed: a config without attention biases has no bias parameter for them to fill.
WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("model.embed_tokens.weight", "embedder.input_embedding"),
    *(row for projection in ("q_proj", "k_proj", "v_proj", "o_proj")
      for row in linear_rows(f"{LAYER}.self_attn.{projection}", f"{NNX_LAYER}.attn.{projection}", bias=True)),
    WeightRule(f"{LAYER}.self_attn.sinks", f"{NNX_LAYER}.attn.sinks"),
    *linear_rows(f"{LAYER}.mlp.router", f"{NNX_LAYER}.mlp.router", bias=True),
    # transformers keeps the experts as stacked parameters in the layout the NNX module holds.
    WeightRule(f"{EXPERTS}.gate_up_proj", f"{NNX_EXPERTS}.gate_up_proj"),
    WeightRule(f"{EXPERTS}.gate_up_proj_bias", f"{NNX_EXPERTS}.gate_up_proj_bias"),
    WeightRule(f"{EXPERTS}.down_proj", f"{NNX_EXPERTS}.down_proj"),
    WeightRule(f"{EXPERTS}.down_proj_bias", f"{NNX_EXPERTS}.down_proj_bias"),
    *norm_rows(f"{LAYER}.input_layernorm", f"{NNX_LAYER}.input_layernorm"),
    *norm_rows(f"{LAYER}.post_attention_layernorm", f"{NNX_LAYER}.post_attention_layernorm"),
    *norm_rows("model.norm", "final_norm"),
    *linear_rows("lm_head", "lm_head"),
)


def export_config(config: dict) -> dict:
    """``config.json`` without an MXFP4 ``quantization_config``: the experts are exported in bfloat16."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "mxfp4":
        return config
    return {key: value for key, value in config.items() if key != "quantization_config"}


def router_logits(run, module):
    """``(run(module), RouterRecord)``: the router logits of the forward passes ``run`` makes
    (``Family.router_logits``)."""
    result, logits = run_recording_router_logits(run, module, GptOssExperts)
    return result, RouterRecord(top_k=module.config.num_experts_per_tok, logits=logits)


TINY_CONFIGS = {
    # GPT-OSS: 4 experts of 32, 2 per token, sliding and full layers taking turns (a window of 8), attention sinks,
    # YaRN rope as published (factor 32 over an original 4096 positions).
    "gpt_oss": TinyConfig("GptOssConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}),
        alternating_layer_types=True),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures=("GptOssForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(mlp=()),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    router_logits=router_logits,
    import_tensors=lambda tensors, hf_config: mxfp4.dequantized(tensors),
    export_config=export_config,
    lora_not_linear={r".*\.mlp\.experts.*": "the experts are stacked parameters, not linear modules (PEFT reaches them "
                                          "only through target_parameters)",
                  r".*\.mlp\.router": "the router is not a linear module in transformers' GPT-OSS"},
    sequence_classification={"gpt_oss": "GptOssForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
