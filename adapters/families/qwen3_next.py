"""Qwen3-Next (``Qwen3NextForCausalLM``) on the native decoder: a hybrid of gated DeltaNet layers
(:mod:`adapters.model.linear_attention`, ``in_proj_qkvz``/``in_proj_ba`` grouped per key head) and gated full-attention
layers (``q_proj`` gives each head's query and an output gate; per-head QK norms; a quarter of each head rotated), in
the order of ``config.layer_types``; RMS norms that multiply by ``1 + weight``; Qwen's mixture of experts with a gated
shared expert on the sparse layers (``decoder_sparse_step``, ``mlp_only_layers``), dense MLPs elsewhere.

The spec and weight rows here are shared with Qwen3.5 (:mod:`.qwen3_5`), whose DeltaNet projections are split.
"""

from __future__ import annotations

from typing import Any

from ..losses.router import RouterRecord
from ..model.experts import run_recording_router_logits as recorded_router_logits
from ..model.linear_attention import GatedDeltaNetSpec
from ..model.native_decoder import DecoderSpec, NativeDecoder, SparseMoe, SparseMoeSpec
from .base import DECODER_IGNORED_KEYS, Layout, TinyConfig, WeightRule, require
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    linear_rows,
    llama_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)
from .qwen3_moe import FUSED_EXPERT_WEIGHTS, LORA_REFUSED, expert_weights

LAYER_TYPES = {"linear_attention": "linear_attention", "full_attention": "attention"}
"""``config.layer_types`` -> the native decoder's layer types."""


class DepthwiseConvWeight(Layout):
    """HF ``nn.Conv1d(groups=C)`` weight ``(C, 1, K)`` <-> NNX ``(C, K)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.reshape(nnx_shape)

    def to_hf(self, nnx):
        return nnx.reshape(nnx.shape[0], 1, nnx.shape[1])

    def hf_shape(self, nnx_shape):
        return (nnx_shape[0], 1, nnx_shape[1])


DEPTHWISE_CONV_WEIGHT = DepthwiseConvWeight()


def layer_types(hf_config, family: str) -> tuple[str, ...]:
    """The native layer types of ``config.layer_types``, checked."""
    types = list(hf_config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    require(not unknown, f"{family}: layer_types {unknown} are not supported; supported: {sorted(LAYER_TYPES)}.")
    require(len(types) == hf_config.num_hidden_layers,
            f"{family}: layer_types has {len(types)} entries for num_hidden_layers={hf_config.num_hidden_layers}.")
    return tuple(LAYER_TYPES[kind] for kind in types)


def gated_deltanet_spec(hf_config, family: str, fused: bool) -> GatedDeltaNetSpec:
    """The gated DeltaNet sizes of a Qwen3-Next / Qwen3.5 config, checked."""
    key_heads, value_heads = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    require(value_heads % key_heads == 0, f"{family}: linear_num_value_heads={value_heads} must be a multiple of "
                                          f"linear_num_key_heads={key_heads}.")
    require(hf_config.hidden_act in ("silu", "swish"),
            f"{family}: hidden_act={hf_config.hidden_act!r}: the gated DeltaNet layers use SiLU; set 'silu'.")
    return GatedDeltaNetSpec(num_key_heads=key_heads, num_value_heads=value_heads,
                             key_head_dim=hf_config.linear_key_head_dim, value_head_dim=hf_config.linear_value_head_dim,
                             conv_kernel=hf_config.linear_conv_kernel_dim, fused=fused, norm_eps=hf_config.rms_norm_eps)


def sparse_layers(hf_config) -> tuple[bool, ...]:
    """Qwen3-Next's sparse layers (transformers' rule: not in ``mlp_only_layers``, ``num_experts > 0`` and
    ``(i + 1) % decoder_sparse_step == 0``); every layer for a config without those fields (Qwen3.5-MoE)."""
    count = getattr(hf_config, "num_experts", 0) or 0
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return tuple(count > 0 and index not in dense and (index + 1) % step == 0
                 for index in range(hf_config.num_hidden_layers))


def hybrid_spec(hf_config, dtype, family: str, fused: bool, norm_topk_prob: bool | None = None) -> DecoderSpec:
    """The native decoder spec of a Qwen3-Next or Qwen3.5 (dense or MoE) text config.

    Args:
        fused: Qwen3-Next's fused DeltaNet input projections.
        norm_topk_prob: the MoE router's renormalisation when the config has no field for it (Qwen3.5-MoE always
            renormalises); ``None``: ``config.norm_topk_prob``.
    """
    check_native_config(hf_config, family)
    types = layer_types(hf_config, family)
    layers = hf_config.num_hidden_layers
    rope = rope_of(hf_config, family)
    moe = None
    sparse = sparse_layers(hf_config)
    if any(sparse):
        top_k, experts = hf_config.num_experts_per_tok, hf_config.num_experts
        require(0 < top_k <= experts, f"{family}: num_experts_per_tok={top_k} must be between 1 and num_experts="
                                      f"{experts}.")
        moe = SparseMoeSpec(num_experts=experts, num_experts_per_tok=top_k,
                            intermediate_size=hf_config.moe_intermediate_size,
                            norm_topk_prob=bool(hf_config.norm_topk_prob if norm_topk_prob is None else norm_topk_prob),
                            shared_expert_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0)
                            or 0, layers=sparse)
    fields = sizes(hf_config, dtype)
    if all(sparse):  # no dense MLP anywhere (Qwen3.5-MoE has no intermediate_size)
        fields["intermediate_size"] = getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size
    return DecoderSpec(**fields, ropes=(rope,) * layers, windows=(None,) * layers,
                       norm_eps=hf_config.rms_norm_eps, norm_offset=1.0, activation=hf_config.hidden_act,
                       attention_bias=bool(hf_config.attention_bias), output_bias=bool(hf_config.attention_bias),
                       qk_norm="head", attention_output_gate=True, layer_types=types,
                       linear_attention=gated_deltanet_spec(hf_config, family, fused), sparse_moe=moe)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Qwen3-Next config."""
    return hybrid_spec(hf_config, dtype, "qwen3_next", fused=True)


