"""SmolLM3 (``SmolLM3ForCausalLM``) on the native decoder: the Llama layout with layers that skip the rotary embedding
(``no_rope_layers``: 0 for a NoPE layer) and optional sliding layers."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig, require
from .native import check_native_config, layer_types_windows, llama_rows, lora_targets_of, native_family, rope_of, sizes


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a SmolLM3 config."""
    check_native_config(hf_config, "smollm3")
    layers = hf_config.num_hidden_layers
    uses_rope = list(hf_config.no_rope_layers or [1] * layers)
    require(len(uses_rope) >= layers, f"smollm3: no_rope_layers has {len(uses_rope)} entries for {layers} layers.")
    rope = rope_of(hf_config, "smollm3")
    bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderSpec(**sizes(hf_config, dtype), ropes=tuple(rope if uses_rope[layer] else None
                                                              for layer in range(layers)),
                       windows=layer_types_windows(hf_config, "smollm3"), norm_eps=hf_config.rms_norm_eps,
                       activation=hf_config.hidden_act, attention_bias=bias, output_bias=bias,
                       mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))



# Every bias row is listed: a config without biases has no bias parameter for them to fill.
WEIGHTS = llama_rows(attention_bias=True, output_bias=True, mlp_bias=True)

TINY_CONFIGS = {
    # SmolLM3: the second layer without rope (no_rope_layers), tied embeddings.
    "smollm3": TinyConfig("SmolLM3Config", dict(rope_theta=10000.0, no_rope_layers=[1, 0], tie_word_embeddings=True)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="smollm3",
    model_types=("smollm3",),
    architectures=("SmolLM3ForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    sequence_classification={"smollm3": "SmolLM3ForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
