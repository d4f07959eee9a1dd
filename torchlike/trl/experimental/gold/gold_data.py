"""GOLD's data: rows tokenised as TRL 1.16's ``GOLDTrainer._prepare_dataset_with_original_text`` tokenises them, then
batched as ``DataCollatorForChatML`` batches tokenised rows (``torchlike.trl.experimental.gkd.gkd_data``).

A row is a ``messages`` conversation (its last assistant message is the completion), a ``prompt``/``completion`` pair
(conversational or text) or a text column (all completion). The prompt and completion are rendered (the prompt with
the generation prompt, cut to what it shares with the whole conversation's rendering), the whole text is tokenised
once, and the completion starts at the first token that ends after the prompt's text. The row keeps
``original_prompt_text`` and ``original_completion_text`` (what a cross-tokenizer teacher reads) and, for extended
ULD, each token's UTF-8 byte offsets relative to the completion. A text row gets the eos token appended. A row longer
than ``max_length`` keeps its last ``max_length`` tokens, and its texts are decoded again from the kept ids.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import numpy as np

from ....adapters.losses.uld import (
    ULDLossSettings,
    alignment_columns,
    alignment_sizes,
    prepare_uld_alignment,
)
from ....adapters.rollout.sampling import bucket_length
from ....type_aliases import Tokenizer
from ...data_utils import is_conversational, maybe_convert_to_chatml
from ..gkd.gkd_data import tokenize_conversation

__all__ = ["TEXT_COLUMNS", "prompt_and_completion_texts", "teacher_columns", "text_columns", "tokenize_row",
           "tokenize_with_original_text"]

#: The host-only columns of a ULD micro-batch, turned into the teacher's columns before the step
#: (:func:`teacher_columns`).
TEXT_COLUMNS = ("original_prompt_text", "original_completion_text", "byte_offsets")


def _shared_prefix(text: str, other: str) -> str:
    return "".join(character for character, _ in takewhile(lambda pair: pair[0] == pair[1],
                                                             zip(text, other, strict=False)))


def prompt_and_completion_texts(row: dict, tokenizer: Tokenizer, dataset_text_field: str) -> tuple[str, str, str]:
    """``(prompt_text, completion_text, full_text)`` of a row, rendered as TRL's GOLD renders them."""
    kwargs = row.get("chat_template_kwargs") or {}
    render = tokenizer.apply_chat_template
    if "prompt" in row:
        if is_conversational(row):
            prompt_text = render(row["prompt"], add_generation_prompt=True, tokenize=False, **kwargs)
            full_text = render(row["prompt"] + row["completion"], tokenize=False, **kwargs)
            prompt_text = _shared_prefix(prompt_text, full_text)
            return prompt_text, full_text[len(prompt_text):], full_text
        return row["prompt"], row["completion"], row["prompt"] + row["completion"]
    if is_conversational(row):
        messages = row["messages"]
        assistant = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if not assistant:
            full_text = render(messages, tokenize=False, **kwargs)
            return "", full_text, full_text
        prompt_messages, full_messages = messages[:assistant[-1]], messages[:assistant[-1] + 1]
        prompt_text = render(prompt_messages, add_generation_prompt=True, tokenize=False, **kwargs) \
            if prompt_messages else ""
        full_text = render(full_messages, add_generation_prompt=False, tokenize=False, **kwargs)
        prompt_text = _shared_prefix(prompt_text, full_text)
        return prompt_text, full_text[len(prompt_text):], full_text
    text = row.get(dataset_text_field, row.get("text", ""))
    return "", text, text


