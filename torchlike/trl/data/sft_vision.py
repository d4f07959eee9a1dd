"""Vision-language SFT data, as TRL's ``DataCollatorForVisionLanguageModeling`` makes it: each batch rendered and
processed on the fly by the model's processor (images included), with the labels TRL sets, then laid out for the
JAX step: every batch padded to a bucketed length and its images gathered per row (``Family.images``).

TRL's vision datasets hold ``images`` (a list per example) or ``image`` beside ``messages`` (language modelling), a
text field, or ``prompt``/``completion``; ``{"type": "image"}`` message parts mark where each image goes
(:func:`prepare_multimodal_messages` adds them before the first user turn when the content is plain text).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...type_aliases import Processor
from ..data_utils import is_message_list, prepare_multimodal_messages
from ..trainer.base_config import round_up_to_multiple
from .model_images import ModelImages

if TYPE_CHECKING:
    from ..trainer.sft_config import SFTConfig

__all__ = ["VisionLanguageCollator", "batch_images", "check_vision_settings", "flush_left",
           "images_in_slots", "with_image_list"]

LENGTH_BUCKET = 32
"""Batches are padded to a multiple of this many tokens (TRL pads to the longest row), so a run compiles its step for
a few lengths rather than one per batch."""


def check_vision_settings(args: SFTConfig, data_collator: Callable | None) -> None:
    """TRL's refusals of SFT settings a vision dataset cannot take (its messages).

    Raises:
        ValueError: packing, padding-free batches, ``truncation_mode="keep_end"`` with a ``max_length``, or a custom
            ``data_collator`` (torchlike's batches carry the images per row, which a collator of TRL's layout
            does not make).
    """
    if args.packing:
        raise ValueError("Packing is not supported for vision datasets. Please set `packing=False` in the SFTConfig.")
    if args.padding_free:
        raise ValueError("Padding-free training is yet not supported for vision datasets. Please set "
                         "`padding_free=False` in the `SFTConfig`.")
    if args.assistant_only_loss:
        raise ValueError("Assistant-only loss for vision datasets requires transformers>=5.18.0. Please upgrade "
                         "transformers or set `assistant_only_loss=False` in the `SFTConfig`.")
    if args.max_length is not None and args.truncation_mode == "keep_end":
        raise ValueError("truncation_mode='keep_end' is not supported for vision datasets. Image tokens reside inside "
                         "the prompt portion of the sequence; depending on the example, keep_end may silently drop "
                         "them, causing pixel_values to be forwarded to the model with no corresponding visual tokens "
                         "in input_ids. Use truncation_mode='keep_start' (the default) or set max_length=None.")
    if data_collator is not None:
        raise ValueError("a custom data_collator is not supported for vision datasets in torchlike: its collator "
                         "processes the images and gives each row its image slots, which the JAX step reads.")




def flush_left(mask: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """TRL's ``flush_left``: each row's real tokens moved to its start, then the columns no row uses dropped.

    Args:
        mask: ``[B, T]``, nonzero on real tokens.
        arrays: ``[B, T]`` arrays moved with it (token ids, completion masks, token types).

    Returns:
        ``mask`` and each of ``arrays``, rearranged and cut to the longest row.
    """
    order = np.argsort(~mask.astype(bool), axis=1, kind="stable")
    moved = [np.take_along_axis(array, order, axis=1) for array in (mask, *arrays)]
    width = int(mask.sum(axis=1).max(initial=0))
    return tuple(array[:, :width] for array in moved)


def with_image_list(example: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a vision example whose images are a list under ``images`` (TRL's collators turn a single ``image``
    into ``images=[image]``; an example with neither gets ``[]``)."""
    example = dict(example)
    if "image" in example:
        example["images"] = [example.pop("image")]
    example.setdefault("images", [])
    return example


def batch_images(examples: Sequence[Mapping[str, Any]]) -> list | None:
    """The ``images`` lists of a batch for the processor, ``None`` when no example has one (transformers' processors
    want at least one image when given ``images``)."""
    images = [example["images"] for example in examples]
    return None if all(not row for row in images) else images


