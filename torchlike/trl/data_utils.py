"""TRL's ``trl/data_utils.py`` for torchlike's trainers: conversation detection, chat templates, prompt extraction,
unpairing, plus the small helpers every data module shares (columns, token windows, padding, messages).

The functions TRL exports keep TRL's names (``is_conversational``, ``apply_chat_template``, ``extract_prompt``,
``unpair_preference_dataset``, ``common_prefix_length``...). They work on examples as dicts and on lists of rows (TRL's
work on ``datasets.Dataset``); where a rule differs from TRL's, the docstring says so. TRL is not a runtime
dependency.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..type_aliases import DatasetLike, Tokenizer

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = [
    "MAX_DROP_WARNINGS",
    "UNPAIR_BLOCK_SIZE",
    "apply_chat_template",
    "as_int_list",
    "chat_template_kwargs_for",
    "common_prefix_length",
    "describe",
    "example_tools",
    "extract_prompt",
    "get_dataset_column_names",
    "is_conversational",
    "is_conversational_from_value",
    "is_message_list",
    "load_chat_template",
    "map_batches",
    "maybe_apply_chat_template",
    "maybe_convert_to_chatml",
    "maybe_extract_prompt",
    "maybe_unpair_preference_dataset",
    "pad_token_id_for",
    "padded_sequences",
    "prepare_multimodal_messages",
    "response_sequence",
    "tokenized_examples",
    "truncation_window",
    "unpair_preference_dataset",
]

#: How many dropped examples a data module reports one by one before it stops warning about each.
MAX_DROP_WARNINGS = 5
#: Pairs per ``datasets.map`` batch when TRL unpairs a preference dataset (``datasets``' default ``batch_size``).
UNPAIR_BLOCK_SIZE = 1000


# ---------------------------------------------------------------------------------------------------------------------
# Describing data
# ---------------------------------------------------------------------------------------------------------------------


def describe(value: object) -> str:
    """A short description of a value's type for error messages: ``"a str"``, ``"a list of dict"``, ``"an empty
    list"``.

    Args:
        value (`Any`): The value found where another was expected.

    Returns:
        `str`: The description.
    """
    if isinstance(value, list):
        return f"a list of {type(value[0]).__name__}" if value else "an empty list"
    return f"a {type(value).__name__}"


def get_dataset_column_names(dataset: DatasetLike | Iterable[Mapping[str, Any]],
                             first: Mapping[str, Any] | None = None) -> list[str]:
    """The column names of a dataset, as TRL's ``get_dataset_column_names``: ``dataset.column_names`` when it is a
    list, else the keys of the first row (an ``IterableDataset`` without features, a list of dicts).

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or an iterable of dicts): The dataset.
        first (`dict`, *optional*): Its first row when already read, so that a stream is not read again.

    Returns:
        `list[str]`: The column names (empty when the first row is not a dict or there is none).
    """
    names = getattr(dataset, "column_names", None)
    if isinstance(names, (list, tuple)):
        return list(names)
    if first is None:
        first = next(iter(dataset), None)
    return list(first) if isinstance(first, Mapping) else []


def is_message_list(value: object, keys: tuple[str, ...] = ("role",)) -> bool:
    """Whether ``value`` is a non-empty list of chat messages: its first item is a dict with every key of ``keys``.

    Args:
        value (`Any`): A column's value.
        keys (`tuple[str, ...]`, *optional*, defaults to `("role",)`): The keys a message has (``("from", "value")``
            for ShareGPT).

    Returns:
        `bool`
    """
    return (
        isinstance(value, list)
        and len(value) > 0
        and isinstance(value[0], Mapping)
        and all(key in value[0] for key in keys)
    )


def is_conversational(example: Mapping[str, Any]) -> bool:
    """TRL's ``is_conversational``: whether the first of ``prompt``, ``chosen``, ``rejected``, ``completion`` and
    ``messages`` the example has is a list of ``{"role", ...}`` messages.

    Args:
        example (`dict`): One example of any TRL format.

    Returns:
        `bool`
    """
    for key in ("prompt", "chosen", "rejected", "completion", "messages"):
        if key in example:
            return is_message_list(example[key])
    return False


def is_conversational_from_value(example: Mapping[str, Any]) -> bool:
    """TRL's ``is_conversational_from_value``: whether the example is ShareGPT data, a ``conversations`` list of
    ``{"from", "value"}`` messages.

    Args:
        example (`dict`): One example.

    Returns:
        `bool`
    """
    return is_message_list(example.get("conversations"), keys=("from", "value"))


def maybe_convert_to_chatml(example: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's ``maybe_convert_to_chatml``: ShareGPT ``{"from", "value"}`` messages renamed ``{"role", "content"}``,
    and ``conversations`` renamed ``messages``.

    Role values are kept as they are (as in TRL), so data whose roles are ``"human"``/``"gpt"`` reaches the chat
    template with those names. Unlike TRL, the input is not modified, and only ``prompt``, ``completion``,
    ``messages`` and ``conversations`` are converted.

    Args:
        example (`dict`): One example.

    Returns:
        `dict`: A converted copy.
    """
    converted = dict(example)
    for key in ("prompt", "completion", "messages", "conversations"):
        if isinstance(converted.get(key), list):
            messages = []
            for message in converted[key]:
                if isinstance(message, Mapping):
                    message = dict(message)
                    if "from" in message:
                        message["role"] = message.pop("from")
                    if "value" in message:
                        message["content"] = message.pop("value")
                messages.append(message)
            converted[key] = messages
    if "conversations" in converted:
        converted["messages"] = converted.pop("conversations")
    return converted


