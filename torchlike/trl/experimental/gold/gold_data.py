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

from ....type_aliases import Tokenizer
from ...data_utils import is_conversational, maybe_convert_to_chatml
from ..gkd.gkd_data import tokenize_conversation

__all__ = ["prompt_and_completion_texts", "tokenize_row", "tokenize_with_original_text"]


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
                 use_extended_uld: bool, skip_prepare_dataset: bool = False) -> dict[str, Any]:
    """One row as TRL's GOLD hands it to ``DataCollatorForChatML`` and as that collator reads it: the row (converted
    to ChatML) with :func:`tokenize_with_original_text`'s columns and ``prompt_ids``. With
    ``skip_prepare_dataset`` (SFT's ``dataset_kwargs``) the raw row goes to the collator, which tokenises a
    ``messages`` conversation itself (:func:`.gkd_data.tokenize_conversation`).

    Raises:
        ValueError: no prompt token is left after truncation (TRL's collator's message).
    """
    row = maybe_convert_to_chatml(dict(row))
    if not skip_prepare_dataset and "input_ids" not in row:
        row = {**row, **tokenize_with_original_text(row, tokenizer, dataset_text_field, max_length,
                                                    use_extended_uld)}
    return tokenize_conversation(row, tokenizer, max_length)
