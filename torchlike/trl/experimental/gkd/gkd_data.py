"""GKD's data: conversations tokenised as TRL 1.16's ``trl.experimental.utils.DataCollatorForChatML`` tokenises them,
and the step columns of a micro-batch, from the dataset or from sampled completions.

A row is a ``messages`` conversation whose last message is the completion. Its prompt is ``prompt`` (already
rendered text) when the row has one, else the chat template's rendering of every message but the last with the
generation prompt. The conversation is rendered and tokenised whole; the completion starts at its first token that
starts at or after the end of the prompt's text (a byte-level tokenizer), or after as many tokens as the prompt
tokenised alone has (any other tokenizer). A row with ``input_ids`` is taken as tokenised, its prompt ending where its
``completion_mask`` first is 1. A conversation longer than ``max_length`` keeps its last ``max_length`` tokens.

The step columns of ``n`` rows at width ``W`` (``adapters.losses.distillation.gkd_step_loss`` reads them):
``input_ids``/``attention_mask`` ``[n, W]``, ``completion_mask`` ``[n, W - 1]`` (1 where token ``t + 1`` is a label,
TRL's shifted ``labels != -100``) and ``label_count`` ``[n]`` (the row's dataset labels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ....type_aliases import Tokenizer

if TYPE_CHECKING:
    import tokenizers

__all__ = ["dataset_columns", "is_byte_level_tokenizer", "sampled_columns", "tokenize_conversation"]


def is_byte_level_tokenizer(backend: tokenizers.Tokenizer) -> bool:
    """TRL's ``is_byte_level_tokenizer``: whether a fast tokenizer's backend (``tokenizer.backend_tokenizer``) is a
    ByteLevel BPE (its pre-tokenizer or decoder is ByteLevel), whose pieces spell one character per source byte.

    Args:
        backend: the ``tokenizers.Tokenizer`` behind a ``transformers`` fast tokenizer.

    Returns:
        `bool`
    """
    return "ByteLevel" in repr(backend.pre_tokenizer) or "ByteLevel" in repr(backend.decoder)


def tokenize_conversation(row: dict, tokenizer: Tokenizer, max_length: int | None) -> dict:
    """One row as ``DataCollatorForChatML`` tokenises it.

    Args:
        row: a dataset row with ``messages`` (and optionally a rendered ``prompt``), or with ``input_ids`` (and
            optionally ``completion_mask``).
        tokenizer: a ``transformers`` fast tokenizer with a chat template.
        max_length: the most tokens kept (the last ones); ``None`` keeps them all.

    Returns:
        The row with ``input_ids`` (the kept conversation) and ``prompt_ids`` (its leading prompt tokens).

    Raises:
        ValueError: no prompt token is left after truncation (TRL's message).
    """
    prompt = row.get("prompt", row.get("original_prompt_text"))
    if prompt is None:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
    if "input_ids" in row:
        ids = list(row["input_ids"])
        completion_mask = row.get("completion_mask")
        if completion_mask is not None:
            prompt_length = list(completion_mask).index(1) if 1 in completion_mask else len(ids)
        else:
            prompt_length = min(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]), len(ids))
    else:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=False, tokenize=False)
        if is_byte_level_tokenizer(tokenizer.backend_tokenizer):
            encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
            ids = list(encoding.ids)
            prompt_length = next((index for index, (start, _) in enumerate(encoding.offsets) if start >= len(prompt)),
                                 len(ids))
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompt_length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if max_length is not None and len(ids) > max_length:
            prompt_length = max(0, prompt_length - (len(ids) - max_length))
            ids = ids[-max_length:]
    if prompt_length == 0:
        raise ValueError(f"An example has no prompt tokens left after truncation to max_length={max_length}. This "
                         "happens when the completion alone fills the whole window, so the prompt is entirely "
                         "dropped, leaving nothing to generate from. Increase `max_length`.")
    return {**row, "input_ids": ids, "prompt_ids": ids[:prompt_length]}


def empty_columns(count: int, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """``count`` rows of step columns at ``width`` with nothing to train on (padding rows)."""
    return {"input_ids": np.full((count, width), pad_token_id, np.int32),
            "attention_mask": np.zeros((count, width), np.int32),
            "completion_mask": np.zeros((count, width - 1), np.int32),
            "label_count": np.zeros(count, np.float32)}


def dataset_columns(rows: list[dict], width: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """The step columns of tokenised rows (:func:`tokenize_conversation`), left-padded to ``width`` as TRL's collator
    pads them; the labels are the tokens after each row's prompt."""
    columns = empty_columns(len(rows), width, pad_token_id)
    for index, row in enumerate(rows):
        ids, prompt_length = row["input_ids"], len(row["prompt_ids"])
        start = width - len(ids)
        columns["input_ids"][index, start:] = ids
        columns["attention_mask"][index, start:] = row.get("attention_mask", 1)
        columns["completion_mask"][index, start + prompt_length - 1:] = 1
        columns["label_count"][index] = len(ids) - prompt_length
    return columns


def sampled_columns(prompt_ids: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray, completion_mask: np.ndarray,
                    label_count: np.ndarray, width: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """The step columns of sampled completions, as TRL's ``GKDTrainer.generate_on_policy_outputs`` builds them: the
    left-padded prompt, then the completion (its tokens up to and with the first EOS are labels), right-padded to
    ``width``; ``label_count`` stays the dataset rows' (TRL's ``num_items_in_batch`` is counted before the swap).

    Args:
        prompt_ids, prompt_mask: ``[n, P]`` left-padded prompts.
        tokens, completion_mask: ``[n, C]`` right-padded completions and their kept tokens.
        label_count: ``[n]`` the dataset rows' label counts.
        width: the step width, at least ``P + C``.
        pad_token_id: the padding id.
    """
    count, prompt_width = prompt_ids.shape
    end = prompt_width + tokens.shape[1]
    columns = empty_columns(count, width, pad_token_id)
    columns["input_ids"][:, :prompt_width] = prompt_ids
    columns["input_ids"][:, prompt_width:end] = tokens
    columns["attention_mask"][:, :prompt_width] = prompt_mask
    columns["attention_mask"][:, prompt_width:end] = completion_mask
    columns["completion_mask"][:, prompt_width - 1:end - 1] = completion_mask
    columns["label_count"][:] = label_count
    return columns
