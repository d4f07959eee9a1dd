"""GRPO's ``tools``: TRL 1.16's tool-calling loop, driving any ``generate(prompt_id_lists) -> completion id lists``.

What ``trl.GRPOTrainer`` does when it is given ``tools`` (``_tool_call_loop``, ``_get_tool_suffix_ids`` and the checks
of its constructor), reimplemented without importing TRL:

1. The prompts are rendered with the tools' JSON schemas (``apply_chat_template(tools=...)``; the trainer does that).
2. Each completion is parsed into an assistant message (:meth:`ToolCalling.parse`): with ``transformers``' own
   response parser when the tokenizer has a ``response_template`` or ``response_schema``, else with a built-in parser
   of the Qwen 2.5 / Qwen 3 format ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a completion
   that does not parse becomes plain text, as in TRL.
3. Its tool calls run (:meth:`ToolCalling.call`, sync or ``async def`` tools); an exception, an unknown tool or a call
   of another type becomes an ``{"error": ...}`` result and counts as a failure.
4. The results are appended as ``tool`` messages; the token ids the chat template puts between the assistant's turn
   and the next one (:meth:`ToolCalling.suffix_ids`) are appended to prompt + completion, and one more completion is
   generated for each sample, up to ``max_tool_calling_iterations`` rounds.
5. A sample whose tool results would push it past ``max_completion_length`` (or the model's context) leaves the loop
   as it was before them; a continuation that would is cut to the budget.

The result keeps TRL's ``tool_mask`` (0 on the tool-result tokens, 1 on the model's own) for the loss, the message
lists the reward functions receive, and the call and failure counts of TRL's ``tools/call_frequency`` and
``tools/failure_frequency``.

A chat template that is not prefix-preserving (Qwen 3's, whose assistant turns lose their thinking once a tool message
follows) is replaced, as TRL does, by TRL's training copy of it (``trl.chat_template_utils.get_training_chat_template``,
read from an installed ``trl``; without one, or for a template TRL has no copy of, TRL's error). Qwen turns are
parsed as TRL parses them: below transformers 5.13 by a built-in parser that gives
what TRL's legacy ``response_schema`` for Qwen gives (no ``jmespath`` needed), from 5.13 by transformers' own parser
with a Qwen ``response_template`` (passed to ``parse_response``; the tokenizer is not changed).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import transformers
from jinja2.exceptions import TemplateError
from packaging.version import Version

from ...type_aliases import Tokenizer

__all__ = ["ToolCalling", "ToolLoopResult", "is_chat_template_prefix_preserving", "require_tool_template",
           "supports_tool_calling", "training_chat_template"]

_TRANSFORMERS = Version(transformers.__version__)
#: transformers' new-style ``response_template`` parser (with ``prefix=``), and its ``tools=`` argument.
_RESPONSE_TEMPLATE_FROM = Version("5.13.0.dev0")
_PARSE_WITH_TOOLS_FROM = Version("5.15.0")

#: The Qwen 2.5 / Qwen 3 assistant turn (TRL's ``qwen3_schema``): optional reasoning, content, then tool calls.
_QWEN_RESPONSE = re.compile(
    r"^(?:<think>\n?(?:(?P<reasoning_content>.*?\S.*?)\n?|[\s]*)</think>\s*)?"
    r"(?P<content>(?:(?!<tool_call>)[\s\S])*?)(?:\n(?=<tool_call>))?(?=(?:<tool_call>|<\|im_end\|>|$))"
    r"(?P<tool_calls>(?:<tool_call>(?:(?!</tool_call>)[\s\S])+</tool_call>\s*)+)?\s*(?:<\|im_end\|>|$)",
    re.DOTALL)
_QWEN_TOOL_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)

#: The same turn as a new-style ``response_template`` (transformers >= 5.13, "Response parsing" in its chat docs): the
#: assistant header the prompt ends with, then optional ``<think>`` reasoning, any number of ``<tool_call>`` JSON
#: objects made into function calls, and the text up to ``<|im_end|>``. TRL sets an equal template on the Qwen
#: tokenizers it knows, so torchlike parses as TRL does on either side of 5.13.
_QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

_NO_TOOL_TEMPLATE = ("The provided chat template does not support tool calling. The template must be able to render a "
                     "full tool-calling conversation (user -> assistant with tool_calls -> tool).")
_NOT_PREFIX_PRESERVING = (
    "The chat template is not training-compatible (missing prefix-preservation or `{% generation %}` markers) and "
    "patching is not supported for this template. Please manually modify the chat template for training. "
    "(Tool calling needs a template that renders earlier messages the same whatever follows them. TRL swaps in its "
    "own training copy of known templates, e.g. Qwen 3's, when trl is installed: install trl, or set "
    "tokenizer.chat_template to a prefix-preserving template.)")
_UNKNOWN_RESPONSE_FORMAT = (
    "Unrecognized chat template, failed to add response schema. Please manually set the response schema on the "
    "tokenizer or processor. See the Transformers "
    "[docs](https://huggingface.co/docs/transformers/main/en/chat_response_parsing#response-parsing) for more details "
    "on response parsing. (torchlike parses Qwen's '<tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>' "
    "turns itself; for another format set tokenizer.response_schema, or tokenizer.response_template with "
    "transformers >= 5.13, before creating the trainer.)")


def _tool_conversation(name: str, arguments: object, content: str) -> list[dict]:
    """user -> assistant calling ``name(**arguments)`` -> tool answering ``content``."""
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}]
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "name": name, "content": content}]


def _render(tokenizer: Tokenizer, messages: list[dict], **kwargs: Any) -> Any:
    """``apply_chat_template(messages)``, retried with JSON-text arguments for templates that reject a dict there
    (TRL's fallback for DeepSeek-V3-style templates)."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except TypeError:
        for message in messages:
            for call in message.get("tool_calls") or []:
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return tokenizer.apply_chat_template(messages, **kwargs)


def supports_tool_calling(tokenizer: transformers.PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders a whole tool exchange (TRL's ``supports_tool_calling``): the call's name,
    argument and the tool's answer must all appear, so a template that drops tool calls or tool messages fails."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    name, key, value, content = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", \
        "tool_content_c4f9a8e2"
    try:
        rendered = _render(tokenizer, _tool_conversation(name, {key: value}, content), tokenize=False)
    except TemplateError:
        return False
    return all(sentinel in rendered for sentinel in (name, key, value, content))


def require_tool_template(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """TRL's refusal of a chat template that cannot render a tool exchange (:func:`supports_tool_calling`).

    Raises:
        ValueError: with TRL's message.
    """
    if not supports_tool_calling(tokenizer):
        raise ValueError(_NO_TOOL_TEMPLATE)


def training_chat_template(tokenizer: transformers.PreTrainedTokenizerBase) -> str:
    """TRL's prefix-preserving training copy of ``tokenizer``'s chat template (``get_training_chat_template``, from
    the installed ``trl``: its templates are TRL's own files, not repeated here).

    Raises:
        ValueError: ``trl`` is not installed, or TRL has no training copy of this template (TRL's error).
    """
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise ValueError(_NOT_PREFIX_PRESERVING) from None
    template = get_training_chat_template(tokenizer)
    if template is None:  # TRL found nothing to patch: prefix-preservation holds by its own check
        raise ValueError(_NOT_PREFIX_PRESERVING)
    return template


def is_chat_template_prefix_preserving(tokenizer: transformers.PreTrainedTokenizerBase) -> bool:
    """Whether appending a tool message leaves the tokens of the conversation before it unchanged (TRL's
    ``is_chat_template_prefix_preserving``), which :meth:`ToolCalling.suffix_ids` relies on."""
    conversation = _tool_conversation("dummy", {}, "dummy")
    shorter = _render(tokenizer, conversation[:2], tokenize=True, return_dict=False)
    longer = _render(tokenizer, conversation, tokenize=True, return_dict=False, add_generation_prompt=True)
    return list(longer[:len(shorter)]) == list(shorter)


def _renders_qwen_tool_calls(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes tool calls as Qwen 2.5 / Qwen 3 do: ChatML turns closed by ``<|im_end|>``
    and ``<tool_call>`` around a ``{"name": ..., "arguments": {...}}`` JSON object."""
    name = "tool_name_a8f3e2b1"
    try:
        rendered = _render(tokenizer, _tool_conversation(name, {"key": "value"}, "result")[:2], tokenize=False)
    except TemplateError:
        return False
    call = re.compile(r'<tool_call>\s*\{"name":\s*"' + name + r'",\s*"arguments":\s*\{"key":\s*"value"\}\}\s*'
                      r"</tool_call>")
    return "<|im_end|>" in rendered and call.search(rendered) is not None


def _qwen_tool_call(text: str) -> dict:
    """One ``<tool_call>`` body as ``{"type": "function", "function": {...}}``; ``ValueError``/``TypeError`` when it
    is not a JSON object with a string ``name`` and object ``arguments`` (what the legacy schema parser rejects)."""
    call = json.loads(text)
    if not isinstance(call, dict):
        raise TypeError(f"a tool call must be a JSON object, got {text!r}")
    if "name" in call and not isinstance(call["name"], str):
        raise TypeError(f"a tool call's name must be a string, got {call['name']!r}")
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        raise ValueError(f"a tool call's arguments must be a JSON object, got the string {arguments!r}")
    if arguments is not None and not isinstance(arguments, dict):
        raise TypeError(f"a tool call's arguments must be a JSON object, got {arguments!r}")
    return {"type": "function", "function": call}


def _parse_qwen_response(text: str) -> dict | None:
    """A decoded Qwen assistant turn as a message (``None`` when it does not have the turn's shape)."""
    match = _QWEN_RESPONSE.search(text)
    if match is None:
        return None
    groups = match.groupdict()
    message: dict[str, Any] = {"role": "assistant"}
    for key in ("content", "reasoning_content"):
        if groups[key] is not None:
            message[key] = groups[key]
    if groups["tool_calls"] is not None:
        message["tool_calls"] = [_qwen_tool_call(body) for body in _QWEN_TOOL_CALL.findall(groups["tool_calls"])]
    return message


def _check_tool_calls(tool_calls: object) -> None:
    """TRL's ``_validate_tool_calls``: every call names its function; missing arguments become ``{}``."""
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{index}] must be a dict.")
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise ValueError(f"tool_calls[{index}]['function'] must be a dict.")
        if not isinstance(function.get("name"), str):
            raise ValueError(f"tool_calls[{index}] must name its function with a string.")
        if function.get("arguments") is None:
            function["arguments"] = {}


def _error(message: str) -> dict:
    return {"error": message}


@dataclass
class ToolLoopResult:
    """What :meth:`ToolCalling.run` returns (lists in the order of the samples).

    Attributes:
        completion_ids: each completion's tokens: the model's turns and the tool-result tokens between them.
        tool_mask: one int per completion token, 0 on tool-result tokens and 1 on the model's (TRL's ``tool_mask``).
        completions: each completion as chat messages: the assistant turns (parsed) and the ``tool`` messages.
        call_count: tool calls made.
        failure_count: calls that raised, named no known tool or were not function calls.
    """

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    completions: list[list[dict]]
    call_count: int = 0
    failure_count: int = 0


@dataclass
class ToolCalling:
    """A trainer's ``tools`` and what running them needs (TRL 1.16's checks run in :meth:`create`).

    Args:
        tokenizer: the tokenizer whose chat template renders the prompts and tool results.
        tools: the functions the model may call, named by ``__name__``; ``async def`` functions are awaited.
        chat_template_kwargs: extra ``apply_chat_template`` arguments (``GRPOConfig.chat_template_kwargs``), with
            ``chat_template`` when the tokenizer's own is replaced by TRL's training copy (:meth:`create`).
        trainer_name: the trainer named in TRL's messages.
    """

    tokenizer: Any
    tools: list[Callable]
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trainer_name: str = "GRPOTrainer"

    @classmethod
    def create(cls, tokenizer: transformers.PreTrainedTokenizerBase, tools: Sequence[Callable],
               chat_template_kwargs: Mapping[str, Any] | None = None,
               trainer_name: str = "GRPOTrainer") -> ToolCalling:
        """Checks the tokenizer as TRL's ``GRPOTrainer`` (or ``trainer_name``) does when given ``tools``, with TRL's
        errors.

        Raises:
            ImportError: transformers older than 5.0, or a legacy ``response_schema`` to parse on transformers < 5.13
                without ``jmespath`` installed.
            ValueError: a tool that is not callable, a chat template that cannot render a tool exchange or is not
                prefix-preserving, or no known way to parse the model's tool calls.
        """
        if _TRANSFORMERS < Version("5.0.0"):
            raise ImportError(f"Using tools with {trainer_name} requires transformers version 5.0.0 or higher. Please "
                              "upgrade transformers with `pip install --upgrade transformers` to use this feature.")
        tools = list(tools)
        for tool in tools:
            if not callable(tool) or not hasattr(tool, "__name__"):
                raise ValueError(f"each tool must be a function (it is called by its __name__); got {tool!r}.")
        require_tool_template(tokenizer)
        calling = cls(tokenizer, tools, dict(chat_template_kwargs or {}), trainer_name)
        calling.parser_kind  # noqa: B018 (fails early when no parser fits)
        if not is_chat_template_prefix_preserving(tokenizer):
            calling.chat_template_kwargs["chat_template"] = training_chat_template(tokenizer)
        return calling

    @property
    def chat_template(self) -> str | None:
        """TRL's ``GRPOTrainer.chat_template``: the training copy that renders prompts and tool turns in place of a
        chat template that is not prefix-preserving, else ``None`` (the tokenizer's own)."""
        return self.chat_template_kwargs.get("chat_template")

    # ------------------------------------------------------------------ parsing
    @functools.cached_property
    def parser_kind(self) -> str:
        """``"template"`` / ``"schema"``: transformers parses with the tokenizer's own ``response_template`` /
        ``response_schema``; for a chat template in Qwen's format, ``"qwen template"``: transformers (>= 5.13)
        parses with torchlike's Qwen ``response_template``, or ``"qwen"``: the built-in parser of the legacy schema
        (older transformers)."""
        if getattr(self.tokenizer, "response_template", None) is not None and _TRANSFORMERS >= _RESPONSE_TEMPLATE_FROM:
            return "template"
        if getattr(self.tokenizer, "response_schema", None) is not None:
            if _TRANSFORMERS < _RESPONSE_TEMPLATE_FROM and not transformers.utils.is_jmespath_available():
                raise ImportError(f"Using tools with {self.trainer_name} on transformers below 5.13.0 requires the "
                                  "jmespath library for response parsing. Please install it with `pip install "
                                  "jmespath`, or upgrade transformers to 5.13.0 or higher, which doesn't need it.")
            return "schema"
        if _renders_qwen_tool_calls(self.tokenizer):
            return "qwen template" if _TRANSFORMERS >= _RESPONSE_TEMPLATE_FROM else "qwen"
        raise ValueError(_UNKNOWN_RESPONSE_FORMAT)

    def parse(self, ids: Sequence[int], prefix: Sequence[int] | None = None,
              tools: Sequence[Callable] | None = None) -> dict:
        """A completion's tokens as an assistant message, as TRL's ``parse_response``.

        Args:
            ids: the completion's token ids.
            prefix: the tokens before it (prompt and earlier turns); read by ``transformers``' new-style parser.
            tools: the tools its prompt rendered (default: :attr:`tools`); read by ``transformers``' parser from 5.15.

        Returns:
            ``{"role": "assistant", "content": str, ...}`` with ``tool_calls`` when the model called tools; the
            decoded text as ``content`` when the completion does not parse (e.g. a malformed tool call).
        """
        tokenizer = self.tokenizer
        kind = self.parser_kind
        try:
            if kind == "qwen template" or (kind == "template" and prefix is not None):
                extra = {"tools": list(self.tools if tools is None else tools)} \
                    if _TRANSFORMERS >= _PARSE_WITH_TOOLS_FROM else {}
                template = _QWEN_RESPONSE_TEMPLATE if kind == "qwen template" else None
                parsed = tokenizer.parse_response(list(ids), template, prefix=list(prefix or []), **extra)
            elif kind == "qwen":
                parsed = _parse_qwen_response(tokenizer.decode(list(ids)))
            else:
                parsed = tokenizer.parse_response(list(ids))
            if parsed is None:  # a completion cut so short that not even its content is left
                raise ValueError("parse_response returned None")
            if isinstance(parsed.get("content"), str):
                parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
            if not parsed.get("content"):
                parsed["content"] = ""
            if "tool_calls" in parsed and parsed["tool_calls"] is not None:
                _check_tool_calls(parsed["tool_calls"])
        except (ValueError, TypeError):
            parsed = {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}
        return parsed

    # ------------------------------------------------------------------ tokens
    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template writes after an assistant's tool-calling turn (its end-of-turn token
        included) for ``tool_messages`` and the next assistant header, as TRL's ``_get_tool_suffix_ids``.

        Raises:
            ValueError: the template renders the conversation before the tool messages differently once they follow.
        """
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        kwargs = dict(tokenize=True, return_dict=False, **self.chat_template_kwargs)
        prefix = list(self.tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kwargs))
        full = list(self.tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **kwargs))
        # Templates that follow the end-of-turn token with a newline (Qwen) leave that newline to the suffix.
        ends = [index for index, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
        return full[len(prefix):]

    # ------------------------------------------------------------------ running tools
    def call(self, tool_calls: list[dict], tools: Sequence[Callable] | None = None) -> tuple[list[dict], int]:
        """Runs one assistant turn's tool calls, as TRL does: sync tools in order, then the ``async`` ones together.

        Args:
            tool_calls: the turn's parsed calls.
            tools: the tools this sample may call, by ``__name__`` (default: :attr:`tools`; an environment's rollout
                calls its own instance's methods).

        Returns:
            ``(tool messages, failures)``: one ``{"role": "tool", "name": ..., "content": ...}`` per call (a list
            result is kept as content blocks, anything else becomes ``str(result)``; a failure's content is
            ``str({"error": message})``), sync results first.
        """
        tools = self.tools if tools is None else tools
        sync = {tool.__name__: tool for tool in tools if not inspect.iscoroutinefunction(tool)}
        asynchronous = {tool.__name__: tool for tool in tools if inspect.iscoroutinefunction(tool)}
        results: list[tuple[str, Any]] = []
        pending: list[tuple[str, Any]] = []
        failures = 0
        for call in tool_calls:
            if call.get("type") != "function":
                failures += 1
                results.append((call.get("name", "unknown"), _error(f"Unsupported tool call type: {call.get('type')}")))
                continue
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                if name in sync:
                    results.append((name, sync[name](**arguments)))
                elif name in asynchronous:
                    pending.append((name, asynchronous[name](**arguments)))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as exception:  # a tool's failure is the model's to see, not the trainer's
                failures += 1
                results.append((name, _error(str(exception))))
        if pending:
            async def gather():
                return await asyncio.gather(*(coroutine for _, coroutine in pending), return_exceptions=True)

            for (name, _), result in zip(pending, asyncio.run(gather()), strict=True):
                if isinstance(result, Exception):
                    failures += 1
                    result = _error(str(result))
                results.append((name, result))
        messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                    for name, result in results]
        return messages, failures

    def run(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
            generate: Callable[..., list[list[int]]], *, max_completion_length: int, max_model_length: int,
            max_iterations: int | None = None, tools: Sequence[Sequence[Callable]] | None = None,
            call_rows: Callable[[list[int], list[list[dict]]], list[tuple[list[dict], int]]] | None = None,
            ) -> ToolLoopResult:
        """TRL's ``_tool_call_loop`` on first completions already generated.

        Args:
            prompt_ids: each sample's prompt tokens (rendered with the tools).
            completion_ids: each sample's first completion (up to and including its end token).
            generate: ``generate(prompt_id_lists, max_new_tokens=n) -> completion id lists``, one completion per
                prompt (ending at the first end token); ``n`` is the largest budget left, a hint it may ignore
                (longer continuations are cut here, as TRL does).
            max_completion_length: the most tokens a completion may hold, tool results included.
            max_model_length: the model's context; a sample whose next prompt would reach it leaves the loop.
            max_iterations: the most rounds of tool calls (``None``: no limit).
            tools: each sample's tools (default: :attr:`tools` for every sample), for parsing and calling.
            call_rows: runs the tool calls of several samples, ``(sample indices, [calls of a sample]) ->
                [(messages, failures)]`` (default: :meth:`call` on each, here); a trainer with several processes
                shares the work.

        Returns:
            :class:`ToolLoopResult`.
        """
        tools = [self.tools] * len(prompt_ids) if tools is None else list(tools)
        call_rows = call_rows or (lambda rows, calls: [self.call(row_calls, tools[row])
                                                       for row, row_calls in zip(rows, calls, strict=True)])
        completion_ids = [list(ids) for ids in completion_ids]
        completions = [[self.parse(ids, prefix=prompt, tools=row_tools)]
                       for prompt, ids, row_tools in zip(prompt_ids, completion_ids, tools, strict=True)]
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        result = ToolLoopResult(completion_ids, tool_mask, completions)
        pending = [row for row, messages in enumerate(completions) if messages[0].get("tool_calls")]
        calls = [completions[row][0]["tool_calls"] for row in pending]
        limit = sys.maxsize if max_iterations is None else max_iterations
        iteration = 0
        while pending and iteration < limit:
            kept = [len(completions[row]) for row in pending]
            for row, row_calls, (messages, failures) in zip(pending, calls, call_rows(pending, calls), strict=True):
                result.call_count += len(row_calls)
                result.failure_count += failures
                completions[row].extend(messages)
            extended = [list(prompt_ids[row]) + completion_ids[row] + self.suffix_ids(_trailing_tool_messages(
                completions[row])) for row in pending]
            used = [len(ids) - len(prompt_ids[row]) for row, ids in zip(pending, extended, strict=True)]
            fits = [length <= max_completion_length and len(ids) < max_model_length
                    for length, ids in zip(used, extended, strict=True)]
            for row, before, fit in zip(pending, kept, fits, strict=True):
                if not fit:  # leaves the loop as it was before these tool results
                    del completions[row][before:]
            pending, extended, used = ([item for item, fit in zip(items, fits, strict=True) if fit]
                                       for items in (pending, extended, used))
            if not pending:
                break
            budgets = [max_completion_length - length for length in used]
            continuations = generate(extended, max_new_tokens=max(1, *budgets))
            continuations = [list(ids)[:budget] for ids, budget in zip(continuations, budgets, strict=True)]
            for row, ids, length, new in zip(pending, extended, used, continuations, strict=True):
                tool_length = length - len(completion_ids[row])
                tool_mask[row] += [0] * tool_length + [1] * len(new)
                completion_ids[row] = ids[len(prompt_ids[row]):] + new
            parsed = [self.parse(new, prefix=ids, tools=tools[row]) if new else {}
                      for row, ids, new in zip(pending, extended, continuations, strict=True)]
            for row, message in zip(pending, parsed, strict=True):
                if message:  # {} when the budget left no room for a continuation
                    completions[row].append(message)
            calls = [message.get("tool_calls") for message in parsed]
            pending = [row for row, row_calls in zip(pending, calls, strict=True) if row_calls]
            calls = [row_calls for row_calls in calls if row_calls]
            iteration += 1
        return result


def _trailing_tool_messages(messages: list[dict]) -> list[dict]:
    """The ``tool`` messages at the end of a completion (those of the last round)."""
    trailing: list[dict] = []
    for message in reversed(messages):
        if message["role"] != "tool":
            break
        trailing.insert(0, message)
    return trailing