def common_prefix_length(ids: Sequence[Any], other_ids: Sequence[Any]) -> int:
    """TRL's ``common_prefix_length``: how many leading items ``ids`` and ``other_ids`` share (token ids, characters
    or messages).

    Args:
        ids (`Sequence`), other_ids (`Sequence`): The two sequences.

    Returns:
        `int`: The length of their longest common prefix.
    """
    length = 0
    for item, other in zip(ids, other_ids, strict=False):
        if item != other:
            break
        length += 1
    return length


def as_int_list(values: ArrayLike, name: str, index: int) -> list[int]:
    """A column of token ids (a list, tuple, numpy, torch or JAX array) as a list of Python ints.

    Args:
        values (`Any`): The column's value.
        name (`str`), index (`int`): The column and the example's index, for the error message.

    Returns:
        `list[int]`

    Raises:
        TypeError: ``values`` is not a sequence of numbers.
    """
    if hasattr(values, "tolist"):  # numpy / torch / jax arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"Example {index}: '{name}' should be a list of ints; found {describe(values)}.")
    return [int(v) for v in values]


# ---------------------------------------------------------------------------------------------------------------------
# Chat templates and the tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def chat_template_kwargs_for(example: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``apply_chat_template`` on one example, built as TRL builds them.

    Args:
        example (`dict`): The raw example; its optional ``tools`` column (a list, or JSON text) and
            ``chat_template_kwargs`` column (a dict) are read.
        defaults (`dict`, *optional*): Keyword arguments for every example; the row's ``chat_template_kwargs``
            override them.

    Returns:
        `dict`: ``{"tools": ..., **defaults, **example["chat_template_kwargs"]}``.
    """
    return {"tools": example_tools(example), **(defaults or {}), **(example.get("chat_template_kwargs") or {})}


def _shared_text(text: str, other: str) -> str:
    return "".join(a for a, _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(text, other, strict=False)))


#: The key sets TRL's ``apply_chat_template`` renders, one per dataset type.
_CHAT_TEMPLATE_KEYS = ("prompt", "chosen", "rejected", "completion", "messages", "label")
_CHAT_TEMPLATE_LAYOUTS = ({"messages"}, {"prompt"}, {"prompt", "completion"}, {"prompt", "chosen", "rejected"},
                          {"chosen", "rejected"}, {"prompt", "completion", "label"})


def example_tools(example: Mapping[str, Any]) -> list | None:
    """An example's ``tools`` column as the list TRL's trainers pass to ``apply_chat_template(tools=...)`` (JSON text
    decoded), or ``None``."""
    tools = example.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def apply_chat_template(example: Mapping[str, Any], processing_class: Tokenizer, tools: list | None = None,
                        **template_kwargs: Any) -> dict[str, Any]:
    """TRL's ``apply_chat_template``: a conversational example rendered to text by the chat template, for every dataset
    type TRL has.

    ``messages`` becomes ``text``; a ``prompt`` gets the generation prompt after a user or tool turn (or continues its
    last assistant turn) and is then cut to the text it shares with each rendered prompt + response conversation, and
    each response (``chosen``, ``rejected``, ``completion``) is what its conversation adds to it; without a prompt,
    ``chosen`` and ``rejected`` are rendered whole; ``label`` is kept. The example's ``chat_template_kwargs`` (a dict)
    and ``template_kwargs`` go to the template.

    Args:
        example (`dict`): One of ``{"messages"}``, ``{"prompt"}``, ``{"prompt", "completion"}``,
            ``{"prompt", "chosen", "rejected"}``, ``{"chosen", "rejected"}`` or ``{"prompt", "completion", "label"}``
            (other keys are ignored), each a list of ``{"role", "content"}`` messages.
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Renders the messages.
        tools (`list`, *optional*): Function schemas (or Python functions) for the template; an empty list counts as
            none, as in TRL.
        **template_kwargs: Further keyword arguments for ``processing_class.apply_chat_template``.

    Returns:
        `dict`: The rendered text under the example's keys (``text`` for ``messages``).

    Raises:
        KeyError: the example's keys are none of the layouts above (TRL's message).
        ValueError: a prompt whose last turn is not from the user, a tool or the assistant (TRL's message).
    """
    keys = {key for key in example if key in _CHAT_TEMPLATE_KEYS}
    if keys not in _CHAT_TEMPLATE_LAYOUTS:
        raise KeyError(f"Invalid keys in the example: {keys}")
    kwargs = {"tools": tools or None, **(example.get("chat_template_kwargs") or {}), **template_kwargs}

    def render(messages: list, **extra: Any) -> str:
        return processing_class.apply_chat_template(messages, tokenize=False, **extra, **kwargs)

    output: dict[str, Any] = {}
    if "messages" in example:
        output["text"] = render(example["messages"])
    responses = [key for key in ("chosen", "rejected", "completion") if key in example]
    if "prompt" in example:
        last_role = example["prompt"][-1]["role"]
        if last_role not in ("user", "tool", "assistant"):
            raise ValueError(f"Invalid role in the last message: {last_role}")
        prompt = render(example["prompt"], continue_final_message=last_role == "assistant",
                        add_generation_prompt=last_role != "assistant")
        full = {key: render(example["prompt"] + example[key]) for key in responses}
        for text in full.values():  # DeepSeek-R1's generation prompt is not a prefix of the whole conversation
            prompt = _shared_text(prompt, text)
        output["prompt"] = prompt
        output.update({key: text[len(prompt):] for key, text in full.items()})
    else:
        output.update({key: render(example[key]) for key in responses})
    if "label" in example:
        output["label"] = example["label"]
    return output


def maybe_apply_chat_template(example: Mapping[str, Any], processing_class: Tokenizer, tools: list | None = None,
                              **template_kwargs: Any) -> Mapping[str, Any]:
    """TRL's ``maybe_apply_chat_template``: [`apply_chat_template`] for a conversational example
    ([`is_conversational`]), the example itself otherwise.

    Args:
        example (`dict`): A data row of any TRL dataset type.
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Renders the messages.
        tools (`list`, *optional*): Function schemas for the template.
        **template_kwargs: Further keyword arguments for the chat template.

    Returns:
        `dict`: The rendered example, or ``example`` unchanged when it is text.
    """
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools, **template_kwargs)
    return example


def load_chat_template(tokenizer: Tokenizer, path: str) -> None:
    """Replaces ``tokenizer``'s chat template as ``chat_template_path`` asks (TRL 1.16's rule).

    A ``.jinja``/``.j2`` file is the template itself. Anything else is a tokenizer directory or hub id whose chat
    template and eos token are copied (TRL's ``clone_chat_template``).

    Args:
        tokenizer (`transformers.PreTrainedTokenizerBase`): The tokenizer to change, in place.
        path (`str`): The template file, or the tokenizer to copy it from.

    Raises:
        ValueError: the source tokenizer has tokens ``tokenizer`` lacks. TRL adds them and resizes the model's
            embeddings; torchlike does not resize embeddings.
    """
    if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
        with open(path, encoding="utf-8") as template:
            tokenizer.chat_template = template.read()
        return
    from ..tokenization import AutoTokenizer

    source = AutoTokenizer.from_pretrained(path)
    vocabulary = tokenizer.get_vocab()
    missing = [token.content for token in source.added_tokens_decoder.values() if token.content not in vocabulary]
    if missing:
        raise ValueError(
            f"chat_template_path={path!r}: that tokenizer has tokens {missing[:8]} which {type(tokenizer).__name__} "
            "lacks. TRL adds them and resizes the model's embeddings, which torchlike does not do. Save the template "
            "as a .jinja file written with the tokens this tokenizer has, and pass its path."
        )
    tokenizer.chat_template = source.get_chat_template()
    tokenizer.eos_token = source.eos_token


def pad_token_id_for(tokenizer: Tokenizer, eos_token: str | None = None) -> int:
    """The padding id TRL's collators use: ``tokenizer.pad_token``, else the eos token (``eos_token`` if given).

    Padding never enters the loss (its masks are 0, whatever the id), so a pad equal to eos is safe.

    Args:
        tokenizer (`transformers.PreTrainedTokenizerBase`): The tokenizer.
        eos_token (`str`, *optional*): The config's ``eos_token``, which overrides the tokenizer's eos.

    Returns:
        `int`: The token id to pad ``input_ids`` with.
    """
    token = tokenizer.pad_token or eos_token or tokenizer.eos_token
    if token is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has neither a pad_token nor an eos_token to pad with; set "
            "tokenizer.pad_token = '...' (any token in its vocabulary)."
        )
    return int(tokenizer.convert_tokens_to_ids(token))


def tokenized_examples(dataset: DatasetLike | Iterable[Mapping[str, Any]], examples: Iterable[Mapping[str, Any]],
                       tokenize: Callable[[Mapping[str, Any], int], Mapping[str, Any]],
                       num_proc: int | None) -> Iterable[Mapping[str, Any]]:
    """``tokenize(example, index)`` for every example: through ``datasets.Dataset.map(num_proc=...)`` (TRL's
    ``dataset_num_proc``) when ``num_proc > 1`` and ``dataset`` is a ``datasets.Dataset``, else one by one, lazily.

    Args:
        dataset (`Any`): The dataset as given (read with ``map`` in the first case).
        examples (`Iterable[dict]`): Its examples (read in the second case; the first may already be read).
        tokenize (`Callable[[dict, int], dict]`): Turns one raw example and its index into token columns.
        num_proc (`int`, *optional*): The number of processes.

    Returns:
        `Iterable[dict]`: The tokenised examples, in order.
    """
    if num_proc and num_proc > 1 and hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return dataset.map(lambda raw, index: tokenize(raw, index), with_indices=True, num_proc=num_proc,
                           remove_columns=list(dataset.column_names))
    return (tokenize(raw, index) for index, raw in enumerate(examples))


# ---------------------------------------------------------------------------------------------------------------------
# Preference data: prompts, unpairing, token windows
# ---------------------------------------------------------------------------------------------------------------------


def extract_prompt(example: Mapping[str, Any]) -> dict[str, Any]:
    """Splits the shared prompt off an implicit-prompt preference example, as TRL 1.16's ``extract_prompt``.

    The prompt is the longest common prefix of ``chosen`` and ``rejected`` (characters for strings, messages for
    conversations), minus a trailing space (which stays with the responses). As in TRL, at least the last element of
    the shorter response stays in the responses when one response is a prefix of the other.

    Args:
        example (`dict`): With ``chosen`` and ``rejected`` (both strings or both message lists).

    Returns:
        `dict`: ``{"prompt", "chosen", "rejected"}`` with the prompt removed from the responses.
    """
    chosen, rejected = example["chosen"], example["rejected"]
    shortest = min(len(chosen), len(rejected))
    shared = common_prefix_length(chosen, rejected)
    if shared < shortest:
        split = shared - 1 if shared > 0 and chosen[shared - 1] == " " else shared
    else:  # TRL's loop ends without a mismatch on the last index of the shorter response
        split = max(shortest - 1, 0)
    return {"prompt": chosen[:split], "chosen": chosen[split:], "rejected": rejected[split:]}


def maybe_extract_prompt(example: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's ``maybe_extract_prompt``: :func:`extract_prompt` for an implicit-prompt preference example; the example as
    it is when it is no preference example, or already has a ``prompt`` of the same kind (text or conversation) as its
    responses.

    Args:
        example (`dict`): One example.

    Returns:
        `dict`: The example with an explicit prompt, or the example itself.
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example and (is_conversational({"prompt": example["prompt"]})
                                == is_conversational({"chosen": example["chosen"]})):
        return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def _shards(length: int, num_proc: int | None) -> list[range]:
    """The contiguous row ranges ``datasets.Dataset.map(num_proc=...)`` hands its processes (``Dataset.shard`` with
    ``contiguous=True``; ``num_proc`` is reduced to the number of rows)."""
    count = max(1, min(num_proc or 1, length))
    size, extra = divmod(length, count)
    starts = [size * index + min(index, extra) for index in range(count + 1)]
    return [range(start, end) for start, end in zip(starts, starts[1:], strict=False)]


def map_batches(length: int, batch_size: int, num_proc: int | None) -> Iterator[range]:
    """The batches a batched ``datasets.Dataset.map(num_proc=...)`` hands its function: consecutive blocks of
    ``batch_size`` rows within each process's contiguous shard (so a block never crosses a shard).

    Args:
        length (`int`): The number of rows.
        batch_size (`int`): The ``map`` batch size.
        num_proc (`int`, *optional*): The number of processes (``None``: one).

    Yields:
        `range`: The row indices of each batch, in order.
    """
    for shard in _shards(length, num_proc):
        for start in range(shard.start, shard.stop, batch_size):
            yield range(start, min(start + batch_size, shard.stop))


def unpair_preference_dataset(dataset: DatasetLike | Sequence[Mapping[str, Any]], num_proc: int | None = None,
                              **map_kwargs: Any) -> DatasetLike | list[dict[str, Any]]:
    """TRL's ``unpair_preference_dataset``: each pair becomes a ``completion`` with ``label`` True (the chosen one) and
    one with ``label`` False (the rejected one); the other columns are copied to both.

    TRL's batched ``map`` gives, per block of [`UNPAIR_BLOCK_SIZE`] pairs (within each process's shard with
    ``num_proc``, see [`map_batches`]), the chosen rows first and then the rejected rows; so does this, on a list of
    rows as on a ``datasets`` dataset.

    Args:
        dataset (`Dataset`, `DatasetDict`, `IterableDataset` or `Sequence[dict]`): Rows with ``chosen`` and
            ``rejected`` (and optionally ``prompt`` and other columns).
        num_proc (`int`, *optional*): Processes for ``datasets.Dataset.map`` (TRL's ``dataset_num_proc``), which
            decide the blocks.
        **map_kwargs: Further arguments of ``datasets.Dataset.map`` (``desc``...), as TRL passes them; a list of rows
            takes only ``desc``, which it ignores.

    Returns:
        The unpaired dataset, of the kind given (a list of rows for a list).
    """
    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        columns = dataset.column_names
        if isinstance(columns, dict):  # a DatasetDict: each split's columns
            columns = next(iter(columns.values()))
        if columns is None:  # an IterableDataset whose features are unknown
            columns = list(next(iter(dataset)).keys())
        if num_proc is not None:
            map_kwargs["num_proc"] = num_proc
        return dataset.map(_unpaired_batch, batched=True, remove_columns=columns, **map_kwargs)
    if set(map_kwargs) - {"desc"}:
        raise TypeError(f"unpair_preference_dataset on a list of rows takes num_proc and desc only; got "
                        f"{sorted(set(map_kwargs) - {'desc'})}. Pass a datasets.Dataset for map's other arguments.")
    rows = dataset
    unpaired = []
    for block in map_batches(len(rows), UNPAIR_BLOCK_SIZE, num_proc):
        for response, label in (("chosen", True), ("rejected", False)):
            for index in block:
                row = {key: value for key, value in rows[index].items() if key not in ("chosen", "rejected")}
                unpaired.append({**row, "completion": rows[index][response], "label": label})
    return unpaired


def _unpaired_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """One batch of pairs unpaired: the chosen completions, then the rejected ones, other columns twice."""
    size = len(batch["chosen"])
    unpaired = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * size + [False] * size}
    unpaired.update({key: values + values for key, values in batch.items() if key not in ("chosen", "rejected")})
    return unpaired


def maybe_unpair_preference_dataset(dataset: DatasetLike | Sequence[Mapping[str, Any]], num_proc: int | None = None,
                                    desc: str | None = None) -> DatasetLike | list[dict[str, Any]]:
    """TRL's ``maybe_unpair_preference_dataset``: :func:`unpair_preference_dataset` when the dataset has ``chosen``
    and ``rejected`` columns, otherwise the dataset itself.

    Args:
        dataset (`Dataset`, `DatasetDict` or `Sequence[dict]`): A preference dataset, paired or not.
        num_proc (`int`, *optional*): Processes for ``datasets.Dataset.map``.
        desc (`str`, *optional*): The progress bar's description while mapping.

    Returns:
        The unpaired dataset, or ``dataset`` as it is.
    """
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict: its first split's columns, as TRL reads them
        names = next(iter(names.values()))
    columns = names if isinstance(names, (list, tuple)) else get_dataset_column_names(dataset)
    if "chosen" in columns and "rejected" in columns:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


def truncation_window(max_length: int | None, truncation_mode: str = "keep_start") -> slice:
    """The tokens a collator keeps of a sequence: the first ``max_length`` (``"keep_start"``), the last ones
    (``"keep_end"``), or all of them (``max_length=None``).

    Args:
        max_length (`int` or `None`): The truncation length.
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`): ``"keep_start"`` or ``"keep_end"``.

    Returns:
        `slice`: Applied to a sequence of tokens.
    """
    if max_length is None:
        return slice(None)
    return slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)


def response_sequence(example: Mapping[str, Any], response: str, window: slice) -> tuple[list[int], list[int]]:
    """``(prompt + response ids, completion mask)`` of one response of a prepared example, cut by ``window`` as TRL's
    collators cut it.

    Args:
        example (`dict`): ``prompt_ids`` and ``<response>_ids``; ``<response>_prompt_ids`` when each response has its
            own prompt tokens (TRL's experimental trainers tokenise them apart), used instead of ``prompt_ids``.
        response (`str`): ``"chosen"``, ``"rejected"``, ``"completion"``...
        window (`slice`): From [`truncation_window`].

    Returns:
        `tuple[list[int], list[int]]`: The token ids and the mask (1 on the response's tokens).
    """
    prompt = list(example.get(f"{response}_prompt_ids", example["prompt_ids"]))
    completion = list(example[f"{response}_ids"])
    return (prompt + completion)[window], ([0] * len(prompt) + [1] * len(completion))[window]


def padded_sequences(examples: Sequence[Mapping[str, Any]], responses: Iterable[tuple[str, str]], pad_token_id: int,
                     length: int, window: slice) -> dict[str, np.ndarray]:
    """Each example's prompt + response as fixed-width rows ([`response_sequence`]).

    Args:
        examples (`Sequence[dict]`): Prepared examples.
        responses (`Iterable[tuple[str, str]]`): ``(response, prefix)`` pairs: the response to read and the prefix of
            its output columns.
        pad_token_id (`int`): Fills ``input_ids`` past each sequence.
        length (`int`): The padded length.
        window (`slice`): From [`truncation_window`].

    Returns:
        `dict[str, np.ndarray]`: For every ``(response, prefix)``, int32 ``[B, length]`` ``<prefix>input_ids``,
        ``<prefix>attention_mask`` and ``<prefix>completion_mask`` (1 on the response's tokens).

    Raises:
        ValueError: a sequence longer than ``length``.
    """
    batch: dict[str, np.ndarray] = {}
    for response, prefix in responses:
        input_ids = np.full((len(examples), length), pad_token_id, dtype=np.int32)
        attention_mask = np.zeros((len(examples), length), dtype=np.int32)
        completion_mask = np.zeros((len(examples), length), dtype=np.int32)
        for row, example in enumerate(examples):
            ids, mask = response_sequence(example, response, window)
            if len(ids) > length:
                raise ValueError(f"Example {row} of the batch has a {len(ids)}-token {response} sequence, more than "
                                 f"the padded length {length}; compute the length with padded_length(...).")
            input_ids[row, :len(ids)], attention_mask[row, :len(ids)], completion_mask[row, :len(ids)] = ids, 1, mask
        batch.update({f"{prefix}input_ids": input_ids, f"{prefix}attention_mask": attention_mask,
                      f"{prefix}completion_mask": completion_mask})
    return batch

def prepare_multimodal_messages(messages: Sequence[Mapping[str, Any]], images: Sequence[Any] | None = None
                                ) -> list[dict[str, Any]]:
    """TRL's ``prepare_multimodal_messages``: every ``content`` as a list of typed parts, image placeholders for
    ``images`` before the first user turn's text when the conversation is plain text, and each placeholder filled
    with its image in order.

    Args:
        messages: ``role``/``content`` turns (``content`` a string or a list of parts).
        images: the example's images.

    Returns:
        New message dicts (the inputs are not changed).

    Raises:
        ValueError: a role other than system, user, assistant or tool, or a placeholder count that differs from the
            number of images (TRL's messages).
    """
    images = list(images or [])
    prepared: list[dict[str, Any]] = []
    placed = False
    for message in messages:
        role, content = message["role"], message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"Invalid role in message: {role}. Expected 'system', 'user', 'assistant', or 'tool'.")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                parts = [{"type": "image"} for _ in images] + parts
                placed = True
            message = {**message, "content": parts}
        prepared.append(dict(message))
    open_slots = [(turn, index) for turn, message in enumerate(prepared)
                  if message.get("content") and message["role"] != "tool"
                  for index, part in enumerate(message["content"]) if part["type"] == "image" and "image" not in part]
    if len(open_slots) != len(images):
        raise ValueError(f"Number of images provided ({len(images)}) does not match number of image placeholders "
                         f"({len(open_slots)}).")
    for (turn, index), image in zip(open_slots, images, strict=True):
        content = list(prepared[turn]["content"])
        content[index] = {**content[index], "image": image}
        prepared[turn] = {**prepared[turn], "content": content}
    return prepared
