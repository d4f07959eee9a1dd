"""Gemma 4 as Google publishes it (``Gemma4ForConditionalGeneration``): the Gemma 4 text decoder (:mod:`.gemma4`)
under ``model.language_model.``, its vision encoder and ``embed_vision`` (:mod:`adapters.model.gemma4_vision`) under
``model.vision_tower.`` and ``model.embed_vision.``, and the audio tower passed through.

Tunix 0.1.7 has no Gemma 4 audio encoder, so its tensors (``model.audio_tower.``, ``model.embed_audio.``) are kept as
they are beside the module and written back unchanged on export (``Family.kept_hf_keys``); audio inputs are refused
with that reason. A checkpoint without a ``vision_config`` runs its text decoder only and refuses images.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.gemma4_vision import (
    Gemma4VisionModel,
    Gemma4VisionSpec,
    MultimodalEmbedder,
    image_features_in_place,
)
from ..model.native_decoder import ACTIVATIONS
from . import gemma4
from .base import TRANSPOSED, Family, WeightRule, images_by_row, reprefixed, require

TEXT_PREFIX = "model.language_model."
"""Where Gemma 4 checkpoints keep the text decoder (``model.`` of ``Gemma4ForCausalLM``)."""
VISION_PREFIX = "model.vision_tower."
EMBED_VISION_PREFIX = "model.embed_vision."

_CLIPPED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _vision_rows() -> tuple[WeightRule, ...]:
    """The encoder's and ``embed_vision``'s tensors <-> :class:`~adapters.model.gemma4_vision.Gemma4VisionModel`
    (``vision_tower``) and :class:`~adapters.model.gemma4_vision.MultimodalEmbedder` (``embed_vision``), named alike."""
    layer, nnx_layer = f"{VISION_PREFIX}encoder.layers.{{layer}}", "vision_tower.encoder.layers.{layer}"
    rows = [WeightRule(f"{VISION_PREFIX}patch_embedder.input_proj.weight",
                       "vision_tower.patch_embedder.input_proj.kernel", TRANSPOSED),
            WeightRule(f"{VISION_PREFIX}patch_embedder.position_embedding_table",
                       "vision_tower.patch_embedder.position_embedding_table"),
            WeightRule(f"{VISION_PREFIX}std_bias", "vision_tower.std_bias"),
            WeightRule(f"{VISION_PREFIX}std_scale", "vision_tower.std_scale"),
            WeightRule(f"{EMBED_VISION_PREFIX}embedding_projection.weight", "embed_vision.embedding_projection.kernel",
                       TRANSPOSED)]
    for module in _CLIPPED:
        rows.append(WeightRule(f"{layer}.{module}.linear.weight", f"{nnx_layer}.{module}.linear.kernel", TRANSPOSED))
        rows += [WeightRule(f"{layer}.{module}.{bound}", f"{nnx_layer}.{module}.{bound}") for bound in _CLIP_BOUNDS]
    for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        rows.append(WeightRule(f"{layer}.{norm}.weight", f"{nnx_layer}.{norm}.scale"))
    return tuple(rows)


WEIGHTS = reprefixed(gemma4.TEXT_WEIGHTS, "model.", TEXT_PREFIX, aliases=("model.",)) + _vision_rows()
"""The text decoder's rows (also read under a text-only checkpoint's names, which load leniently into this model)
and the vision rows."""

KEPT_KEYS: tuple[str, ...] = (r"model\.audio_tower\..*", r"model\.embed_audio\..*")
"""Tunix 0.1.7 has no Gemma 4 audio encoder and torchlike builds none: the audio tower and ``embed_audio`` are kept as
they are and saved back unchanged; ``input_features`` are refused by name."""
TEXT_ONLY_KEPT_KEYS: tuple[str, ...] = (r"model\.vision_tower\..*", r"model\.embed_vision\..*")
"""A config without ``vision_config`` has no vision tower to fill; tensors under its names are kept as they are."""

NO_AUDIO_ENCODER = ("Tunix 0.1.7 has no Gemma 4 audio encoder and torchlike builds none (the audio tower's weights are "
                    "kept and saved back unchanged); pass text and images")

NO_VISION_CONFIG = ("this Gemma 4 checkpoint has no vision_config (no vision tower), so it runs its text decoder "
                    "only")

LORA_TARGETS = {
    **gemma4.LORA_TARGETS,
    # Gemma4ClippableLinear wraps the tower's nn.Linear as ".linear", the module PEFT adapts.
    "linear": r"vision_tower/encoder/layers/\d+/(self_attn|mlp)/\w+/linear",
    "embedding_projection": "embed_vision/embedding_projection",
    "input_proj": "vision_tower/patch_embedder/input_proj",
}


def image_token_id(hf_config) -> int:
    """The placeholder id the soft tokens replace (``image_token_id``)."""
    return int(hf_config.image_token_id)


def vision_spec(hf_config, dtype) -> Gemma4VisionSpec:
    """The encoder's spec of a ``Gemma4Config``'s ``vision_config``.

    Raises:
        UnsupportedConfigError: a vision config the modules compute differently from ``transformers`` (named).
    """
    vision = hf_config.vision_config
    require(vision.hidden_activation in ACTIVATIONS,
            f"gemma4: vision_config.hidden_activation={vision.hidden_activation!r} is not supported; supported: "
            f"{sorted(ACTIVATIONS)}.")
    rope = vision.rope_parameters or {}
    require(rope.get("rope_type", "default") == "default",
            f"gemma4: vision_config.rope_parameters rope_type={rope.get('rope_type')!r} is not supported (the "
            "vision encoder's 2-D rope is 'default').")
    require(vision.head_dim % 4 == 0, f"gemma4: vision_config.head_dim={vision.head_dim} must be a multiple of 4 (the "
                                      "2-D rope rotates a half of each head per image axis).")
    require(vision.num_attention_heads % vision.num_key_value_heads == 0,
            f"gemma4: vision_config.num_attention_heads={vision.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={vision.num_key_value_heads}.")
    require(vision.pooling_kernel_size >= 2,
            f"gemma4: vision_config.pooling_kernel_size={vision.pooling_kernel_size} is not supported; transformers "
            "pools patches into soft tokens with a kernel of 2 or more (Google's checkpoints use 3).")
    require(not vision.attention_bias, "gemma4: vision_config.attention_bias=True is not supported (transformers' "
                                       "vision projections have no bias).")
    return Gemma4VisionSpec(
        width=vision.hidden_size, num_heads=vision.num_attention_heads, num_kv_heads=vision.num_key_value_heads,
        head_dim=vision.head_dim, intermediate_size=vision.intermediate_size, blocks=vision.num_hidden_layers,
        patch_size=vision.patch_size, position_embedding_size=vision.position_embedding_size,
        pooling_kernel_size=vision.pooling_kernel_size, rope_theta=float(rope.get("rope_theta", 100.0)),
        norm_eps=float(vision.rms_norm_eps), activation=vision.hidden_activation,
        clipped_linears=bool(vision.use_clipped_linears), standardize=bool(vision.standardize),
        text_hidden_size=hf_config.text_config.hidden_size, image_token_id=image_token_id(hf_config),
        dtype=jnp.dtype(dtype))


class Gemma4MultimodalDecoder(gemma4.Gemma4Decoder):
    """:class:`.gemma4.Gemma4Decoder` with the vision encoder (``vision_tower``) and ``embed_vision``: a call with
    ``images`` (:func:`images`) runs ``transformers``' ``Gemma4Model.forward``: the image, video and audio tokens are
    embedded as the pad token, for the input embeddings and the per-layer inputs alike; each row's soft tokens then
    replace its image tokens, in order, and the per-layer inputs' projection reads the embeddings with the images in
    place. A call without images is the text decoder's."""

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, cache: dict | None = None,
                 attention_mask: jax.Array | None = None, decode_only_last_token: bool = False,
                 segment_ids: jax.Array | None = None, images: dict | None = None
                 ) -> tuple[jax.Array, dict | None]:
        if images is None:
            return super().__call__(tokens, positions, cache, attention_mask, decode_only_last_token, segment_ids)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
        placeholders = jnp.isin(tokens, jnp.asarray(self.placeholder_ids, tokens.dtype))
        text_tokens = jnp.where(placeholders, self.pad_token_id, tokens)
        x = self.embedder.encode(text_tokens)
        patches = images["patches"]
        batch, slots = patches.shape[:2]
        flat = lambda array: array.reshape(batch * slots, *array.shape[2:])  # noqa: E731
        features, real = self.vision_tower(flat(patches), flat(images["positions"]), flat(images["patch_mask"]))
        features = self.embed_vision(features)
        x = image_features_in_place(x, tokens == self.vision_tower.spec.image_token_id,
                                    features.reshape(batch, -1, features.shape[-1]), real.reshape(batch, -1))
        per_layer_inputs = (self.embedder.encode_per_layer_input(x, text_tokens)
                            if self.config.per_layer_input_dim > 0 else None)
        return self.decode_embeddings(x, per_layer_inputs, positions, cache, attention_mask, decode_only_last_token)

    def get_model_input(self) -> dict:
        """Qwix's tracing call with one image of one pooled cell per row, so the encoder and ``embed_vision`` run."""
        inputs = super().get_model_input()
        spec = self.vision_tower.spec
        patches = spec.pooling_kernel_size ** 2
        inputs["tokens"] = jnp.full((2, 1), spec.image_token_id, jnp.int32)
        inputs["positions"] = jnp.zeros((2, 1), jnp.int32)
        inputs["attention_mask"] = jnp.ones((2, 1, 1), jnp.bool_)
        side = jnp.arange(spec.pooling_kernel_size, dtype=jnp.int32)
        grid = jnp.stack(jnp.meshgrid(side, side, indexing="xy"), axis=-1).reshape(patches, 2)
        inputs["images"] = {"patches": jnp.zeros((2, 1, patches, spec.patch_values), jnp.float32),
                            "positions": jnp.broadcast_to(grid, (2, 1, patches, 2)),
                            "patch_mask": jnp.ones((2, 1, patches), jnp.bool_)}
        return inputs


