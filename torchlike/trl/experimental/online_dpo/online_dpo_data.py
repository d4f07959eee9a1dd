"""Online DPO's data: prompts tokenised as TRL 1.16's ``OnlineDPOTrainer._generate`` tokenises them, and the step
columns of a micro-batch's ranked completions, laid out as its ``training_step`` scores them.

A micro-batch samples two completions of each of its ``B`` prompts: row ``i`` and row ``i + B`` share prompt ``i``
(TRL's ``prompt_ids.repeat(2, 1)``). Once rewarded, each pair is ranked (:func:`ranked_order`) and the step columns
hold the chosen completions first, then the rejected ones (``adapters.losses.online_dpo`` reads them). TRL's tensors
are as wide as the micro-batch's longest prompt and longest completion; torchlike's are fixed (so the step compiles
once), and what depends on TRL's widths is reproduced from them: the prompt columns ``max_length`` drops
(:func:`truncated_prompt_mask`), and the generation window its unmasked metrics sum over (``completion_window``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ....type_aliases import DatasetLike, Tokenizer
from ...data_utils import get_dataset_column_names, is_message_list

__all__ = ["contains_end_token", "prepare_prompt_rows", "preference_columns", "ranked_order", "truncated_prompt_mask"]


def prompt_text(prompt: str | list[dict], tokenizer: Tokenizer) -> str:
    """A prompt as TRL's ``maybe_apply_chat_template({"prompt": prompt})`` renders it: text as it is; messages through
    the chat template with the generation prompt after a user or tool turn, continuing a last assistant turn.

    Raises:
        ValueError: the last message has another role (TRL's message).
    """
    if isinstance(prompt, str):
        return prompt
    last_role = prompt[-1]["role"]
    if last_role not in ("user", "tool", "assistant"):
        raise ValueError(f"Invalid role in the last message: {last_role}")
    continues = last_role == "assistant"
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not continues,
                                         continue_final_message=continues)


def prepare_prompt_rows(dataset: DatasetLike, tokenizer: Tokenizer, name: str) -> list[dict]:
    """The dataset's rows with ``prompt_ids``: each prompt rendered (:func:`prompt_text`) and tokenised without
    special tokens, as TRL's ``_generate``.

    Args:
        dataset: rows with a ``prompt`` column (text or chat messages) and any columns the reward functions read.
        tokenizer: the policy's tokenizer.
        name: the argument's name, for messages.

    Returns:
        The rows, each a dict with its columns and ``prompt_ids``.

    Raises:
        ValueError: no ``prompt`` column, a prompt that is neither text nor messages, a conversational prompt without a
            chat template, or no rows.
    """
    columns = get_dataset_column_names(dataset)
    if "prompt" not in columns:
        raise ValueError(f"{name} has no 'prompt' column (found {columns}); online DPO samples completions of "
                         "'prompt' (text or a list of chat messages); other columns reach the reward functions.")
    rows = []
    for index, row in enumerate(dataset):
        row, prompt = dict(row), row["prompt"]
        if not isinstance(prompt, str) and not is_message_list(prompt):
            raise ValueError(f"{name} row {index}: 'prompt' must be a string or a list of chat messages, got "
                             f"{type(prompt).__name__}.")
        if not isinstance(prompt, str) and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{name} row {index} has a conversational prompt but the tokenizer has no chat template; "
                             "set tokenizer.chat_template or use text prompts.")
        row["prompt_ids"] = tokenizer(prompt_text(prompt, tokenizer), add_special_tokens=False)["input_ids"]
        rows.append(row)
    if not rows:
        raise ValueError(f"{name} is empty.")
    return rows


def ranked_order(rewards: np.ndarray) -> np.ndarray:
    """TRL's ranking of the two completions of each prompt: ``[2B]`` row indices, the chosen ones then the rejected
    ones; completion ``i`` is chosen over ``i + B`` when its reward is at least as high.

    Args:
        rewards: ``[2B]`` the completions' rewards, rows ``i`` and ``i + B`` of the same prompt.
    """
    half = len(rewards) // 2
    first_wins = rewards[:half] >= rewards[half:]
    pairs = np.arange(half)
    return np.concatenate([pairs + ~first_wins * half, pairs + first_wins * half])


def contains_end_token(tokens: np.ndarray, window: int, eos_token_ids: Sequence[int]) -> np.ndarray:
    """TRL's ``contain_eos_token``: ``[N]`` whether any of a row's first ``window`` completion tokens (its generated
    tokens, padding after an end token included) is an end token."""
    return np.isin(tokens[:, :window], list(eos_token_ids)).any(axis=1)


def truncated_prompt_mask(prompt_mask: np.ndarray, window: int, max_length: int) -> np.ndarray:
    """The prompt mask once TRL's ``_forward`` has cut ``longest prompt + window - max_length`` columns off the left
    of its prompt tensor (as wide as the longest prompt): each row keeps at most its last ``longest - cut`` tokens.

    Args:
        prompt_mask: ``[N, P]`` left-padded prompts' mask.
        window: the micro-batch's longest completion.
        max_length: ``OnlineDPOConfig.max_length``.

    Raises:
        ValueError: the cut would drop every prompt column (TRL then scores each completion token with the logits at
            its own position, not the one before).
    """
    longest = int(prompt_mask.sum(axis=1).max())
    kept = longest - max(longest + window - max_length, 0)
    if kept <= 0:
        raise ValueError(f"max_length={max_length} leaves no prompt token before a completion of {window} tokens "
                         f"(max_new_tokens is at most that long); raise max_length above max_new_tokens.")
    tokens_from_here = np.cumsum(prompt_mask[:, ::-1], axis=1)[:, ::-1]
    return prompt_mask * (tokens_from_here <= kept)


def preference_columns(prompt_ids: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray,
                       completion_mask: np.ndarray, rewards: np.ndarray, missing_eos_penalty: float | None,
                       beta: float, eos_token_ids: Sequence[int], max_length: int,
                       images: Any = None,  # Any: the model's image tree (an array, or a dict of arrays)
                       prompt_token_types: np.ndarray | None = None) -> dict[str, Any]:
    """The step columns of one micro-batch's completions, ranked by their rewards less ``missing_eos_penalty`` for
    those without an end token (:func:`contains_end_token`), chosen first (:func:`ranked_order`).

    Image prompts keep every prompt token, as TRL's ``_forward`` does with images (cutting the left would drop image
    tokens): ``max_length`` cuts text prompts only.

    Args:
        prompt_ids, prompt_mask: ``[2B, P]`` left-padded prompts (rows ``i`` and ``i + B`` the same prompt).
        tokens, completion_mask: ``[2B, C]`` completions right-padded with the pad token; the mask 1 up to and with
            the first end token.
        rewards: ``[2B]`` the completions' rewards (the weighted sum over reward functions).
        missing_eos_penalty: ``OnlineDPOConfig.missing_eos_penalty`` (``None``: no penalty).
        beta: the micro-batch's DPO temperature.
        eos_token_ids: the end tokens.
        max_length: ``OnlineDPOConfig.max_length``.
        images: image prompts' images as the model takes them (an array with one entry per row, or a dict of them),
            or ``None``.
        prompt_token_types: ``[2B, P]`` 1 on the image prompts' image tokens (with ``images``).

    Returns:
        ``input_ids``, ``attention_mask``, ``position_ids`` ``[2B, P + C]``; ``completion_mask`` and
        ``completion_window`` ``[2B, C]``; ``rewards``, ``contain_eos``, ``beta`` ``[2B]`` float32; with images also
        ``images`` (ranked like the rows) and ``token_type_ids`` ``[2B, P + C]``.
    """
    rows, width = tokens.shape
    window = int(completion_mask.sum(axis=1).max())
    contain_eos = contains_end_token(tokens, window, eos_token_ids)
    if missing_eos_penalty is not None:
        rewards = rewards - np.float32(missing_eos_penalty) * ~contain_eos
    order = ranked_order(rewards)
    ids = np.concatenate([prompt_ids, tokens], axis=1)
    kept_prompt = prompt_mask if images is not None else truncated_prompt_mask(prompt_mask, window, max_length)
    columns = {
        "input_ids": ids,
        "attention_mask": np.concatenate([kept_prompt, completion_mask], axis=1),
        "position_ids": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape),
        "completion_mask": completion_mask,
        "completion_window": np.broadcast_to((np.arange(width) < window).astype(np.int32), (rows, width)),
        "rewards": rewards.astype(np.float32),
        "contain_eos": contain_eos.astype(np.float32),
        "beta": np.full(rows, beta, np.float32),
    }
    if images is not None:
        columns["token_type_ids"] = np.concatenate([prompt_token_types, np.zeros_like(tokens)], axis=1)
    ranked = {key: np.ascontiguousarray(value[order]).astype(value.dtype) for key, value in columns.items()}
    if images is not None:
        ranked["images"] = jax.tree.map(lambda value: np.ascontiguousarray(np.asarray(value)[order]), images)
    return ranked
