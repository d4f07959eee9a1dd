"""Gemma 3 text (``Gemma3ForCausalLM``) <-> ``tunix.models.gemma3``, with HF's per-layer types."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.gemma3 import model as tunix_gemma3

from ..model import paged_attention
from ..model.rope import UnsupportedRopeScalingError
from .base import (
    GEMMA_IGNORED_KEYS,
    GEMMA_LORA_TARGETS,
    Family,
    TinyConfig,
    UnsupportedConfigError,
    WeightRule,
    decoder_hidden_states,
    gemma_model_sizes,
    gemma_weights,
    head_logits,
    read_also_as,
    require,
    split_fused_qkv,
)

MULTIMODAL_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
"""Where a ``Gemma3ForConditionalGeneration`` keeps this decoder: Google's files, and ``transformers`` in memory."""

TEXT_WEIGHTS: tuple[WeightRule, ...] = gemma_weights(post_attention_norm="post_attention_norm") + (
    WeightRule("model.layers.{layer}.self_attn.q_norm.weight", "layers.{layer}.attn._query_norm.scale"),
    WeightRule("model.layers.{layer}.self_attn.k_norm.weight", "layers.{layer}.attn._key_norm.scale"),
)
WEIGHTS: tuple[WeightRule, ...] = TEXT_WEIGHTS + read_also_as(TEXT_WEIGHTS, "model.", MULTIMODAL_TEXT_PREFIXES)
"""The decoder's rows; a ``Gemma3ForConditionalGeneration`` state dict's text tensors load too (and its vision
tensors are reported unexpected)."""

IGNORED_KEYS: tuple[str, ...] = GEMMA_IGNORED_KEYS + (r"model\.rotary_emb_local\..*",)

SUPPORTED_ROPE_TYPES = ("default", "linear")
_ATTENTION_TYPES = {
    "sliding_attention": tunix_gemma3.AttentionType.LOCAL_SLIDING,
    "full_attention": tunix_gemma3.AttentionType.GLOBAL,
}


