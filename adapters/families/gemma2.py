"""Gemma 2 (``Gemma2ForCausalLM``) <-> ``tunix.models.gemma``, with HF's window, query scaling and rope."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.gemma import model as tunix_gemma

from ..model.attention_masks import sliding_window_mask
from ..model.rope import attention_with_rope
from .base import (
    GEMMA_IGNORED_KEYS,
    GEMMA_LORA_TARGETS,
    Family,
    TinyConfig,
    WeightRule,
    decoder_forward,
    decoder_hidden_states,
    gemma_model_sizes,
    gemma_weights,
    require,
    split_fused_qkv,
)

WEIGHTS: tuple[WeightRule, ...] = gemma_weights(post_attention_norm="post_attn_norm")

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma2Attention(tunix_gemma.Attention):
    """Tunix's Gemma attention with transformers' sliding window and query scaling.

    Attributes set by :func:`build_model`:
        sliding_window: the window of a ``sliding_attention`` layer, ``None`` for ``full_attention``.
        query_pre_attn_scalar: queries are scaled by ``query_pre_attn_scalar**-0.5``.
    """

    sliding_window: int | None = None
    query_pre_attn_scalar: float = 1.0

    def __call__(self, x, segment_pos, cache, attn_mask):
        # Tunix compares cache slots with token positions, which differ on left-padded rows, so it sees
        # every layer as GLOBAL and the window is applied to the mask here, in cache slots as transformers does.
        if self.sliding_window is not None:
            # Tunix writes the new keys at slot end_index (the same for every row).
            first = cache["end_index"][0] if cache is not None else 0
            attn_mask = attn_mask & sliding_window_mask(x.shape[1], attn_mask.shape[-1], first, self.sliding_window)
        return super().__call__(x, segment_pos, cache, attn_mask)

    def paged_projections(self, x):
        """The queries, keys and values of ``x`` as Tunix's ``block`` projects them (before the rope), for the paged
        engine's kernels (:func:`~..model.rope.reading_pages`; :func:`build_model` splits a fused ``qkv_einsum``)."""
        query = self.q_einsum(x)
        key, value = self.kv_einsum(x)
        return query, key, value

    def paged_settings(self) -> dict:
        """The paged kernels' query scale, window and logit soft cap: transformers' Gemma 2 attention."""
        return {"scale": self.query_pre_attn_scalar**-0.5, "window": self.sliding_window,
                "soft_cap": self.attn_logits_soft_cap}

    def paged_output(self, heads):
        """The output projection of the heads' outputs ``[B, T, N, H]``."""
        return self.attn_vec_einsum(heads)

    @property
    def head_dim(self):
        # Tunix's block reads head_dim for rope (swapped for apply_rope, which ignores it) and to scale the queries
        # by head_dim**-0.5; transformers scales by query_pre_attn_scalar**-0.5. Shapes come from the weights.
        return self.query_pre_attn_scalar


def _check_config(hf_config) -> None:
    """Refuses what the Tunix Gemma model does not implement (it would give wrong logits)."""
    # Tunix's RMSNorm hard-codes eps=1e-6.
    require(float(hf_config.rms_norm_eps) == 1e-6,
            f"gemma2: rms_norm_eps={hf_config.rms_norm_eps} is not supported (Tunix fixes 1e-6).")
    # Tunix's FeedForward uses nnx.gelu, whose default is the tanh approximation.
    activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    require(activation == "gelu_pytorch_tanh",
            f"gemma2: hidden_activation={activation!r} is not supported (only 'gelu_pytorch_tanh').")
    require(not getattr(hf_config, "attention_bias", False), "gemma2: attention_bias=True is not supported.")
    require(not getattr(hf_config, "use_bidirectional_attention", False),
            "gemma2: use_bidirectional_attention=True is not supported (causal attention only).")
    require(bool(getattr(hf_config, "tie_word_embeddings", True)),
            "gemma2: tie_word_embeddings=False is not supported (Tunix's Gemma has no lm_head; it decodes with the "
            "input embedding).")
    layer_types = list(hf_config.layer_types)
    require(len(layer_types) == hf_config.num_hidden_layers,
            f"gemma2: layer_types has {len(layer_types)} entries for {hf_config.num_hidden_layers} layers.")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    require(not unknown, f"gemma2: layer_types {unknown} are not supported (only {sorted(LAYER_TYPES)}).")
    require("sliding_attention" not in layer_types or hf_config.sliding_window is not None,
            "gemma2: sliding_attention layers need config.sliding_window.")
    require(hf_config.head_dim % 2 == 0, f"gemma2: head_dim={hf_config.head_dim} must be even for rope.")


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> tunix_gemma.Gemma:
    """A Tunix ``Gemma`` whose layers follow ``config.layer_types``, ``sliding_window``, ``query_pre_attn_scalar``
    and ``rope_parameters``, with both soft-caps (see ``adapters.upstream``).

    ``dtype`` is applied when the weights are filled: Tunix's Gemma has no parameter dtype of its own and computes
    in its parameters' dtype.

    Raises:
        UnsupportedConfigError: for another norm eps or activation, untied embeddings, attention bias,
            bidirectional attention or unknown layer types.
        UnsupportedRopeScalingError: for rope types ``adapters.model.rope`` does not implement.
    """
    _check_config(hf_config)
    config = tunix_gemma.ModelConfig(
        **gemma_model_sizes(hf_config),
        final_logit_softcap=hf_config.final_logit_softcapping,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        # Every layer is GLOBAL to Tunix: Gemma2Attention applies the sliding window itself.
        attention_types=(tunix_gemma.AttentionType.GLOBAL,) * hf_config.num_hidden_layers,
        attn_logits_soft_cap=hf_config.attn_logit_softcapping,
    )
    model = tunix_gemma.Gemma(config, rngs=rngs)
    attention_class = attention_with_rope(Gemma2Attention, hf_config.rope_parameters, hf_config.head_dim, pages=True)
    for layer, layer_type in zip(model.layers, hf_config.layer_types, strict=True):
        attention = layer.attn
        if attention.use_qkv_einsum:
            split_fused_qkv(attention, tunix_gemma.Einsum, config, rngs)
        attention.__class__ = attention_class
        attention.sliding_window = hf_config.sliding_window if layer_type == "sliding_attention" else None
        attention.query_pre_attn_scalar = float(hf_config.query_pre_attn_scalar)
    return model


def logits_from_hidden(module: tunix_gemma.Gemma, hidden: jax.Array) -> jax.Array:
    """Tunix Gemma's output head on final-norm hidden states: the tied embedding's ``decode``, then the final
    soft-cap ``tanh(logits / cap) * cap`` in the same order and dtype as its ``__call__``; float32."""
    logits = module.embedder.decode(hidden)
    cap = module.final_logits_softcap
    if cap is not None:
        logits = jnp.tanh(logits / cap) * cap
    return logits.astype(jnp.float32)


TINY_CONFIGS = {
    # Gemma 2: sliding and full attention layers taking turns (transformers' default layer_types), a window (4)
    # shorter than a typical test row, attention and final soft-caps small enough to bind on random weights, and
    # queries scaled by a query_pre_attn_scalar other than head_dim (as Gemma 2 27B is).
    "gemma2": TinyConfig("Gemma2Config", dict(
        sliding_window=4, tie_word_embeddings=True, attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
        query_pre_attn_scalar=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=GEMMA_IGNORED_KEYS,
    lora_targets=GEMMA_LORA_TARGETS,
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "gemma2"
    norms_scale_by_one_plus_weight=True,
    sequence_classification={"gemma2": "Gemma2ForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
