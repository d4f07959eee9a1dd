"""Image prompts for the online trainers, as TRL's GRPO reads them: an ``images`` (or ``image``) column beside a
conversational ``prompt``, the images placed in the first user turn (:func:`.data_utils.prepare_multimodal_messages`)
and the prompt rendered and processed by the model's processor, so its ids carry the image tokens."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ...type_aliases import Processor
from ..data_utils import prepare_multimodal_messages
from .model_images import ModelImages
from .prompt_data import is_conversational_prompt, left_padded

__all__ = ["PIXEL_VALUES", "TOKEN_TYPES", "VISION_OUTPUTS", "prepare_vision_prompts", "row_images",
           "rows_vision_inputs"]

PIXEL_VALUES = "prompt_pixel_values"
"""A prepared row's column of its prompt's images, as the processor gives them (Gemma 3's ``[n, C, H, W]``, Qwen-VL's
patches)."""
VISION_OUTPUTS = "prompt_vision_outputs"
"""A prepared row's column of the processor's other vision outputs for its prompt (Qwen-VL's ``image_grid_thw``), by
name; ``{}`` where the processor gives none."""
_TEXT_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "pixel_values")
TOKEN_TYPES = "prompt_token_type_ids"
"""A prepared row's column of its prompt's token types (1 on image tokens)."""


def row_images(row: Mapping[str, Any]) -> list:
    """A dataset row's images: its ``images`` list, or its one ``image``, or none."""
    if row.get("images"):
        return list(row["images"])
    return [row["image"]] if row.get("image") is not None else []


def prepare_vision_prompts(dataset: Iterable[Mapping[str, Any]], processor: Processor, name: str,
                           chat_template_kwargs: Mapping[str, Any] | None = None) -> list[dict]:
    """Rows as dicts with ``prompt_ids``, :data:`TOKEN_TYPES` and :data:`PIXEL_VALUES` (``None`` for a row without
    images) beside the original columns.

    Args:
        dataset: rows with a conversational ``prompt`` and ``images`` or ``image``.
        processor: the model's ``transformers`` processor.
        name: the argument's name, for messages.
        chat_template_kwargs: extra arguments of ``apply_chat_template``.

    Raises:
        ValueError: a prompt that is not a list of messages (TRL places images in conversational prompts only), or
            no rows.
    """
    rows = []
    for index, row in enumerate(dataset):
        row = dict(row)
        if not is_conversational_prompt(row.get("prompt")):
            raise ValueError(f"{name} row {index}: a prompt with images must be a list of chat messages (TRL places "
                             "the images in the first user turn); got a plain string.")
        images = row_images(row)
        messages = prepare_multimodal_messages(row["prompt"], images)
        processed = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="np",
                                                  **dict(chat_template_kwargs or {}))
        ids = np.asarray(processed["input_ids"])[0]
        row["prompt_ids"] = ids.tolist()
        types = processed.get("token_type_ids")
        row[TOKEN_TYPES] = (np.zeros_like(ids) if types is None else np.asarray(types)[0]).tolist()
        row[PIXEL_VALUES] = np.asarray(processed["pixel_values"], np.float32) if images else None
        row[VISION_OUTPUTS] = {key: np.asarray(value) for key, value in processed.items()
                               if images and key not in _TEXT_OUTPUTS and value is not None}
        rows.append(row)
    if not rows:
        raise ValueError(f"{name} is empty.")
    return rows


def rows_vision_inputs(rows: list[Mapping[str, Any]], prompt_ids: np.ndarray, images_of: ModelImages, slots: int,
                       image_shape: tuple[int, int, int]) -> tuple[Any, np.ndarray]:
    """``(images, token types [N, P])`` of a generation batch's prompts, left-padded like ``prompt_ids`` ``[N, P]``:
    the images in ``slots`` per row ``[N, slots, H, W, C]``, or, for a model that reads more than the pixels
    (:attr:`ModelImages.keys`: Qwen-VL), the dict of per-row arrays its ``Family.images`` makes.

    Args:
        rows: the prepared rows (:func:`prepare_vision_prompts`), one per completion.
        prompt_ids: their left-padded prompt ids.
        images_of: the model's images (:class:`~.model_images.ModelImages`).
        slots: image slots per row (the most images any prompt has), so every batch has one shape.
        image_shape: ``(H, W, C)`` of the model's images (the slots of a batch without images are zeros).
    """
    types, _ = left_padded([list(row[TOKEN_TYPES]) for row in rows], prompt_ids.shape[1], 0)
    with_images = [row for row in rows if row.get(PIXEL_VALUES) is not None]
    pixels = _concatenated([np.asarray(row[PIXEL_VALUES], np.float32) for row in with_images]) if with_images \
        else None
    if images_of.keys:
        outputs = {key: np.concatenate([row[VISION_OUTPUTS][key] for row in with_images])
                   for key in images_of.keys if with_images and key in with_images[0].get(VISION_OUTPUTS, {})}
        return images_of(prompt_ids, pixels, **outputs), types.astype(np.int32)
    images = np.zeros((len(rows), max(slots, 1), *image_shape), np.float32)
    if pixels is not None:
        per_row = images_of(prompt_ids, pixels)
        images[:, :per_row.shape[1]] = per_row
    return images, types.astype(np.int32)


def _concatenated(pixels: list[np.ndarray]) -> np.ndarray:
    """The prompts' pixels one after the other; tiled images (LLaVA-NeXT's ``[n, tiles, C, H, W]``, each prompt
    padded to its own most tiles) padded with zero tiles to the most of all."""
    if pixels[0].ndim == 5:
        most = max(array.shape[1] for array in pixels)
        pixels = [np.pad(array, ((0, 0), (0, most - array.shape[1]), (0, 0), (0, 0), (0, 0))) for array in pixels]
    return np.concatenate(pixels)
