"""Cohere 2 / Command R7B (``Cohere2ForCausalLM``) on the native decoder: one LayerNorm (no bias) feeding attention and
MLP in parallel, interleaved rope on the sliding layers only (the full layers use no positions), a logit scale, tied
embeddings."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig
from .native import check_native_config, layer_types_windows, llama_rows, lora_targets_of, native_family, rope_of, sizes


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Cohere 2 config."""
    check_native_config(hf_config, "cohere2")
    windows = layer_types_windows(hf_config, "cohere2")
    rope = rope_of(hf_config, "cohere2", interleaved=True)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderSpec(**sizes(hf_config, dtype), ropes=tuple(rope if window is not None else None
                                                              for window in windows),
                       windows=windows, norm="layer", norm_eps=hf_config.layer_norm_eps,
                       block="parallel_shared_norm", activation=hf_config.hidden_act, attention_bias=bias,
                       output_bias=bias, logits_multiplier=float(hf_config.logit_scale))


# Every bias row is listed: a config without biases has no bias parameter for them to fill.
WEIGHTS = llama_rows(attention_bias=True, output_bias=True, norms=("input_layernorm",))

TINY_CONFIGS = {
    # Cohere 2: one norm for the parallel attention and MLP, interleaved rope on the sliding layers only (alternating
    # with full layers), a window of 8, the logit scale of Command R7B (0.25), tied embeddings.
    "cohere2": TinyConfig("Cohere2Config", dict(
        rope_theta=10000.0, sliding_window=8, logit_scale=0.25, layer_norm_eps=1e-5, tie_word_embeddings=True),
        alternating_layer_types=True),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="cohere2",
    model_types=("cohere2",),
    architectures=("Cohere2ForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    tiny_configs=TINY_CONFIGS,
)
