"""Triple-preference data for TPO: TRL 1.16's ``TPOTrainer._prepare_dataset`` and ``DataCollatorForTriplePreference``
(TRL is not a runtime dependency), with fixed-shape batches so that XLA compiles the step once.

Each example has a ``chosen``, a ``rejected`` and a gold ``reference`` response, strings or message lists, with an
explicit ``prompt`` or an implicit one (split off ``chosen``/``rejected`` as TRL's ``extract_prompt`` does, and off
``reference``, which must start with it). Text responses get the eos token appended; the prompt and the prompt followed
by each response are tokenised (message lists with the chat template, ``tools`` and ``chat_template_kwargs`` columns
passed to it), and the completion starts where the tokenised prompt stops being a prefix of all three. No example is
dropped. Batches are ``dpo_data.collate_preference_batch``'s with the gold responses' columns added.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ....adapters.losses.tpo import RESPONSES
from ....type_aliases import Tokenizer
from ...data.dpo_data import PreferenceTokenizer
from ...data_utils import describe, extract_prompt, tokenized_examples

__all__ = ["RESPONSES", "extract_triple_prompt", "prepare_triple_examples"]



def extract_triple_prompt(example: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's ``_extract_triple_prompt``: the implicit prompt split off ``chosen`` and ``rejected``
    (:func:`~torchlike.trl.data_utils.extract_prompt`) and off ``reference``.

    Raises:
        ValueError: ``reference`` does not start with that prompt (TRL's words).
    """
    extracted = extract_prompt(example)
    prompt, reference = extracted["prompt"], example["reference"]
    if reference[:len(prompt)] != prompt:
        raise ValueError("The `reference` completion does not start with the implicit prompt extracted from "
                         "`chosen`/`rejected`. Either provide an explicit `prompt` column, or make sure the "
                         "`reference` completion shares the same prompt prefix as the `chosen` and `rejected` "
                         "completions.")
    return {**extracted, "reference": reference[len(prompt):]}


class _TripleTokenizer(PreferenceTokenizer):
    """DPO's preference tokenizer with the gold response added, TRL's TPO column errors and its prompt split."""

    responses = RESPONSES

    def __init__(self, tokenizer: Tokenizer, first: Mapping[str, Any]):
        if "chosen" not in first or "rejected" not in first:
            raise ValueError("TPO requires a triple-preference dataset with `chosen`, `rejected` and `reference` "
                             "columns, but the dataset is missing `chosen` or `rejected`. Got columns: "
                             f"{list(first)}.")
        if "reference" not in first:
            raise ValueError("TPO requires a triple-preference dataset with `chosen`, `rejected` and `reference` "
                             "columns, but the dataset is missing the `reference` (gold) column. Got columns: "
                             f"{list(first)}.")
        self._start(tokenizer, first, "TPO")

    def _missing_error(self, example: Mapping[str, Any], index: int, missing: list[str],
                       keys: Sequence[str]) -> ValueError:
        return ValueError(f"Example {index} of the TPO dataset has no {missing} (the first example has "
                          f"{list(keys)}).")

    def _split_prompt(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return extract_triple_prompt(raw)


def prepare_triple_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *,
                            num_proc: int | None = None) -> list[dict[str, list[int]]]:
    """Tokenises a triple-preference dataset the way ``trl.experimental.tpo.TPOTrainer`` (1.16) prepares it.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Examples with ``chosen``,
            ``rejected`` and ``reference`` (and ``prompt``, else an implicit one), strings or message lists. They are
            never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`): Tokenises strings with ``tokenizer(text=...)`` and
            message lists with ``tokenizer.apply_chat_template``.
        num_proc (`int`, *optional*): Tokenise in this many processes when ``dataset`` is a ``datasets.Dataset``.

    Returns:
        `list[dict]`: ``{"prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"}`` per example.

    Raises:
        ValueError: an empty dataset, a missing column (TRL's words), mixed layouts, a ``reference`` that does not
            start with the implicit prompt, or conversational data without a chat template.
    """
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(f"The TPO dataset is empty ({type(dataset).__name__} with no examples); pass at least one "
                         "triple (prompt, chosen, rejected, reference).") from None
    if not isinstance(first, Mapping):
        raise TypeError(f"Example 0 should be a dict of columns; found {describe(first)}.")
    tokenize = _TripleTokenizer(tokenizer, first)
    examples = tokenized_examples(dataset, itertools.chain([first], iterator), tokenize, num_proc)
    columns = ("prompt_ids", *(f"{key}_ids" for key in RESPONSES))
    return [{key: list(example[key]) for key in columns} for example in examples]
