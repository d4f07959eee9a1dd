"""SFT data preparation: TRL 1.16's dataset formats turned into token ids and labels, then fixed-shape batches.

This module reimplements what ``trl.SFTTrainer._prepare_dataset`` does to a dataset (TRL is not a runtime dependency)
and adds the batching a JAX training step needs: fixed shapes, so XLA compiles the step once. Packing is
:mod:`torchlike.trl.data.packing`; the helpers TRL keeps in ``trl/data_utils.py`` are :mod:`torchlike.trl.data_utils`.

Formats (decided from the first example, as TRL does; every later example must have the same layout):

- ``input_ids`` (optionally ``labels``, ``completion_mask``, ``assistant_masks``): pre-tokenised, used as is. Loss
  mask: ``labels != -100`` when ``labels`` is given, else the masks (see below), else all ones.
- ``prompt`` + ``completion`` strings: standard prompt-completion. Tokenises ``prompt + completion + eos``; loss mask on
  the completion tokens.
- ``prompt`` + ``completion`` message lists: conversational prompt-completion. The chat template renders
  ``prompt + completion`` (the prompt alone with ``add_generation_prompt=True`` to find the boundary); loss mask on the
  completion tokens, and on assistant tokens with ``assistant_only_loss``.
- ``messages`` message list: conversational language modeling through the chat template; loss mask all ones, or the
  assistant tokens with ``assistant_only_loss``.
- ``conversations`` list of ``{"from", "value"}``: ShareGPT, renamed to ``role``/``content`` and handled as
  ``messages``.
- a string column named by ``dataset_text_field`` (default ``text``): language modeling on ``text + eos``; all ones.
- any columns with ``formatting_func``: language modeling on ``formatting_func(example) + eos``; all ones.

The completion mask applies when ``completion_only_loss`` is ``True``, or ``None`` and the raw dataset has ``prompt``
and ``completion`` columns (TRL's rule: so a pre-tokenised ``completion_mask`` is only used with
``completion_only_loss=True``). Assistant masks always apply when present. Masks combine with a logical AND.

**Label alignment.** ``loss_mask[t] == 1`` means the token ``input_ids[t]`` is a target: the loss term is
``-log p(input_ids[t] | input_ids[:t])``, read from the logits at position ``t - 1``. It is exactly TRL's
``labels[t] != -100`` (Hugging Face models shift the labels inside the loss). In a next-token loss use
``logits[:, :-1]`` against ``input_ids[:, 1:]`` weighted by ``loss_mask[:, 1:]``; ``loss_mask[:, 0]`` is never used.
A collated batch's Hugging Face ``labels`` are ``input_ids`` where ``loss_mask`` is 1, else ``-100``.

Where this differs from TRL 1.16 (each a case where TRL silently does something its user did not ask for):

- ``formatting_func``'s result is always what gets tokenised. TRL stores it in a ``text`` column next to the original
  ones and then ignores it when the example also has ``prompt`` or ``messages``, or when ``dataset_text_field`` is not
  ``"text"``.
- The eos token is appended to the field that is tokenised (TRL appends it to a ``text`` column when one exists, even
  when the example is then tokenised as prompt-completion, which then has no eos).
- ShareGPT data counts as conversational for ``assistant_only_loss`` (TRL checks before converting it and refuses), and
  pre-tokenised data with ``assistant_masks`` is accepted with ``assistant_only_loss=True``.
- A chat template without ``{% generation %}`` markers is an error with ``assistant_only_loss=True``; TRL swaps in its
  own training copy of about thirty known templates (Qwen, Llama 3, Gemma...). Set ``tokenizer.chat_template`` to
  such a template (TRL ships them as ``trl/chat_templates/*_training.jinja``) or point ``SFTConfig.chat_template_path``
  at one.
- Examples left with no loss token (a prompt that fills ``max_length``, a pre-tokenised all-zero mask) are dropped
  with an [`SFTDataWarning`] naming the example, its length and where its loss tokens started; TRL drops them
  silently, and only when ``max_length`` is set. A dataset where every example is dropped is an error.
- Packing ([`~torchlike.trl.data.packing.pack_rows`]) drops examples left with no loss token before packing, as above;
  TRL packs them.

Longer than most modules because it covers every dataset format TRL's ``SFTTrainer`` accepts (text,
prompt/completion, messages, conversational prompt/completion, ShareGPT, pre-tokenised) with TRL's exact
tokenisation rules; each format is one short function.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...type_aliases import RowsLike, Tokenizer
from ..data_utils import (
    MAX_DROP_WARNINGS,
    as_int_list,
    chat_template_kwargs_for,
    common_prefix_length,
    describe,
    get_dataset_column_names,
    is_conversational,
    is_conversational_from_value,
    is_message_list,
    maybe_convert_to_chatml,
)
from .packing import pack_rows

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = [
    "ACCEPTED_FORMATS",
    "SFTDataWarning",
    "SFTRows",
    "collate_sft_batch",
    "is_prepared",
    "iter_sft_examples",
    "prepare_sft_dataset",
    "unprepared_sft_examples",
]

ACCEPTED_FORMATS = (
    "language modeling: a string column named by `dataset_text_field` (default 'text')",
    "prompt-completion: 'prompt' and 'completion' columns, both strings or both lists of {'role', 'content'} messages",
    "conversational: 'messages', a list of {'role', 'content'} messages (rendered with the chat template)",
    "ShareGPT: 'conversations', a list of {'from', 'value'} messages (converted to 'messages')",
    "pre-tokenised: 'input_ids', optionally with 'completion_mask', 'assistant_masks' or 'labels'",
    "any columns together with formatting_func(example) -> str",
)

_TRUNCATION_MODES = ("keep_start", "keep_end")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class SFTDataWarning(UserWarning):
    """Warnings about SFT data preparation: dropped examples, ignored columns, prompt/completion token boundaries.

    Turn them into errors with ``warnings.simplefilter("error", SFTDataWarning)``.
    """


# ---------------------------------------------------------------------------------------------------------------------
# Format detection
# ---------------------------------------------------------------------------------------------------------------------


def _unrecognised(columns: Sequence[str], dataset_text_field: str, detail: str = "") -> ValueError:
    hint = ""
    if dataset_text_field != "text" and "text" in columns:
        hint = f" The dataset has a 'text' column but dataset_text_field={dataset_text_field!r}."
    elif dataset_text_field == "text":
        hint = " If the text is in another column, pass dataset_text_field='<that column>'."
    formats = "\n".join(f"  - {fmt}" for fmt in ACCEPTED_FORMATS)
    return ValueError(
        f"The SFT dataset has no recognised column{detail}. Found columns: {list(columns)}. Accepted formats:\n"
        f"{formats}\n{hint.strip()}"
    )


def _detect_format(example: Mapping[str, Any], dataset_text_field: str) -> str:
    """One of ``tokenized``, ``prompt_completion``, ``messages``, ``text`` (TRL's order of precedence)."""
    columns = list(example.keys())
    if "input_ids" in example:
        return "tokenized"
    if "prompt" in example:
        if "completion" not in example:
            raise ValueError(
                f"The SFT dataset has a 'prompt' column but no 'completion' column (found columns: {columns}). "
                "Prompt-only data is for GRPO/RLOO; SFT needs 'prompt' and 'completion' (or 'messages', or a text "
                "column named by dataset_text_field)."
            )
        return "prompt_completion"
    if "messages" in example and is_message_list(example["messages"]):
        return "messages"
    if dataset_text_field in example:
        return "text"
    if "messages" in example:
        raise _unrecognised(
            columns, dataset_text_field,
            f" ('messages' must be a list of {{'role', 'content'}} dicts; found {describe(example['messages'])})",
        )
    raise _unrecognised(columns, dataset_text_field)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------------------------------


def _has_generation_markers(template: str | Mapping[str, str] | None) -> bool:
    if isinstance(template, Mapping):
        template = template.get("default")
    return bool(template) and _GENERATION_MARKER.search(template) is not None


class _Preparer:
    """Holds the settings resolved once per dataset and turns one raw example into ``(input_ids, loss_mask)``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        first_raw: Mapping[str, Any],
        columns: Sequence[str],
        *,
        dataset_text_field: str,
        max_length: int | None,
        truncation_mode: str,
        completion_only_loss: bool | None,
        assistant_only_loss: bool,
        eos_token: str | None,
        formatting_func: Callable[[dict], str] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ):
        self.tokenizer = tokenizer
        self.dataset_text_field = dataset_text_field
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.assistant_only_loss = assistant_only_loss
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.prefix_warned = False
        self.ignored_mask_warned = False

        self.tokenized = "input_ids" in first_raw
        if completion_only_loss is None:  # TRL: decided on the raw first example, before formatting_func
            completion_only_loss = "prompt" in first_raw and "completion" in first_raw
        self.completion_only_loss = completion_only_loss
        if formatting_func is not None and completion_only_loss:
            raise ValueError(
                "formatting_func was given while completion_only_loss resolves to True (it is True, or None with "
                "'prompt' and 'completion' columns), which is incompatible: formatting_func turns every example "
                "into plain text, which has no completion to mask. Apply the formatting to the dataset beforehand "
                "or pass completion_only_loss=False."
            )
        if formatting_func is not None and self.tokenized:
            warnings.warn(
                "The dataset is already tokenised (it has an 'input_ids' column), so formatting_func is ignored. "
                "Remove formatting_func or pass a dataset without 'input_ids'.",
                SFTDataWarning,
                stacklevel=3,
            )
            formatting_func = None
        self.formatting_func = formatting_func

        first = self.convert(first_raw)
        self.format = _detect_format(first, dataset_text_field)
        self.conversational = is_conversational(first)

        # The eos string: appended to standard (non-conversational) text and completions.
        vocab = tokenizer.get_vocab()
        if eos_token is not None and eos_token not in vocab:
            raise ValueError(
                f"eos_token={eos_token!r} is not in the tokenizer's vocabulary ({type(tokenizer).__name__}, "
                f"{len(vocab)} tokens). Pass a token the tokenizer knows (e.g. '<|im_end|>' for Qwen chat models), "
                "or add it with tokenizer.add_special_tokens(...) and resize the model's embeddings."
            )
        self.eos = eos_token if eos_token is not None else tokenizer.eos_token
        if eos_token is not None:
            # TRL sets tokenizer.eos_token, which chat templates read as `eos_token`; pass it without mutating.
            self.chat_template_kwargs.setdefault("eos_token", eos_token)
        if self.format in ("text", "prompt_completion") and not self.conversational and not self.eos:
            raise ValueError(
                f"The tokenizer ({type(tokenizer).__name__}) has no eos_token, and standard (non-conversational) SFT "
                "data gets one appended so the model learns to stop. Pass eos_token='...' (SFTConfig.eos_token) or "
                "set tokenizer.eos_token."
            )

        if assistant_only_loss:
            if self.format == "tokenized":
                if first.get("assistant_masks") is None:
                    raise ValueError(
                        "assistant_only_loss=True with pre-tokenised data needs an 'assistant_masks' column; found "
                        f"columns {list(columns)}. Add the masks (apply_chat_template(..., "
                        "return_assistant_tokens_mask=True) gives them) or pass assistant_only_loss=False."
                    )
            elif not self.conversational:
                raise ValueError(
                    f"assistant_only_loss=True needs conversational data (message lists under 'messages', "
                    f"'conversations' or 'prompt'/'completion'), but the dataset is {self.format!r} with plain "
                    f"strings (columns {list(columns)}). Pass assistant_only_loss=False, or completion_only_loss=True "
                    "for prompt-completion data."
                )
        if self.conversational and self.format != "tokenized":
            self._check_chat_template()

    # -- per-dataset checks -------------------------------------------------------------------------------------------

    def _template(self) -> Any:
        return self.chat_template_kwargs.get("chat_template") or getattr(self.tokenizer, "chat_template", None)

    def _check_chat_template(self) -> None:
        template = self._template()
        if not template:
            raise ValueError(
                f"The dataset is conversational ({self.format!r} with message lists), but the tokenizer "
                f"({type(self.tokenizer).__name__}) has no chat template to render it. Set one with "
                "`tokenizer.chat_template = '<jinja template>'` (for example the one of the model family you train), "
                "or with SFTConfig(chat_template_path='template.jinja' or a tokenizer directory)."
            )
        if not self.assistant_only_loss:
            return
        if not _has_generation_markers(template):
            raise ValueError(
                "assistant_only_loss=True needs a chat template that marks assistant turns with "
                "`{% generation %}...{% endgeneration %}` (transformers' return_assistant_tokens_mask), but the "
                "tokenizer's chat template has no such markers. Set tokenizer.chat_template to a training template "
                "that has them (TRL ships some as trl/chat_templates/*_training.jinja; TRL swaps them in itself for "
                "known templates, torchlike does not), or pass SFTConfig(chat_template_path=...). Include the "
                "end-of-turn token inside the markers so the model learns to stop."
            )
        self._warn_if_stop_token_untrained()

    def _warn_if_stop_token_untrained(self) -> None:
        """TRL's check: the last masked token of an assistant turn followed by a user turn is an added token."""
        messages = [
            {"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "dummy"},
            {"role": "user", "content": "dummy"},
        ]
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                **self.chat_template_kwargs,
            )
        except Exception:  # a template that cannot render this probe: nothing to say about it
            return
        added = set(self.tokenizer.get_added_vocab().values())
        masked = [tok for tok, bit in zip(out["input_ids"], out["assistant_masks"], strict=False) if bit]
        for token_id in reversed(masked):
            if self.tokenizer.decode([token_id]).strip() == "":
                continue
            if token_id not in added:
                break
            return
        warnings.warn(
            "The chat template does not include the assistant turn's end-of-turn token in the loss mask, so the "
            "model may never learn to stop (the training loss still looks healthy). Move the end-of-turn token "
            "inside `{% generation %}...{% endgeneration %}`, or pass assistant_only_loss=False.",
            SFTDataWarning,
            stacklevel=5,
        )

    # -- per-example work ---------------------------------------------------------------------------------------------

    def convert(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """formatting_func, then ShareGPT conversion; never mutates ``raw``."""
        if self.formatting_func is not None:
            text = self.formatting_func(dict(raw))
            if not isinstance(text, str):
                raise TypeError(f"formatting_func should return a str; it returned {describe(text)}.")
            return {self.dataset_text_field: text}
        if is_conversational_from_value(raw):
            return maybe_convert_to_chatml(raw)
        return dict(raw)

    def _chat(self, messages: list, **kwargs: Any) -> dict[str, Any]:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)

    def _template_kwargs(self, example: Mapping[str, Any]) -> dict[str, Any]:
        return chat_template_kwargs_for(example, self.chat_template_kwargs)

    def _check_layout(self, example: Mapping[str, Any], index: int) -> None:
        fmt = _detect_format(example, self.dataset_text_field)
        if fmt != self.format:
            raise ValueError(
                f"Example {index} is {fmt!r} data (columns {list(example)}), but the dataset's first example is "
                f"{self.format!r}. Every example of an SFT dataset must have the same layout."
            )
        if fmt == "prompt_completion":
            kinds = [is_message_list(example[key]) for key in ("prompt", "completion")]
            if kinds != [self.conversational] * 2:
                found = ", ".join(f"{key} is {describe(example[key])}" for key in ("prompt", "completion"))
                expected = "message lists" if self.conversational else "strings"
                raise ValueError(
                    f"Example {index}: prompt and completion should both be {expected} like the first example; "
                    f"found {found}."
                )
        elif fmt == "text" and not isinstance(example[self.dataset_text_field], str):
            raise ValueError(
                f"Example {index}: column {self.dataset_text_field!r} should be a string; found "
                f"{describe(example[self.dataset_text_field])}."
            )

    def tokenize(self, raw: Mapping[str, Any], index: int) -> tuple[list[int], list[int], Mapping[str, Any]]:
        """Returns ``(input_ids, loss_mask, example)`` before truncation; ``example`` is ``raw`` as tokenised (after
        ``formatting_func`` and the ShareGPT conversion of :meth:`convert`, or ``raw`` itself when pre-tokenised)."""
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"Example {index} should be a dict of columns; found {describe(raw)}. Wrap plain strings as "
                "{'text': ...}."
            )
        if self.tokenized:
            return (*self._pretokenized(raw, index), raw)
        example = self.convert(raw)
        self._check_layout(example, index)
        masks: list[list[int]] = []
        if self.format == "prompt_completion":
            input_ids, completion_mask, assistant_masks = self._prompt_completion(example, index)
            if self.completion_only_loss:
                masks.append(completion_mask)
            if assistant_masks is not None:
                masks.append(assistant_masks)
        elif self.format == "messages":
            out = self._chat(
                example["messages"], return_assistant_tokens_mask=self.assistant_only_loss,
                **self._template_kwargs(example),
            )
            input_ids = list(out["input_ids"])
            if self.assistant_only_loss:
                masks.append(self._assistant_masks(out, index))
        else:
            text = example[self.dataset_text_field]
            if not text.endswith(self.eos):
                text = text + self.eos
            input_ids = list(self.tokenizer(text=text)["input_ids"])
        return input_ids, _and_masks(len(input_ids), masks), example

    def _assistant_masks(self, out: Mapping[str, Any], index: int) -> list[int]:
        mask = list(out["assistant_masks"])
        if 1 not in mask:
            raise ValueError(
                f"assistant_only_loss=True, but example {index} has no assistant token in its "
                "return_assistant_tokens_mask (it has no assistant turn, or the chat template's "
                "`{% generation %}` markers do not wrap the assistant content). Fix the template or the example."
            )
        return mask

    def _prompt_completion(
        self, example: Mapping[str, Any], index: int
    ) -> tuple[list[int], list[int], list[int] | None]:
        prompt, completion = example["prompt"], example["completion"]
        assistant_masks = None
        if self.conversational:
            kwargs = self._template_kwargs(example)
            prompt_ids = list(self._chat(prompt, add_generation_prompt=True, **kwargs)["input_ids"])
            out = self._chat(
                prompt + completion, return_assistant_tokens_mask=self.assistant_only_loss, **kwargs
            )
            input_ids = list(out["input_ids"])
            if self.assistant_only_loss:
                assistant_masks = self._assistant_masks(out, index)
        else:
            if not completion.endswith(self.eos):
                completion = completion + self.eos
            prompt_ids = list(self.tokenizer(text=prompt)["input_ids"])
            input_ids = list(self.tokenizer(text=prompt + completion)["input_ids"])
        # The completion starts where prompt and prompt+completion diverge (tokens can merge across the boundary).
        prompt_len = common_prefix_length(prompt_ids, input_ids)
        if prompt_len < len(prompt_ids) and not self.prefix_warned:
            self.prefix_warned = True
            warnings.warn(
                f"Example {index}: the tokenised prompt is not a prefix of the tokenised prompt+completion (tokens "
                "merge across the boundary, or the chat template renders the prompt alone differently); the loss "
                f"starts where they diverge, and the prompt's tail {self.tokenizer.decode(prompt_ids[prompt_len:])!r}"
                " is not in the training sequence. End prompts on a token boundary to avoid it. Shown once; it "
                "likely applies to other examples.",
                SFTDataWarning,
                stacklevel=4,
            )
        completion_mask = [0] * prompt_len + [1] * (len(input_ids) - prompt_len)
        return input_ids, completion_mask, assistant_masks

    def _pretokenized(self, example: Mapping[str, Any], index: int) -> tuple[list[int], list[int]]:
        input_ids = as_int_list(example["input_ids"], "input_ids", index)
        if example.get("labels") is not None:
            return input_ids, _labels_as_loss_mask(example["labels"], input_ids, index)
        masks = []
        if example.get("completion_mask") is not None:
            if self.completion_only_loss:
                masks.append(as_int_list(example["completion_mask"], "completion_mask", index))
                _check_length(masks[-1], input_ids, "completion_mask", index)
            elif not self.ignored_mask_warned:
                self.ignored_mask_warned = True
                warnings.warn(
                    "The pre-tokenised dataset has a 'completion_mask' column, but completion_only_loss resolves to "
                    "False (None means True only for 'prompt'/'completion' columns, as in TRL), so the loss covers "
                    "every token. Pass completion_only_loss=True to use the mask.",
                    SFTDataWarning,
                    stacklevel=4,
                )
        if example.get("assistant_masks") is not None:
            masks.append(as_int_list(example["assistant_masks"], "assistant_masks", index))
            _check_length(masks[-1], input_ids, "assistant_masks", index)
        return input_ids, _and_masks(len(input_ids), masks)

    def truncate(self, input_ids: list[int], loss_mask: list[int]) -> tuple[list[int], list[int]]:
        if self.max_length is None or len(input_ids) <= self.max_length:
            return input_ids, loss_mask
        window = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
        return input_ids[window], loss_mask[window]


