"""What every family on torchlike's native decoder (:mod:`adapters.model.native_decoder`) shares: its rope from
``transformers``' own rope functions, the checks every such config passes, the Llama-style weight rows in the native
layout, and :func:`native_family`, which turns a ``spec_from_config`` function and a weight table into a
:class:`Family`.

A family module on the native decoder is then: the spec (sizes and switches read from the config, every field it
cannot honour refused by name), the weight table (HF name <-> NNX path), PEFT's default targets and the tiny test
config in ``torchlike.testing``; plus one line in ``families/__init__.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..model.native_decoder import ACTIVATIONS, DecoderSpec, NativeDecoder, Rope
from ..model.rope import default_inverse_frequencies
from .base import TRANSPOSED, Family, WeightRule, decoder_forward, decoder_hidden_states, head_dim_of, require

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
"""Rope types the native decoder computes (frequencies from ``transformers``' own functions); ``dynamic`` changes
with the sequence length inside ``transformers``' forward and is refused."""

DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob",
                  "attention_probs_dropout_prob", "mlp_dropout", "residual_dropout", "embedding_dropout")


def rope_parameters_of(hf_config, layer_type: str | None = None) -> Mapping[str, Any]:
    """The config's ``rope_parameters`` (of ``layer_type`` when they are given per layer type)."""
    parameters = hf_config.rope_parameters
    if layer_type is not None and layer_type in parameters:
        return parameters[layer_type]
    return parameters


def rope_of(hf_config, family: str, layer_type: str | None = None, interleaved: bool = False) -> Rope:
    """A layer's :class:`Rope` computed as ``transformers`` computes it: the default frequencies
    ``1 / theta ** (2i / rotary_dim)`` over ``rotary_dim = head_dim * partial_rotary_factor``, or the scaled ones of
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` with their attention factor (LongRoPE: both sets);
    ``interleaved``: Cohere's pairing of neighbouring features.

    Raises:
        UnsupportedConfigError: a rope type outside :data:`ROPE_TYPES`, named with the field.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = rope_parameters_of(hf_config, layer_type)
    rope_type = parameters.get("rope_type", parameters.get("type", "default")) or "default"
    require(rope_type in ROPE_TYPES,
            f"{family}: rope_parameters.rope_type={rope_type!r} is not supported; supported: {list(ROPE_TYPES)}.")
    keywords = {"layer_type": layer_type} if layer_type is not None and layer_type in hf_config.rope_parameters else {}
    if rope_type == "default":
        rotary_dim = int(head_dim_of(hf_config) * parameters.get("partial_rotary_factor", 1.0))
        inv_freq = default_inverse_frequencies(float(parameters["rope_theta"]), rotary_dim)
        return Rope(_floats(inv_freq), interleaved=interleaved)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **keywords)
    if rope_type != "longrope":
        return Rope(_floats(inv_freq.numpy()), float(factor), interleaved=interleaved)
    original = int(parameters["original_max_position_embeddings"])
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, seq_len=original + 1, **keywords)
    return Rope(_floats(inv_freq.numpy()), float(factor), _floats(long_inv_freq.numpy()), original, interleaved)


def _floats(values) -> tuple[float, ...]:
    return tuple(float(value) for value in np.asarray(values, np.float32))


def check_native_config(hf_config, family: str, activation_field: str | None = "hidden_act") -> None:
    """Refuses what no native family computes: dropout during training, an activation outside
    :data:`~adapters.model.native_decoder.ACTIVATIONS` (``activation_field=None``: the family's activation is fixed,
    whatever the config says), attention other than causal."""
    for name in DROPOUT_FIELDS:
        value = getattr(hf_config, name, 0.0) or 0.0
        require(float(value) == 0.0, f"{family}: {name}={value} is not supported (torchlike trains without dropout); "
                                     f"set {name}=0.0 in config.json.")
    activation = getattr(hf_config, activation_field, "silu") if activation_field else "silu"
    require(activation in ACTIVATIONS, f"{family}: {activation_field}={activation!r} is not supported; supported: "
                                       f"{sorted(ACTIVATIONS)}.")
    require(not getattr(hf_config, "use_bidirectional_attention", False),
            f"{family}: use_bidirectional_attention=True is not supported (causal attention only).")


def layer_windows(hf_config, family: str, sliding: Callable[[int], bool]) -> tuple[int | None, ...]:
    """Each layer's sliding window: ``config.sliding_window`` where ``sliding(layer)``, else ``None``."""
    window = getattr(hf_config, "sliding_window", None)
    windows = tuple(window if sliding(layer) else None for layer in range(hf_config.num_hidden_layers))
    require(all(w is None or w > 0 for w in windows), f"{family}: sliding_window={window} must be positive.")
    return windows


def layer_types_windows(hf_config, family: str) -> tuple[int | None, ...]:
    """Windows from ``config.layer_types`` (``"sliding_attention"`` layers slide; every other type is full)."""
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    require(not unknown, f"{family}: layer_types {unknown} are not supported (sliding_attention, full_attention).")
    require("sliding_attention" not in types or getattr(hf_config, "sliding_window", None) is not None,
            f"{family}: sliding_attention layers need config.sliding_window.")
    return layer_windows(hf_config, family, lambda layer: types[layer] == "sliding_attention")


