"""Qwen2 / Qwen2.5 (dense) <-> ``tunix.models.qwen2``."""

from __future__ import annotations

import functools

from tunix.models.qwen2 import model as tunix_qwen2

from ..model import paged_attention
from ..model.rope import rope_inverse_frequencies, sin_cos, with_rope
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
    WeightRule("model.layers.{layer}.self_attn.q_proj.bias", "layers.{layer}.attn.q_bias"),
    WeightRule("model.layers.{layer}.self_attn.k_proj.bias", "layers.{layer}.attn.k_bias"),
    WeightRule("model.layers.{layer}.self_attn.v_proj.bias", "layers.{layer}.attn.v_bias"),
)


def build_model(hf_config, dtype, rngs):
    """A Tunix ``Qwen2`` for ``hf_config``, with rope taken from ``config.rope_parameters``."""
    check_decoder_config(hf_config, "qwen2")
    require(not getattr(hf_config, "use_sliding_window", False),
            "qwen2: use_sliding_window=True is not supported by the Tunix Qwen2 model.")
    head_dim = head_dim_of(hf_config)
    config = tunix_qwen2.ModelConfig(
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
    inv_freq = rope_inverse_frequencies(hf_config.rope_parameters, head_dim)
    model_class = with_rope(tunix_qwen2.Qwen2, "__call__", "_generate_pos_embeddings", sin_cos, inv_freq)
    model = model_class(config, rngs=rngs)
    attention_class = attention_reading_pages(tunix_qwen2.Attention)
    for layer in model.layers:
        layer.attn.__class__ = attention_class
    return model


@functools.cache
def attention_reading_pages(cls: type) -> type:
    """Tunix Qwen2's attention ``cls`` whose ``block`` also takes the paged engine's cache entry
    (:func:`~..model.paged_attention.is_paged`): the fed token's query, key and value projected with their biases and
    rotated by the model's ``sin``/``cos`` as Tunix's ``block`` does, then :func:`~..model.paged_attention.attend` (the
    key and value written to their page, the row's pages read in place). Any other cache runs Tunix's ``block``. Keeps
    the class name; cached and registered for pickled abstract models."""

    def paged_block(self, x, cache, attn_mask, sin, cos, *_):
        dtype = self.config.dtype
        query, key, value = (projection(x) for projection in (self.q_proj, self.k_proj, self.v_proj))
        query = query + self.q_bias.astype(dtype).reshape(query.shape[2:])
        key = key + self.k_bias.astype(dtype).reshape(key.shape[2:])
        value = value + self.v_bias.astype(dtype).reshape(value.shape[2:])
        query = tunix_qwen2.apply_rotary_embedding(query, sin, cos)
        key = tunix_qwen2.apply_rotary_embedding(key, sin, cos)
        out, cache = paged_attention.attend(query, key, value, cache, scale=self.scale)
        return cache, self.o_proj(out)

    return paged_attention.reading_pages_subclass(cls, paged_block, 1, attention_reading_pages, (cls,))



def logits_from_hidden(module, hidden):
    """Tunix Qwen2's output head on final-norm hidden states (its ``__call__`` after ``final_norm``), float32."""
    return head_logits(module, hidden, tied=module.config.use_tied_embedding)


TINY_CONFIGS = {
    "qwen2": TinyConfig("Qwen2Config", dict(rope_theta=10000.0, tie_word_embeddings=False)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=decoder_forward,
    hidden_states=decoder_hidden_states,
    logits_from_hidden=logits_from_hidden,
    ignored_hf_keys=DECODER_IGNORED_KEYS,
    lora_targets=DECODER_LORA_TARGETS,
    default_lora_targets=("q_proj", "v_proj"),  # PEFT's default for model_type "qwen2"
    # Tunix's attention Einsum cannot take Qwix's quantised weights (see adapters.upstream).
    quantization_excluded=("q_proj", "k_proj", "v_proj", "o_proj"),
    sequence_classification={"qwen2": "Qwen2ForSequenceClassification"},
    prompt_learning=True,
    tiny_configs=TINY_CONFIGS,
)
