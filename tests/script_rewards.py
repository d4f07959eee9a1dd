"""Reward functions the GRPO script tests name by import path (``--reward_funcs tests.script_rewards.<name>``)."""

from __future__ import annotations

from typing import Any


def completion_length_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Longer completions score higher: ``len(ids) / 8`` per completion."""
    return [len(ids) / 8 for ids in completion_ids]