def sizes(hf_config, dtype) -> dict[str, Any]:
    """The size fields of a :class:`DecoderSpec` every Llama-style config names alike."""
    return dict(num_layers=hf_config.num_hidden_layers, vocab_size=hf_config.vocab_size,
                hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
                num_heads=hf_config.num_attention_heads,
                num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                head_dim=head_dim_of(hf_config), tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                dtype=jnp.dtype(dtype))


def build_native_model(spec_from_config: Callable[[Any, Any], DecoderSpec], hf_config, dtype, rngs) -> NativeDecoder:
    """The native decoder of ``hf_config`` (``Family.build_model`` of a native family, bound with
    :func:`functools.partial`)."""
    return NativeDecoder(spec_from_config(hf_config, dtype), rngs=rngs)


def native_logits_from_hidden(module: NativeDecoder, hidden):
    """The native decoder's output head on final-norm hidden states (float32 logits)."""
    return module.head(hidden)


def native_family(name: str, model_types: tuple[str, ...], architectures: tuple[str, ...],
                  spec_from_config: Callable[[Any, Any], DecoderSpec], weights: tuple[WeightRule, ...],
                  lora_targets: Mapping[str, str], default_lora_targets: tuple[str, ...] | str = (),
                  ignored_hf_keys: tuple[str, ...] = (), **fields: Any) -> Family:
    """A :class:`Family` on the native decoder: ``spec_from_config(hf_config, dtype)`` builds its spec (and refuses
    what it cannot honour; ``fields`` may give a ``build_model`` of its own, e.g. reading a composite config's
    ``text_config``); the rest is the family table."""
    fields.setdefault("prompt_learning", True)  # the embedder is a table lookup; prefixes ride in the KV cache
    fields.setdefault("build_model", functools.partial(build_native_model, spec_from_config))
    return Family(name=name, model_types=model_types, architectures=architectures, weights=weights,
                  forward=decoder_forward,
                  hidden_states=decoder_hidden_states, logits_from_hidden=native_logits_from_hidden,
                  ignored_hf_keys=ignored_hf_keys, lora_targets=lora_targets,
                  default_lora_targets=default_lora_targets, **fields)


def linear_rows(hf_module: str, nnx_module: str, bias: bool = False) -> tuple[WeightRule, ...]:
    """The rows of one ``nn.Linear``: its weight (transposed to the NNX kernel) and, with ``bias``, its bias."""
    rows = (WeightRule(f"{hf_module}.weight", f"{nnx_module}.kernel", TRANSPOSED),)
    return rows + ((WeightRule(f"{hf_module}.bias", f"{nnx_module}.bias"),) if bias else ())


def norm_rows(hf_module: str, nnx_module: str, bias: bool = False) -> tuple[WeightRule, ...]:
    """The rows of one norm: ``weight`` is the NNX ``scale``, ``bias`` its ``bias``."""
    rows = (WeightRule(f"{hf_module}.weight", f"{nnx_module}.scale"),)
    return rows + ((WeightRule(f"{hf_module}.bias", f"{nnx_module}.bias"),) if bias else ())


LAYER, NNX_LAYER = "model.layers.{layer}", "layers.{layer}"


def llama_rows(attention_bias: bool = False, output_bias: bool = False, mlp_bias: bool = False,
               norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")) -> tuple[WeightRule, ...]:
    """The Llama-layout table on the native decoder (``model.embed_tokens``, ``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, the layer's ``norms``, ``model.norm``, ``lm_head``)."""
    rows = [WeightRule("model.embed_tokens.weight", "embedder.input_embedding")]
    for projection in ("q_proj", "k_proj", "v_proj"):
        rows += linear_rows(f"{LAYER}.self_attn.{projection}", f"{NNX_LAYER}.attn.{projection}", attention_bias)
    rows += linear_rows(f"{LAYER}.self_attn.o_proj", f"{NNX_LAYER}.attn.o_proj", output_bias)
    for projection in ("gate_proj", "up_proj", "down_proj"):
        rows += linear_rows(f"{LAYER}.mlp.{projection}", f"{NNX_LAYER}.mlp.{projection}", mlp_bias)
    for norm in norms:
        rows += norm_rows(f"{LAYER}.{norm}", f"{NNX_LAYER}.{norm}")
    rows += norm_rows("model.norm", "final_norm")
    rows += linear_rows("lm_head", "lm_head")
    return tuple(rows)


def lora_targets_of(attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                    mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
                    renamed: Mapping[str, str] | None = None) -> dict[str, str]:
    """HF module name -> NNX module regex for the native decoder's projections (``renamed``: HF name -> NNX name
    where they differ, e.g. GPT-NeoX's ``dense`` is the NNX ``o_proj``)."""
    renamed = dict(renamed or {})
    targets = {name: rf"layers/\d+/attn/{renamed.get(name, name)}" for name in attention}
    targets.update({name: rf"layers/\d+/mlp/{renamed.get(name, name)}" for name in mlp})
    return targets
