"""Qwen3-VL-MoE as Qwen publishes it (``Qwen3VLMoeForConditionalGeneration``): Qwen3-VL (:mod:`.qwen3_vl`: its vision
tower with DeepStack, Qwen3's attention rotated by interleaved M-RoPE) whose text decoder has Qwen's mixture of experts
on its sparse layers (``transformers``' ``Qwen3VLMoeTextSparseMoeBlock``) and dense MLPs elsewhere. Checkpoints, in
memory and on disk: ``model.language_model.``, ``model.visual.``, ``lm_head``.

Each sparse layer's experts are two parameters in ``transformers`` (``Qwen3VLMoeTextExperts``), not one module per
expert: ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``(E, H, I)``, as ``transformers`` 5 holds and saves them. Here they are ``mlp.gate_up_proj``
``(E, H, 2I)`` and ``mlp.down_proj`` ``(E, I, H)`` (:class:`FusedSparseMoe`): one table row each, the last two axes
swapped, so the export is ``transformers``' own layout and round-trips bit-exact. Qwen's original files store the
experts in the NNX layout (``transformers``' conversion mapping for ``qwen3_vl_moe`` transposes them when their shape
says so); they are refused here with the shapes named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..losses.router import RouterRecord
from ..model.experts import routed_experts, softmax_top_k
from ..model.native_decoder import DecoderSpec, SparseMoe, SparseMoeSpec
from ..model.qwen_vision import QwenVLDecoder
from . import qwen3_vl
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
from .gemma4 import SWAPPED_LAST_AXES
from .native import linear_rows, native_family
from .qwen2_vl import CONV_REASON, IMAGE_KEYS
from .qwen3_next import run_recording_router_logits, sparse_layers

FAMILY_NAME = "qwen3_vl_moe"
MLP, NNX_MLP = f"{qwen3_vl.TEXT_PREFIX}layers.{{layer}}.mlp", "layers.{layer}.mlp"


class FusedSparseMoe(SparseMoe):
    """Qwen's mixture of experts as ``transformers``' ``Qwen3VLMoeTextSparseMoeBlock`` computes it: the router ``gate``
    (``Qwen3VLMoeTextTopKRouter``: a float32 softmax over its logits, the top ``num_experts_per_tok``, always
    renormalised to sum to 1, then cast to the compute dtype), and only the chosen experts run
    (:func:`~adapters.model.experts.routed_experts`). The experts are held fused as ``transformers`` holds them:
    ``gate_up_proj`` ``[E, H, 2I]`` (gate columns, then up columns) and ``down_proj`` ``[E, I, H]``; no shared expert.

    Attributes:
        records_router_logits: sow the router logits as ``nnx.Intermediate`` ``router_logits`` (the load-balancing
            loss reads them, :func:`~adapters.model.experts.run_recording_router_logits`).
    """

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs):
        super().__init__(spec, rngs)
        gate_up = jnp.concatenate([self.gate_proj.get_value(), self.up_proj.get_value()], axis=-1)
        self.gate_up_proj = nnx.Param(gate_up, sharding=("fsdp", None, "tp"))
        del self.gate_proj, self.up_proj

    def __call__(self, x: jax.Array) -> jax.Array:
        router_logits = self.gate(x)
        if self.records_router_logits:
            self.sow(nnx.Intermediate, "router_logits", router_logits)
        weights, experts = softmax_top_k(router_logits, self.top_k, self.norm_topk_prob)
        gate, up = jnp.split(self.gate_up_proj.get_value().astype(x.dtype), 2, axis=-1)
        return routed_experts(x, experts, weights.astype(x.dtype), gate, up, self.down_proj.get_value().astype(x.dtype))


def sparse_moe_spec(text_config) -> SparseMoeSpec | None:
    """The experts of a Qwen3-VL-MoE ``text_config``: on the layers ``transformers``' ``Qwen3VLMoeTextDecoderLayer``
    makes sparse (not in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``), the
    chosen experts' probabilities always renormalised (the config has no ``norm_topk_prob``); ``None`` when no layer
    is sparse.

    Raises:
        UnsupportedConfigError: ``num_experts_per_tok`` outside ``1..num_experts``, or a ``decoder_sparse_step`` below
            1, naming the field.
    """
    step = text_config.decoder_sparse_step
    require(step >= 1, f"{FAMILY_NAME}: text_config.decoder_sparse_step={step} must be at least 1 (1: every layer "
                       "not in mlp_only_layers holds experts).")
    layers = sparse_layers(text_config)
    if not any(layers):
        return None
    experts, top_k = text_config.num_experts, text_config.num_experts_per_tok
    require(0 < top_k <= experts, f"{FAMILY_NAME}: text_config.num_experts_per_tok={top_k} must be between 1 and "
                                  f"text_config.num_experts={experts}.")
    return SparseMoeSpec(num_experts=experts, num_experts_per_tok=top_k,
                         intermediate_size=text_config.moe_intermediate_size, norm_topk_prob=True,
                         shared_expert_intermediate_size=0, layers=layers)


def text_spec(hf_config, dtype) -> DecoderSpec:
    """Qwen3-VL's text decoder spec (:func:`.qwen3_vl.text_spec`) with the experts of :func:`sparse_moe_spec`."""
    return dataclasses.replace(qwen3_vl.text_spec(hf_config, dtype),
                               sparse_moe=sparse_moe_spec(hf_config.text_config))


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> QwenVLDecoder:
    """The native decoder of ``text_config``, its sparse layers' MLPs :class:`FusedSparseMoe`, with Qwen3-VL's vision
    tower of ``vision_config``."""
    spec = text_spec(hf_config, dtype)
    model = QwenVLDecoder(spec, qwen3_vl.vision_spec(hf_config, dtype), rngs=rngs)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp = FusedSparseMoe(spec, rngs)
    return model