def tokenize_with_original_text(row: dict, tokenizer: Tokenizer, dataset_text_field: str, max_length: int | None,
                                use_extended_uld: bool) -> dict[str, Any]:
    """TRL's ``tokenize_with_original_text`` of one row.

    Args:
        row: a dataset row (``messages``, ``prompt``/``completion``, or ``dataset_text_field``).
        tokenizer: a ``transformers`` fast tokenizer (with a chat template for conversational rows).
        dataset_text_field: the text column of plain text rows.
        max_length: the most tokens kept (the last ones); ``None`` keeps them all.
        use_extended_uld: compute the completion's byte offsets (a ByteLevel tokenizer is needed).

    Returns:
        ``input_ids``, ``attention_mask``, ``byte_offsets`` (``(start, end)`` per token, completion-relative, the
        prompt's ``(0, 0)``), ``completion_mask`` and ``original_prompt_text`` / ``original_completion_text``.
    """
    prompt_text, completion_text, full_text = prompt_and_completion_texts(row, tokenizer, dataset_text_field)
    if use_extended_uld:
        from .uld_inputs import encode_with_byte_offsets

        [(input_ids, full_offsets)] = encode_with_byte_offsets(tokenizer.backend_tokenizer, [full_text],
                                                               add_special_tokens=False)
        prompt_bytes = len(prompt_text.encode("utf-8"))
        completion_start = next((index for index, (_, end) in enumerate(full_offsets) if end > prompt_bytes),
                                len(input_ids))
        byte_offsets = [(0, 0)] * completion_start + [(max(0, start - prompt_bytes), end - prompt_bytes)
                                                      for start, end in full_offsets[completion_start:]]
    else:
        encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoding["input_ids"])
        completion_start = next((index for index, (_, end) in enumerate(encoding["offset_mapping"])
                                 if end > len(prompt_text)), len(input_ids))
        byte_offsets = [(0, 0)] * len(input_ids)
    input_ids = list(input_ids)
    append_eos = not is_conversational(row) and tokenizer.eos_token_id is not None \
        and (not input_ids or input_ids[-1] != tokenizer.eos_token_id)
    if append_eos:
        input_ids.append(tokenizer.eos_token_id)
        completion_bytes = len(completion_text.encode("utf-8"))
        byte_offsets.append((completion_bytes, completion_bytes) if use_extended_uld else (0, 0))
    texts = {"original_prompt_text": prompt_text, "original_completion_text": completion_text}
    if max_length is not None and len(input_ids) > max_length:
        drop = len(input_ids) - max_length
        input_ids, byte_offsets = input_ids[drop:], byte_offsets[drop:]
        completion_start = max(0, completion_start - drop)
        if completion_start < len(byte_offsets):
            base = byte_offsets[completion_start][0]
            if base > 0:
                byte_offsets = byte_offsets[:completion_start] + [(start - base, end - base)
                                                                  for start, end in byte_offsets[completion_start:]]
        completion_ids = input_ids[completion_start:-1] if append_eos else input_ids[completion_start:]
        texts = {"original_prompt_text": tokenizer.decode(input_ids[:completion_start], skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False),
                 "original_completion_text": tokenizer.decode(completion_ids, skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False)}
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "byte_offsets": byte_offsets,
            "completion_mask": [0] * completion_start + [1] * (len(input_ids) - completion_start), **texts}


def tokenize_row(row: dict, tokenizer: Tokenizer, dataset_text_field: str, max_length: int | None,
                 use_extended_uld: bool, skip_prepare_dataset: bool = False,
                 keep_tokenized: bool = True) -> dict[str, Any]:
    """One row as TRL's GOLD hands it to ``DataCollatorForChatML`` and as that collator reads it: the row (converted
    to ChatML) with :func:`tokenize_with_original_text`'s columns and ``prompt_ids``. A row that has ``input_ids``
    keeps them with ``keep_tokenized`` (as TRL without ULD; ULD re-tokenises every row for its texts). With
    ``skip_prepare_dataset`` (SFT's ``dataset_kwargs``) the raw row goes to the collator, which tokenises a
    ``messages`` conversation itself (:func:`.gkd_data.tokenize_conversation`).

    Raises:
        ValueError: no prompt token is left after truncation (TRL's collator's message).
    """
    row = maybe_convert_to_chatml(dict(row))
    if not skip_prepare_dataset and not ("input_ids" in row and keep_tokenized):
        row = {**row, **tokenize_with_original_text(row, tokenizer, dataset_text_field, max_length,
                                                    use_extended_uld)}
    return tokenize_conversation(row, tokenizer, max_length)


