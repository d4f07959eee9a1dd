"""Prompt data of the online trainers (GRPO, RLOO): rows with a ``prompt`` (text, or chat messages rendered with the
chat template and ``add_generation_prompt=True``) tokenised to ``prompt_ids``, and left-padded prompt batches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...type_aliases import DatasetLike, Tokenizer
from ..data_utils import get_dataset_column_names, is_conversational

__all__ = ["is_conversational_prompt", "left_padded", "prepare_prompts"]


def is_conversational_prompt(prompt: object) -> bool:
    """Whether ``prompt`` is a list of chat messages (TRL's ``is_conversational`` on ``{"prompt": prompt}``)."""
    return is_conversational({"prompt": prompt})


def prepare_prompts(dataset: DatasetLike | list[dict] | None, tokenizer: Tokenizer, name: str,
                    max_prompt_length: int | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                    default_prompt: list[dict] | None = None) -> list[dict] | None:
    """Rows as dicts: the original columns plus ``prompt_ids``.

    Args:
        dataset: a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column (``None`` gives ``None``).
        tokenizer: the tokenizer; conversational prompts use its chat template with ``add_generation_prompt=True``.
        name: the argument's name, for messages (``"train_dataset"``).
        max_prompt_length: keep the last this many prompt tokens (TRL truncates prompts on the left).
        chat_template_kwargs: extra arguments of ``apply_chat_template``.
        default_prompt: the prompt of rows without one (they stay without a ``prompt`` column); ``None``: every row
            needs one.

    Returns:
        The prepared rows.

    Raises:
        ValueError: a dict of datasets, no ``prompt`` column, a prompt of another type, a conversational prompt
            without a chat template, or no rows.
    """
    if dataset is None:
        return None
    if hasattr(dataset, "keys") and not hasattr(dataset, "column_names"):
        raise ValueError(f"{name} is a dict of datasets; pass one dataset.")
    columns = get_dataset_column_names(dataset)
    if "prompt" not in columns and default_prompt is None:
        raise ValueError(f"{name} has no 'prompt' column (found {columns}); these datasets need 'prompt' as text or "
                         "as a list of chat messages, plus any columns your reward functions read.")
    rows = []
    for index, row in enumerate(dataset):
        row = dict(row)
        prompt = row.get("prompt", default_prompt)
        if is_conversational_prompt(prompt):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f"{name} row {index} has a conversational prompt but the tokenizer has no chat "
                                 "template; set tokenizer.chat_template or use text prompts.")
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **dict(chat_template_kwargs or {}))["input_ids"]
        elif isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            raise ValueError(f"{name} row {index}: 'prompt' must be a string or a list of chat messages, got "
                             f"{type(prompt).__name__}.")
        if max_prompt_length:
            ids = ids[-max_prompt_length:]
        row["prompt_ids"] = list(ids)
        rows.append(row)
    if not rows:
        raise ValueError(f"{name} is empty.")
    return rows


def left_padded(sequences: Sequence[Sequence[int]], length: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [N, length], mask [N, length])``: each sequence's last ``length`` tokens, padded on the left."""
    ids = np.full((len(sequences), length), pad_token_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, sequence in enumerate(sequences):
        sequence = list(sequence)[-length:]
        if sequence:
            ids[row, length - len(sequence):] = sequence
            mask[row, length - len(sequence):] = 1
    return ids, mask
