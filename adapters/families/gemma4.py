"""Gemma 4 text (``Gemma4ForCausalLM``) <-> ``tunix.models.gemma4``, with HF's per-layer types, head sizes, rope,
KV sharing, per-layer inputs and mixture of experts."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.gemma4 import model as tunix_gemma4
from tunix.models.gemma4 import moe as tunix_moe

from ..model import paged_attention
from ..model.nnx_state import Buffer
from ..model.rope import UnsupportedRopeScalingError
from .base import (
    DECODER_LORA_TARGETS,
    GEMMA_IGNORED_KEYS,
    HEADS_FIRST_INPUT_PROJECTION,
    INPUT_PROJECTION,
    TRANSPOSED,
    Family,
    Layout,
    TinyConfig,
    WeightRule,
    decoder_forward,
    decoder_hidden_states,
    gemma_weights,
    read_also_as,
    require,
)


class SplitSecondAxis(Layout):
    """HF ``(a, b*c, ...)`` <-> NNX ``(a, b, c, ...)``: a fused expert ``gate_up_proj`` ``(E, 2*I, H)`` against
    Tunix's ``(E, 2, I, H)``, and the packed per-layer embedding ``(V, L*P)`` against ``(V, L, P)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.reshape(nnx_shape)

    def to_hf(self, nnx):
        return nnx.reshape(nnx.shape[0], nnx.shape[1] * nnx.shape[2], *nnx.shape[3:])

    def hf_shape(self, nnx_shape):
        return (nnx_shape[0], nnx_shape[1] * nnx_shape[2], *nnx_shape[3:])


