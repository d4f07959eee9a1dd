"""Preference data for DPO: TRL 1.16's preference formats turned into prompt/chosen/rejected token ids, then
fixed-shape pair batches.

This module reimplements what ``trl.DPOTrainer._prepare_dataset`` and ``DataCollatorForPreference`` do (TRL is not a
runtime dependency), with one change a JAX step needs: every batch is padded to one length, so XLA compiles once.

Formats (decided from the first example; every later example must have the same layout):

- ``prompt``, ``chosen``, ``rejected`` strings: standard, explicit prompt. ``eos`` is appended to ``chosen`` and
  ``rejected`` when missing; ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` are tokenised.
- ``prompt``, ``chosen``, ``rejected`` message lists: conversational, explicit prompt. The chat template renders the
  prompt (with ``add_generation_prompt=True``) and the prompt followed by each response (an optional ``tools`` column
  and ``chat_template_kwargs`` column are passed to it).
- ``chosen``, ``rejected`` only: implicit prompt, split off as TRL's ``extract_prompt`` does (the longest common
  prefix of characters, or of messages for conversations).

The completion starts where the tokenised prompt and prompt + response diverge (tokens can merge across the boundary;
a warning says so once). Sequences longer than ``max_length`` are cut per sequence (``truncation_mode``), and with
``"keep_start"`` an example whose prompt alone fills ``max_length`` is dropped, as in TRL (here with a warning).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...type_aliases import PromptLike, Tokenizer
from ..data_utils import (
    MAX_DROP_WARNINGS,
    chat_template_kwargs_for,
    common_prefix_length,
    describe,
    extract_prompt,
    get_dataset_column_names,
    is_message_list,
    padded_sequences,
    response_sequence,
    tokenized_examples,
    truncation_window,
)
from ..trainer.base_config import round_up_to_multiple

__all__ = [
    "ACCEPTED_FORMATS",
    "PreferenceDataWarning",
    "PreferenceTokenizer",
    "collate_preference_batch",
    "padded_length",
    "prepare_preference_examples",
]

ACCEPTED_FORMATS = (
    "standard, explicit prompt: 'prompt', 'chosen' and 'rejected' strings",
    "conversational, explicit prompt: 'prompt', 'chosen' and 'rejected' lists of {'role', 'content'} messages",
    "standard, implicit prompt: 'chosen' and 'rejected' strings that start with the same prompt",
    "conversational, implicit prompt: 'chosen' and 'rejected' conversations that start with the same messages",
)

_RESPONSES = ("chosen", "rejected")
class PreferenceDataWarning(UserWarning):
    """Warnings about preference data preparation: dropped examples, prompt/completion token boundaries."""


def _missing_columns_error(columns: Sequence[str], detail: str) -> ValueError:
    formats = "\n".join(f"  - {fmt}" for fmt in ACCEPTED_FORMATS)
    return ValueError(f"The DPO dataset {detail}. Found columns: {list(columns)}. Accepted preference formats:\n"
                      f"{formats}")


class PromptResponseTokenizer:
    """What the offline preference trainers' tokenisers share: the tokenizer checks (a chat template for message
    lists, an eos token to append to text responses), token ids of text or messages, and the prompt split where the
    tokenised prompt stops being a prefix of prompt + response (TRL's rule), with one warning per dataset.

    Args:
        tokenizer: the tokenizer.
        conversational: the dataset holds message lists.
        trainer: ``"DPO"``, ``"KTO"``..., for messages.
    """

    def __init__(self, tokenizer: Tokenizer, conversational: bool, trainer: str):
        self.tokenizer = tokenizer
        self.conversational = conversational
        self.prefix_warned = False
        if conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"The {trainer} dataset is conversational (message lists), but the tokenizer "
                             f"({type(tokenizer).__name__}) has no chat template to render it. Set one with "
                             "`tokenizer.chat_template = '<jinja template>'`, e.g. the template of the model family "
                             "you train.")
        if not conversational and not tokenizer.eos_token:
            raise ValueError(f"The tokenizer ({type(tokenizer).__name__}) has no eos_token, and standard "
                             f"(non-conversational) {trainer} responses get one appended so the model learns to stop. "
                             "Set tokenizer.eos_token.")

    def _ids(self, messages_or_text: PromptLike, template_kwargs: Mapping[str, Any], **kwargs: Any) -> list[int]:
        if self.conversational:
            out = self.tokenizer.apply_chat_template(messages_or_text, tokenize=True, return_dict=True,
                                                     **template_kwargs, **kwargs)
        else:
            out = self.tokenizer(text=messages_or_text)
        return list(out["input_ids"])

    def _with_eos(self, text: str) -> str:
        eos = self.tokenizer.eos_token
        return text if text.endswith(eos) else text + eos

    def _prompt_ids(self, prompt: PromptLike, template_kwargs: Mapping[str, Any]) -> list[int]:
        if self.conversational:
            return self._ids(prompt, template_kwargs, add_generation_prompt=True)
        return self._ids(prompt, template_kwargs)

    def _prompt_length(self, prompt_ids: list[int], full_ids: Iterable[list[int]], index: int) -> int:
        """Where the prompt ends: the longest prefix ``prompt_ids`` shares with every tokenised prompt + response."""
        prompt_length = min(common_prefix_length(prompt_ids, ids) for ids in full_ids)
        if prompt_length < len(prompt_ids) and not self.prefix_warned:
            self.prefix_warned = True
            warnings.warn(
                f"Example {index}: the tokenised prompt is not a prefix of the tokenised prompt + response (tokens "
                "merge across the boundary, or the chat template renders the prompt alone differently); the "
                "completion starts where they diverge, and the prompt's tail "
                f"{self.tokenizer.decode(prompt_ids[prompt_length:])!r} is not in the training sequence. End prompts "
                "on a token boundary to avoid it. Shown once; it likely applies to other examples.",
                PreferenceDataWarning, stacklevel=5)
        return prompt_length


class PreferenceTokenizer(PromptResponseTokenizer):
    """Settings resolved once per dataset; turns one raw example into ``prompt_ids`` and ``<response>_ids`` for each
    of :attr:`responses` (a subclass with more responses, TPO's, changes the checks' words and the prompt split)."""

    responses: tuple[str, ...] = _RESPONSES

    def __init__(self, tokenizer: Tokenizer, first: Mapping[str, Any], columns: Sequence[str]):
        missing = [key for key in _RESPONSES if key not in first]
        if missing:
            raise _missing_columns_error(columns, f"has no {' or '.join(repr(key) for key in missing)} column")
        self._start(tokenizer, first, "DPO")

    def _start(self, tokenizer: Tokenizer, first: Mapping[str, Any], trainer: str) -> None:
        self.explicit_prompt = "prompt" in first
        PromptResponseTokenizer.__init__(self, tokenizer, is_message_list(first["chosen"]), trainer)

    def _missing_error(self, example: Mapping[str, Any], index: int, missing: list[str],
                       keys: Sequence[str]) -> ValueError:
        return _missing_columns_error(list(example), f"example {index} has no {missing} (the first example has "
                                                     f"{list(keys)})")

    def _split_prompt(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """The implicit prompt split off the responses (TRL's ``extract_prompt``)."""
        return extract_prompt(raw)

    def _check_layout(self, example: Mapping[str, Any], index: int) -> None:
        keys = (("prompt",) if self.explicit_prompt else ()) + self.responses
        missing = [key for key in keys if key not in example]
        if missing:
            raise self._missing_error(example, index, missing, keys)
        matches = is_message_list if self.conversational else (lambda value: isinstance(value, str))
        if not all(matches(example[key]) for key in keys):
            expected = "lists of {'role', 'content'} messages" if self.conversational else "strings"
            found = ", ".join(f"{key} is {describe(example[key])}" for key in keys)
            raise ValueError(f"Example {index}: {', '.join(keys)} should all be {expected}, like the first "
                             f"example; found {found}.")

    def __call__(self, raw: Mapping[str, Any], index: int) -> dict[str, list[int]]:
        if not isinstance(raw, Mapping):
            raise TypeError(f"Example {index} should be a dict of columns; found {describe(raw)}.")
        self._check_layout(raw, index)
        example = dict(raw) if self.explicit_prompt else {**raw, **self._split_prompt(raw)}
        prompt = example["prompt"]
        template_kwargs = chat_template_kwargs_for(example) if self.conversational else {}
        if not self.conversational:
            example.update({key: self._with_eos(example[key]) for key in self.responses})
        prompt_ids = self._prompt_ids(prompt, template_kwargs)
        full = {key: self._ids(prompt + example[key], template_kwargs) for key in self.responses}
        prompt_length = self._prompt_length(prompt_ids, full.values(), index)
        return {"prompt_ids": prompt_ids[:prompt_length],
                **{f"{key}_ids": full[key][prompt_length:] for key in self.responses}}


def prepare_preference_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *, max_length: int | None,
                                truncation_mode: str = "keep_start", num_proc: int | None = None
                                ) -> list[dict[str, list[int]]]:
    """Tokenises a preference dataset the way ``trl.DPOTrainer`` (1.16) prepares it.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Preference examples in one
            of ``ACCEPTED_FORMATS``. They are never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`): Tokenises strings with ``tokenizer(text=...)`` (special
            tokens included, as TRL does) and message lists with ``tokenizer.apply_chat_template``.
        max_length (`int` or `None`): With ``truncation_mode="keep_start"``, examples whose prompt alone has
            ``max_length`` tokens or more are dropped (truncation would leave no response token).
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`): ``"keep_start"`` or ``"keep_end"``.
        num_proc (`int`, *optional*): Tokenise in this many processes (``datasets.Dataset.map``) when ``dataset`` is
            a ``datasets.Dataset``.

    Returns:
        `list[dict]`: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists of ints) per kept example; the
        sequences scored are ``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids``.

    Raises:
        ValueError: an empty dataset, missing ``chosen``/``rejected`` columns (the message lists the columns found
            and the accepted formats), mixed layouts, conversational data without a chat template, or every example
            dropped.
    """
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(f"The DPO dataset is empty ({type(dataset).__name__} with no examples); pass at least one "
                         "preference example.") from None
    if not isinstance(first, Mapping):
        raise TypeError(f"Example 0 should be a dict of columns; found {describe(first)}.")
    tokenize = PreferenceTokenizer(tokenizer, first, get_dataset_column_names(dataset, first))
    kept, dropped = [], 0
    examples = tokenized_examples(dataset, itertools.chain([first], iterator), tokenize, num_proc)
    for index, example in enumerate(examples):
        prompt = len(example["prompt_ids"])
        if max_length is not None and truncation_mode == "keep_start" and prompt >= max_length:
            dropped += 1
            if dropped <= MAX_DROP_WARNINGS:
                warnings.warn(f"Example {index} is dropped: its prompt has {prompt} tokens, so truncation to "
                              f"max_length={max_length} (keep_start) leaves no response token. Raise max_length or "
                              "shorten the prompt.", PreferenceDataWarning, stacklevel=2)
            continue
        kept.append({key: list(example[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids")})
    if not kept:
        raise ValueError(f"All {dropped} examples of the DPO dataset were dropped: every prompt fills "
                         f"max_length={max_length}. Raise max_length above the prompt lengths or shorten the prompts.")
    return kept


def padded_length(examples: Iterable[Mapping[str, Any]], max_length: int | None, truncation_mode: str = "keep_start",
                  pad_to_multiple_of: int | None = None, responses: Sequence[str] = _RESPONSES) -> int:
    """The one length every batch is padded to: the longest truncated sequence, rounded up to a multiple.

    Args:
        examples (`Iterable[dict]`): Outputs of [`prepare_preference_examples`].
        max_length (`int` or `None`): Truncation length (``None``: none).
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`): As in preparation.
        pad_to_multiple_of (`int`, *optional*): Round the length up to a multiple of it.
        responses (`Sequence[str]`, *optional*): The responses batches hold (TPO's triples add ``"reference"``).

    Returns:
        `int`: The padded length for [`collate_preference_batch`].
    """
    window = truncation_window(max_length, truncation_mode)
    longest = max((len(response_sequence(example, response, window)[0])
                   for example in examples for response in responses), default=1)
    return round_up_to_multiple(longest, pad_to_multiple_of)


def collate_preference_batch(examples: Sequence[Mapping[str, Any]], pad_token_id: int, length: int,
                             max_length: int | None = None, truncation_mode: str = "keep_start",
                             responses: Sequence[str] = _RESPONSES) -> dict[str, np.ndarray]:
    """Truncates and right-pads prepared pairs to a fixed batch, as TRL's ``DataCollatorForPreference`` with a fixed
    length.

    TRL stacks the chosen sequences on top of the rejected ones (``2B`` rows); here each pair is one row with
    ``chosen_*`` and ``rejected_*`` columns, so the rows of a batch split evenly over data-parallel devices.

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_preference_examples`], optionally with float
            ``ref_chosen_logps``/``ref_rejected_logps``.
        pad_token_id (`int`): Fills ``*_input_ids`` past each sequence.
        length (`int`): The padded length (see [`padded_length`]).
        max_length (`int` or `None`, *optional*): Each ``prompt + response`` is truncated to it first.
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`): ``"keep_start"`` or ``"keep_end"``.
        responses (`Sequence[str]`, *optional*): The responses to collate (TPO's triples add ``"reference"``).

    Returns:
        `dict[str, np.ndarray]`: for each response (``chosen`` and ``rejected``), int32 ``[B, length]`` arrays
        ``*_input_ids``, ``*_attention_mask`` (1 on real tokens) and ``*_completion_mask`` (1 on response tokens); plus
        float32 ``[B]`` ``ref_chosen_logps``/``ref_rejected_logps`` when the examples have them.
    """
    window = truncation_window(max_length, truncation_mode)
    batch = padded_sequences(examples, [(response, f"{response}_") for response in responses], pad_token_id, length,
                             window)
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        if examples and key in examples[0]:
            batch[key] = np.asarray([example[key] for example in examples], dtype=np.float32)
    return batch