def _labels_as_loss_mask(labels: ArrayLike, input_ids: list[int], index: int) -> list[int]:
    """Hugging Face ``labels`` (``input_ids[t]`` or -100, unshifted) as a loss mask: 1 where ``labels != -100``."""
    labels = as_int_list(labels, "labels", index)
    _check_length(labels, input_ids, "labels", index)
    wrong = [t for t, (label, tok) in enumerate(zip(labels, input_ids, strict=True)) if -100 != label != tok]
    if wrong:
        raise ValueError(
            f"Example {index}: 'labels' differ from 'input_ids' at positions {wrong[:8]} (other than -100). "
            "torchlike keeps labels as a loss mask over input_ids, in the Hugging Face convention where "
            "labels[t] is input_ids[t] or -100 and the model shifts them. Pass unshifted labels, or a "
            "'completion_mask' / 'assistant_masks' column instead."
        )
    return [int(label != -100) for label in labels]


def _check_length(values: list[int], input_ids: list[int], name: str, index: int) -> None:
    if len(values) != len(input_ids):
        raise ValueError(
            f"Example {index}: '{name}' has {len(values)} entries but 'input_ids' has {len(input_ids)}; they must "
            "align token for token."
        )


def _and_masks(length: int, masks: list[list[int]]) -> list[int]:
    """1 where every mask is 1 (all ones when there is no mask)."""
    if not masks:
        return [1] * length
    return [int(all(bits)) for bits in zip(*masks, strict=True)]


