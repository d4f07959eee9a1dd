"""``think_format_reward``: 1.0 when a completion opens with one ``<think>...</think>`` block, else 0.0."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["completion_text", "think_format_reward"]

# One leading <think> block (no second "<think>" inside it), then anything.
_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of one completion as GRPO passes it: a string (standard prompts) or a one-message list
    (conversational prompts), whose ``content`` is read.

    Args:
        completion: ``"text"`` or ``[{"role": "assistant", "content": "text"}]``.

    Returns:
        The completion's text.
    """
    return completion if isinstance(completion, str) else completion[0]["content"]


def think_format_reward(completions: list[list[dict[str, str]]] | list[str], **kwargs: Any) -> list[float]:
    """Whether the reasoning is enclosed in ``<think>`` and ``</think>`` at the start of the completion.

    Args:
        completions: conversational completions (``[[{"content": ...}], ...]``, as in TRL) or plain strings.
        **kwargs: the other GRPO reward arguments (unused).

    Returns:
        ``1.0`` per completion that matches ``^<think>...</think>`` with a single ``<think>``, else ``0.0``.

    Example:
        >>> think_format_reward([[{"content": "<think>\\nWhy.\\n</think>\\nAnswer."}], [{"content": "<think>Why."}]])
        [1.0, 0.0]
    """
    return [1.0 if _THINK_FORMAT.match(completion_text(completion)) else 0.0 for completion in completions]
