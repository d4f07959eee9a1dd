"""Ministral (``MinistralForCausalLM``): Mistral's decoder with sliding and full layers by ``layer_types``; PEFT has no
default targets for it."""

from __future__ import annotations

import dataclasses

from .base import TinyConfig
from .mistral import FAMILY as MISTRAL

TINY_CONFIGS = {
    "ministral": TinyConfig("MinistralConfig", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False),
                            alternating_layer_types=True),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = dataclasses.replace(MISTRAL, name="ministral", model_types=("ministral",),
                             architectures=("MinistralForCausalLM",), default_lora_targets=(),
                             sequence_classification={"ministral": "MinistralForSequenceClassification"},
                             tiny_configs=TINY_CONFIGS)