def _rope_for(hf_config, layer_type: str) -> tuple[float, float]:
    """``(base_frequency, scale_factor)`` for one layer type, as Tunix's ``apply_rope`` takes them.

    Raises:
        UnsupportedRopeScalingError: for rope types other than ``default`` and ``linear``.
    """
    parameters = hf_config.rope_parameters
    # transformers 5 nests the parameters per layer type; a flat dict applies to every layer.
    params: Mapping[str, Any] = parameters[layer_type] if layer_type in parameters else parameters
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeScalingError(
            f"config.json: gemma3 {layer_type} layers use rope_scaling type {rope_type!r}, which "
            f"is not supported; supported types are {list(SUPPORTED_ROPE_TYPES)}."
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedRopeScalingError(
            "config.json: gemma3 partial_rotary_factor != 1 is not supported."
        )
    # Tunix divides the angles by the scale factor, which is HF's "linear" scaling.
    factor = float(params["factor"]) if rope_type == "linear" else 1.0
    if factor < 1.0:
        # Tunix's apply_rope raises on factors below one; say so before tracing starts.
        raise UnsupportedRopeScalingError(
            f"config.json: gemma3 linear rope factor {factor} < 1 is not supported."
        )
    return float(params["rope_theta"]), factor


def _query_pre_attn_norm(hf_config) -> tunix_gemma3.QueryPreAttentionNormalisation:
    """Tunix has two query scalings, 1/sqrt(head_dim) and 1/sqrt(hidden/heads); HF takes any."""
    scalar = hf_config.query_pre_attn_scalar
    norms = tunix_gemma3.QueryPreAttentionNormalisation
    if scalar == hf_config.head_dim:
        return norms.BY_ONE_OVER_SQRT_HEAD_DIM
    if scalar == hf_config.hidden_size // hf_config.num_attention_heads:
        return norms.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    raise UnsupportedConfigError(
        f"gemma3: query_pre_attn_scalar={scalar} is not supported; the Tunix model only scales "
        f"queries by head_dim ({hf_config.head_dim}) or hidden_size/num_attention_heads "
        f"({hf_config.hidden_size // hf_config.num_attention_heads})."
    )


def _check_config(hf_config) -> None:
    """Refuses what the Tunix Gemma3 model does not implement (it would give wrong logits)."""
    # Tunix's Gemma3 has no logit soft-capping (Gemma 2 had it; Gemma 3 checkpoints set both null).
    require(
        getattr(hf_config, "final_logit_softcapping", None) is None,
        "gemma3: final_logit_softcapping is not supported by the Tunix Gemma3 model.",
    )
    require(
        getattr(hf_config, "attn_logit_softcapping", None) is None,
        "gemma3: attn_logit_softcapping is not supported by the Tunix Gemma3 model.",
    )
    # Tunix's RMSNorm hard-codes eps=1e-6.
    require(
        float(hf_config.rms_norm_eps) == 1e-6,
        f"gemma3: rms_norm_eps={hf_config.rms_norm_eps} is not supported (Tunix fixes 1e-6).",
    )
    # Tunix's FeedForward uses nnx.gelu, whose default is the tanh approximation.
    activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    require(
        activation == "gelu_pytorch_tanh",
        f"gemma3: hidden_activation={activation!r} is not supported (only 'gelu_pytorch_tanh').",
    )
    require(
        not getattr(hf_config, "attention_bias", False),
        "gemma3: attention_bias=True is not supported.",
    )
    require(
        not getattr(hf_config, "use_bidirectional_attention", False),
        "gemma3: use_bidirectional_attention=True (EmbeddingGemma) is not supported.",
    )
    require(
        bool(getattr(hf_config, "tie_word_embeddings", True)),
        "gemma3: tie_word_embeddings=False is not supported (Tunix's Gemma3 has no lm_head; "
        "it decodes with the input embedding).",
    )
    layer_types = list(hf_config.layer_types)
    require(
        len(layer_types) == hf_config.num_hidden_layers,
        f"gemma3: layer_types has {len(layer_types)} entries for "
        f"{hf_config.num_hidden_layers} layers.",
    )
    unknown = sorted(set(layer_types) - set(_ATTENTION_TYPES))
    require(
        not unknown,
        f"gemma3: layer_types {unknown} are not supported (only {sorted(_ATTENTION_TYPES)}).",
    )
    require(
        "sliding_attention" not in layer_types or hf_config.sliding_window is not None,
        "gemma3: sliding_attention layers need config.sliding_window.",
    )
    require(
        hf_config.head_dim % 2 == 0, f"gemma3: head_dim={hf_config.head_dim} must be even for rope."
    )


def build_model(hf_config, dtype, rngs: nnx.Rngs, vision_config=None) -> tunix_gemma3.Gemma3:
    """A Tunix ``Gemma3`` whose layers follow ``config.layer_types`` and ``config.rope_parameters``.

    Args:
        hf_config: the text config (``Gemma3TextConfig``).
        vision_config: a Tunix ``SigLIPConfig``: the model also gets Tunix's vision encoder and the embedder's
            multimodal projection (``gemma3_multimodal``); ``None``: text only.

    Raises:
        UnsupportedConfigError: for soft-capping, another norm eps or activation, untied embeddings,
            or a query scaling Tunix cannot express.
        UnsupportedRopeScalingError: for rope types other than ``default``/``linear``.
    """
    _check_config(hf_config)
    local_theta, local_factor = _rope_for(hf_config, "sliding_attention")
    global_theta, global_factor = _rope_for(hf_config, "full_attention")
    config = tunix_gemma3.ModelConfig(
        **gemma_model_sizes(hf_config),
        # Tunix builds its own 5:1 pattern first, which needs a window even if no HF layer slides.
        sliding_window_size=hf_config.sliding_window or hf_config.max_position_embeddings,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_factor,
        global_scale_factor=global_factor,
        query_pre_attn_norm=_query_pre_attn_norm(hf_config),
        param_dtype=dtype,
        vision_config=vision_config,
    )
    model = tunix_gemma3.Gemma3(config, rngs=rngs)
    ropes = {
        "sliding_attention": (local_theta, local_factor),
        "full_attention": (global_theta, global_factor),
    }
    # Tunix fixes the pattern (5 sliding, 1 global); HF checkpoints list each layer's type.
    attention_class = attention_reading_pages(tunix_gemma3.Attention)
    for layer, layer_type in zip(model.layers, hf_config.layer_types, strict=True):
        attention = layer.attn
        attention.__class__ = attention_class
        attention.attn_type = _ATTENTION_TYPES[layer_type]
        attention.rope_base_frequency, attention.rope_scale_factor = ropes[layer_type]
        if attention.use_qkv_einsum:
            split_fused_qkv(attention, tunix_gemma3.Einsum, config, rngs, param_dtype=config.param_dtype)
    return model


@functools.cache
def attention_reading_pages(cls: type) -> type:
    """Tunix Gemma 3's attention ``cls`` whose ``block`` also takes the paged engine's cache entry
    (:func:`~..model.paged_attention.is_paged`): the fed token's query, key and value projected, normed and rotated as
    Tunix's ``block`` does them (its rope with the layer's base frequency and scale factor), the queries scaled by its
    ``query_pre_attn_scalar``, then :func:`~..model.paged_attention.attend` with the layer's window (a sliding layer's
    ``sliding_window_size`` keys, its own included, as Tunix's ``create_sliding_window_mask``). Any other cache runs
    Tunix's ``block``. Keeps the class name; cached and registered for pickled abstract models."""

    def paged_block(self, x, segment_pos, cache, *_):
        query = self.q_einsum(x)  # build_model splits a fused qkv_einsum (split_fused_qkv)
        key, value = self.kv_einsum(x)
        query, key = self._query_norm(query), self._key_norm(key)
        query, key = (tunix_gemma3.apply_rope(part, segment_pos, head_dim=self.head_dim,
                                              base_frequency=self.rope_base_frequency,
                                              scale_factor=self.rope_scale_factor) for part in (query, key))
        sliding = self.attn_type == tunix_gemma3.AttentionType.LOCAL_SLIDING
        out, cache = paged_attention.attend(query, key, value, cache, scale=self.query_pre_attn_scalar,
                                            window=self.sliding_window_size if sliding else None)
        return cache, self.attn_vec_einsum(out)

    return paged_attention.reading_pages_subclass(cls, paged_block, 2, attention_reading_pages, (cls,))


def forward(
    module: tunix_gemma3.Gemma3, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array
):
    """Float32 logits; Gemma3's first argument is ``last_tokens``, so arguments go positionally."""
    logits, _ = module(tokens, positions, None, attention_mask)
    # Tunix decodes in the parameter dtype; the facade promises float32 logits.
    return logits.astype(jnp.float32)


def logits_from_hidden(module: tunix_gemma3.Gemma3, hidden: jax.Array) -> jax.Array:
    """Tunix Gemma3's output head on final-norm hidden states: the tied embedding's ``decode`` (Tunix's Gemma3 has
    no final-logit soft-capping; ``_check_config`` refuses checkpoints that set it), float32."""
    return head_logits(module, hidden, tied=True)


TINY_CONFIGS = {
    # Gemma 3 text: sliding and full attention layers taking turns, a window (8) shorter than a typical test
    # row, and a linear-scaled global rope as the 4B+ checkpoints have.
    "gemma3": TinyConfig("Gemma3TextConfig", dict(
        sliding_window=8, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }), alternating_layer_types=True, copied_fields={'query_pre_attn_scalar': 'head_dim'}),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=IGNORED_KEYS,
    lora_targets=GEMMA_LORA_TARGETS,
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "gemma3_text"
    norms_scale_by_one_plus_weight=True,
    sequence_classification={"gemma3_text": "Gemma3TextForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
