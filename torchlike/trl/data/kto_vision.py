"""Vision-language unpaired preference data for KTO, as TRL 1.16's ``DataCollatorForVisionUnpairedPreference``
makes it: each batch rendered and processed on the fly by the model's processor (the prompt with its images,
left-padded; the completion alone, right-padded), flushed left and cut to ``max_length``; for a loss with a KL term,
each prompt also followed by the completion before it in its batch (TRL's cycle by one), which shares the prompt's
images. Laid out for the JAX step with the rows' images (``Family.images``) and padded to a bucketed length.

TRL's vision KTO rows hold ``prompt``, ``completion`` and ``label`` beside ``images`` (a list) or ``image``; message
lists place the images in the first user turn (:func:`~.data_utils.prepare_multimodal_messages`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...type_aliases import DatasetLike, Processor
from ..data_utils import apply_chat_template, describe, is_message_list, prepare_multimodal_messages
from ..trainer.base_config import round_up_to_multiple
from .dpo_vision import VisionPreferenceCollator
from .sft_vision import LENGTH_BUCKET, ModelImages, batch_images, images_in_slots, with_image_list

if TYPE_CHECKING:
    from ..trainer.kto_config import KTOConfig

__all__ = ["VisionUnpairedCollator", "check_vision_unpaired_settings", "vision_unpaired_rows"]


def check_vision_unpaired_settings(args: KTOConfig, dataset_sample: Mapping[str, Any], data_collator: Callable | None,
                                   compute_metrics: Callable | None) -> None:
    """TRL's refusals of KTO settings a vision dataset cannot take (its messages), and torchlike's own.

    Raises:
        ValueError: ``precompute_ref_log_probs=True`` or paired rows (TRL's messages); a custom ``data_collator``
            or ``compute_metrics`` (torchlike: its collator gives each row its images, which the step reads).
        NotImplementedError: ``pad_to_multiple_of`` (TRL's collator raises it on the first batch).
    """
    if args.precompute_ref_log_probs:
        raise ValueError("`precompute_ref_log_probs=True` is not supported for vision datasets. For vision-language "
                         "models, all data processing is performed on the fly rather than upfront. "
                         "Set `precompute_ref_log_probs=False`.")
    if "chosen" in dataset_sample or "rejected" in dataset_sample:
        raise ValueError("Vision datasets must be in unpaired format with `completion` and `label` columns. Paired "
                         "format (`chosen`/`rejected`) is not supported for vision datasets because iterating over "
                         "the full dataset to unpair it would be too expensive for large image collections. Unpair "
                         "your dataset first: `dataset = unpair_preference_dataset(dataset)`.")
    if args.pad_to_multiple_of is not None:
        raise NotImplementedError("Padding to a multiple of a value is not yet implemented for vision-language "
                                  "modeling and prompt-completion data.")
    if data_collator is not None:
        raise ValueError("a custom data_collator is not supported for vision datasets in torchlike: its collator "
                         "processes the images and gives each row its images, which the JAX step reads.")
    if compute_metrics is not None:
        raise ValueError("compute_metrics is not supported for vision datasets in torchlike: the logits it reads "
                         "would be computed without the images. Read the logged KTO metrics instead.")


def vision_unpaired_rows(dataset: DatasetLike | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a vision KTO dataset as dicts the collator processes (and the reference log-probabilities are
    stored in), each with its images as a list under ``images``.

    Raises:
        ValueError: an empty dataset, or a row without ``prompt``, ``completion`` or ``label``.
    """
    rows = []
    for index, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            raise TypeError(f"Example {index} should be a dict of columns; found {describe(row)}.")
        missing = [key for key in ("prompt", "completion", "label") if key not in row]
        if missing:
            raise ValueError(f"Example {index} of the vision KTO dataset has no {missing} (found {sorted(row)}); "
                             "vision KTO data holds 'prompt', 'completion', 'label' and 'images'.")
        rows.append(with_image_list(row))
    if not rows:
        raise ValueError("The KTO dataset is empty; pass at least one example.")
    return rows


class VisionUnpairedCollator(VisionPreferenceCollator):
    """Vision KTO batches as TRL's ``DataCollatorForVisionUnpairedPreference`` builds them, as numpy.

    Args:
        processor: the model's ``transformers`` processor.
        images: the model's images (:class:`~.model_images.ModelImages`).
        pad_token_id: fills the ids past each row.
        max_length: each row keeps its first ``max_length`` tokens (``None``: all).
        images_per_row: image slots per row (a model taking image slots).
        kl_chunk_size: the KL completions cycle within consecutive chunks of this many rows (TRL's batch of
            ``per_device_train_batch_size``, with its sequential sampler); ``None``: no KL completions.

    Returns from ``__call__``: int32 ``[B, L]`` ``input_ids``, ``attention_mask``, ``completion_mask`` and
    ``token_type_ids`` (with a ``KL_`` prefix too, with ``kl_chunk_size``), bool ``label``, the rows' ``images`` and,
    when the rows carry them, float32 ``ref_logps``/``ref_KL_logps``.
    """

    def __init__(self, processor: Processor, images: ModelImages, pad_token_id: int, max_length: int | None = None,
                 images_per_row: int = 1, kl_chunk_size: int | None = None):
        super().__init__(processor, images, pad_token_id, max_length, images_per_row)
        self.kl_chunk_size = kl_chunk_size

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        examples = [with_image_list(example) for example in examples]
        texts = [self._rendered_unpaired(example) for example in examples]
        prompts = self.processor(images=batch_images(examples), text=[text["prompt"] for text in texts],
                                 padding=True, padding_side="left", return_tensors="np", add_special_tokens=False)
        completions = [text["completion"] for text in texts]
        sequences = {"": self._sequences(prompts, completions)}
        if self.kl_chunk_size:
            cycled = []
            for start in range(0, len(completions), self.kl_chunk_size):
                chunk = completions[start:start + self.kl_chunk_size]
                cycled += chunk[-1:] + chunk[:-1]  # TRL's KL completions: each prompt with the one before it
            sequences["KL_"] = self._sequences(prompts, cycled)
        width = max(arrays[0].shape[1] for arrays in sequences.values())
        length = round_up_to_multiple(max(width, 1), LENGTH_BUCKET)
        batch = {"images": images_in_slots(self.processor, self.images, np.asarray(prompts["input_ids"]), prompts,
                                           self.images_per_row)}
        for prefix, arrays in sequences.items():
            for name, array, fill in zip(("input_ids", "attention_mask", "completion_mask", "token_type_ids"), arrays,
                                         (self.pad_token_id, 0, 0, 0), strict=True):
                batch[f"{prefix}{name}"] = np.pad(array, ((0, 0), (0, length - array.shape[1])),
                                                  constant_values=fill).astype(np.int32)
        batch["label"] = np.asarray([bool(example["label"]) for example in examples], dtype=bool)
        for key in ("ref_logps", "ref_KL_logps"):
            if key in examples[0]:
                batch[key] = np.asarray([example[key] for example in examples], dtype=np.float32)
        return batch

    def _rendered_unpaired(self, example: Mapping[str, Any]) -> dict[str, str]:
        """``{"prompt", "completion"}`` as text: a conversation's image placeholders filled and rendered by the
        processor's chat template (TRL's ``apply_chat_template``), plain text as it is."""
        if not is_message_list(example["prompt"]):
            return {"prompt": example["prompt"], "completion": example["completion"]}
        messages = {"prompt": prepare_multimodal_messages(example["prompt"], example["images"]),
                    "completion": prepare_multimodal_messages(example["completion"])}
        return apply_chat_template(messages, self.processor)
