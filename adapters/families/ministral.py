"""Ministral (``MinistralForCausalLM``): Mistral's decoder with sliding and full layers by ``layer_types``; PEFT has no
default targets for it."""

from __future__ import annotations

import dataclasses

from .mistral import FAMILY as MISTRAL

FAMILY = dataclasses.replace(MISTRAL, name="ministral", model_types=("ministral",),
                             architectures=("MinistralForCausalLM",), default_lora_targets=(),
                             sequence_classification={"ministral": "MinistralForSequenceClassification"})
