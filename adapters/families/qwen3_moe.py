"""Qwen3 mixture-of-experts (``Qwen3MoeForCausalLM``) <-> ``tunix.models.qwen3`` with ``num_experts``: each sparse
layer's experts stacked into one parameter per projection, transformers' routing, and dense layers where the config
puts them.

On disk (what ``save_pretrained`` writes and Hub checkpoints hold) each expert is three ``nn.Linear`` weights,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers 5 fuses them into 3-D parameters when it
loads, and splits them back when it saves. Here expert ``e``'s weight is part ``e`` of the stacked NNX parameter
``layers.{i}.mlp.{gate,up,down}_proj`` (experts first, as Tunix's ``MoELayer`` holds them): one table row per expert
and projection, added for the config's ``num_experts`` (:func:`expert_weights`). The fused in-memory tensors
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: what a transformers model's ``state_dict()`` holds) load
through ``load_only`` rows, so ``load_state_dict(hf_model.state_dict())`` works too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx
from tunix.models.qwen3 import model as tunix_qwen3

from ..losses.router import RouterRecord
from ..model.experts import routed_experts, softmax_top_k
from ..model.experts import run_recording_router_logits as recorded_router_logits
from ..model.rope import attention_with_rope
from .base import (
    DECODER_IGNORED_KEYS,
    DECODER_LORA_TARGETS,
    TRANSPOSED,
    Family,
    Layout,
    TinyConfig,
    WeightRule,
    decoder_forward,
    decoder_hidden_states,
    head_dim_of,
    head_logits,
    require,
)
from .qwen3 import WEIGHTS as QWEN3_WEIGHTS

R = TypeVar("R")


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class FusedExperts(Layout):
    """transformers' in-memory expert tensor ``(experts, parts * out, in)`` -> part ``part`` of it as the NNX stacked
    kernel ``(experts, in, out)``: ``gate_up_proj`` holds gate (part 0) then up (part 1), ``down_proj`` one part.
    Load-only: exports write the per-expert on-disk names."""

    part: int = 0
    parts: int = 1

    def to_nnx(self, hf, nnx_shape):
        size = nnx_shape[-1]
        return hf[:, self.part * size:(self.part + 1) * size, :].transpose(0, 2, 1)

    def to_hf(self, nnx):
        raise NotImplementedError("fused expert tensors are only read; exports write one tensor per expert")

    def hf_shape(self, nnx_shape):
        experts, inputs, outputs = nnx_shape
        return (experts, self.parts * outputs, inputs)


FUSED_EXPERT_WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("model.layers.{layer}.mlp.experts.gate_up_proj", "layers.{layer}.mlp.gate_proj",
               FusedExperts(part=0, parts=2), load_only=True),
    WeightRule("model.layers.{layer}.mlp.experts.gate_up_proj", "layers.{layer}.mlp.up_proj",
               FusedExperts(part=1, parts=2), load_only=True),
    WeightRule("model.layers.{layer}.mlp.experts.down_proj", "layers.{layer}.mlp.down_proj", FusedExperts(),
               load_only=True),
)
"""transformers 5's fused expert parameters, as its ``state_dict()`` names them (``Qwen3MoeExperts``)."""

