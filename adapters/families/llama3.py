"""Llama 3 / 3.1 / 3.2 <-> ``tunix.models.llama3``, with ``rope_theta`` and ``llama3`` rope scaling implemented."""

from __future__ import annotations

from tunix.models.llama3 import model as tunix_llama3

from ..model.rope import attention_with_rope
from .base import (
    DECODER_IGNORED_KEYS,
    DECODER_LORA_TARGETS,
    DECODER_WEIGHTS,
    Family,
    TinyConfig,
    check_decoder_config,
    decoder_forward,
    decoder_hidden_states,
    head_dim_of,
    head_logits,
    require,
)


def build_model(hf_config, dtype, rngs):
    """A Tunix ``Llama3`` whose attention uses the checkpoint's rope (theta and ``llama3`` scaling)."""
    check_decoder_config(hf_config, "llama")
    require(not getattr(hf_config, "attention_bias", False), "llama: attention_bias=True is not supported.")
    head_dim = head_dim_of(hf_config)
    config = tunix_llama3.ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        embed_dim=hf_config.hidden_size,
        hidden_dim=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        head_dim=head_dim,
        num_kv_heads=hf_config.num_key_value_heads,
        rope_theta=hf_config.rope_parameters["rope_theta"],
        norm_eps=hf_config.rms_norm_eps,
        weight_tying=bool(hf_config.tie_word_embeddings),
    )
    model = tunix_llama3.Llama3(config, rngs=rngs)
    attention_class = attention_with_rope(tunix_llama3.Attention, hf_config.rope_parameters, head_dim, pages=True)
    for layer in model.layers:
        layer.attn.__class__ = attention_class
    return model



def logits_from_hidden(module, hidden):
    """Tunix Llama3's output head on final-norm hidden states (its ``__call__`` after ``final_norm``), float32."""
    return head_logits(module, hidden, tied=module.config.weight_tying)


LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
TINY_CONFIGS = {
    "llama3": TinyConfig("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=False)),
    # Llama 3.2: Llama 3's scaled rope and tied embeddings.
    "llama32": TinyConfig("LlamaConfig", dict(rope_parameters=LLAMA32_ROPE, tie_word_embeddings=True)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="llama3",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    weights=DECODER_WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    lora_targets=DECODER_LORA_TARGETS,
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "llama"
    sequence_classification={"llama": "LlamaForSequenceClassification"},
    prompt_learning=True,
    tiny_configs=TINY_CONFIGS,
)
