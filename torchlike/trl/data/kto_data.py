"""Unpaired preference data for KTO: TRL 1.16's formats turned into prompt/completion token ids with their KL
completions, then fixed-shape batches.

This module reimplements what ``trl.KTOTrainer._prepare_dataset`` and ``DataCollatorForUnpairedPreference`` do (TRL is
not a runtime dependency), with one change a JAX step needs: every batch is padded to one length, so XLA compiles once.

Formats (decided from the first example; every later example must have the same layout):

- ``prompt``, ``completion`` and ``label``: unpaired, standard (strings) or conversational (message lists rendered
  with the chat template; an optional ``tools`` and ``chat_template_kwargs`` column are passed to it). ``label`` is
  True (or 1) for a desirable completion, False (or 0) for an undesirable one.
- ``prompt``, ``chosen``, ``rejected``, or ``chosen`` and ``rejected`` with the prompt implicit (split off as TRL's
  ``extract_prompt`` does): paired preference data, unpaired as TRL's ``unpair_preference_dataset`` does. That is a
  ``datasets.map`` with batches of 1000 pairs, so within each block of 1000 pairs come first the chosen completions
  (label True), then the rejected ones (label False).

Standard completions get ``eos`` appended when missing. The prompt and the prompt + completion are tokenised; the
completion starts where they diverge (a warning says so once when tokens merge across the boundary). With
``max_length``, examples whose prompt alone fills it are dropped (with a warning; TRL drops them silently), and the
collator keeps the first ``max_length`` tokens of each sequence.

KL completions (loss types that estimate the KL term): the prepared examples are cut, in order, into consecutive
chunks of ``per_device_train_batch_size`` and each example of a chunk takes the completion of the example before it
(the first takes the last's): ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``. With ``dataset_num_proc`` on a
``datasets.Dataset`` (or a list), TRL's maps run on contiguous shards, one per process, and these chunks and the
1000-pair blocks restart at each shard; this is reproduced.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...type_aliases import DatasetLike, Tokenizer
from ..data_utils import (
    MAX_DROP_WARNINGS,
    chat_template_kwargs_for,
    describe,
    extract_prompt,
    get_dataset_column_names,
    is_message_list,
    map_batches,
    padded_sequences,
    response_sequence,
    tokenized_examples,
    truncation_window,
    unpair_preference_dataset,
)
from ..trainer.base_config import round_up_to_multiple
from .dpo_data import PreferenceDataWarning, PromptResponseTokenizer

__all__ = [
    "ACCEPTED_FORMATS",
    "check_desirability_balance",
    "collate_unpaired_batch",
    "desirability_label",
    "padded_length",
    "prepare_unpaired_examples",
    "unpaired_rows",
]

ACCEPTED_FORMATS = (
    "unpaired, standard: 'prompt' and 'completion' strings and a boolean 'label' (True: desirable completion)",
    "unpaired, conversational: 'prompt' and 'completion' lists of {'role', 'content'} messages and a boolean 'label'",
    "paired preference: 'prompt', 'chosen' and 'rejected' (strings or message lists), or 'chosen' and 'rejected' "
    "with the prompt implicit; each pair becomes a desirable and an undesirable example",
)

_PROMPT_COLUMNS = ("prompt", "completion")


def _format_error(columns: Sequence[str], detail: str, trainer: str = "KTO") -> ValueError:
    formats = "\n".join(f"  - {fmt}" for fmt in ACCEPTED_FORMATS)
    return ValueError(f"The {trainer} dataset {detail}. Found columns: {list(columns)}. Accepted formats:\n{formats}")


def desirability_label(value: object, index: int) -> bool:
    """Example ``index``'s ``label`` as a bool (True or 1: desirable; False or 0: undesirable).

    Raises:
        ValueError: any other value.
    """
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"Example {index}: 'label' should be True (desirable completion) or False (undesirable); "
                     f"found {value!r}.")


class _UnpairedTokenizer(PromptResponseTokenizer):
    """Settings resolved from the first example; turns one unpaired example into ``prompt_ids``/``completion_ids``."""

    def __init__(self, tokenizer: Tokenizer, first: Mapping[str, Any]):
        super().__init__(tokenizer, is_message_list(first["prompt"]) or is_message_list(first["completion"]), "KTO")

    def check_layout(self, example: Mapping[str, Any], index: int) -> None:
        missing = [key for key in (*_PROMPT_COLUMNS, "label") if key not in example]
        if missing:
            raise _format_error(list(example), f"example {index} has no {missing} (the first example has "
                                               "'prompt', 'completion' and 'label')")
        matches = is_message_list if self.conversational else (lambda value: isinstance(value, str))
        if not all(matches(example[key]) or (self.conversational and example[key] == []) for key in _PROMPT_COLUMNS):
            expected = "lists of {'role', 'content'} messages" if self.conversational else "strings"
            found = ", ".join(f"{key} is {describe(example[key])}" for key in _PROMPT_COLUMNS)
            raise ValueError(f"Example {index}: prompt and completion should both be {expected}, like the first "
                             f"example; found {found}.")

    def __call__(self, example: Mapping[str, Any], index: int) -> dict[str, Any]:
        prompt, completion = example["prompt"], example["completion"]
        template_kwargs = chat_template_kwargs_for(example) if self.conversational else {}
        if not self.conversational:
            completion = self._with_eos(completion)
        prompt_ids = self._prompt_ids(prompt, template_kwargs)
        full_ids = self._ids(prompt + completion, template_kwargs)
        prompt_length = self._prompt_length(prompt_ids, [full_ids], index)
        return {"prompt_ids": prompt_ids[:prompt_length], "completion_ids": full_ids[prompt_length:],
                "label": desirability_label(example["label"], index)}


def unpaired_rows(dataset: Iterable[Mapping[str, Any]], num_proc: int | None,
                  trainer: str = "KTO") -> list[dict[str, Any]]:
    """The dataset's rows in TRL's unpaired layout (``prompt``, ``completion``, ``label`` and the other columns):
    an implicit prompt split off and paired data unpaired, as TRL's ``maybe_extract_prompt`` and
    ``maybe_unpair_preference_dataset`` do.

    Args:
        dataset: rows in one of ``ACCEPTED_FORMATS``.
        num_proc: ``dataset_num_proc`` (the unpairing blocks restart at each process's shard).
        trainer: the trainer's name in error messages.

    Raises:
        ValueError: an empty dataset, or missing columns (the message lists those found and the accepted formats).
    """
    rows = list(dataset)
    if not rows:
        raise ValueError(f"The {trainer} dataset is empty ({type(dataset).__name__} with no examples); pass at least "
                         "one example.")
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"Example {index} should be a dict of columns; found {describe(row)}.")
    first, columns = rows[0], get_dataset_column_names(dataset, rows[0])
    paired = "chosen" in first and "rejected" in first
    if "prompt" not in first:
        if not paired:
            raise _format_error(columns, "has no 'prompt' column, and its prompt cannot be extracted: that needs "
                                         "paired 'chosen' and 'rejected' columns", trainer)
        rows = [{**row, **extract_prompt(row)} for row in rows]
    if paired:
        return unpair_preference_dataset(rows, num_proc)
    missing = [key for key in ("completion", "label") if key not in first]
    if missing:
        raise _format_error(columns, f"has no {' or '.join(repr(key) for key in missing)} column", trainer)
    return rows


def _with_kl_completions(examples: list[dict[str, Any]], chunk_size: int, num_proc: int | None) -> None:
    """Adds ``KL_completion_ids`` in place: within each chunk, the completion of the example before (TRL's rotation
    by one)."""
    for chunk in map_batches(len(examples), chunk_size, num_proc):
        completions = [examples[index]["completion_ids"] for index in chunk]
        for index, completion in zip(chunk, completions[-1:] + completions[:-1], strict=True):
            examples[index]["KL_completion_ids"] = completion


def _tokenized(dataset: DatasetLike | Iterable[Mapping[str, Any]], rows: list[dict[str, Any]],
               tokenize: _UnpairedTokenizer, num_proc: int | None) -> Iterable[Mapping[str, Any]]:
    """The tokenised rows ([`~torchlike.trl.data_utils.tokenized_examples`]): with ``num_proc`` on a
    ``datasets.Dataset``, the unpaired rows as a ``datasets.Dataset`` are what ``map`` reads."""
    if num_proc and num_proc > 1 and hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        import datasets

        return tokenized_examples(datasets.Dataset.from_list(rows), rows, tokenize, num_proc)
    return tokenized_examples(rows, rows, tokenize, num_proc)


def prepare_unpaired_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *, max_length: int | None,
                              kl_chunk_size: int | None, num_proc: int | None = None) -> list[dict[str, Any]]:
    """Tokenises a KTO dataset the way ``trl.KTOTrainer`` (1.16) prepares it, KL completions included.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Examples in one of
            ``ACCEPTED_FORMATS``. They are never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`): Tokenises strings with ``tokenizer(text=...)`` (special
            tokens included, as TRL does) and message lists with ``tokenizer.apply_chat_template``.
        max_length (`int` or `None`): Examples whose prompt alone has ``max_length`` tokens or more are dropped
            (truncation would leave no completion token).
        kl_chunk_size (`int` or `None`): ``per_device_train_batch_size``, the size of the chunks within which the
            completions are rotated to build the KL completions (TRL uses the training batch size for evaluation
            data too); ``None`` when the loss type does not estimate the KL term (no ``KL_completion_ids``).
        num_proc (`int`, *optional*): ``dataset_num_proc``. On a ``datasets.Dataset`` (or a list) it tokenises in
            that many processes and, as in TRL, the unpairing blocks and KL chunks restart at each process's shard;
            an ``IterableDataset`` ignores it, as in TRL.

    Returns:
        `list[dict]`: ``{"prompt_ids", "completion_ids", "label"}`` (lists of ints, a bool) per kept example, plus
        ``"KL_completion_ids"`` with ``kl_chunk_size``; the sequences scored are ``prompt_ids + completion_ids`` and
        ``prompt_ids + KL_completion_ids``.

    Raises:
        ValueError: an empty dataset, missing columns (a missing ``label`` included; the message lists the columns
            found and the accepted formats), mixed layouts, labels that are not booleans, conversational data
            without a chat template, or every example dropped.
    """
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        num_proc = None  # TRL passes num_proc to map only for a map-style Dataset
    rows = unpaired_rows(dataset, num_proc)
    tokenize = _UnpairedTokenizer(tokenizer, rows[0])
    for index, row in enumerate(rows):
        tokenize.check_layout(row, index)
    kept, dropped = [], 0
    for index, example in enumerate(_tokenized(dataset, rows, tokenize, num_proc)):
        prompt = len(example["prompt_ids"])
        if max_length is not None and prompt >= max_length:
            dropped += 1
            if dropped <= MAX_DROP_WARNINGS:
                warnings.warn(f"Example {index} is dropped: its prompt has {prompt} tokens, so truncation to "
                              f"max_length={max_length} leaves no completion token. Raise max_length or shorten the "
                              "prompt.", PreferenceDataWarning, stacklevel=2)
            continue
        kept.append({"prompt_ids": list(example["prompt_ids"]), "completion_ids": list(example["completion_ids"]),
                     "label": bool(example["label"])})
    if not kept:
        raise ValueError(f"All {dropped} examples of the KTO dataset were dropped: every prompt fills "
                         f"max_length={max_length}. Raise max_length above the prompt lengths or shorten the prompts.")
    if kl_chunk_size is not None:
        _with_kl_completions(kept, kl_chunk_size, num_proc)
    return kept


def check_desirability_balance(labels: Sequence[bool], desirable_weight: float, undesirable_weight: float) -> None:
    """TRL's warning when desirable and undesirable examples are unbalanced and neither weight is in the range Eq. (8)
    of the KTO paper recommends for that ratio.

    Args:
        labels (`Sequence[bool]`): The training examples' labels.
        desirable_weight (`float`), undesirable_weight (`float`): The ``KTOConfig`` fields.
    """
    num_desirable = max(sum(bool(label) for label in labels), 1)
    num_undesirable = max(len(labels) - num_desirable, 1)
    if num_desirable == num_undesirable:
        return
    desirable_low = round(num_undesirable * undesirable_weight / num_desirable, 2)
    desirable_high = round(num_undesirable * undesirable_weight / num_desirable * 1.33, 2)
    undesirable_low = round(num_desirable * desirable_weight / num_undesirable / 1.33, 2)
    undesirable_high = round(num_desirable * desirable_weight / num_undesirable, 2)
    if not (desirable_low <= desirable_weight <= desirable_high
            or undesirable_low <= undesirable_weight <= undesirable_high):
        warnings.warn("You have different amounts of desirable/positive and undesirable/negative examples but the "
                      "weights on the desirable and undesirable losses don't seem to be in an ideal range. Based on "
                      f"your data, we recommend EITHER desirable_weight in [{desirable_low}, {desirable_high}] or "
                      f"undesirable_weight in [{undesirable_low}, {undesirable_high}] (but NOT BOTH). See the "
                      "documentation on how to optimally set these weights.", UserWarning, stacklevel=2)


def _responses(examples: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return ("completion", "KL_completion") if examples and "KL_completion_ids" in examples[0] else ("completion",)


def padded_length(examples: Sequence[Mapping[str, Any]], max_length: int | None,
                  pad_to_multiple_of: int | None = None) -> int:
    """The one length every batch is padded to: the longest truncated sequence (completion or KL), rounded up.

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_unpaired_examples`].
        max_length (`int` or `None`): Truncation length (``None``: none).
        pad_to_multiple_of (`int`, *optional*): Round the length up to a multiple of it.

    Returns:
        `int`: The padded length for [`collate_unpaired_batch`].
    """
    window = truncation_window(max_length, "keep_start")
    longest = max((len(response_sequence(example, response, window)[0]) for example in examples
                   for response in _responses(examples)), default=1)
    return round_up_to_multiple(longest, pad_to_multiple_of)


def collate_unpaired_batch(examples: Sequence[Mapping[str, Any]], pad_token_id: int, length: int,
                           max_length: int | None = None) -> dict[str, np.ndarray]:
    """Truncates and right-pads prepared examples to a fixed batch, as TRL's ``DataCollatorForUnpairedPreference``
    with a fixed length.

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_unpaired_examples`], optionally with float ``ref_logps``
            and ``ref_KL_logps``.
        pad_token_id (`int`): Fills ``input_ids`` and ``KL_input_ids`` past each sequence.
        length (`int`): The padded length (see [`padded_length`]).
        max_length (`int` or `None`, *optional*): Each sequence keeps its first ``max_length`` tokens.

    Returns:
        `dict[str, np.ndarray]`: int32 ``[B, length]`` ``input_ids``, ``attention_mask`` (1 on real tokens) and
        ``completion_mask`` (1 on completion tokens), the same with a ``KL_`` prefix when the examples have KL
        completions, bool ``[B]`` ``label``, and float32 ``[B]`` ``ref_logps``/``ref_KL_logps`` when the examples
        have them.
    """
    batch = padded_sequences(examples, [(response, response.removesuffix("completion"))
                                        for response in _responses(examples)], pad_token_id, length,
                             truncation_window(max_length, "keep_start"))
    batch["label"] = np.asarray([bool(example["label"]) for example in examples], dtype=bool)
    for key in ("ref_logps", "ref_KL_logps"):
        if examples and key in examples[0]:
            batch[key] = np.asarray([example[key] for example in examples], dtype=np.float32)
    return batch