def images_attend_both_ways(hf_config) -> bool:
    """Whether each image's tokens attend to each other both ways (``text_config.use_bidirectional_attention`` is
    ``"vision"``, as in the larger Gemma 4 checkpoints; transformers reads the blocks from ``mm_token_type_ids``)."""
    return getattr(hf_config.text_config, "use_bidirectional_attention", None) == "vision"


def _check_multimodal_config(hf_config) -> None:
    """Refuses what the multimodal model computes differently from ``transformers``' ``Gemma4Model``."""
    both_ways = hf_config.text_config.use_bidirectional_attention
    require(both_ways is None or (both_ways == "vision" and hf_config.vision_config is not None),
            f"gemma4: text_config.use_bidirectional_attention={both_ways!r} is not supported: only None (causal "
            "attention, as Gemma 4 E2B/E4B) and 'vision' with a vision tower (each image's tokens attending to each "
            "other both ways) are.")
    require(hf_config.text_config.pad_token_id is not None,
            "gemma4: text_config.pad_token_id is None; transformers embeds image tokens as the pad token, so the "
            "config must name one.")


def build_model(hf_config, dtype, rngs: nnx.Rngs) -> gemma4.Gemma4Decoder:
    """The Gemma 4 text decoder of a ``Gemma4Config`` (:func:`.gemma4.build_model` on its ``text_config``) with,
    when the config has a ``vision_config``, the vision encoder and ``embed_vision``.

    Raises:
        UnsupportedConfigError: what :func:`.gemma4.build_model` or :func:`vision_spec` refuses, or bidirectional
            attention over images.
    """
    _check_multimodal_config(hf_config)
    model = gemma4.build_model(hf_config.text_config, dtype, rngs, images_attend_both_ways(hf_config))
    if hf_config.vision_config is None:
        return model
    spec = vision_spec(hf_config, dtype)
    model.__class__ = Gemma4MultimodalDecoder
    model.vision_tower = Gemma4VisionModel(spec, rngs)
    model.embed_vision = MultimodalEmbedder(spec, rngs)
    model.pad_token_id = int(hf_config.text_config.pad_token_id)
    model.placeholder_ids = tuple(int(token) for token in (hf_config.image_token_id, hf_config.video_token_id,
                                                            hf_config.audio_token_id) if token is not None)
    return model