def images_in_slots(processor: Processor, images: ModelImages, input_ids: np.ndarray,
                    processed: Mapping[str, Any], images_per_row: int | None) -> Any:
    """Each row's images, in token order, for the JAX step: in ``images_per_row`` slots (zeros past a row's own), or,
    for a model that reads more than ``pixel_values`` (:attr:`ModelImages.keys`: Qwen-VL), the dict of per-row
    arrays its ``Family.images`` makes (patches padded to a power-of-two count).

    Args:
        processor: the model's processor (its ``image_processor.size`` shapes an image-less batch).
        images: the model's images (:class:`ModelImages`).
        input_ids: ``[B, T]`` processed token ids (image tokens included).
        processed: the processor's outputs for the batch (``pixel_values`` absent when it has no image).
        images_per_row: the slots per row; ``None``: the batch's most images per row rounded up to a power of two
            (a few shapes over a run, without counting every example's images first).

    Returns:
        float32 ``[B, images_per_row, H, W, C]``, or the dict of arrays.

    Raises:
        ValueError: a row has more images than ``images_per_row``.
    """
    if images.keys:
        return images.of(input_ids, processed)
    pixel_values = processed.get("pixel_values")
    if pixel_values is None:
        size = processor.image_processor.size
        return np.zeros((len(input_ids), images_per_row or 1, size["height"], size["width"], 3), np.float32)
    per_row = images(input_ids, np.asarray(pixel_values, np.float32))
    if images_per_row is None:
        images_per_row = 1 << max(per_row.shape[1] - 1, 0).bit_length()
    if per_row.shape[1] > images_per_row:
        raise ValueError(f"a row has {per_row.shape[1]} images, more than the {images_per_row} the dataset's rows were "
                         "counted to have.")
    slots = np.zeros((len(input_ids), images_per_row, *per_row.shape[2:]), np.float32)
    slots[:, :per_row.shape[1]] = per_row
    return slots


