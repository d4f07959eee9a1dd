"""Length and repetition shaping rewards over completion token ids: ``get_soft_overlong_punishment`` (DAPO) and
``get_repetition_penalty_reward``.

The factories return callable objects rather than closures so the rewards pickle; their ``__name__`` is what GRPO
logs under ``rewards/<name>/mean``, the same as TRL's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get_repetition_penalty_reward", "get_soft_overlong_punishment"]


class RepetitionPenaltyReward:
    """``(1 - unique n-grams / n-grams) * max_penalty`` per completion; see :func:`get_repetition_penalty_reward`."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        rewards = []
        for ids in completion_ids:
            if len(ids) < self.ngram_size:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*(ids[i:] for i in range(self.ngram_size)), strict=False))
            repeated_share = 1 - len(set(ngrams)) / len(ngrams)
            rewards.append(repeated_share * self.max_penalty if repeated_share else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenaltyReward:
    """A reward that penalises repeated token n-grams (Appendix C.2 of "Demystifying Long Chain-of-Thought
    Reasoning", https://huggingface.co/papers/2502.03373).

    ``R(y) = (1 - #unique n-grams / #n-grams) * max_penalty``: ``0.0`` without repetition, towards ``max_penalty``
    for a fully repetitive completion, ``0.0`` for completions shorter than ``ngram_size`` tokens.

    Args:
        ngram_size: tokens per n-gram.
        max_penalty: the most negative reward; must be ``<= 0``.

    Returns:
        A reward function ``(completion_ids, **kwargs) -> list[float]``.

    Raises:
        ValueError: ``max_penalty > 0``.

    Example:
        >>> get_repetition_penalty_reward(ngram_size=2)([[1, 2, 3, 4], [5, 5, 5, 5, 5]])
        [0.0, -0.75]
    """
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return RepetitionPenaltyReward(ngram_size, max_penalty)


class SoftOverlongPunishment:
    """DAPO's length penalty per completion; see :func:`get_soft_overlong_punishment`."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        free_length = self.max_completion_len - self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free_length:
                rewards.append(0.0)
            elif length <= self.max_completion_len:
                rewards.append((free_length - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """A reward that penalises overlong completions without rewarding short ones (DAPO, Eq. 13,
    https://huggingface.co/papers/2503.14476).

    With ``L = max_completion_len`` and ``C = soft_punish_cache``: ``0`` for ``|y| <= L - C``,
    ``((L - C) - |y|) / C`` for ``L - C < |y| <= L``, and ``-1`` beyond ``L``.

    Args:
        max_completion_len: ``L``, the longest completion without full penalty.
        soft_punish_cache: ``C``, the length of the linear ramp before ``L``.

    Returns:
        A reward function ``(completion_ids, **kwargs) -> list[float]``.

    Example:
        >>> get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[1] * 90])
        [-0.5]
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)
