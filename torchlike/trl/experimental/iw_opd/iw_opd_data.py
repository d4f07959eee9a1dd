"""IW-OPD's data: conversations tokenised as TRL 1.16's ``IWOPDTrainer`` collator (``_DistillationCollator``)
tokenises them, with separate prompt and completion budgets, and the step columns of a micro-batch (GKD's layout,
``torchlike.trl.experimental.gkd.gkd_data``, with an ``on_policy`` flag).

A row is a ``messages`` conversation; when its last message is the assistant's, that message is the completion and
the rest the prompt, else the whole conversation is the prompt (no completion: on-policy training samples one). The
prompt is rendered with the generation prompt and tokenised without special tokens, truncated to
``max_prompt_length`` on the tokenizer's ``truncation_side``; the completion is what the whole conversation's
tokens add after the untruncated prompt's, cut so that prompt + completion fit ``max_length``.
"""

from __future__ import annotations

import numpy as np

from ....type_aliases import Tokenizer

__all__ = ["flagged", "tokenize_row"]


def tokenize_row(row: dict, tokenizer: Tokenizer, max_length: int | None, max_prompt_length: int | None) -> dict:
    """One row as TRL's ``_DistillationCollator`` tokenises it: the row with ``prompt_ids`` and ``input_ids``
    (prompt + completion).

    Raises:
        ValueError: a row without ``messages`` (naming the columns found).
    """
    if "messages" not in row:
        raise ValueError(f"IWOPDTrainer's rows are 'messages' conversations (the last assistant message is the "
                         f"completion); this row has {sorted(row)}.")
    messages = row["messages"]
    has_completion = len(messages) > 1 and messages[-1].get("role") == "assistant"
    prompt_text = tokenizer.apply_chat_template(messages[:-1] if has_completion else messages, tokenize=False,
                                                add_generation_prompt=True)
    truncation = {} if max_prompt_length is None else {"truncation": True, "max_length": max_prompt_length}
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False, **truncation)["input_ids"])
    completion: list[int] = []
    if has_completion:
        full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False),
                         add_special_tokens=False)["input_ids"]
        untruncated = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        completion = list(full[len(untruncated):])
        room = (max_length if max_length is not None else len(prompt_ids) + len(completion)) - len(prompt_ids)
        completion = completion[:room] if room > 0 else []
    return {**row, "prompt_ids": prompt_ids, "input_ids": prompt_ids + completion}


def flagged(columns: dict[str, np.ndarray], on_policy: bool) -> dict[str, np.ndarray]:
    """``columns`` with the ``on_policy`` flag of every row."""
    count = len(columns["input_ids"])
    return {**columns, "on_policy": np.full(count, float(on_policy), np.float32)}
