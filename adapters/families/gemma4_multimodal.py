"""Gemma 4 as Google publishes it (``Gemma4ForConditionalGeneration``): the Gemma 4 text decoder (:mod:`.gemma4`)
under ``model.language_model.``, with the vision and audio towers passed through.

Tunix 0.1.7 has no Gemma 4 vision or audio encoder, so their tensors (``model.vision_tower.``, ``model.embed_vision.``,
``model.audio_tower.``, ``model.embed_audio.``) are kept as they are beside the module and written back unchanged on
export (``Family.kept_hf_keys``); image and audio inputs are refused with that reason.
"""

from __future__ import annotations

from flax import nnx

from . import gemma4
from .base import Family, reprefixed

TEXT_PREFIX = "model.language_model."
"""Where Gemma 4 checkpoints keep the text decoder (``model.`` of ``Gemma4ForCausalLM``)."""

WEIGHTS = reprefixed(gemma4.TEXT_WEIGHTS, "model.", TEXT_PREFIX, aliases=("model.",))
"""The text decoder's rows, also read under a text-only checkpoint's names (which load leniently into this model)."""

KEPT_KEYS: tuple[str, ...] = (r"model\.vision_tower\..*", r"model\.embed_vision\..*", r"model\.audio_tower\..*",
                              r"model\.embed_audio\..*")

NO_VISION_ENCODER = ("Tunix 0.1.7 has no Gemma 4 vision or audio encoder, so torchlike runs the Gemma 4 text decoder "
                     "only; its vision and audio weights are kept and saved back unchanged")


def build_model(hf_config, dtype, rngs: nnx.Rngs):
    """The Gemma 4 text decoder of a ``Gemma4Config`` (:func:`.gemma4.build_model` on its ``text_config``)."""
    return gemma4.build_model(hf_config.text_config, dtype, rngs)


FAMILY = Family(
    name="gemma4_multimodal",
    model_types=("gemma4",),
    architectures=("Gemma4ForConditionalGeneration",),
    weights=WEIGHTS,
    build_model=build_model,
    forward=gemma4.FAMILY.forward,
    hidden_states=gemma4.FAMILY.hidden_states,
    logits_from_hidden=gemma4.logits_from_hidden,
    ignored_hf_keys=gemma4.FAMILY.ignored_hf_keys,
    lora_targets=gemma4.FAMILY.lora_targets,
    default_lora_targets=r".*language_model\..*\.(q_proj|v_proj)",  # PEFT's default for model_type "gemma4"
    quantization_excluded=gemma4.FAMILY.quantization_excluded,
    kept_hf_keys=KEPT_KEYS,
    no_images_reason=NO_VISION_ENCODER,
    decoder="gemma4",
)