def text_columns(prompt_texts: list[str], completion_texts: list[str],
                 byte_offsets: np.ndarray) -> dict[str, np.ndarray]:
    """The host-only columns of ULD rows: their texts (object arrays) and the student's ``[n, W, 2]`` byte offsets."""
    return {"original_prompt_text": np.array(prompt_texts, dtype=object),
            "original_completion_text": np.array(completion_texts, dtype=object),
            "byte_offsets": np.asarray(byte_offsets, np.int64)}


def _power_of_two(count: int, limit: int) -> int:
    return min(limit, 1 << max(count - 1, 0).bit_length()) if count else 0


def teacher_columns(micro_batches: list[dict[str, np.ndarray]], teacher_tokenizer: Tokenizer,
                    settings: ULDLossSettings) -> list[dict[str, np.ndarray]]:
    """The micro-batches of one step with their texts replaced by what GOLD's ULD step reads: the teacher's own
    tokenisation (TRL's ``build_teacher_inputs_from_texts``, right-padded to one bucketed width for the step) and the
    alignment plan (``adapters.losses.uld``), cut to the step's most groups and scalar slots (rounded up to a power of
    two, so few programs compile).

    Args:
        micro_batches: step columns with :data:`TEXT_COLUMNS` (``input_ids``/``completion_mask`` the student's).
        teacher_tokenizer: the teacher's fast tokenizer.
        settings: the ULD loss's settings.
    """
    from .uld_inputs import build_teacher_inputs_from_texts

    extended = settings.use_extended_uld
    encoded = [build_teacher_inputs_from_texts(teacher_tokenizer, list(batch["original_prompt_text"]),
                                               list(batch["original_completion_text"]), extended)
               for batch in micro_batches]
    teacher_width = bucket_length(max(ids.shape[1] for ids, *_ in encoded))
    pad_token_id = teacher_tokenizer.pad_token_id if teacher_tokenizer.pad_token_id is not None else 0
    prepared = []
    for batch, (ids, labels, mask, offsets) in zip(micro_batches, encoded, strict=True):
        extra = teacher_width - ids.shape[1]
        ids, labels, mask = (np.pad(array, ((0, 0), (0, extra)), constant_values=value)
                             for array, value in ((ids, pad_token_id), (labels, -100), (mask, 0)))
        offsets = np.pad(offsets, ((0, 0), (0, extra), (0, 0)))
        student_ids, width = batch["input_ids"], batch["input_ids"].shape[1]
        student_labels = np.where(np.pad(batch["completion_mask"], ((0, 0), (1, 0))) > 0, student_ids, -100)
        alignment = prepare_uld_alignment(
            student_labels, labels, student_ids, ids, settings, num_groups=min(width, teacher_width),
            group_width=max(width, teacher_width), student_byte_offsets=batch["byte_offsets"] if extended else None,
            teacher_byte_offsets=offsets if extended else None)
        prepared.append((batch, ids, mask, alignment))
    sizes = [alignment_sizes(alignment) for *_, alignment in prepared]
    groups = _power_of_two(max(1, *(size[0] for size in sizes)), min(micro_batches[0]["input_ids"].shape[1],
                                                                      teacher_width))
    slots = _power_of_two(max(size[1] for size in sizes), max(micro_batches[0]["input_ids"].shape[1], teacher_width))
    return [{**{key: value for key, value in batch.items() if key not in TEXT_COLUMNS},
             "teacher_input_ids": ids.astype(np.int32), "teacher_attention_mask": mask.astype(np.int32),
             **alignment_columns(alignment, groups, slots)} for batch, ids, mask, alignment in prepared]
