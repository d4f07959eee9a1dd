"""OLMo 2 and OLMo 3 (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``) on the native decoder: norms after the attention and
the MLP instead of before (no input norm), RMS norms over the whole query and key projections, and OLMo 3's sliding
layers (``layer_types``)."""

from __future__ import annotations

from ..model.native_decoder import DecoderSpec
from .base import DECODER_IGNORED_KEYS, TinyConfig
from .native import (
    LAYER,
    NNX_LAYER,
    check_native_config,
    layer_types_windows,
    llama_rows,
    lora_targets_of,
    native_family,
    norm_rows,
    rope_of,
    sizes,
)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of an OLMo 2 or OLMo 3 config."""
    family = hf_config.model_type
    check_native_config(hf_config, family)
    rope = rope_of(hf_config, family)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderSpec(**sizes(hf_config, dtype), ropes=(rope,) * hf_config.num_hidden_layers,
                       windows=layer_types_windows(hf_config, family), norm_eps=hf_config.rms_norm_eps,
                       block="post_norm", qk_norm="projection", activation=hf_config.hidden_act,
                       attention_bias=bias, output_bias=bias)



def export_config(config: dict) -> dict:
    """OLMo 3's ``config.json`` with its flat ``rope_parameters`` also written per layer type: later ``transformers``
    (and so vLLM) read OLMo 3's rope per layer type and take a flat one for a different ``rope_theta``; the flat keys
    stay for the ``transformers`` pinned here."""
    rope = config.get("rope_parameters")
    if config.get("model_type") != "olmo3" or not isinstance(rope, dict) or "rope_theta" not in rope:
        return config
    flat = {key: value for key, value in rope.items() if not isinstance(value, dict)}
    per_type = {layer_type: dict(flat) for layer_type in set(config.get("layer_types") or ())}
    return {**config, "rope_parameters": {**rope, **per_type}}


# Every bias row is listed: a config without biases has no bias parameter for them to fill.
WEIGHTS = llama_rows(attention_bias=True, output_bias=True,
                     norms=("post_attention_layernorm", "post_feedforward_layernorm")) + norm_rows(
    f"{LAYER}.self_attn.q_norm", f"{NNX_LAYER}.attn.q_norm") + norm_rows(
    f"{LAYER}.self_attn.k_norm", f"{NNX_LAYER}.attn.k_norm")

TINY_CONFIGS = {
    # OLMo 2: norms after attention and MLP, query/key norms over the whole projections.
    "olmo2": TinyConfig("Olmo2Config", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    # OLMo 3: OLMo 2 with sliding and full layers taking turns.
    "olmo3": TinyConfig("Olmo3Config", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False),
                        alternating_layer_types=True),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name="olmo2",
    model_types=("olmo2", "olmo3"),
    architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=lora_targets_of(),
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    export_config=export_config,
    sequence_classification={"olmo2": "Olmo2ForSequenceClassification", "olmo3": "Olmo3ForSequenceClassification"},
    tiny_configs=TINY_CONFIGS,
)