def router_logits(run, module: QwenVLDecoder) -> tuple[Any, RouterRecord]:
    """``run(module)`` and the router logits of its forward passes, sparse layer by sparse layer
    (``Family.router_logits``: what ``transformers`` records from ``Qwen3VLMoeTextTopKRouter`` with
    ``output_router_logits=True``).

    Raises:
        ValueError: the text decoder has no sparse layer, so there is no router loss.
    """
    if module.config.sparse_moe is None:
        raise ValueError("router_aux_loss_coef: this Qwen3-VL-MoE model has no sparse layer (text_config.num_experts=0 "
                         "or every layer in mlp_only_layers), so there is no router loss to add; set "
                         "router_aux_loss_coef=0.")
    return run_recording_router_logits(run, module)


EXPERT_ROWS: tuple[WeightRule, ...] = (
    *linear_rows(f"{MLP}.gate", f"{NNX_MLP}.gate"),
    WeightRule(f"{MLP}.experts.gate_up_proj", f"{NNX_MLP}.gate_up_proj", SWAPPED_LAST_AXES),
    WeightRule(f"{MLP}.experts.down_proj", f"{NNX_MLP}.down_proj", SWAPPED_LAST_AXES),
)
"""A sparse layer's router (``Qwen3VLMoeTextTopKRouter.weight`` ``(E, H)``, an NNX kernel ``(H, E)``) and its fused
experts."""

def hub_expert_layout(tensors: Iterable[tuple[str, np.ndarray, Any]], hf_config
                      ) -> Iterator[tuple[str, np.ndarray, Any]]:
    """``Family.import_tensors``: experts as Qwen publishes them, ``gate_up_proj`` ``(E, H, 2I)`` and ``down_proj``
    ``(E, I, H)``, turned into ``transformers``' layout ``(E, 2I, H)`` / ``(E, H, I)`` (which ``transformers`` 5 saves);
    as ``transformers``' ``Transpose(1, 2, check_dims=True)`` for ``qwen3_vl_moe`` does, a tensor already of the
    expected shape is left as it is."""
    text = hf_config.text_config
    experts, hidden, inner = text.num_experts, text.hidden_size, text.moe_intermediate_size
    expected = {"gate_up_proj": (experts, 2 * inner, hidden), "down_proj": (experts, hidden, inner)}
    for name, array, origin in tensors:
        kind = name.rsplit(".", 1)[-1]
        if ".mlp.experts." in name and kind in expected and array.shape != expected[kind] \
                and array.shape == (experts, expected[kind][2], expected[kind][1]):
            array = np.swapaxes(array, 1, 2)
        yield name, array, origin


NOT_LINEAR = {
    r".*\.mlp\.experts.*": "transformers keeps the routed experts as fused parameters (Qwen3VLMoeTextExperts."
                           "gate_up_proj, down_proj), not linear modules: PEFT's target_modules never adapt them",
    r".*\.mlp\.gate": "the router is not a linear module in transformers (Qwen3VLMoeTextTopKRouter)",
    qwen3_vl.PATCH_EMBED: CONV_REASON,
}
"""``Family.lora_not_linear``: modules PEFT's ``target_modules`` (``"all-linear"`` too) leave alone, with why."""

TINY_CONFIGS = {
    # The text decoder of torchlike.testing.tiny_multimodal_config("qwen3_vl_moe"): qwen3_vl's rope, layer 0 dense
    # (mlp_only_layers), layer 1 4 experts of 24 with 2 chosen per token (24 keeps every expert tensor's shape apart
    # from its transpose).
    "qwen3_vl_moe": TinyConfig("Qwen3VLMoeTextConfig", dict(
        qwen3_vl.TINY_CONFIGS["qwen3_vl"].fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        mlp_only_layers=[0], decoder_sparse_step=1)),
}

FAMILY = native_family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), architectures=("Qwen3VLMoeForConditionalGeneration",),
    spec_from_config=text_spec, weights=qwen3_vl.text_rows() + EXPERT_ROWS + qwen3_vl.vision_rows(),
    build_model=build_model, lora_targets=qwen3_vl.lora_targets(),
    default_lora_targets=(),  # PEFT has no default for this model type
    ignored_hf_keys=DECODER_IGNORED_KEYS, images=qwen3_vl.images, image_keys=IMAGE_KEYS, lora_not_linear=NOT_LINEAR,
    lora_refused={qwen3_vl.PATCH_EMBED: CONV_REASON}, router_logits=router_logits, prompt_learning=False,
    import_tensors=hub_expert_layout,
    tiny_configs=TINY_CONFIGS)