LINEAR, NNX_LINEAR = f"{LAYER}.linear_attn", f"{NNX_LAYER}.linear_attn"
MLP, NNX_MLP = f"{LAYER}.mlp", f"{NNX_LAYER}.mlp"


def deltanet_rows(projections: tuple[str, ...]) -> tuple[WeightRule, ...]:
    """A gated DeltaNet layer's rows: its input ``projections``, the convolution, ``dt_bias``, ``A_log``, the gated
    norm and ``out_proj``."""
    rows: list[WeightRule] = []
    for projection in (*projections, "out_proj"):
        rows += linear_rows(f"{LINEAR}.{projection}", f"{NNX_LINEAR}.{projection}")
    return (*rows, WeightRule(f"{LINEAR}.conv1d.weight", f"{NNX_LINEAR}.conv1d.weight", DEPTHWISE_CONV_WEIGHT),
            WeightRule(f"{LINEAR}.dt_bias", f"{NNX_LINEAR}.dt_bias"),
            WeightRule(f"{LINEAR}.A_log", f"{NNX_LINEAR}.A_log"),
            WeightRule(f"{LINEAR}.norm.weight", f"{NNX_LINEAR}.norm.weight"))


SPARSE_MOE_ROWS: tuple[WeightRule, ...] = (
    *linear_rows(f"{MLP}.gate", f"{NNX_MLP}.gate"),
    *(row for projection in ("gate_proj", "up_proj", "down_proj")
      for row in linear_rows(f"{MLP}.shared_expert.{projection}", f"{NNX_MLP}.shared_expert.{projection}")),
    *linear_rows(f"{MLP}.shared_expert_gate", f"{NNX_MLP}.shared_expert_gate"),
) + FUSED_EXPERT_WEIGHTS
"""The router, the gated shared expert and transformers' fused in-memory expert tensors of a sparse layer (the
per-expert on-disk rows come from the config: :func:`expert_weights`)."""

