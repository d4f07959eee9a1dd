"""TRL's ``trl/chat_template_utils.py`` for torchlike: chat templates for training and tool calling.

:func:`clone_chat_template` changes the model as well as the tokenizer, so it is torchlike's own (the vocabulary of a
:class:`~torchlike.CausalLM` is resized on its JAX weights). The functions that only read or patch a tokenizer with
TRL's own data (its training copies of chat templates and its response schemas, dozens of Jinja and JSON files:
:func:`get_training_chat_template`, :func:`add_response_schema`, :func:`parse_response`, :func:`has_generation_markers`,
:func:`is_chat_template_stop_token_trained`) are the installed ``trl``'s, not repeated here: they raise an
``ImportError`` that says to install ``trl`` when it is missing. :func:`supports_tool_calling` and
:func:`is_chat_template_prefix_preserving` are torchlike's own (GRPO's tool calling uses them without TRL), with
TRL's signatures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .online import tool_calling

if TYPE_CHECKING:
    from ..modeling import CausalLM
    from ..type_aliases import Tokenizer

__all__ = ["add_response_schema", "clone_chat_template", "get_training_chat_template", "has_generation_markers",
           "is_chat_template_prefix_preserving", "is_chat_template_stop_token_trained", "parse_response",
           "supports_tool_calling"]


def clone_chat_template(model: CausalLM, tokenizer: Tokenizer, source_tokenizer_path: str,
                        resize_to_multiple_of: int | None = 64) -> tuple[CausalLM, Tokenizer, list[int]]:
    """TRL's ``clone_chat_template``: gives ``tokenizer`` the chat template, added tokens and EOS of the tokenizer at
    ``source_tokenizer_path``, and resizes ``model``'s vocabulary to match.

    The source's added tokens the tokenizer lacks are added; the EOS token becomes the source's, in the tokenizer, the
    model's (text) config and its generation config; the embeddings are resized to the tokenizer's vocabulary, rounded
    up to ``resize_to_multiple_of``, and ``<extra_id_N>`` tokens fill the tokenizer up to the embedding's rows, as in
    TRL. New embedding rows are drawn as ``transformers`` draws them (``CausalLM.resize_token_embeddings``).

    Args:
        model (`torchlike.CausalLM`): The model to resize (changed in place and returned).
        tokenizer (`transformers.PreTrainedTokenizerBase`): The tokenizer to update (changed in place and returned).
        source_tokenizer_path (`str`): A local path or Hub id of the tokenizer whose chat template is cloned.
        resize_to_multiple_of (`int`, *optional*, defaults to `64`): Round the vocabulary up to a multiple of this
            (``None``: no rounding).

    Returns:
        `tuple`: ``(model, tokenizer, added_tokens)``, the ids of the tokens added to the tokenizer.

    Raises:
        RuntimeError: the tokenizer's vocabulary and the embedding rows still differ (TRL's message).

    Example:
        >>> model = torchlike.AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")
        >>> tokenizer = torchlike.AutoTokenizer.from_pretrained("meta-llama/Llama-3.2-1B")
        >>> model, tokenizer, added = clone_chat_template(model, tokenizer, "Qwen/Qwen3-0.6B")
    """
    from transformers import AddedToken, AutoTokenizer

    source = AutoTokenizer.from_pretrained(source_tokenizer_path)
    tokenizer.chat_template = source.get_chat_template()
    added = [token for token in source.added_tokens_decoder.values() if token.content not in tokenizer.vocab]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:  # a classifier has none
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.resize_token_embeddings(new_num_tokens=len(tokenizer.vocab), pad_to_multiple_of=resize_to_multiple_of)
    rows = model.get_input_embeddings().num_embeddings
    index = 0
    while rows > len(tokenizer.vocab):
        filler = AddedToken(f"<extra_id_{index}>")
        index += 1
        if tokenizer.add_tokens(filler) == 1:
            added.append(filler)
    if len(tokenizer.vocab) != rows:
        raise RuntimeError(f"Vocabulary size mismatch after resizing: tokenizer vocab size is {len(tokenizer.vocab)}, "
                           f"but model embedding size is {rows}. This indicates an internal error in the token "
                           "alignment process.")
    return model, tokenizer, tokenizer.convert_tokens_to_ids([token.content for token in added])


def _trl_function(stub: Callable[..., Any]) -> Callable[..., Any]:
    """``stub`` (TRL's signature and a docstring) calling the installed TRL's ``trl.chat_template_utils`` function of
    the same name: TRL's templates and schemas are its data files."""
    name = stub.__name__

    @functools.wraps(stub)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            function = getattr(import_module("trl.chat_template_utils"), name)
        except ImportError:
            raise ImportError(f"torchlike.trl.{name} uses TRL's own chat templates and response schemas, which come "
                              "with the trl package: pip install 'trl>=1.16,<2'.") from None
        return function(*args, **kwargs)

    return call


def supports_tool_calling(processing_class: Tokenizer) -> bool:
    """TRL's ``supports_tool_calling``: whether the chat template renders a whole tool exchange (the call's name and
    arguments and the tool's answer all appear).

    Args:
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Whose template to check.

    Returns:
        `bool`
    """
    return tool_calling.supports_tool_calling(processing_class)


def is_chat_template_prefix_preserving(processing_class: Tokenizer) -> bool:
    """TRL's ``is_chat_template_prefix_preserving``: whether appending a tool message leaves the tokens of the
    conversation before it unchanged (what tool calling in GRPO needs).

    Args:
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Whose template to check.

    Returns:
        `bool`
    """
    return tool_calling.is_chat_template_prefix_preserving(processing_class)


@_trl_function
def get_training_chat_template(processing_class: Tokenizer | None = None, tokenizer: Tokenizer | None = None
                               ) -> str | None:
    """TRL's ``get_training_chat_template``: the prefix-preserving training copy of the tokenizer's chat template
    (with ``{% generation %}`` markers for assistant-only loss), or ``None`` when the template needs no patch.

    Args:
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Whose template to patch.
        tokenizer: TRL's older name for ``processing_class``.

    Returns:
        `str` or `None`: The training template (the installed TRL's).
    """


@_trl_function
def add_response_schema(processing_class: Tokenizer) -> Tokenizer:
    """TRL's ``add_response_schema``: the tokenizer with TRL's response template (or schema) for its chat template,
    which ``parse_response`` and GRPO's tool calling read.

    Args:
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): Changed in place.

    Returns:
        The same processing class.
    """


@_trl_function
def parse_response(tokenizer: Tokenizer, ids: list[int], prefix: list[int] | None = None,
                   tools: list[dict | Callable] | None = None) -> dict:
    """TRL's ``parse_response``: a completion's token ids parsed into an assistant message (content, tool calls).

    Args:
        tokenizer (`transformers.PreTrainedTokenizerBase`): With a response template or schema.
        ids (`list[int]`): The completion's ids.
        prefix (`list[int]`, *optional*): The ids before them (transformers 5.13's streamable parsing).
        tools (`list`, *optional*): The tools' schemas, which type the call arguments (transformers 5.15).

    Returns:
        `dict`: The message.
    """


@_trl_function
def has_generation_markers(chat_template: str | dict[str, str]) -> bool:
    """TRL's ``has_generation_markers``: whether a chat template (its ``default`` variant) has ``{% generation %}``
    markers.

    Returns:
        `bool`
    """


@_trl_function
def is_chat_template_stop_token_trained(processing_class: Tokenizer, chat_template: str | None = None) -> bool:
    """TRL's ``is_chat_template_stop_token_trained``: whether assistant-only loss trains the turn's stop token.

    Args:
        processing_class (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`): The tokenizer.
        chat_template (`str`, *optional*): The template to check instead of the tokenizer's.

    Returns:
        `bool`
    """
