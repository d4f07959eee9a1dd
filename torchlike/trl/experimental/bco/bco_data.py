"""Unpaired preference data for BCO: TRL 1.0.0's BCO tokenisation (``_tokenize`` and ``_process_tokens`` of
``trl.experimental.bco``), then fixed-shape batches.

The formats are KTO's (:mod:`torchlike.trl.data.kto_data`: ``prompt``/``completion``/``label``, or paired data unpaired
as TRL does), but the tokenisation differs from ``trl.KTOTrainer``'s. Message lists are rendered to text as TRL's
``maybe_apply_chat_template`` renders them (the prompt with the generation prompt, the completion as what it adds to the
conversation). Without special tokens, the prompt and prompt + completion are tokenised, the completion starting one
token early where the prompt's last token merges with it; a BOS token goes before a prompt that lacks one (when the
tokenizer has one), an EOS token after a completion that lacks one, and when prompt + completion exceed ``max_length``
(less one for each of those tokens to be added) the completion is cut to fit (the prompt never is).

With an ``embedding_tokenizer`` (underlying distribution matching) each example also carries ``embedding_ids``, its
prompt text tokenised by that tokenizer without special tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ....type_aliases import Tokenizer
from ...data.kto_data import collate_unpaired_batch, desirability_label, unpaired_rows
from ...data_utils import apply_chat_template, example_tools, is_message_list

__all__ = ["DEFAULT_MAX_LENGTH", "collate_bco_batch", "padded_length", "prepare_bco_examples"]

#: The ``max_length`` TRL's BCOTrainer uses when the config's is ``None``.
DEFAULT_MAX_LENGTH = 512


def _rendered(example: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[Any, Any]:
    """``(prompt, completion)`` as text: message lists rendered as TRL's ``maybe_apply_chat_template`` renders a
    prompt-completion example (which is how it renders a pair whose two responses are that completion)."""
    prompt, completion = example["prompt"], example["completion"]
    if not is_message_list(prompt):
        return prompt, completion
    rendered = apply_chat_template({"prompt": prompt, "completion": completion,
                                    "chat_template_kwargs": example.get("chat_template_kwargs")},
                                   tokenizer, tools=example_tools(example))
    return rendered["prompt"], rendered["completion"]


class _BCOTokenizer:
    """TRL 1.0.0's BCO ``_tokenize`` and ``_process_tokens`` for one unpaired example of a decoder-only model."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, embedding_tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.embedding_tokenizer = embedding_tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def __call__(self, example: Mapping[str, Any], index: int) -> dict[str, Any]:
        prompt, completion = _rendered(example, self.tokenizer)
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise ValueError(f"{key} should be an str but got {type(value)}")
        prompt_ids, full_ids = self._ids(prompt), self._ids(prompt + completion)
        start = len(prompt_ids) - (prompt_ids != full_ids[:len(prompt_ids)])
        prompt_ids, answer_ids = full_ids[:start], full_ids[start:]
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        room = self.max_length - (prompt_ids[:1] != [bos]) - (answer_ids[-1:] != [eos])
        if len(prompt_ids) + len(answer_ids) > room:
            answer_ids = answer_ids[:room - len(prompt_ids)]  # TRL's slice, negative bounds included
        if bos is not None and prompt_ids[:1] != [bos]:
            prompt_ids = [bos, *prompt_ids]
        if answer_ids[-1:] != [eos]:
            answer_ids = [*answer_ids, eos]
        prepared = {"prompt_ids": prompt_ids, "completion_ids": answer_ids,
                    "label": desirability_label(example["label"], index)}
        if self.embedding_tokenizer is not None:
            prepared["embedding_ids"] = list(self.embedding_tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return prepared


def prepare_bco_examples(dataset: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, *, max_length: int | None,
                         num_proc: int | None = None,
                         embedding_tokenizer: Tokenizer | None = None) -> list[dict[str, Any]]:
    """Tokenises a BCO dataset the way TRL 1.0.0's ``BCOTrainer`` prepares it.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Examples in one of
            ``torchlike.trl.data.kto_data.ACCEPTED_FORMATS``. They are never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`): The processing class.
        max_length (`int` or `None`): Prompt + completion fit it by cutting the completion (``None``: 512, with
            TRL's warning).
        num_proc (`int`, *optional*): ``dataset_num_proc``: the unpairing blocks of paired data restart at each
            process's shard, as in TRL.
        embedding_tokenizer (`transformers.PreTrainedTokenizerBase`, *optional*): Tokenises each prompt into
            ``embedding_ids`` (underlying distribution matching).

    Returns:
        `list[dict]`: ``{"prompt_ids", "completion_ids", "label"}`` per example (BOS and EOS included; the sequence
        scored is ``prompt_ids + completion_ids``), plus ``"embedding_ids"`` with ``embedding_tokenizer``.

    Raises:
        ValueError: an empty dataset, missing columns (the message lists the columns found and the accepted
            formats), labels that are not booleans, a prompt or completion that is not text after rendering.
    """
    if max_length is None:
        warnings.warn("When using DPODataCollatorWithPadding, you should set `max_length` in the `BCOConfig`. It will "
                      "be set to `512` by default, but you should do it yourself in the future.", UserWarning,
                      stacklevel=2)
        max_length = DEFAULT_MAX_LENGTH
    tokenize = _BCOTokenizer(tokenizer, max_length, embedding_tokenizer)
    return [tokenize(row, index) for index, row in enumerate(unpaired_rows(dataset, num_proc, "BCO"))]


def padded_length(examples: Sequence[Mapping[str, Any]]) -> int:
    """The one length every batch is padded to: the longest sequence plus one padding column (the logits of TRL's
    ``logits/*`` metrics reach the last position of its padded batch, which predicts no token here).

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_bco_examples`].

    Returns:
        `int`: The padded length for [`collate_bco_batch`].
    """
    return max((len(example["prompt_ids"]) + len(example["completion_ids"]) for example in examples), default=1) + 1


def collate_bco_batch(examples: Sequence[Mapping[str, Any]], pad_token_id: int, length: int,
                      delta: float) -> dict[str, np.ndarray]:
    """Right-pads prepared examples to a fixed batch.

    Args:
        examples (`Sequence[dict]`): Outputs of [`prepare_bco_examples`], optionally with float ``ref_logps`` and
            ``udm_weight``.
        pad_token_id (`int`): Fills ``input_ids`` past each sequence.
        length (`int`): The padded length (see [`padded_length`]).
        delta (`float`): The running reward mean, the ``delta`` column of every row (a train step replaces it with
            each micro-batch's own).

    Returns:
        `dict[str, np.ndarray]`: int32 ``[B, length]`` ``input_ids``, ``attention_mask`` and ``completion_mask``,
        bool ``[B]`` ``label``, float32 ``[B]`` ``delta`` and, when the examples have them, ``ref_logps`` and
        ``udm_weight``.
    """
    batch = collate_unpaired_batch(examples, pad_token_id, length)
    batch["delta"] = np.full(len(examples), delta, np.float32)
    if examples and "udm_weight" in examples[0]:
        batch["udm_weight"] = np.asarray([example["udm_weight"] for example in examples], np.float32)
    return batch