def images(hf_config, input_ids: np.ndarray, pixel_values: np.ndarray | None,
           image_position_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Gemma 4's image processor outputs as the model takes them: each row's images as slots (``patches``,
    ``positions``, ``patch_mask``: :class:`~adapters.model.gemma4_vision.Gemma4VisionSpec`), zero slots after them.

    Args:
        input_ids: ``[B, T]``; a row's image tokens take its images' soft tokens, in order.
        pixel_values: ``[images, max_patches, 3 * patch_size ** 2]`` every image of the batch in token order, already
            cut into patches (values in ``[0, 1]``).
        image_position_ids: ``[images, max_patches, 2]`` each patch's ``(x, y)``, ``(-1, -1)`` for padding.

    Returns:
        ``patches`` float32, ``positions`` int32 and ``patch_mask`` bool, each with a ``[B, slots]`` lead.

    Raises:
        ValueError: a missing or ill-shaped input, positions beyond the position table, or image tokens that do not
            match the images' soft tokens (named).
    """
    if hf_config.vision_config is None:
        raise ValueError(f"pixel_values were given but the model cannot take images: {NO_VISION_CONFIG}.")
    spec = vision_spec(hf_config, jnp.float32)
    pixels = None if pixel_values is None else np.asarray(pixel_values, np.float32)
    if pixels is None or pixels.ndim != 3 or pixels.shape[-1] != spec.patch_values:
        raise ValueError(f"gemma4 takes pixel_values [images, max_patches, {spec.patch_values}] (patches of "
                         f"3 x {spec.patch_size} x {spec.patch_size} values) as its image processor returns them; got "
                         f"shape {np.shape(pixel_values)}.")
    if image_position_ids is None:
        raise ValueError("gemma4 needs image_position_ids with pixel_values (its image processor returns both): each "
                         "patch's (x, y) in its image, (-1, -1) for padding.")
    places = np.asarray(image_position_ids).astype(np.int64)
    if places.shape != (*pixels.shape[:2], 2):
        raise ValueError(f"image_position_ids has shape {places.shape}; pixel_values {pixels.shape} needs "
                         f"{(*pixels.shape[:2], 2)}.")
    kernel = spec.pooling_kernel_size
    if pixels.shape[1] % kernel ** 2:
        raise ValueError(f"pixel_values hold {pixels.shape[1]} patches per image, not a multiple of "
                         f"pooling_kernel_size ** 2 = {kernel ** 2}: pad them as the image processor does.")
    real = ~np.all(places == -1, axis=-1)
    if places[real].size and (places[real].min() < 0 or places[real].max() >= spec.position_embedding_size):
        raise ValueError(f"image_position_ids reach patch {int(places[real].max())} along a side but "
                         f"vision_config.position_embedding_size={spec.position_embedding_size}: resize the images "
                         "with the model's image processor.")
    # An image's soft tokens are the pooled cells holding one of its real patches.
    soft_tokens = [len({(x // kernel, y // kernel) for x, y in places[index][real[index]]})
                   for index in range(len(pixels))]
    window = hf_config.text_config.sliding_window
    if images_attend_both_ways(hf_config) and max(soft_tokens, default=0) > window:
        # Tunix's sliding layers keep keys within the window of each query, where transformers lets an image's
        # tokens see the whole image: equal as long as an image is no longer than the window.
        raise ValueError(f"an image of {max(soft_tokens)} soft tokens is longer than text_config.sliding_window="
                         f"{window}, across which its tokens would attend both ways (use_bidirectional_attention="
                         "'vision'); use fewer soft tokens per image (the image processor's max_soft_tokens).")
    rows = images_by_row(input_ids, spec.image_token_id, list(range(len(pixels))),
                         lambda index: soft_tokens[index], "<|image|>")
    slots = max([len(taken) for taken in rows] + [1])
    out = {"patches": np.zeros((len(rows), slots, *pixels.shape[1:]), np.float32),
           "positions": np.zeros((len(rows), slots, pixels.shape[1], 2), np.int32),
           "patch_mask": np.zeros((len(rows), slots, pixels.shape[1]), bool)}
    for row, taken in enumerate(rows):
        for slot, index in enumerate(taken):
            out["patches"][row, slot] = pixels[index]
            out["positions"][row, slot] = np.where(real[index][:, None], places[index], 0)
            out["patch_mask"][row, slot] = real[index]
    return out


def _text_only(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is None


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
    lora_targets=LORA_TARGETS,
    default_lora_targets=r".*language_model\..*\.(q_proj|v_proj)",  # PEFT's default for model_type "gemma4"
    quantization_excluded=gemma4.FAMILY.quantization_excluded,
    kept_hf_keys=KEPT_KEYS,
    config_kept_keys=lambda hf_config: TEXT_ONLY_KEPT_KEYS if _text_only(hf_config) else (),
    images=images,
    image_keys=("image_position_ids",),
    mm_types_attend_both_ways=images_attend_both_ways,
    refused_inputs={name: NO_AUDIO_ENCODER for name in ("input_features", "input_features_mask")},
    decoder="gemma4",
)
"""Gemma 4 (``Gemma4ForConditionalGeneration``) <-> the Tunix Gemma 4 text decoder (:mod:`.gemma4`) with the vision
encoder of :mod:`adapters.model.gemma4_vision`; the audio tower is kept."""