class VisionLanguageCollator:
    """Vision-language SFT batches as TRL's ``DataCollatorForVisionLanguageModeling`` builds them, as numpy.

    Args:
        processor: the model's ``transformers`` processor (``AutoProcessor``).
        images: the model's images (:class:`ModelImages`).
        max_length: truncate the processed rows to this many tokens (``None``: no truncation).
        completion_only_loss: for prompt-completion data, train on the completion only (TRL's default ``None``:
            yes).
        dataset_text_field: the text column of non-conversational language-modelling rows.
        pad_to_multiple_of: TRL's padding multiple (the bucket length is also a multiple of it).
        images_per_row: the image slots every batch gets per row (the most images any example has), so every batch
            has one shape; ``None``: each batch's most, rounded up to a power of two (:func:`images_in_slots`).

    Returns from ``__call__``: ``input_ids``, ``attention_mask``, ``loss_mask`` (TRL's labels other than ``-100``),
    ``token_type_ids`` (1 on image tokens) and ``images`` (:func:`images_in_slots`).
    """

    def __init__(self, processor: Processor, images: ModelImages,
                 max_length: int | None = None,
                 completion_only_loss: bool | None = None, dataset_text_field: str = "text",
                 pad_to_multiple_of: int | None = None, images_per_row: int | None = None):
        self.processor = processor
        self.images = images
        self.max_length = max_length
        self.completion_only_loss = completion_only_loss
        self.dataset_text_field = dataset_text_field
        self.pad_to_multiple_of = pad_to_multiple_of
        self.images_per_row = None if images_per_row is None else max(int(images_per_row), 1)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        examples = [with_image_list(example) for example in examples]
        if "messages" in examples[0] or self.dataset_text_field in examples[0]:
            if self.completion_only_loss:
                raise ValueError("The `completion_only_loss` argument is not supported for language modeling "
                                 "datasets.")
            processed, loss_mask = self._language_modeling(examples)
        elif "prompt" in examples[0] and "completion" in examples[0]:
            processed, loss_mask = self._prompt_completion(examples)
        else:
            raise KeyError(f"Unexpected input keys in examples: {list(examples[0].keys())}.")
        return self._laid_out(processed, loss_mask)

    def _processor_kwargs(self, padding_side: str = "right") -> dict[str, Any]:
        return {"padding": True, "padding_side": padding_side, "truncation": self.max_length is not None,
                "max_length": self.max_length, "add_special_tokens": False}

    def _language_modeling(self, examples: Sequence[Mapping[str, Any]]) -> tuple[dict, np.ndarray]:
        if "messages" in examples[0]:
            conversations = [prepare_multimodal_messages(example["messages"], example["images"])
                             for example in examples]
            processed = self.processor.apply_chat_template(
                conversations, tokenize=True, return_dict=True, return_tensors="np",
                processor_kwargs=self._processor_kwargs())
        else:
            texts = [example[self.dataset_text_field] for example in examples]
            processed = self.processor(images=batch_images(examples), text=texts, return_tensors="np",
                                       **self._processor_kwargs())
        return dict(processed), np.asarray(processed["attention_mask"])

    def _prompt_completion(self, examples: Sequence[Mapping[str, Any]]) -> tuple[dict, np.ndarray]:
        prompts, completions = [], []
        template = self.processor
        for example in examples:
            if is_message_list(example["prompt"]):
                prompt = prepare_multimodal_messages(example["prompt"], example["images"])
                completion = prepare_multimodal_messages(example["completion"])
                prompt_text = template.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                full = template.apply_chat_template(prompt + completion, tokenize=False)
                prompts.append(prompt_text)
                completions.append(full[len(prompt_text):])
            else:
                prompts.append(example["prompt"])
                completions.append(example["completion"])
        prompt_part = self.processor(images=batch_images(examples), text=prompts, return_tensors="np",
                                     padding=True, padding_side="left", add_special_tokens=False)
        completion_part = self.processor(text=completions, return_tensors="np", padding=True,
                                         padding_side="right", add_special_tokens=False)
        ids = np.concatenate([prompt_part["input_ids"], completion_part["input_ids"]], axis=1)
        mask = np.concatenate([prompt_part["attention_mask"], completion_part["attention_mask"]], axis=1)
        in_completion = np.concatenate([np.zeros_like(prompt_part["input_ids"]), completion_part["attention_mask"]],
                                       axis=1)
        types = np.concatenate([prompt_part.get("token_type_ids", np.zeros_like(prompt_part["input_ids"])),
                                np.zeros_like(completion_part["input_ids"])], axis=1)
        mask, ids, in_completion, types = flush_left(mask, ids, in_completion, types)
        if self.max_length is not None:
            mask, ids, in_completion, types = (array[:, :self.max_length] for array in (mask, ids, in_completion,
                                                                                        types))
        processed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        for key in ("pixel_values", *self.images.keys):
            if key in prompt_part:
                processed[key] = prompt_part[key]
        completion_only = self.completion_only_loss is None or self.completion_only_loss
        return processed, mask * in_completion if completion_only else mask

    def _laid_out(self, processed: Mapping[str, Any], loss_mask: np.ndarray) -> dict[str, np.ndarray]:
        """The processed batch padded on the right to the bucketed length, with per-row images."""
        ids = np.asarray(processed["input_ids"])
        length = round_up_to_multiple(round_up_to_multiple(ids.shape[1], LENGTH_BUCKET), self.pad_to_multiple_of)
        width = length - ids.shape[1]

        def padded(array, value=0):
            return np.pad(np.asarray(array), ((0, 0), (0, width)), constant_values=value).astype(np.int32)

        pad_id = self.processor.tokenizer.pad_token_id
        types = processed.get("token_type_ids", np.zeros_like(ids))
        batch = {"input_ids": padded(ids, pad_id), "attention_mask": padded(processed["attention_mask"]),
                 "loss_mask": padded(loss_mask), "token_type_ids": padded(types)}
        batch["images"] = images_in_slots(self.processor, self.images, ids, processed, self.images_per_row)
        return batch
