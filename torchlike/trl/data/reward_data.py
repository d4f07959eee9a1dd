"""Preference data for reward modelling: TRL 1.16's formats turned into chosen/rejected token ids, then fixed-shape
pair batches.

This module reimplements what ``trl.RewardTrainer._prepare_dataset`` and its ``DataCollatorForPreference`` do (TRL is
not a runtime dependency), with one change a JAX step needs: every batch is padded to one length, so XLA compiles once.

Formats (decided from the first example; every later example must have the same layout), each with an optional
float ``margin`` column (the loss then asks the chosen score to exceed the rejected one by it):

- ``prompt``, ``chosen``, ``rejected`` strings (explicit prompt), or ``chosen``, ``rejected`` strings (implicit
  prompt): ``eos`` is appended to ``chosen`` and ``rejected`` when missing, then ``prompt + chosen`` and
  ``prompt + rejected`` (or ``chosen`` and ``rejected``) are tokenised.
- The same with message lists (conversational): ``prompt + chosen`` and ``prompt + rejected`` are rendered whole by the
  chat template (no generation prompt; an optional ``tools`` column and ``chat_template_kwargs`` column are passed to
  it). No ``eos`` is added: the template ends the turn.
- ``chosen_ids`` and ``rejected_ids`` (already tokenised): used as they are (the deprecated ``chosen_input_ids`` /
  ``rejected_input_ids`` too, with TRL's FutureWarning).

Unlike DPO's, the sequence is never split into prompt and completion: the reward model reads it whole. With
``max_length``, pairs whose chosen or rejected sequence is longer are dropped (nothing is truncated), as in TRL.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...type_aliases import PromptLike, Tokenizer
from ..data_utils import (
    as_int_list,
    chat_template_kwargs_for,
    describe,
    get_dataset_column_names,
    is_message_list,
    tokenized_examples,
)
from ..trainer.base_config import round_up_to_multiple
from .dpo_data import PreferenceDataWarning

__all__ = ["ACCEPTED_FORMATS", "collate_reward_batch", "padded_length", "prepare_reward_examples"]

ACCEPTED_FORMATS = (
    "standard, explicit prompt: 'prompt', 'chosen' and 'rejected' strings",
    "standard, implicit prompt: 'chosen' and 'rejected' strings (each the whole text)",
    "conversational, explicit prompt: 'prompt', 'chosen' and 'rejected' lists of {'role', 'content'} messages",
    "conversational, implicit prompt: 'chosen' and 'rejected' conversations",
    "tokenised: 'chosen_ids' and 'rejected_ids' lists of token ids",
    "any of these with a float 'margin' column",
)

_RESPONSES = ("chosen", "rejected")
_TOKENISED = ("chosen_ids", "rejected_ids")
_LEGACY_TOKENISED = ("chosen_input_ids", "rejected_input_ids")


def _format_error(columns: Sequence[str], detail: str) -> ValueError:
    formats = "\n".join(f"  - {fmt}" for fmt in ACCEPTED_FORMATS)
    return ValueError(f"The reward dataset {detail}. Found columns: {list(columns)}. Accepted preference formats:\n"
                      f"{formats}")


class _PairTokenizer:
    """Settings resolved from the first example; turns one raw example into ``chosen_ids``/``rejected_ids`` (and
    ``margin``)."""

    def __init__(self, tokenizer: Tokenizer, first: Mapping[str, Any], columns: Sequence[str]):
        self.tokenised = all(key in first for key in _TOKENISED)
        self.legacy = not self.tokenised and all(key in first for key in _LEGACY_TOKENISED)
        if self.legacy:
            warnings.warn("Detected legacy dataset columns `chosen_input_ids`/`rejected_input_ids`; they are "
                          "deprecated and will not be supported in v1. Please migrate to `chosen_ids`/`rejected_ids`.",
                          FutureWarning, stacklevel=4)
        self.with_margin = "margin" in first
        self.tokenizer = tokenizer
        if self.tokenised or self.legacy:
            return
        missing = [key for key in _RESPONSES if key not in first]
        if missing:
            raise _format_error(columns, f"has no {' or '.join(repr(key) for key in missing)} column")
        self.explicit_prompt = "prompt" in first
        self.conversational = is_message_list(first["chosen"])
        if self.conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"The reward dataset is conversational (message lists), but the tokenizer "
                             f"({type(tokenizer).__name__}) has no chat template to render it. Set one with "
                             "`tokenizer.chat_template = '<jinja template>'` or RewardConfig(chat_template_path=...).")
        if not self.conversational and not tokenizer.eos_token:
            raise ValueError(f"The tokenizer ({type(tokenizer).__name__}) has no eos_token, and standard "
                             "(non-conversational) chosen and rejected texts get one appended, as in TRL. Set "
                             "tokenizer.eos_token or RewardConfig(eos_token=...).")

    def _margin(self, raw: Mapping[str, Any], index: int) -> dict[str, float]:
        if not self.with_margin:
            return {}
        if "margin" not in raw:
            raise _format_error(list(raw), f"example {index} has no 'margin' (the first example has one)")
        return {"margin": float(raw["margin"])}

    def _check_layout(self, raw: Mapping[str, Any], index: int) -> None:
        keys = (("prompt",) if self.explicit_prompt else ()) + _RESPONSES
        missing = [key for key in keys if key not in raw]
        if missing:
            raise _format_error(list(raw), f"example {index} has no {missing} (the first example has {list(keys)})")
        matches = is_message_list if self.conversational else (lambda value: isinstance(value, str))
        if not all(matches(raw[key]) for key in keys):
            expected = "lists of {'role', 'content'} messages" if self.conversational else "strings"
            found = ", ".join(f"{key} is {describe(raw[key])}" for key in keys)
            raise ValueError(f"Example {index}: {', '.join(keys)} should all be {expected}, like the first example; "
                             f"found {found}.")

    def _ids(self, sequence: PromptLike, template_kwargs: Mapping[str, Any]) -> list[int]:
        if self.conversational:
            out = self.tokenizer.apply_chat_template(sequence, tokenize=True, return_dict=True, **template_kwargs)
        else:
            out = self.tokenizer(text=sequence)
        return list(out["input_ids"])

    def __call__(self, raw: Mapping[str, Any], index: int) -> dict[str, Any]:
        if not isinstance(raw, Mapping):
            raise TypeError(f"Example {index} should be a dict of columns; found {describe(raw)}.")
        if self.tokenised or self.legacy:
            names = _TOKENISED if self.tokenised else _LEGACY_TOKENISED
            missing = [name for name in names if name not in raw]
            if missing:
                raise _format_error(list(raw), f"example {index} has no {missing} (the first example has them)")
            return {key: as_int_list(raw[name], name, index) for key, name in zip(_TOKENISED, names, strict=True)} \
                | self._margin(raw, index)
        self._check_layout(raw, index)
        prompt = raw["prompt"] if self.explicit_prompt else ([] if self.conversational else "")
        if self.conversational:
            template_kwargs = chat_template_kwargs_for(raw)
            responses = {key: raw[key] for key in _RESPONSES}
        else:
            template_kwargs, eos = {}, self.tokenizer.eos_token
            responses = {key: raw[key] if raw[key].endswith(eos) else raw[key] + eos for key in _RESPONSES}
        return {f"{key}_ids": self._ids(prompt + responses[key], template_kwargs) for key in _RESPONSES} \
            | self._margin(raw, index)


def prepare_reward_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *, max_length: int | None,
                            num_proc: int | None = None) -> list[dict[str, Any]]:
    """Tokenises a preference dataset the way ``trl.RewardTrainer`` (1.16) prepares it.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Preference examples in one
            of ``ACCEPTED_FORMATS``. They are never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`): Tokenises strings with ``tokenizer(text=...)`` (special
            tokens included, as TRL does) and message lists with ``tokenizer.apply_chat_template``.
        max_length (`int` or `None`): Pairs whose chosen or rejected sequence has more tokens are dropped.
        num_proc (`int`, *optional*): Tokenise in this many processes (``datasets.Dataset.map``) when ``dataset`` is
            a ``datasets.Dataset``.

    Returns:
        `list[dict]`: ``{"chosen_ids", "rejected_ids"}`` (lists of ints), plus a float ``"margin"`` when the data has
        that column, per kept pair. Already tokenised examples pass through (filtered by ``max_length``), so
        preparing prepared examples again changes nothing.

    Raises:
        ValueError: an empty dataset, a missing ``chosen`` or ``rejected`` column (the message lists the columns found
            and the accepted formats), mixed layouts, conversational data without a chat template, or every pair
            dropped.
    """
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(f"The reward dataset is empty ({type(dataset).__name__} with no examples); pass at least one "
                         "preference pair.") from None
    if not isinstance(first, Mapping):
        raise TypeError(f"Example 0 should be a dict of columns; found {describe(first)}.")
    tokenize = _PairTokenizer(tokenizer, first, get_dataset_column_names(dataset, first))
    kept, total = [], 0
    for example in tokenized_examples(dataset, itertools.chain([first], iterator), tokenize, num_proc):
        total += 1
        if max_length is None or max(len(example["chosen_ids"]), len(example["rejected_ids"])) <= max_length:
            kept.append({key: list(value) if key != "margin" else value for key, value in example.items()})
    if not kept:
        raise ValueError(f"All {total} pairs of the reward dataset were dropped: each has a chosen or rejected "
                         f"sequence longer than max_length={max_length}. Raise max_length (None keeps every pair).")
    if len(kept) < total:
        warnings.warn(f"{total - len(kept)} of {total} preference pairs were dropped: their chosen or rejected "
                      f"sequence is longer than max_length={max_length} tokens (TRL filters them out the same way). "
                      "Raise max_length to keep them.", PreferenceDataWarning, stacklevel=2)
    return kept


def padded_length(examples: Iterable[Mapping[str, Any]], pad_to_multiple_of: int | None = None) -> int:
    """The one length every batch is padded to: the longest chosen or rejected sequence, rounded up to a multiple.

    Args:
        examples (`Iterable[dict]`): Outputs of [`prepare_reward_examples`].
        pad_to_multiple_of (`int`, *optional*): Round the length up to a multiple of it.

    Returns:
        `int`: The padded length for [`collate_reward_batch`].
    """
    longest = max((len(example[key]) for example in examples for key in _TOKENISED), default=1)
    return round_up_to_multiple(longest, pad_to_multiple_of)


def collate_reward_batch(examples: Sequence[Mapping[str, Any]], pad_token_id: int,
                         length: int) -> dict[str, np.ndarray]:
    """Right-pads prepared pairs to a fixed batch, as TRL's ``DataCollatorForPreference`` with a fixed length.

    TRL stacks the chosen sequences on top of the rejected ones (``2B`` rows); here each pair is one row with
    ``chosen_*`` and ``rejected_*`` columns, so the rows of a batch split evenly over data-parallel devices (the loss
    stacks them again for its one forward pass).

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_reward_examples`].
        pad_token_id (`int`): Fills ``*_input_ids`` past each sequence.
        length (`int`): The padded length (see [`padded_length`]).

    Returns:
        `dict[str, np.ndarray]`: int32 ``[B, length]`` arrays ``chosen_input_ids``, ``chosen_attention_mask``,
        ``rejected_input_ids`` and ``rejected_attention_mask`` (1 on real tokens), plus float32 ``[B]`` ``margin``
        when the examples have one.
    """
    batch: dict[str, np.ndarray] = {}
    for response in _RESPONSES:
        input_ids = np.full((len(examples), length), pad_token_id, dtype=np.int32)
        attention_mask = np.zeros((len(examples), length), dtype=np.int32)
        for row, example in enumerate(examples):
            ids = example[f"{response}_ids"]
            if len(ids) > length:
                raise ValueError(f"Example {row} of the batch has a {len(ids)}-token {response} sequence, more than "
                                 f"the padded length {length}; compute the length with padded_length(...).")
            input_ids[row, :len(ids)], attention_mask[row, :len(ids)] = ids, 1
        batch.update({f"{response}_input_ids": input_ids, f"{response}_attention_mask": attention_mask})
    if examples and "margin" in examples[0]:
        batch["margin"] = np.asarray([example["margin"] for example in examples], dtype=np.float32)
    return batch
