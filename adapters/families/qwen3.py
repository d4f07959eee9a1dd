"""Qwen3 (dense) <-> ``tunix.models.qwen3``, with the config's ``rope_theta`` honoured."""

from __future__ import annotations

from tunix.models.qwen3 import model as tunix_qwen3

from ..model.rope import attention_with_rope
from .base import (
    DECODER_IGNORED_KEYS,
    DECODER_LORA_TARGETS,
    DECODER_WEIGHTS,
    Family,
    TinyConfig,
    WeightRule,
    check_decoder_config,
    decoder_forward,
    decoder_hidden_states,
    head_dim_of,
    head_logits,
    require,
)

WEIGHTS = DECODER_WEIGHTS + (
    WeightRule("model.layers.{layer}.self_attn.q_norm.weight", "layers.{layer}.attn.q_norm.w"),
    WeightRule("model.layers.{layer}.self_attn.k_norm.weight", "layers.{layer}.attn.k_norm.w"),
)


def build_model(hf_config, dtype, rngs):
    """A Tunix ``Qwen3`` whose attention uses the checkpoint's rope (see ``adapters.upstream``)."""
    check_decoder_config(hf_config, "qwen3")
    require(not getattr(hf_config, "attention_bias", False), "qwen3: attention_bias=True is not supported.")
    require(not getattr(hf_config, "use_sliding_window", False),
            "qwen3: use_sliding_window=True is not supported by the Tunix Qwen3 model.")
    head_dim = head_dim_of(hf_config)
    config = tunix_qwen3.ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        embed_dim=hf_config.hidden_size,
        hidden_dim=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        head_dim=head_dim,
        num_kv_heads=hf_config.num_key_value_heads,
        rope_theta=hf_config.rope_parameters["rope_theta"],
        norm_eps=hf_config.rms_norm_eps,
        use_tied_embedding=bool(hf_config.tie_word_embeddings),
        dtype=dtype,
        param_dtype=dtype,
    )
    model = tunix_qwen3.Qwen3(config, rngs=rngs)
    attention_class = attention_with_rope(tunix_qwen3.Attention, hf_config.rope_parameters, head_dim, pages=True)
    for layer in model.layers:
        layer.attn.__class__ = attention_class
    return model



def logits_from_hidden(module, hidden):
    """Tunix Qwen3's output head on final-norm hidden states (its ``__call__`` after ``final_norm``), float32."""
    return head_logits(module, hidden, tied=module.config.use_tied_embedding)


TINY_CONFIGS = {
    "qwen3": TinyConfig("Qwen3Config", dict(rope_theta=10000.0, tie_word_embeddings=False)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    lora_targets=DECODER_LORA_TARGETS,
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "qwen3"
    # Tunix's attention Einsum cannot take Qwix's quantised weights (see adapters.upstream).
    quantization_excluded=("q_proj", "k_proj", "v_proj", "o_proj"),
    sequence_classification={"qwen3": "Qwen3ForSequenceClassification"},
    prompt_learning=True,
    tiny_configs=TINY_CONFIGS,
)
