"""LFM2 (``Lfm2ForCausalLM``) on the native decoder: a hybrid of short-convolution layers
(:mod:`adapters.model.short_conv`) and grouped-query attention layers with per-head query and key RMS norms
(``q_layernorm``, ``k_layernorm``; the output projection is ``out_proj``), in the order of ``config.layer_types``; each
followed by a SiLU-gated MLP (``feed_forward.w1``/``w3``/``w2``, its width adjusted as ``transformers``' ``Lfm2MLP``
adjusts it). ``operator_norm`` and ``ffn_norm`` are the layer's two norms; ``model.embedding_norm`` is the final norm,
applied after the last layer despite its name.
"""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from ..model.short_conv import ShortConvSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig, WeightRule, require
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    linear_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    rope_parameters_of,
    sizes,
)
from .qwen3_next import DEPTHWISE_CONV_WEIGHT

LAYER_TYPES = {"conv": "conv", "full_attention": "attention"}
"""``config.layer_types`` -> the native decoder's layer types (``"conv"`` is the short convolution's)."""


def layer_types(hf_config) -> tuple[str, ...]:
    """The native layer types of ``config.layer_types``, checked."""
    types = list(hf_config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    require(not unknown, f"lfm2: layer_types {unknown} are not supported; supported: {sorted(LAYER_TYPES)}.")
    require(len(types) == hf_config.num_hidden_layers,
            f"lfm2: layer_types has {len(types)} entries for num_hidden_layers={hf_config.num_hidden_layers}.")
    return tuple(LAYER_TYPES[kind] for kind in types)


def feed_forward_size(hf_config) -> int:
    """The MLP width ``transformers``' ``Lfm2MLP`` builds: ``intermediate_size``, or with ``block_auto_adjust_ff_dim``
    ``int(2 * intermediate_size / 3)`` times ``block_ffn_dim_multiplier``, rounded up to a multiple of
    ``block_multiple_of``."""
    if not hf_config.block_auto_adjust_ff_dim:
        return hf_config.intermediate_size
    size = int(hf_config.block_ffn_dim_multiplier * int(2 * hf_config.intermediate_size / 3))
    multiple = hf_config.block_multiple_of
    return multiple * ((size + multiple - 1) // multiple)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of an LFM2 config.

    Raises:
        UnsupportedConfigError: a layer type other than ``conv`` and ``full_attention``, a ``partial_rotary_factor``
            (``transformers``' LFM2 rotates every feature of a head), a rope type the native decoder lacks, or a
            convolution without taps (``conv_L_cache < 1``), each named with its field.
    """
    check_native_config(hf_config, "lfm2", activation_field=None)  # Lfm2MLP is SiLU-gated whatever the config says
    types = layer_types(hf_config)
    partial = rope_parameters_of(hf_config).get("partial_rotary_factor", 1.0)
    require(partial in (None, 1.0), f"lfm2: rope_parameters.partial_rotary_factor={partial} is not supported: "
                                    f"transformers' LFM2 rotates every feature of a head; remove it.")
    require(hf_config.conv_L_cache >= 1, f"lfm2: conv_L_cache={hf_config.conv_L_cache} must be at least 1.")
    layers = hf_config.num_hidden_layers
    fields = sizes(hf_config, dtype) | {"intermediate_size": feed_forward_size(hf_config)}
    return DecoderSpec(**fields, ropes=(rope_of(hf_config, "lfm2"),) * layers, windows=(None,) * layers,
                       norm_eps=hf_config.norm_eps, qk_norm="head", output_name="out_proj", layer_types=types,
                       recurrent_mixers=(("conv", ShortConvSpec(kernel=hf_config.conv_L_cache,
                                                                bias=bool(hf_config.conv_bias))),))


ATTENTION, NNX_ATTENTION = f"{LAYER}.self_attn", f"{NNX_LAYER}.attn"
CONV, NNX_CONV = f"{LAYER}.conv", f"{NNX_LAYER}.conv"
FEED_FORWARD = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""``Lfm2MLP``'s projections -> the native MLP's."""


def _rows() -> tuple[WeightRule, ...]:
    rows = [WeightRule("model.embed_tokens.weight", "embedder.input_embedding")]
    for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
        rows += linear_rows(f"{ATTENTION}.{projection}", f"{NNX_ATTENTION}.{projection}")
    rows += norm_rows(f"{ATTENTION}.q_layernorm", f"{NNX_ATTENTION}.q_norm")
    rows += norm_rows(f"{ATTENTION}.k_layernorm", f"{NNX_ATTENTION}.k_norm")
    # Every bias row is listed: a config without conv_bias has no bias parameter for them to fill.
    for projection in ("in_proj", "out_proj"):
        rows += linear_rows(f"{CONV}.{projection}", f"{NNX_CONV}.{projection}", bias=True)
    rows += [WeightRule(f"{CONV}.conv.weight", f"{NNX_CONV}.conv.weight", DEPTHWISE_CONV_WEIGHT),
             WeightRule(f"{CONV}.conv.bias", f"{NNX_CONV}.conv.bias")]
    for hf_name, nnx_name in FEED_FORWARD.items():
        rows += linear_rows(f"{LAYER}.feed_forward.{hf_name}", f"{NNX_LAYER}.mlp.{nnx_name}")
    rows += norm_rows(f"{LAYER}.operator_norm", f"{NNX_LAYER}.input_layernorm")
    rows += norm_rows(f"{LAYER}.ffn_norm", f"{NNX_LAYER}.post_attention_layernorm")
    rows += norm_rows("model.embedding_norm", "final_norm")
    rows += linear_rows("lm_head", "lm_head")
    return tuple(rows)


WEIGHTS = _rows()

LORA_TARGETS = lora_targets_of(attention=("q_proj", "k_proj", "v_proj"), mlp=tuple(FEED_FORWARD),
                               renamed=FEED_FORWARD) | {
    "in_proj": r"layers/\d+/conv/in_proj", "out_proj": r"layers/\d+/(attn|conv)/out_proj"}
"""HF module names LoRA adapts: the attention projections (``out_proj`` is also the short convolution's), the short
convolution's ``in_proj`` and the MLP's ``w1``/``w3``/``w2``. The depthwise ``conv`` is an ``nn.Conv1d``, not adapted
(naming it is refused as matching no module). PEFT has no default targets for ``lfm2``, so none are defaulted."""

TINY_CONFIGS = {
    # Short convolution, attention, short convolution (3 taps, no biases: the published models' setting); the MLP
    # width adjusted (128 -> int(2 * 128 / 3) = 85 -> a multiple of 32: 96); tied embeddings, as published.
    "lfm2": TinyConfig("Lfm2Config", dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                          conv_L_cache=3, conv_bias=False, block_multiple_of=32, norm_eps=1e-5)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="lfm2",
    model_types=("lfm2",),
    architectures=("Lfm2ForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    tiny_configs=TINY_CONFIGS,
)