class SwappedLastAxes(Layout):
    """HF expert ``down_proj`` ``(E, H, I)`` <-> Tunix's ``(E, I, H)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.swapaxes(-1, -2)

    def to_hf(self, nnx):
        return nnx.swapaxes(-1, -2)

    def hf_shape(self, nnx_shape):
        return (*nnx_shape[:-2], nnx_shape[-1], nnx_shape[-2])


SPLIT_SECOND_AXIS = SplitSecondAxis()
SWAPPED_LAST_AXES = SwappedLastAxes()

_LAYER, _NNX_LAYER = "model.layers.{layer}", "layers.{layer}"

TEXT_WEIGHTS: tuple[WeightRule, ...] = tuple(
    # Gemma 4's keys and values are two einsums here (one when keys are values), not Tunix's stacked kv_einsum.
    rule for rule in gemma_weights(post_attention_norm="post_attention_norm") if rule.stack is None
) + (
    WeightRule(f"{_LAYER}.self_attn.k_proj.weight", f"{_NNX_LAYER}.attn.key_einsum.w", HEADS_FIRST_INPUT_PROJECTION),
    WeightRule(f"{_LAYER}.self_attn.v_proj.weight", f"{_NNX_LAYER}.attn.value_einsum.w",
               HEADS_FIRST_INPUT_PROJECTION),
    WeightRule(f"{_LAYER}.self_attn.q_norm.weight", f"{_NNX_LAYER}.attn._query_norm.scale"),
    WeightRule(f"{_LAYER}.self_attn.k_norm.weight", f"{_NNX_LAYER}.attn._key_norm.scale"),
    WeightRule(f"{_LAYER}.layer_scalar", f"{_NNX_LAYER}.skip_scale"),
    # Per-layer inputs (PLE).
    WeightRule("model.embed_tokens_per_layer.weight", "embedder.per_layer_input_embedding", SPLIT_SECOND_AXIS),
    # Tunix scales this weight by hidden_size**-0.5 where transformers scales its output: both store it unscaled.
    WeightRule("model.per_layer_model_projection.weight", "embedder.per_layer_model_projection.w", INPUT_PROJECTION),
    WeightRule("model.per_layer_projection_norm.weight", "embedder.per_layer_projection_norm.scale"),
    WeightRule(f"{_LAYER}.per_layer_input_gate.weight", f"{_NNX_LAYER}.per_layer_input_gate.w", TRANSPOSED),
    WeightRule(f"{_LAYER}.per_layer_projection.weight", f"{_NNX_LAYER}.per_layer_projection.w", TRANSPOSED),
    WeightRule(f"{_LAYER}.post_per_layer_input_norm.weight", f"{_NNX_LAYER}.post_per_layer_input_norm.scale"),
    # Mixture of experts, beside the dense MLP.
    WeightRule(f"{_LAYER}.router.proj.weight", f"{_NNX_LAYER}.moe.router_logits", TRANSPOSED),
    WeightRule(f"{_LAYER}.router.scale", f"{_NNX_LAYER}.moe.router_scale"),
    WeightRule(f"{_LAYER}.router.per_expert_scale", f"{_NNX_LAYER}.moe.per_expert_scale"),
    WeightRule(f"{_LAYER}.experts.gate_up_proj", f"{_NNX_LAYER}.moe.gating_einsum", SPLIT_SECOND_AXIS),
    WeightRule(f"{_LAYER}.experts.down_proj", f"{_NNX_LAYER}.moe.linear", SWAPPED_LAST_AXES),
    WeightRule(f"{_LAYER}.pre_feedforward_layernorm_2.weight", f"{_NNX_LAYER}.moe.pre_norm.scale"),
    WeightRule(f"{_LAYER}.post_feedforward_layernorm_1.weight", f"{_NNX_LAYER}.dense_post_ffw_norm.scale"),
    WeightRule(f"{_LAYER}.post_feedforward_layernorm_2.weight", f"{_NNX_LAYER}.moe_post_ffw_norm.scale"),
)
WEIGHTS: tuple[WeightRule, ...] = TEXT_WEIGHTS + read_also_as(TEXT_WEIGHTS, "model.", ("model.language_model.",))
"""The decoder's rows; a ``Gemma4ForConditionalGeneration`` checkpoint's text tensors load too (its vision and audio
tensors are reported unexpected)."""

LORA_TARGETS: Mapping[str, str] = {
    **DECODER_LORA_TARGETS,
    "q_proj": r"layers/\d+/attn/q_einsum",
    "k_proj": r"layers/\d+/attn/key_einsum",
    "v_proj": r"layers/\d+/attn/value_einsum",
    "o_proj": r"layers/\d+/attn/attn_vec_einsum",
    "per_layer_input_gate": r"layers/\d+/per_layer_input_gate",
    "per_layer_projection": r"layers/\d+/per_layer_projection",
}
"""The linear layers LoRA adapts. The experts (``ragged_dot`` on raw parameters), the router and the per-layer model
projection (whose weight Tunix rescales) are not Qwix-interceptable linears here."""

LAYER_TYPES = {
    "sliding_attention": tunix_gemma4.AttentionType.LOCAL_SLIDING,
    "full_attention": tunix_gemma4.AttentionType.GLOBAL,
}
ROPE_TYPES = ("default", "proportional")
UNUSED_ROPE = (10_000.0, 1.0, 1.0)


class Gemma4Attention(tunix_gemma4.Attention):
    """Tunix's Gemma 4 attention with keys and values from two einsums, ``key_einsum`` and ``value_einsum``, that
    also reads the paged engine's KV pages in place (:meth:`block`).

    A full-attention layer whose keys are its values (``attention_k_eq_v``) has no ``value_einsum``; a KV-shared
    layer has neither (it reads its origin layer's keys and values). One HF name then maps to one NNX path in every
    layer, where Tunix would hold ``k_proj`` in a stacked ``kv_einsum`` or a ``k_einsum`` depending on the layer.
    """

    reads_paged_cache = True  # decoder_contract.paged_kernel_refusal

    def kv_einsum(self, x):
        # Tunix's block calls self.kv_einsum(x) and unpacks (keys, values).
        keys = self.key_einsum(x)
        return keys, (self.value_einsum(x) if hasattr(self, "value_einsum") else keys)

    def block(self, x, segment_pos, cache, attn_mask, kv_shared_cache=None):
        """Tunix's ``block``, or, when ``cache`` or ``kv_shared_cache`` is the paged engine's entry
        (:func:`~..model.paged_attention.is_paged`), one decode step on the pages: the fed token's query, key and
        value projected, normed and rotated as Tunix's ``block`` does them (the query and key norms, the value's
        unweighted RMS norm, the layer type's rope and its proportion), then
        :func:`~..model.paged_attention.attend` unscaled (Gemma 4's norms stand in for the scale), a sliding
        layer's window being ``sliding_window_size`` keys, its own included. A KV-shared layer gets its origin's
        entry as ``kv_shared_cache`` (Tunix's decode loop passes the origin's updated cache), reads the fed token's
        key and value the origin wrote to those pages, and writes none.

        Returns:
            ``(the layer's cache, output [B, 1, embed], (keys, values))``, as Tunix's ``block``; a KV-shared layer's
            cache, keys and values are ``None`` (the decoder keeps no cache for it, and only a prefill reads them).
        """
        shared = paged_attention.is_paged(kv_shared_cache)
        if not (shared or paged_attention.is_paged(cache)):
            return super().block(x, segment_pos, cache, attn_mask, kv_shared_cache=kv_shared_cache)
        x = x.astype(self.config.dtype)
        query = self._rope(self._query_norm(self.q_einsum(x)), segment_pos)
        key = value = None
        if not shared:
            key, value = self.kv_einsum(x)
            key = self._rope(self._key_norm(key), segment_pos)
            value = value * jax.lax.rsqrt(jnp.mean(jnp.square(value), axis=-1, keepdims=True) + 1e-6)
        sliding = self.attn_type == tunix_gemma4.AttentionType.LOCAL_SLIDING
        out, entry = paged_attention.attend(query, key, value, kv_shared_cache if shared else cache, scale=1.0,
                                            window=self.config.sliding_window_size if sliding else None)
        return (None if shared else entry), self.attn_vec_einsum(out), (key, value)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return tunix_gemma4.apply_rope(x, positions, base_frequency=self.rope_base_frequency,
                                       scale_factor=self.rope_scale_factor, rope_proportion=self.rope_proportion)


class Gemma4MoE(tunix_moe.MoERagged):
    """Tunix's experts routed on the residual stream, as transformers routes them.

    Tunix's block feeds the MoE the residual already normalised by ``moe_pre_ffw_norm`` and routes on that; in
    transformers the router normalises the raw residual itself and only the experts' input goes through
    ``pre_feedforward_layernorm_2``. The layer's ``moe_pre_ffw_norm`` is moved here as ``pre_norm`` and applied to
    the experts' input only.
    """

    def _run_ffw_and_routing(self, x, expert_choices, expert_weights):
        return super()._run_ffw_and_routing(self.pre_norm(x), expert_choices, expert_weights)


class Unchanged(nnx.Module):
    """Returns its input (stands in for a norm that moved elsewhere)."""

    def __call__(self, x):
        return x


class Gemma4Decoder(tunix_gemma4.Gemma4):
    """Tunix's ``Gemma4`` with the KV cache layout the sampler builds (``adapters.rollout.sampling.init_cache``) and
    a way in from embeddings (:meth:`decode_embeddings`), which a multimodal model needs to put image features in
    place of their tokens. A call with tokens is Tunix's own ``__call__``, unchanged."""

    def decode_embeddings(self, x: jax.Array, per_layer_inputs: jax.Array | None, positions: jax.Array,
                          cache: dict | None, attention_mask: jax.Array, decode_only_last_token: bool = False
                          ) -> tuple[jax.Array, dict | None]:
        """The decoder layers, final norm and soft-capped head on given input embeddings: Tunix's
        ``Gemma4.__call__`` after its embedding step.

        Tunix's ``__call__`` embeds the tokens itself and has no hook between the embedding and the layers, so this
        repeats its layer loop (the KV sharing, read from the origin layer's fresh keys and values in a prefill and
        from its cache in a decode step; each layer's slice of the per-layer inputs; the final norm; the head and
        its soft-cap). ``transformers``' ``Gemma4TextModel.forward`` with ``inputs_embeds`` and ``per_layer_inputs``
        is the same computation. ``tests/test_gemma4_vision.py`` holds it to the token path's logits.

        Args:
            x: ``[B, T, H]`` input embeddings in the compute dtype (the token embeddings already scaled by
                ``sqrt(hidden_size)``, image features in place of image tokens).
            per_layer_inputs: ``[B, T, layers, per_layer_input_dim]`` from ``embedder.encode_per_layer_input``, or
                ``None`` when the config has no per-layer inputs.
            positions: ``[B, T]`` rope positions.
            cache: the KV cache (``{"layer_i": {"k", "v", "end_index"}}``) or ``None``.
            attention_mask: ``[B, T, S]`` boolean (query, key) mask.
            decode_only_last_token: only the last position's logits.

        Returns:
            ``(logits [B, T, V] float32, new cache or None)``, as Tunix's ``__call__`` returns them.
        """
        new_cache: dict = {}
        fresh_keys_values: dict = {}  # the origin layers' keys and values in a prefill, for the layers sharing them
        is_prefill = x.shape[1] > 1
        for index, layer in enumerate(self.layers):
            name = f"layer_{index}"
            origin = self.kv_cache_sharing_patterns[index]
            if origin != index:
                layer_cache = None
                if is_prefill:
                    keys, values = fresh_keys_values[f"layer_{origin}"]
                    shared = {"k": keys, "v": values}
                else:
                    shared = new_cache.get(f"layer_{origin}")
            else:
                layer_cache, shared = (cache[name] if cache else None), None
            layer_cache, x, keys_values = layer(
                x, positions, layer_cache, attention_mask,
                per_layer_input=None if per_layer_inputs is None else per_layer_inputs[:, :, index, :],
                kv_shared_cache=shared)
            if is_prefill and index in self.shared_layer_origins:
                fresh_keys_values[name] = keys_values
            if origin == index:
                new_cache[name] = layer_cache
        x = self.final_norm(x)
        if decode_only_last_token:
            x = x[:, -1:, :]
        return logits_from_hidden(self, x), (None if cache is None else new_cache)

    def kv_cache_shapes(self) -> dict[str, tuple[int, int]]:
        """``{"layer_i": (kv_heads, head_dim)}`` of the layers that keep a cache: a global layer's head sizes may
        differ from a sliding layer's, and a KV-shared layer reads its origin's cache instead of keeping one."""
        return {f"layer_{index}": (layer.attn.num_kv_heads, layer.attn.head_dim)
                for index, layer in enumerate(self.layers) if self.kv_cache_sharing_patterns[index] == index}


def _rope_parameters(hf_config, layer_type: str) -> Mapping[str, Any]:
    parameters = hf_config.rope_parameters
    # transformers nests the parameters per layer type; a flat dict applies to every layer.
    return parameters[layer_type] if layer_type in parameters else parameters


def _rope_for(hf_config, layer_type: str) -> tuple[float, float, float]:
    """``(base_frequency, scale_factor, rope_proportion)`` for one layer type, as Tunix's ``apply_rope`` takes them.

    transformers' ``proportional`` rope rotates the first ``partial_rotary_factor`` of each half of the head and
    divides the angles by ``factor``, which is Tunix's ``rope_proportion`` and ``scale_factor``; ``default`` rotates
    the whole head.

    Raises:
        UnsupportedRopeScalingError: for other rope types or a factor below one.
    """
    params = _rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", "default") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedRopeScalingError(
            f"config.json: gemma4 {layer_type} layers use rope_parameters rope_type={rope_type!r}, which is not "
            f"supported; supported types are {list(ROPE_TYPES)}.")
    if rope_type == "default":
        return float(params["rope_theta"]), 1.0, 1.0
    factor = float(params.get("factor", 1.0))
    if factor < 1.0:
        # Tunix's apply_rope raises on factors below one; say so before tracing starts.
        raise UnsupportedRopeScalingError(
            f"config.json: gemma4 {layer_type} rope factor={factor} < 1 is not supported.")
    return float(params["rope_theta"]), factor, float(params.get("partial_rotary_factor", 1.0))


def kv_sharing_pattern(hf_config) -> list[int]:
    """The layer whose keys and values each layer uses: itself, or, for the last ``num_kv_shared_layers`` layers,
    the last earlier layer of the same type (transformers' ``store_full_length_kv`` layer)."""
    layer_types = list(hf_config.layer_types)
    first_shared = hf_config.num_hidden_layers - hf_config.num_kv_shared_layers
    unshared = layer_types[:first_shared]
    return [index if index < first_shared else first_shared - 1 - unshared[::-1].index(layer_type)
            for index, layer_type in enumerate(layer_types)]


PER_LAYER_FIELDS = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}
"""What transformers from 5.2x lets a Gemma 4 full-attention layer override (``per_layer_config``), and the
attribute its 5.12 config names it by."""


def per_layer_config_flattened(hf_config) -> Any:
    """``hf_config`` as transformers 5.12 describes Gemma 4, which this module reads.

    Later transformers give the full-attention layers' own head size and key heads as ``per_layer_config`` overrides
    (instead of ``global_head_dim`` and ``num_global_key_value_heads``) and refuse to read ``head_dim`` globally. The
    result is a namespace of the config's fields with those two attributes set from the overrides; a config without
    ``per_layer_config`` is returned as it is.

    Raises:
        UnsupportedConfigError: an override of another field, of a sliding-attention layer, or full-attention layers
            that differ from each other (the Tunix model gives all full-attention layers one shape).
    """
    fields = hf_config.to_dict()
    overrides = fields.pop("per_layer_config", None)
    if overrides is None:
        return hf_config
    full = [index for index, kind in enumerate(fields["layer_types"]) if kind == "full_attention"]
    by_layer = {int(layer): dict(values) for layer, values in overrides.items()}
    for layer, values in by_layer.items():
        extra = sorted(set(values) - set(PER_LAYER_FIELDS)) if layer in full else sorted(values)
        require(not extra, f"gemma4: per_layer_config[{layer}] sets {extra} for a "
                           f"{fields['layer_types'][layer]} layer; only the full-attention layers' "
                           f"{sorted(PER_LAYER_FIELDS)} may differ from the config's.")
    shapes = {tuple(sorted(by_layer.get(layer, {}).items())) for layer in full}
    require(len(shapes) <= 1, f"gemma4: per_layer_config gives the full-attention layers different shapes "
                              f"({sorted(shapes)}); the Tunix model builds them all alike.")
    shared = dict(next(iter(shapes), ()))
    require("num_key_value_heads" not in shared or fields.get("attention_k_eq_v"),
            "gemma4: per_layer_config gives the full-attention layers their own num_key_value_heads without "
            "attention_k_eq_v; only layers whose keys are their values have their own key heads here.")
    for name, legacy in PER_LAYER_FIELDS.items():
        fields[legacy] = shared.get(name)
    return types.SimpleNamespace(**fields)


def _check_config(hf_config, images_both_ways: bool = False) -> None:
    """Refuses what the Tunix Gemma4 model (with the fixes here) does not implement (it would give wrong logits);
    ``images_both_ways``: the multimodal model, whose image tokens may attend both ways (``"vision"``)."""
    # Tunix's RMSNorm (and its value and router norms) hard-code eps=1e-6.
    require(float(hf_config.rms_norm_eps) == 1e-6,
            f"gemma4: rms_norm_eps={hf_config.rms_norm_eps} is not supported (Tunix fixes 1e-6).")
    # Tunix's MLP, experts and per-layer gate use the tanh approximation of gelu.
    require(hf_config.hidden_activation == "gelu_pytorch_tanh",
            f"gemma4: hidden_activation={hf_config.hidden_activation!r} is not supported (only 'gelu_pytorch_tanh').")
    require(not hf_config.attention_bias, "gemma4: attention_bias=True is not supported.")
    require(hf_config.use_bidirectional_attention in ((None, "vision") if images_both_ways else (None,)),
            f"gemma4: use_bidirectional_attention={hf_config.use_bidirectional_attention!r} is not supported "
            "(causal attention only).")
    require(bool(hf_config.tie_word_embeddings),
            "gemma4: tie_word_embeddings=False is not supported (Tunix's Gemma4 has no lm_head; it decodes with the "
            "input embedding).")
    layer_types = list(hf_config.layer_types)
    require(len(layer_types) == hf_config.num_hidden_layers,
            f"gemma4: layer_types has {len(layer_types)} entries for {hf_config.num_hidden_layers} layers.")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    require(not unknown, f"gemma4: layer_types {unknown} are not supported (only {sorted(LAYER_TYPES)}).")
    odd = [f"{name}={getattr(hf_config, name)}" for name in ("head_dim", "global_head_dim")
           if (getattr(hf_config, name) or 0) % 2]
    require(not odd, f"gemma4: {', '.join(odd)} must be even for rope.")
    for layer_type in set(layer_types):
        _rope_for(hf_config, layer_type)
    require(not hf_config.attention_k_eq_v or hf_config.num_global_key_value_heads is not None,
            "gemma4: attention_k_eq_v=True needs num_global_key_value_heads (the full-attention layers' key heads).")
    shared = hf_config.num_kv_shared_layers
    require(0 <= shared < hf_config.num_hidden_layers,
            f"gemma4: num_kv_shared_layers={shared} must be below num_hidden_layers={hf_config.num_hidden_layers}.")
    orphans = sorted(set(layer_types[hf_config.num_hidden_layers - shared:])
                     - set(layer_types[:hf_config.num_hidden_layers - shared]))
    require(not orphans, f"gemma4: num_kv_shared_layers={shared} leaves {orphans} layers with no earlier layer of "
                         "their type to share keys and values with.")
    if hf_config.hidden_size_per_layer_input:
        require(hf_config.vocab_size_per_layer_input == hf_config.vocab_size,
                f"gemma4: vocab_size_per_layer_input={hf_config.vocab_size_per_layer_input} != vocab_size="
                f"{hf_config.vocab_size} is not supported (Tunix's per-layer embedding has the main vocabulary).")
    if hf_config.enable_moe_block:
        missing = [name for name in ("num_experts", "top_k_experts", "moe_intermediate_size")
                   if not getattr(hf_config, name)]
        require(not missing, f"gemma4: enable_moe_block=True needs {missing}.")


def _separate_keys_and_values(attention, config: tunix_gemma4.ModelConfig, rngs: nnx.Rngs, shared: bool) -> None:
    """Turns a Tunix attention into :class:`Gemma4Attention` (see there)."""
    keys_are_values = hasattr(attention, "k_einsum")
    delattr(attention, "k_einsum" if keys_are_values else "kv_einsum")
    attention.__class__ = Gemma4Attention
    if shared:
        # transformers' KV-shared layers have no k/v projections or key norm (v_norm has no weight).
        del attention._key_norm
        return

    def einsum():
        # Tunix shards the head axis over tp even for a single key head (its k_einsum does), which no mesh with
        # tp > 1 can split.
        sharding = (None, "fsdp", None) if attention.num_kv_heads == 1 else config.shd_config.kv_weight_cndh[1:]
        return tunix_gemma4.Einsum(einsum_str="BSD,KDH->BSKH",
                                   shape=(attention.num_kv_heads, config.embed_dim, attention.head_dim), rngs=rngs,
                                   sharding=sharding, dtype=config.dtype, param_dtype=config.param_dtype)

    attention.key_einsum = einsum()
    if not keys_are_values:
        attention.value_einsum = einsum()


def build_model(hf_config, dtype, rngs: nnx.Rngs, images_both_ways: bool = False) -> Gemma4Decoder:
    """A Tunix ``Gemma4`` whose layers follow ``config.layer_types``, ``rope_parameters``, ``num_kv_shared_layers``
    and ``use_double_wide_mlp``, with separate key/value einsums and transformers' MoE routing (see
    ``adapters.upstream``). It computes in ``dtype``, the parameters' dtype, as transformers does.

    Args:
        images_both_ways: accept ``use_bidirectional_attention="vision"`` (the multimodal model, whose callers add
            each image's block to the attention mask); the text decoder itself is causal.

    Raises:
        UnsupportedConfigError: for another norm eps or activation, untied embeddings,
            attention bias, bidirectional attention, unknown layer types or an incomplete MoE/KV-sharing config.
        UnsupportedRopeScalingError: for rope types other than ``default``/``proportional``.
    """
    hf_config = per_layer_config_flattened(hf_config)
    _check_config(hf_config, images_both_ways)
    # A type no layer has may have no rope parameters; Tunix still takes a value for it.
    ropes = {layer_type: _rope_for(hf_config, layer_type) for layer_type in set(hf_config.layer_types)}
    local_theta, local_factor, local_proportion = ropes.get("sliding_attention", UNUSED_ROPE)
    global_theta, global_factor, global_proportion = ropes.get("full_attention", UNUSED_ROPE)
    moe = bool(hf_config.enable_moe_block)
    config = tunix_gemma4.ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        num_embed=hf_config.vocab_size,
        embed_dim=hf_config.hidden_size,
        hidden_dim=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        head_dim=hf_config.head_dim,
        num_kv_heads=hf_config.num_key_value_heads,
        final_logit_softcap=hf_config.final_logit_softcapping,
        sliding_window_size=hf_config.sliding_window,
        per_layer_input_dim=hf_config.hidden_size_per_layer_input or 0,
        # Tunix gives every global layer num_global_kv_heads; transformers only those whose keys are values.
        num_global_kv_heads=hf_config.num_global_key_value_heads if hf_config.attention_k_eq_v else None,
        global_key_size=hf_config.global_head_dim or hf_config.head_dim,
        attention_pattern=tuple(LAYER_TYPES[layer_type] for layer_type in hf_config.layer_types),
        k_eq_v_global=bool(hf_config.attention_k_eq_v),
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_factor,
        global_scale_factor=global_factor,
        local_rope_proportion=local_proportion,
        global_rope_proportion=global_proportion,
        param_dtype=dtype,
        dtype=dtype,
        # The sampler's cache holds every slot and the window is a mask, as in transformers.
        use_sliding_window_kv_cache=False,
        enable_moe=moe,
        num_experts=hf_config.num_experts if moe else None,
        num_experts_per_tok=hf_config.top_k_experts if moe else None,
        expert_dim=hf_config.moe_intermediate_size if moe else None,
    )
    model = Gemma4Decoder(config, rngs=rngs)
    # Tunix derives the sharing from a fraction of layers and a fixed layer pattern; transformers from layer_types.
    sharing = kv_sharing_pattern(hf_config)
    model.kv_cache_sharing_patterns = sharing
    model.shared_layer_origins = {origin for index, origin in enumerate(sharing) if origin != index}
    for index, layer in enumerate(model.layers):
        # transformers registers layer_scalar as a buffer: loaded and saved, never trained.
        layer.skip_scale = Buffer(layer.skip_scale.get_value())
        shared = sharing[index] != index
        _separate_keys_and_values(layer.attn, config, rngs, shared)
        if shared and hf_config.use_double_wide_mlp:
            layer.mlp = tunix_gemma4.FeedForward(config, hidden_dim=2 * hf_config.intermediate_size, rngs=rngs)
        if moe:
            layer.moe.__class__ = Gemma4MoE
            layer.moe.pre_norm = layer.moe_pre_ffw_norm
            layer.moe_pre_ffw_norm = Unchanged()
    return model


