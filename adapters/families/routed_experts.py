"""The mixture-of-experts rows and spec that DeepSeek-V3 and GLM-4 MoE share (``transformers``' ``DeepseekV3MoE`` and
``Glm4MoeMoE``): a float32 sigmoid router with a correction bias, group-limited top-k, per-expert gated MLPs stacked
per layer, a shared expert, and dense MLPs on the first ``first_k_dense_replace`` layers."""

from __future__ import annotations

from ..model.native_decoder import RoutedSpec
from .base import TRANSPOSED, WeightRule, require
from .native import LAYER, NNX_LAYER, linear_rows

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def routed_spec(hf_config, family: str) -> RoutedSpec:
    """The :class:`RoutedSpec` of a DeepSeek-V3 or GLM-4 MoE config (checked)."""
    experts, top_k = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    groups, top_groups = hf_config.n_group, hf_config.topk_group
    require(0 < top_k <= experts, f"{family}: num_experts_per_tok={top_k} must be between 1 and n_routed_experts="
                                  f"{experts}.")
    require(groups > 0 and experts % groups == 0 and 0 < top_groups <= groups,
            f"{family}: n_group={groups} must divide n_routed_experts={experts} and topk_group={top_groups} be "
            f"between 1 and n_group.")
    require(experts // groups >= 2, f"{family}: groups of {experts // groups} expert(s): transformers scores a group "
                                    "by its two best experts, so each group needs at least two.")
    layers = tuple(layer >= hf_config.first_k_dense_replace for layer in range(hf_config.num_hidden_layers))
    return RoutedSpec(num_experts=experts, num_experts_per_tok=top_k, intermediate_size=hf_config.moe_intermediate_size,
                      n_shared_experts=hf_config.n_shared_experts, n_group=groups, topk_group=top_groups,
                      norm_topk_prob=bool(hf_config.norm_topk_prob),
                      routed_scaling_factor=float(hf_config.routed_scaling_factor), layers=layers)


MLP, NNX_MLP = f"{LAYER}.mlp", f"{NNX_LAYER}.mlp"

ROUTER_ROWS: tuple[WeightRule, ...] = (
    *linear_rows(f"{MLP}.gate", f"{NNX_MLP}.router"),
    WeightRule(f"{MLP}.gate.e_score_correction_bias", f"{NNX_MLP}.e_score_correction_bias"),
    *(row for projection in EXPERT_PROJECTIONS
      for row in linear_rows(f"{MLP}.shared_experts.{projection}", f"{NNX_MLP}.shared_experts.{projection}")),
)
"""The router and the shared expert of a layer with experts (the dense layers' MLP rows are the Llama ones)."""


def expert_rows(hf_config) -> tuple[WeightRule, ...]:
    """One row per expert and projection: HF's ``mlp.experts.{e}.<projection>.weight (out, in)`` is part ``e`` of NNX
    ``mlp.<projection> (experts, in, out)``; none for a config read only for its architecture."""
    count = getattr(hf_config, "n_routed_experts", None) or 0
    return tuple(WeightRule(f"{MLP}.experts.{expert}.{projection}.weight", f"{NNX_MLP}.{projection}", TRANSPOSED,
                            stack=(expert, count))
                 for expert in range(count) for projection in EXPERT_PROJECTIONS)


NOT_LINEAR = {r".*\.mlp\.experts.*": "transformers keeps the routed experts as stacked parameters, not linear "
                                     "modules (PEFT reaches them only through target_parameters)",
              r".*\.mlp\.gate": "the router is not a linear module in transformers"}
"""``Family.lora_not_linear`` of both families."""

MLP_REFUSED = {r".*\.mlp\.(shared_experts\.)?(gate|up|down)_proj": (
    "PEFT applies the MLP projection names of this model type to the routed experts' stacked parameters "
    "(target_parameters), which torchlike's LoRA cannot adapt; adapt the attention projections")}
"""``Family.lora_refused`` of both families: an adapter on the MLPs would not load in ``peft`` as it was trained."""

ALL_LINEAR_REFUSED = ("PEFT's 'all-linear' on this model also adapts the routed experts and the router through "
                      "target_parameters, which torchlike's LoRA cannot")
"""``Family.all_linear_refused`` of both families."""