# ---------------------------------------------------------------------------------------------------------------------
# Public preparation API
# ---------------------------------------------------------------------------------------------------------------------


def _validate_args(max_length: int | None, truncation_mode: str) -> None:
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length should be a positive int or None (no truncation); found {max_length!r}.")
    if truncation_mode not in _TRUNCATION_MODES:
        raise ValueError(
            f"Unsupported truncation_mode={truncation_mode!r}; expected one of {list(_TRUNCATION_MODES)} "
            "('keep_start' is TRL's default and only non-deprecated mode)."
        )
    if truncation_mode == "keep_end":
        warnings.warn(
            "truncation_mode='keep_end' is deprecated in TRL 1.16 and will be removed in TRL 2.0; use 'keep_start'.",
            FutureWarning,
            stacklevel=4,
        )


def iter_sft_examples(
    dataset: Iterable[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    dataset_text_field: str = "text",
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
    formatting_func: Callable[[dict], str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Lazily prepares SFT examples the way ``trl.SFTTrainer`` (1.16) prepares its dataset.

    Reads one example at a time, so a ``datasets.IterableDataset`` streams. The format is decided from the first
    example (see the module docstring for the table); argument and format errors are raised when the first example
    is read, i.e. on the first ``next()``.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts):
            The training examples. They are never modified.
        tokenizer (`transformers.PreTrainedTokenizerBase`):
            Tokenises strings with ``tokenizer(text=...)`` (its special tokens included, as TRL does) and message
            lists with ``tokenizer.apply_chat_template``.
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            Column holding the text of language-modeling data (``SFTConfig.dataset_text_field``).
        max_length (`int` or `None`, *optional*, defaults to `1024`):
            Sequences are truncated to this many tokens; `None` keeps them whole.
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`):
            `"keep_start"` keeps the first ``max_length`` tokens; `"keep_end"` (deprecated in TRL) the last ones.
        completion_only_loss (`bool`, *optional*):
            Loss on the completion only (`True`), on the whole sequence (`False`), or `None`: completion only when the
            dataset has ``prompt`` and ``completion`` columns.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            Loss only on assistant tokens, from ``apply_chat_template(..., return_assistant_tokens_mask=True)``; the
            chat template needs ``{% generation %}`` markers.
        eos_token (`str`, *optional*):
            Appended to standard text and completions instead of ``tokenizer.eos_token`` (``SFTConfig.eos_token``),
            and passed to chat templates as ``eos_token``. The tokenizer is not modified.
        formatting_func (`Callable[[dict], str]`, *optional*):
            Turns each raw example into the text to train on (language modeling).
        chat_template_kwargs (`dict`, *optional*):
            Extra keyword arguments for every ``apply_chat_template`` call (a per-row ``chat_template_kwargs`` column
            overrides them; a ``tools`` column is passed as ``tools``).

    Yields:
        `dict`: One kept example as TRL's prepared dataset has it: the columns TRL keeps (ShareGPT ``conversations``
        renamed ``messages``, ``text`` added by ``formatting_func``, eos appended to standard ``text``/``completion``
        strings, the mask columns the labels were built from removed), then ``input_ids`` (`list[int]`) and
        ``labels`` (`list[int]`: ``input_ids[t]`` where the token is a prediction target, else ``-100``).

    Raises:
        ValueError: empty dataset, no recognised column, conversational data without a chat template,
            ``assistant_only_loss`` without ``{% generation %}`` markers, or every example dropped because
            truncation left it no loss token.
    """
    _validate_args(max_length, truncation_mode)
    iterator = iter(dataset)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError(
            f"The SFT dataset is empty ({type(dataset).__name__} with no examples); pass at least one example."
        ) from None
    if not isinstance(first, Mapping):
        raise TypeError(
            f"Example 0 should be a dict of columns; found {describe(first)}. Wrap plain strings as {{'text': ...}}."
        )
    preparer = _Preparer(
        tokenizer, first, get_dataset_column_names(dataset, first),
        dataset_text_field=dataset_text_field, max_length=max_length, truncation_mode=truncation_mode,
        completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss, eos_token=eos_token,
        formatting_func=formatting_func, chat_template_kwargs=chat_template_kwargs,
    )
    seen = kept = dropped = 0
    for index, raw in enumerate(itertools.chain([first], iterator)):
        seen += 1
        full_ids, full_mask, example = preparer.tokenize(raw, index)
        input_ids, loss_mask = preparer.truncate(full_ids, full_mask)
        if not any(loss_mask):
            dropped += 1
            if dropped <= MAX_DROP_WARNINGS:
                warnings.warn(_drop_message(index, full_ids, full_mask, max_length, truncation_mode), SFTDataWarning,
                              stacklevel=2)
            if dropped == MAX_DROP_WARNINGS:
                warnings.warn(f"{MAX_DROP_WARNINGS} examples dropped so far; further drops are not reported one by "
                              "one.", SFTDataWarning, stacklevel=2)
            continue
        kept += 1
        labels = [token if bit else -100 for token, bit in zip(input_ids, loss_mask, strict=True)]
        yield {**_trl_columns(raw, example, preparer), "input_ids": input_ids, "labels": labels}
    if kept == 0:
        raise ValueError(
            f"All {seen} examples of the SFT dataset were dropped: none kept a loss token after truncation to "
            f"max_length={max_length} ({truncation_mode}). Raise max_length above the prompt lengths, shorten the "
            "prompts, or check the completion/assistant masks."
        )


def _drop_message(
    index: int, full_ids: list[int], full_mask: list[int], max_length: int | None, truncation_mode: str
) -> str:
    if not any(full_mask):
        return (f"Example {index} ({len(full_ids)} tokens) has no token in its loss mask, so it is dropped (it "
                "would contribute nothing to the loss).")
    first = full_mask.index(1)
    last = len(full_mask) - 1 - full_mask[::-1].index(1)
    return (
        f"Example {index} is dropped: its loss tokens are at positions {first}..{last} of {len(full_ids)} tokens "
        f"(the prompt is {first} tokens), and truncation to max_length={max_length} ({truncation_mode}) removes "
        "them all, so it would contribute nothing to the loss. Raise max_length or shorten the prompt."
    )


def prepare_sft_dataset(
    dataset: Iterable[Mapping[str, Any]],
    tokenizer: Tokenizer,
    *,
    dataset_text_field: str = "text",
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
    formatting_func: Callable[[dict], str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    packing: bool = False,
    packing_strategy: str = "bfd",
    shuffle_seed: int | None = None,
) -> Any:
    """The prepared dataset ``trl.SFTTrainer._prepare_dataset`` (1.16) makes: a ``datasets.Dataset`` with TRL's
    columns, which ``SFTTrainer.train_dataset`` shows.

    Without packing: one row per kept example of [`iter_sft_examples`] (the columns TRL keeps, ``input_ids`` and
    ``labels``), truncated to ``max_length``. With packing: only ``input_ids``, ``labels`` and, for the ``"bfd"``
    strategies, ``seq_lengths`` ([`~torchlike.trl.data.packing.pack_rows`]); examples are not truncated before packing
    (TRL's rule).

    Args:
        dataset, tokenizer, dataset_text_field, max_length, truncation_mode, completion_only_loss,
        assistant_only_loss, eos_token, formatting_func, chat_template_kwargs: as in [`iter_sft_examples`].
        packing (`bool`, *optional*, defaults to `False`): pack the examples into rows of ``max_length`` tokens.
        packing_strategy (`str`, *optional*, defaults to `"bfd"`): see [`~torchlike.trl.data.packing.pack_rows`].
        shuffle_seed (`int`, *optional*): shuffle the examples with this seed (``SFTConfig.shuffle_dataset``): before
            packing and after, as TRL does.

    Returns:
        `datasets.Dataset`.
    """
    import datasets

    if packing and max_length is None:
        raise ValueError("When packing is enabled, `max_length` can't be `None`.")
    rows = list(iter_sft_examples(
        dataset, tokenizer, dataset_text_field=dataset_text_field, max_length=None if packing else max_length,
        truncation_mode=truncation_mode, completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss, eos_token=eos_token, formatting_func=formatting_func,
        chat_template_kwargs=chat_template_kwargs))
    rng = np.random.default_rng(shuffle_seed) if shuffle_seed is not None else None
    if rng is not None:
        rows = [rows[int(i)] for i in rng.permutation(len(rows))]
    if packing:
        rows = pack_rows(rows, max_length, packing_strategy)
        if rng is not None:
            rows = [rows[int(i)] for i in rng.permutation(len(rows))]
    return datasets.Dataset.from_list(rows)


def _trl_columns(raw: Mapping[str, Any], example: Mapping[str, Any], preparer: _Preparer) -> dict[str, Any]:
    """The columns TRL keeps from a raw example beside ``input_ids`` and ``labels``; ``example`` is what
    :meth:`_Preparer.tokenize` made of it (``formatting_func``'s text, ShareGPT converted), reused, not recomputed."""
    row = dict(raw)
    if preparer.tokenized:
        if "labels" in row:
            return row
        row.pop("assistant_masks", None)
        if preparer.completion_only_loss:
            row.pop("completion_mask", None)
        return row
    if preparer.formatting_func is not None:
        row["text"] = example[preparer.dataset_text_field]
    elif is_conversational_from_value(row):
        row = dict(example)
    if not preparer.conversational and preparer.eos:
        for key in (preparer.dataset_text_field, "completion"):
            if isinstance(row.get(key), str):
                if not row[key].endswith(preparer.eos):
                    row[key] = row[key] + preparer.eos
                break
    return row


class SFTRows(Sequence):
    """Row access for the collator to a prepared SFT dataset's token columns, without copying them: row ``i`` is
    ``{"input_ids": array, "labels": array[, "seq_lengths": array]}`` (numpy views into the Arrow buffers of a
    ``datasets.Dataset``; rows of any other sequence as they are).

    Args:
        dataset (`datasets.Dataset` or `Sequence[dict]`): A prepared dataset ([`prepare_sft_dataset`]).
    """

    _COLUMNS = ("input_ids", "labels", "seq_lengths")

    def __init__(self, dataset: RowsLike):
        self.dataset = dataset
        self._columns: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        if hasattr(dataset, "data") and hasattr(dataset, "flatten_indices"):
            if getattr(dataset, "_indices", None) is not None:
                dataset = dataset.flatten_indices()
            self._columns = {}
            for name in self._COLUMNS:
                if name in dataset.column_names:
                    column = dataset.data.column(name).combine_chunks()
                    self._columns[name] = (column.offsets.to_numpy(), column.values.to_numpy())

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if self._columns is None:
            return self.dataset[index]
        return {name: values[offsets[index]:offsets[index + 1]] for name, (offsets, values) in self._columns.items()}


def is_prepared(dataset: Iterable[Mapping[str, Any]]) -> bool:
    """Whether ``dataset`` holds prepared examples already (its first example has ``input_ids`` and ``labels`` or a
    ``loss_mask``), such as ``SFTTrainer.eval_dataset``: ``SFTTrainer.evaluate`` uses those as they are (TRL's
    ``_prepare_dataset`` skips data it prepared likewise).

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): Examples, raw or prepared.
    """
    first = next(iter(dataset), None)
    return isinstance(first, Mapping) and "input_ids" in first and ("labels" in first or "loss_mask" in first)


def unprepared_sft_examples(dataset: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of an already prepared dataset, used as given (``SFTConfig.dataset_kwargs={"skip_prepare_dataset":
    True}``, TRL 1.16's rule): ``input_ids`` as they are, the loss on ``labels != -100`` (on every token without
    ``labels``); nothing is tokenised, truncated, appended or dropped.

    Args:
        dataset (`datasets.Dataset` or an iterable of dicts): Rows with ``input_ids`` and optionally ``labels``.

    Returns:
        `list[dict]`: ``{"input_ids": list[int], "labels": list[int]}`` per row (``labels`` as given, or
        ``input_ids`` without them), as [`iter_sft_examples`] yields them.

    Raises:
        ValueError: a row without ``input_ids``, or with ``completion_mask`` / ``assistant_masks`` but no ``labels``
            (TRL refuses these too: the masks would be ignored and the loss would cover every token).
    """
    examples = []
    for index, row in enumerate(dataset):
        if row.get("input_ids") is None:
            raise ValueError(f"Example {index} has no 'input_ids' (columns {list(row)}), but "
                             "dataset_kwargs={'skip_prepare_dataset': True} uses the dataset as given, so it must be "
                             "tokenised already. Drop skip_prepare_dataset to let SFTTrainer prepare it.")
        input_ids = as_int_list(row["input_ids"], "input_ids", index)
        if row.get("labels") is not None:
            labels = as_int_list(row["labels"], "labels", index)
            _labels_as_loss_mask(labels, input_ids, index)  # refuses labels that are not input_ids or -100
        elif row.get("completion_mask") is not None or row.get("assistant_masks") is not None:
            raise ValueError(f"Example {index} has mask columns but no 'labels', and skip_prepare_dataset=True skips "
                             "building labels from them, so the loss would cover the full sequence. Add a 'labels' "
                             "column (-100 on tokens without loss) or drop skip_prepare_dataset.")
        else:
            labels = list(input_ids)
        examples.append({"input_ids": input_ids, "labels": labels})
    if not examples:
        raise ValueError(f"The SFT dataset is empty ({type(dataset).__name__} with no examples); pass at least one "
                         "example.")
    return examples


# ---------------------------------------------------------------------------------------------------------------------
# Fixed-shape batches
# ---------------------------------------------------------------------------------------------------------------------


def collate_sft_batch(examples: Sequence[Mapping[str, Any]], pad_token_id: int, length: int,
                      position_ids: bool = False) -> dict[str, np.ndarray]:
    """Right-pads prepared examples to a fixed ``[len(examples), length]`` batch.

    Args:
        examples (`Sequence[dict]`): ``input_ids`` with ``labels`` (``-100`` off the loss, [`prepare_sft_dataset`])
            or a 0/1 ``loss_mask``, optionally ``seq_lengths`` (packed rows).
        pad_token_id (`int`): Fills ``input_ids`` past each sequence (see
            [`~torchlike.trl.data_utils.pad_token_id_for`]).
        length (`int`): The padded length, e.g. ``max_length``.
        position_ids (`bool`, *optional*, defaults to `False`): TRL's padding-free batches: add ``position_ids``
            restarting at 0 at each sequence of ``seq_lengths`` (the whole row is one sequence without it; 0 on
            padding), and take the first token of each sequence off the loss (TRL's collator sets its label to
            ``-100``), so no sequence is scored from another's tokens.

    Returns:
        `dict[str, np.ndarray]`, all int32 of shape ``[B, length]``:
        - ``input_ids``: token ids, ``pad_token_id`` on padding;
        - ``attention_mask``: 1 on real tokens, 0 on padding;
        - ``loss_mask``: 1 where ``input_ids[b, t]`` is a prediction target (scored from the logits at ``t - 1``),
          0 on padding and on prompt / non-assistant tokens. ``loss_mask.sum()`` is the number of loss tokens;
        - ``position_ids`` with ``position_ids=True``.
    """
    if length < 1:
        raise ValueError(f"length should be a positive number of tokens; found {length}.")
    batch = len(examples)
    input_ids = np.full((batch, length), pad_token_id, dtype=np.int32)
    attention_mask = np.zeros((batch, length), dtype=np.int32)
    loss_mask = np.zeros((batch, length), dtype=np.int32)
    positions = np.zeros((batch, length), dtype=np.int32) if position_ids else None
    for row, example in enumerate(examples):
        ids = example["input_ids"]
        mask = _loss_mask_of(example)
        n = len(ids)
        if n > length:
            raise ValueError(
                f"Example {row} of the batch has {n} tokens, more than the padded length {length}. Prepare the data "
                f"with max_length <= {length}, or pad to a longer length."
            )
        if len(mask) != n:
            raise ValueError(f"Example {row} of the batch has {n} input_ids but {len(mask)} loss_mask entries.")
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = mask
        if positions is not None:
            seq_lengths = example.get("seq_lengths")
            seq_lengths = [n] if seq_lengths is None else [int(count) for count in seq_lengths]
            starts = np.cumsum([0, *seq_lengths[:-1]])
            positions[row, :n] = np.arange(n) - np.repeat(starts, seq_lengths)
            loss_mask[row, starts] = 0
    collated = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if positions is not None:
        collated["position_ids"] = positions
    return collated


def _loss_mask_of(example: Mapping[str, Any]) -> Any:
    """``loss_mask``, else ``labels != -100``, else every token (TRL's collator copies ``input_ids`` as labels)."""
    if "loss_mask" in example:
        return example["loss_mask"]
    if example.get("labels") is not None:
        return np.asarray(example["labels"]) != -100
    return np.ones(len(example["input_ids"]), dtype=bool)