ATTENTION_ROWS = norm_rows(f"{LAYER}.self_attn.q_norm", f"{NNX_LAYER}.attn.q_norm") + norm_rows(
    f"{LAYER}.self_attn.k_norm", f"{NNX_LAYER}.attn.k_norm")

# Every bias row is listed: a config without attention biases has no bias parameter for them to fill.
WEIGHTS = (llama_rows(attention_bias=True, output_bias=True) + ATTENTION_ROWS
           + deltanet_rows(("in_proj_qkvz", "in_proj_ba")) + SPARSE_MOE_ROWS)

LORA_TARGETS = lora_targets_of(mlp=()) | {
    name: rf"layers/\d+/linear_attn/{name}" for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z",
                                                         "in_proj_b", "in_proj_a", "out_proj")
} | {name: rf"layers/\d+/mlp/(shared_expert/)?{name}" for name in ("gate_proj", "up_proj", "down_proj")
     } | {"shared_expert_gate": r"layers/\d+/mlp/shared_expert_gate"}
"""HF module names LoRA adapts: attention, the DeltaNet projections, the dense MLPs and the shared expert (whose
projections share the dense MLP's names), and the shared expert's gate."""

NOT_LINEAR = {r".*\.mlp\.experts.*": "transformers keeps the routed experts as stacked parameters, not linear "
                                     "modules (PEFT reaches them only through target_parameters)",
              r".*\.mlp\.gate": "the router is not a linear module in transformers (Qwen3NextTopKRouter)",
              r".*\.linear_attn\.conv1d": "the DeltaNet convolution is an nn.Conv1d, which torchlike's LoRA does not "
                                          "adapt"}


def run_recording_router_logits(run, module: NativeDecoder) -> tuple[Any, RouterRecord]:
    """``run(module)``, and the router logits of the forward passes it ran, sparse layer by sparse layer."""
    result, logits = recorded_router_logits(run, module, SparseMoe)
    return result, RouterRecord(top_k=module.config.sparse_moe.num_experts_per_tok, logits=logits)


def router_logits(run, module):
    """:func:`run_recording_router_logits` for a model with experts.

    Raises:
        ValueError: the model has no sparse layer (``num_experts=0``), so no router loss.
    """
    if module.config.sparse_moe is None:
        raise ValueError("router_aux_loss_coef: this Qwen3-Next model has no experts (num_experts=0), so there is no "
                         "router loss to add; set router_aux_loss_coef=0 or output_router_logits=False.")
    return run_recording_router_logits(run, module)


HYBRID_SHAPE = dict(rope_theta=10000.0, tie_word_embeddings=False, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=16,
                    partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
"""The tiny hybrid shape the Qwen3-Next and Qwen3.5 test configs share: DeltaNet, attention, DeltaNet; two value heads
per key head; half of each attention head rotated."""

TINY_CONFIGS = {
    # Qwen3-Next: the hybrid shape, the first layer dense (mlp_only_layers), the others 4 experts of 32 with 2 chosen
    # and renormalised, and a gated shared expert of 32.
    "qwen3_next": TinyConfig("Qwen3NextConfig", dict(
        HYBRID_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    architectures=("Qwen3NextForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    config_weights=expert_weights,
    lora_targets=LORA_TARGETS,
    lora_not_linear=NOT_LINEAR,
    # transformers maps qwen3_next to qwen2_moe's weight conversion, so PEFT turns the MLP projection names into
    # target_parameters on the fused experts, as for Qwen3-MoE.
    lora_refused=LORA_REFUSED,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    router_logits=router_logits,
    norms_scale_by_one_plus_weight=True,
    sequence_classification={"qwen3_next": "Qwen3NextForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
