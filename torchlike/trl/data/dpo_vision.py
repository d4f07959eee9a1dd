"""Vision-language preference data for DPO, as TRL 1.16's ``DataCollatorForVisionPreference`` makes it: each batch
rendered and processed on the fly by the model's processor (the prompt with its images, left-padded; each response
alone, right-padded), every row flushed left, then laid out for the JAX step: one row per pair with its ``chosen_*``
and ``rejected_*`` columns (token types included) padded to a bucketed length, and the pair's images per row
(``Family.images``), which the chosen and the rejected sequence share.

TRL's vision preference rows hold ``images`` (a list) or ``image`` beside ``prompt``, ``chosen`` and ``rejected``,
message lists (``{"type": "image"}`` parts mark where each image goes; :func:`~.data_utils.prepare_multimodal_messages`
places them before the first user turn of a plain-text prompt) or strings that carry the model's image tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...type_aliases import DatasetLike, Processor
from ..data_utils import apply_chat_template, describe, example_tools, is_message_list, prepare_multimodal_messages
from ..trainer.base_config import round_up_to_multiple
from .sft_vision import (
    LENGTH_BUCKET,
    ModelImages,
    batch_images,
    flush_left,
    images_in_slots,
    with_image_list,
)

if TYPE_CHECKING:
    from ..trainer.dpo_config import DPOConfig

__all__ = ["VisionPreferenceCollator", "check_vision_preference_settings", "most_images", "vision_preference_rows"]

_RESPONSES = ("chosen", "rejected")


def check_vision_preference_settings(args: DPOConfig, data_collator: Callable | None,
                                     compute_metrics: Callable | None) -> None:
    """TRL's refusals of DPO settings a vision dataset cannot take (its messages), and torchlike's own.

    Args:
        args: the ``DPOConfig``.
        data_collator: the trainer's ``data_collator`` argument.
        compute_metrics: the trainer's ``compute_metrics`` argument.

    Raises:
        ValueError: ``truncation_mode="keep_end"`` with a ``max_length``, ``precompute_ref_log_probs=True`` (TRL's
            messages); a custom ``data_collator`` or ``compute_metrics`` (torchlike: its collator gives each row
            its image slots, which the step reads, and the logits ``compute_metrics`` reads are computed without
            the images).
        NotImplementedError: ``pad_to_multiple_of`` (TRL's collator raises it on the first batch).
    """
    if args.max_length is not None and args.truncation_mode == "keep_end":
        raise ValueError("truncation_mode='keep_end' is not supported for vision-language models. Image tokens reside "
                         "inside the prompt portion of the sequence; depending on the example, keep_end may silently "
                         "drop them, causing pixel_values to be forwarded to the model with no corresponding visual "
                         "tokens in input_ids. Use truncation_mode='keep_start' (the default) or set max_length=None.")
    if args.precompute_ref_log_probs:
        raise ValueError("`precompute_ref_log_probs=True` is not supported for vision datasets. For vision-language "
                         "models, all data processing is performed on the fly rather than upfront, and running a full "
                         "forward pass of the reference model over the entire dataset is not supported for large "
                         "multimodal models. Set `precompute_ref_log_probs=False`.")
    if args.pad_to_multiple_of is not None:
        raise NotImplementedError("Padding to a multiple of a value is not yet implemented for vision-language "
                                  "modeling and prompt-completion data.")
    if data_collator is not None:
        raise ValueError("a custom data_collator is not supported for vision datasets in torchlike: its collator "
                         "processes the images and gives each pair its image slots, which the JAX step reads.")
    if compute_metrics is not None:
        raise ValueError("compute_metrics is not supported for vision datasets in torchlike: the logits it reads "
                         "would be computed without the images. Read the logged DPO metrics (rewards/*, logps/*) "
                         "instead.")


def vision_preference_rows(dataset: DatasetLike | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a vision preference dataset, as dicts the collator processes (and the reference log-probs are
    stored in), each with its images as a list under ``images``.

    Args:
        dataset: rows with ``prompt``, ``chosen``, ``rejected`` and ``images`` (or ``image``).

    Returns:
        One new dict per row (the dataset is not changed).

    Raises:
        ValueError: an empty dataset, or a row without ``prompt``, ``chosen`` or ``rejected`` (TRL's vision collator
            reads an explicit prompt; implicit-prompt rows are not split for vision data).
    """
    rows = []
    for index, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            raise TypeError(f"Example {index} should be a dict of columns; found {describe(row)}.")
        missing = [key for key in ("prompt", *_RESPONSES) if key not in row]
        if missing:
            raise ValueError(f"Example {index} of the vision DPO dataset has no {missing} (found {sorted(row)}). "
                             "Vision preference data needs an explicit 'prompt' beside 'chosen', 'rejected' and "
                             "'images', as TRL's vision collator reads it.")
        rows.append(with_image_list(row))
    if not rows:
        raise ValueError("The DPO dataset is empty; pass at least one preference example.")
    return rows


def most_images(rows: Iterable[Mapping[str, Any]]) -> int:
    """The most images a row of ``rows`` (from :func:`vision_preference_rows`) has, at least 1."""
    return max((len(row["images"]) for row in rows), default=1) or 1


class VisionPreferenceCollator:
    """Vision-language preference batches as TRL's ``DataCollatorForVisionPreference`` builds them, one row per pair,
    as numpy.

    Args:
        processor: the model's ``transformers`` processor (``AutoProcessor``).
        images: the model's images (:class:`.model_images.ModelImages`).
        pad_token_id: fills ``*_input_ids`` past each sequence.
        max_length: each prompt + response is cut to its first ``max_length`` tokens (``None``: no truncation).
        images_per_row: the image slots every batch gets per row (the most images any example has), so every batch
            has one shape.

    Returns from ``__call__``: for ``chosen`` and ``rejected``, int32 ``[B, L]`` ``*_input_ids``,
    ``*_attention_mask``, ``*_completion_mask`` (1 on response tokens) and ``*_token_type_ids`` (1 on image tokens),
    ``L`` the longest sequence rounded up to a multiple of ``LENGTH_BUCKET``; ``images`` (float32
    ``[B, images_per_row, H, W, C]``, or a dict of per-row arrays: :func:`.sft_vision.images_in_slots`); and
    ``ref_chosen_logps``/``ref_rejected_logps`` ``[B]`` when the rows carry them.

    Raises (from ``__call__``):
        ValueError: ``max_length`` cuts image tokens off a prompt (TRL's message), a row has more images than
            ``images_per_row``, or a conversation's image placeholders do not match its images.
    """

    def __init__(self, processor: Processor, images: ModelImages, pad_token_id: int,
                 max_length: int | None = None, images_per_row: int = 1):
        self.processor = processor
        self.images = images
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.images_per_row = max(int(images_per_row), 1)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        examples = [with_image_list(example) for example in examples]
        texts = [self._rendered(example) for example in examples]
        prompts = self.processor(images=batch_images(examples), text=[text["prompt"] for text in texts],
                                 padding=True, padding_side="left", return_tensors="np", add_special_tokens=False)
        sequences = {key: self._sequences(prompts, [text[key] for text in texts]) for key in _RESPONSES}
        width = max(arrays[0].shape[1] for arrays in sequences.values())
        length = round_up_to_multiple(max(width, 1), LENGTH_BUCKET)
        batch = {"images": images_in_slots(self.processor, self.images, np.asarray(prompts["input_ids"]), prompts,
                                           self.images_per_row)}
        for key, arrays in sequences.items():
            for name, array, fill in zip(("input_ids", "attention_mask", "completion_mask", "token_type_ids"), arrays,
                                         (self.pad_token_id, 0, 0, 0), strict=True):
                batch[f"{key}_{name}"] = np.pad(array, ((0, 0), (0, length - array.shape[1])),
                                                constant_values=fill).astype(np.int32)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:
                batch[key] = np.asarray([example[key] for example in examples], dtype=np.float32)
        return batch

    def _rendered(self, example: Mapping[str, Any]) -> dict[str, str]:
        """``{"prompt", "chosen", "rejected"}`` as text: a conversation's image placeholders filled and rendered by
        the processor's chat template (TRL's ``apply_chat_template``), plain text as it is."""
        if not is_message_list(example["prompt"]):
            return {key: example[key] for key in ("prompt", *_RESPONSES)}
        messages = {"prompt": prepare_multimodal_messages(example["prompt"], example["images"]),
                    **{key: prepare_multimodal_messages(example[key]) for key in _RESPONSES}}
        return apply_chat_template({**messages, "chat_template_kwargs": example.get("chat_template_kwargs")},
                                   self.processor, tools=example_tools(example))

    def _sequences(self, prompts: Mapping[str, Any], responses: list[str]) -> tuple[np.ndarray, ...]:
        """``(input_ids, attention_mask, completion_mask, token_type_ids)`` of each prompt followed by its response,
        flushed left and truncated (TRL's layout)."""
        part = self.processor(text=responses, padding=True, padding_side="right", return_tensors="np",
                              add_special_tokens=False)
        prompt_ids, response_ids = np.asarray(prompts["input_ids"]), np.asarray(part["input_ids"])
        ids = np.concatenate([prompt_ids, response_ids], axis=1)
        mask = np.concatenate([prompts["attention_mask"], part["attention_mask"]], axis=1)
        completion = np.concatenate([np.zeros_like(prompt_ids), part["attention_mask"]], axis=1)
        types = np.concatenate([prompts.get("token_type_ids", np.zeros_like(prompt_ids)),
                                part.get("token_type_ids", np.zeros_like(response_ids))], axis=1)
        mask, ids, completion, types = flush_left(mask, ids, completion, types)
        if self.max_length is not None:
            image_tokens = types.sum(axis=1)
            mask, ids, completion, types = (array[:, :self.max_length] for array in (mask, ids, completion, types))
            if (types.sum(axis=1) != image_tokens).any():
                raise ValueError(f"The current `max_length` ({self.max_length}) is too short and causes image "
                                 "placeholder tokens in `input_ids` to be truncated, while the corresponding image "
                                 "features remain intact. Please increase `max_length` or set it to `None` to disable "
                                 "truncation.")
        return ids, mask, completion, types