LORA_TARGETS = {name: DECODER_LORA_TARGETS[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}

LORA_REFUSED = {
    r"model\.layers\.\d+\.mlp\.(experts(\.\d+)?(\.(gate|up|down)_proj)?|(gate|up|down)_proj)": (
        "with transformers 5, PEFT turns target_modules naming gate_proj/up_proj/down_proj into target_parameters on "
        "the fused expert weights (mlp.experts.gate_up_proj and down_proj, stacked into one parameter per projection "
        "here too), which torchlike does not support; a Qwen3 MoE model takes LoRA on its attention projections "
        "(q_proj, k_proj, v_proj, o_proj)"),
    r"model\.layers\.\d+\.mlp\.gate": (
        "the router (Qwen3MoeTopKRouter) is adapted by PEFT only through target_parameters (mlp.gate.weight), which "
        "torchlike does not support; a Qwen3 MoE model takes LoRA on its attention projections (q_proj, k_proj, "
        "v_proj, o_proj)"),
}
"""HF module-name patterns LoRA cannot target here, with the reason (``Family.lora_refused``)."""


WEIGHTS: tuple[WeightRule, ...] = QWEN3_WEIGHTS + (
    # The router: HF's gate (E, hidden) <-> Tunix's router kernel (hidden, E).
    WeightRule("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.mlp.router.kernel", TRANSPOSED),
) + FUSED_EXPERT_WEIGHTS
"""Qwen3's table (attention, norms, the dense layers' MLP), the router and the fused expert tensors; the on-disk
expert rows depend on the config."""


def expert_weights(hf_config) -> tuple[WeightRule, ...]:
    """One row per expert and projection for ``hf_config.num_experts`` experts: HF's
    ``mlp.experts.{e}.<projection>.weight (out, in)`` is part ``e`` of NNX ``mlp.<projection> (experts, in, out)``.

    A config read only for its architecture (no ``num_experts``) adds none.
    """
    count = getattr(hf_config, "num_experts", None) or 0
    return tuple(
        WeightRule(f"model.layers.{{layer}}.mlp.experts.{expert}.{projection}.weight",
                   f"layers.{{layer}}.mlp.{projection}", TRANSPOSED, stack=(expert, count))
        for expert in range(count) for projection in EXPERT_PROJECTIONS
    )


def sparse_layers(hf_config) -> list[bool]:
    """Which layers hold experts, by transformers' rule: layer ``i`` is sparse unless it is in ``mlp_only_layers``,
    when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    dense = set(hf_config.mlp_only_layers or ())
    return [index not in dense and hf_config.num_experts > 0 and (index + 1) % hf_config.decoder_sparse_step == 0
            for index in range(hf_config.num_hidden_layers)]


class SparseMoeBlock(tunix_qwen3.MoELayer):
    """Tunix's ``MoELayer`` (its router and stacked expert parameters) computed as transformers'
    ``Qwen3MoeSparseMoeBlock``: softmax over the router logits in float32, the top ``num_experts_per_tok``, their
    probabilities renormalised only when ``norm_topk_prob``, then cast to the compute dtype; only the chosen experts
    run (:func:`routed_experts`), on every platform.

    Attributes set by :func:`build_model`:
        norm_topk_prob: renormalise the chosen experts' probabilities to sum to 1.
        records_router_logits: sow the router logits as ``nnx.Intermediate`` ``router_logits``
            (:func:`run_recording_router_logits` turns it on while it captures them).
    """

    norm_topk_prob: bool = False
    records_router_logits: bool = False

    def __call__(self, x):
        router_logits = self.router(x)
        if self.records_router_logits:
            self.sow(nnx.Intermediate, "router_logits", router_logits)
        weights, experts = softmax_top_k(router_logits, self.experts_per_tok, self.norm_topk_prob)
        x = x.astype(self.dtype)
        return routed_experts(x, experts, weights.astype(router_logits.dtype),
                              *(parameter.value.astype(self.dtype)
                                for parameter in (self.gate_proj, self.up_proj, self.down_proj)))


def _check_config(hf_config) -> None:
    """Refuses what the model built here does not implement (it would give wrong logits)."""
    activation = hf_config.hidden_act
    require(activation == "silu", f"qwen3_moe: hidden_act={activation!r} is not supported (only 'silu').")
    require(not hf_config.attention_bias, "qwen3_moe: attention_bias=True is not supported.")
    require(not hf_config.use_sliding_window,
            "qwen3_moe: use_sliding_window=True is not supported by the Tunix Qwen3 model.")
    require(hf_config.num_experts > 0 and any(sparse_layers(hf_config)),
            "qwen3_moe: the config has no sparse layer (num_experts=0, or every layer in mlp_only_layers); load it as "
            "a dense model instead.")
    require(0 < hf_config.num_experts_per_tok <= hf_config.num_experts,
            f"qwen3_moe: num_experts_per_tok={hf_config.num_experts_per_tok} must be between 1 and num_experts="
            f"{hf_config.num_experts}.")


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> tunix_qwen3.Qwen3:
    """A Tunix ``Qwen3`` with ``num_experts``: sparse layers are :class:`SparseMoeBlock` (experts of
    ``moe_intermediate_size``), the others Tunix's dense ``MLP`` of ``intermediate_size``, and the attention uses the
    checkpoint's rope (see ``adapters.upstream``).

    Raises:
        UnsupportedConfigError: another activation, attention bias, a sliding window, no sparse layer or a bad
            ``num_experts_per_tok``.
        UnsupportedRopeScalingError: for rope types ``adapters.model.rope`` does not implement.
    """
    _check_config(hf_config)
    head_dim = head_dim_of(hf_config)
    config = tunix_qwen3.ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        embed_dim=hf_config.hidden_size,
        hidden_dim=hf_config.moe_intermediate_size,
        num_heads=hf_config.num_attention_heads,
        head_dim=head_dim,
        num_kv_heads=hf_config.num_key_value_heads,
        rope_theta=hf_config.rope_parameters["rope_theta"],
        norm_eps=hf_config.rms_norm_eps,
        use_tied_embedding=bool(hf_config.tie_word_embeddings),
        num_experts=hf_config.num_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        dtype=dtype,
        param_dtype=dtype,
    )
    # Tunix builds every layer sparse, with one hidden size; dense layers get Tunix's MLP of intermediate_size.
    dense_config = dataclasses.replace(config, hidden_dim=hf_config.intermediate_size, num_experts=None,
                                       num_experts_per_tok=None)
    model = tunix_qwen3.Qwen3(config, rngs=rngs)
    attention_class = attention_with_rope(tunix_qwen3.Attention, hf_config.rope_parameters, head_dim, pages=True)
    for layer, sparse in zip(model.layers, sparse_layers(hf_config), strict=True):
        layer.attn.__class__ = attention_class
        if sparse:
            layer.mlp.__class__ = SparseMoeBlock
            layer.mlp.norm_topk_prob = bool(hf_config.norm_topk_prob)
            layer.mlp.records_router_logits = False
        else:
            layer.mlp = tunix_qwen3.MLP(dense_config, rngs=rngs)
    return model


def run_recording_router_logits(run: Callable[[tunix_qwen3.Qwen3], R], module: tunix_qwen3.Qwen3
                                ) -> tuple[R, RouterRecord]:
    """``run(module)``, and the router logits of the forward passes it ran, sparse layer by sparse layer
    (:func:`~adapters.model.experts.run_recording_router_logits` over the :class:`SparseMoeBlock` layers)."""
    result, logits = recorded_router_logits(run, module, SparseMoeBlock)
    return result, RouterRecord(top_k=module.config.num_experts_per_tok, logits=logits)


def logits_from_hidden(module: tunix_qwen3.Qwen3, hidden: jax.Array) -> jax.Array:
    """Tunix Qwen3's output head on final-norm hidden states (its ``__call__`` after ``final_norm``), float32."""
    return head_logits(module, hidden, tied=module.config.use_tied_embedding)


TINY_CONFIGS = {
    # Qwen3 MoE: 3 layers, the first dense (mlp_only_layers), the others 4 experts of 32 with 2 chosen per token and
    # their weights renormalised; the dense layer's MLP keeps the tiny intermediate size (128).
    "qwen3_moe": TinyConfig("Qwen3MoeConfig", dict(
        rope_theta=10000.0, tie_word_embeddings=False, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    lora_targets=LORA_TARGETS,
    # PEFT has no default target_modules for model_type "qwen3_moe".
    # Tunix's attention Einsum cannot take Qwix's quantised weights (see adapters.upstream).
    quantization_excluded=("q_proj", "k_proj", "v_proj", "o_proj"),
    config_weights=expert_weights,
    lora_refused=LORA_REFUSED,
    router_logits=run_recording_router_logits,
    sequence_classification={"qwen3_moe": "Qwen3MoeForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
