"""Preference data for TRL 1.16's experimental pairwise trainers (``trl.experimental`` ORPO and CPO): their
``tokenize_row``, which tokenises differently from ``trl.DPOTrainer`` (:mod:`torchlike.trl.data.dpo_data`).

Each example goes through TRL's ``maybe_extract_prompt`` (an implicit prompt is split off) and
``maybe_apply_chat_template`` (message lists are rendered to text: the prompt with the generation prompt, each
response as what prompt + response adds to the text they share); then, without special tokens, the prompt and
prompt + response are tokenised, the response starting one token early where the last prompt token merges with it,
a BOS token is put before each prompt that lacks one, an EOS token after each response that lacks one, and a
response is cut so that prompt + response fit ``max_length`` (the prompt itself is never cut).

The examples carry ``prompt_ids`` (the prompt alone, TRL's ``prompt_input_ids``), ``chosen_prompt_ids`` /
``rejected_prompt_ids`` (each response's own prompt tokens) and ``chosen_ids`` / ``rejected_ids``, which
``dpo_data.collate_preference_batch`` pads into fixed-shape pair batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ...type_aliases import Tokenizer
from ..data_utils import apply_chat_template, example_tools, extract_prompt

__all__ = ["prepare_pairwise_examples"]

_RESPONSES = ("chosen", "rejected")


class _RowTokenizer:
    """TRL's ``tokenize_row`` for a decoder-only model."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.empty_warned = False

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _answer(self, prompt: str, answer: str) -> tuple[list[int], list[int]]:
        """``(prompt ids, answer ids)`` of prompt + answer, the answer starting one token early where the prompt's
        last token merges with it (TRL's ``build_tokenized_answer``)."""
        full = self._ids(prompt + answer)
        start = len(self._ids(prompt))
        if self._ids(prompt) != full[:start]:
            start -= 1
        return full[:start], full[start:]

    def __call__(self, raw: Mapping[str, Any]) -> dict[str, list[int]]:
        example = dict(raw) if "prompt" in raw else {**raw, **extract_prompt(raw)}
        if isinstance(example["prompt"], list):  # a conversation
            pair = {key: example[key] for key in ("prompt", *_RESPONSES, "chat_template_kwargs") if key in example}
            example = {**example, **apply_chat_template(pair, self.tokenizer, tools=example_tools(example))}
        for key in ("prompt", *_RESPONSES):
            if not isinstance(example[key], str):
                raise ValueError(f"{key} should be an str but got {type(example[key])}")
        prompt_ids = self._ids(example["prompt"])
        split = {key: self._answer(example["prompt"], example[key]) for key in _RESPONSES}
        (chosen_prompt, _), (rejected_prompt, _) = split["chosen"], split["rejected"]
        prompt_ids = prompt_ids[:min(len(chosen_prompt), len(rejected_prompt))]
        differing = sum(a != b for a, b in zip(chosen_prompt, rejected_prompt, strict=False))
        if differing > 1 or abs(len(chosen_prompt) - len(rejected_prompt)) > 1:
            raise ValueError("Chosen and rejected prompt_input_ids might only differ on the last token due to "
                             "tokenizer merge ops.")
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        prompts = {"prompt": prompt_ids, **{key: split[key][0] for key in _RESPONSES}}
        if bos is not None:
            prompts = {key: ids if ids and ids[0] == bos else [bos, *ids] for key, ids in prompts.items()}
        prepared = {"prompt_ids": prompts["prompt"]}
        for key in _RESPONSES:
            answer = split[key][1]
            if not answer or answer[-1] != eos:
                answer = [*answer, eos]
            if len(prompts[key]) + len(answer) > self.max_length:
                answer = answer[:max(0, self.max_length - len(prompts[key]))]
            if not answer and not self.empty_warned:
                self.empty_warned = True
                warnings.warn("The prompt alone fills `max_length`, so truncation leaves an empty completion. "
                              "Consider increasing `max_length` or filtering out long prompts.", UserWarning,
                              stacklevel=4)
            prepared[f"{key}_prompt_ids"] = prompts[key]
            prepared[f"{key}_ids"] = answer
        return prepared


def prepare_pairwise_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *, max_length: int,
                              num_proc: int | None = None) -> list[dict[str, list[int]]]:
    """Tokenises a preference dataset as TRL 1.16's experimental ``ORPOTrainer`` / ``CPOTrainer`` do.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): ``prompt``/``chosen``/
            ``rejected`` (or implicit prompt ``chosen``/``rejected``), strings or message lists.
        tokenizer (`transformers.PreTrainedTokenizerBase`): the processing class.
        max_length (`int`): prompt + response are cut to it by cutting the response.
        num_proc (`int`, *optional*): tokenise in this many processes (``datasets.Dataset.map``) when ``dataset`` is
            a ``datasets.Dataset``.

    Returns:
        `list[dict]`: ``prompt_ids``, ``chosen_prompt_ids``, ``chosen_ids``, ``rejected_prompt_ids``,
        ``rejected_ids`` per example.

    Raises:
        ValueError: an empty dataset, a value that is not a string after rendering, chosen and rejected prompts that
            tokenise differently beyond their last token (TRL's messages).
    """
    tokenize = _RowTokenizer(tokenizer, max_length)
    if num_proc and num_proc > 1 and hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        rows = dataset.map(tokenize, num_proc=num_proc, remove_columns=list(dataset.column_names))
    else:
        rows = (tokenize(raw) for raw in dataset)
    examples = [{key: list(value) for key, value in row.items()} for row in rows]
    if not examples:
        raise ValueError(f"The preference dataset is empty ({type(dataset).__name__} with no examples); pass at "
                         "least one example.")
    return examples