def logits_from_hidden(module: Gemma4Decoder, hidden: jax.Array) -> jax.Array:
    """Tunix Gemma4's output head on final-norm hidden states: the tied embedding's ``decode``, cast to float32,
    then the final soft-cap ``tanh(logits / cap) * cap``, in the order of its ``__call__``."""
    logits = module.embedder.decode(hidden).astype(jnp.float32)
    cap = module.config.final_logit_softcap
    if cap is not None:
        logits = jnp.tanh(logits / cap) * cap
    return logits


TINY_CONFIGS = {
    # Gemma 4 text: sliding and full attention layers taking turns, a window (8) shorter than a typical test row,
    # full layers with their own head size (32) and proportional rope on a quarter of it, a binding final soft-cap,
    # no per-layer inputs (transformers' default has them).
    "gemma4": TinyConfig("Gemma4TextConfig", dict(
        sliding_window=8, tie_word_embeddings=True, global_head_dim=32, final_logit_softcapping=5.0,
        hidden_size_per_layer_input=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        }), alternating_layer_types=True, copied_fields={'vocab_size_per_layer_input': 'vocab_size'}),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="gemma4",
    # Not "gemma4": Gemma4ForConditionalGeneration wraps this decoder with its vision and audio towers
    # (families/gemma4_multimodal.py).
    model_types=("gemma4_text",),
    architectures=("Gemma4ForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=GEMMA_IGNORED_KEYS,
    lora_targets=LORA_TARGETS,
    default_lora_targets=(),  # PEFT has none for model_type "gemma4_text"
    # Tunix's Gemma4 Einsum casts its weight with jnp.astype, which Qwix's quantised weights do not take.
    quantization_excluded=("q_proj", "k_proj", "v_proj", "o_proj", "per_layer_input_gate", "per_layer_projection"),
    tiny_configs=TINY_CONFIGS,
)
