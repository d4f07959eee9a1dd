"""Math answer rewards checked with ``math_verify``: ``accuracy_reward``, ``reasoning_accuracy_reward`` and
``get_cosine_scaled_reward``.

``math_verify`` is optional: this module imports without it and each reward raises ``ImportError`` when called
without it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from torchlike.trl.rewards.format_rewards import completion_text

__all__ = ["accuracy_reward", "get_cosine_scaled_reward", "reasoning_accuracy_reward"]


class _Verifier:
    """``math_verify``'s parse/verify with TRL's settings: boxed answers first, LaTeX with units normalised, timeouts
    only in the main thread (``math_verify`` times out with ``signal.alarm``, which works nowhere else)."""

    def __init__(self, reward_name: str):
        try:
            from latex2sympy2_extended import NormalizationConfig
            from math_verify import LatexExtractionConfig, parse, verify
        except ImportError as error:
            raise ImportError(f"{reward_name} needs the `math_verify` package, which is not installed: "
                              "pip install math-verify") from error
        self.parse, self.verify = parse, verify
        self.answer_extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                        boxed_match_priority=0, try_extract_without_anchor=False)]
        in_main_thread = threading.current_thread() is threading.main_thread()
        self.parsing_timeout = 10 if in_main_thread else None
        self.verify_timeout = 5 if in_main_thread else None
        if not in_main_thread:  # silence "timeout is disabled" warnings for timeouts we switched off on purpose
            logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
            logging.getLogger("math_verify.grader").setLevel(logging.ERROR)

    def score(self, answer: str, solution: str) -> tuple[float | None, str, str]:
        """1.0/0.0 for ``answer`` against ``solution`` (``None`` when the solution does not parse), with the parsed
        gold and answer as text for the completions table."""
        gold = self.parse(solution, parsing_timeout=self.parsing_timeout)
        if len(gold) == 0:
            return None, "[unparseable]", "[skipped]"
        parsed = self.parse(answer, extraction_config=self.answer_extraction, extraction_mode="first_match",
                            parsing_timeout=self.parsing_timeout)
        reward = float(self.verify(gold, parsed, timeout_seconds=self.verify_timeout))
        return reward, str(gold), str(parsed) if parsed else "[unparseable]"


def _log_parsed(log_extra: Callable[[str, list], None] | None, solution: list[str], gold: list[str],
                answers: list[str]) -> None:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold)
        log_extra("answer_parsed", answers)


def accuracy_reward(completions: list[list[dict[str, str]]] | list[str], solution: list[str],
                    log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[float | None]:
    r"""Whether each completion's answer equals the ground truth, by symbolic math verification.

    Args:
        completions: conversational completions (``[[{"content": ...}], ...]``) or plain strings.
        solution: the ground-truth answers (a dataset column), one per completion.
        log_extra: the trainer's hook adding columns to the completions table (``None`` outside a trainer).
        **kwargs: the other GRPO reward arguments (unused).

    Returns:
        ``1.0`` or ``0.0`` per completion; ``None`` when the solution cannot be parsed (the example is skipped).

    Raises:
        ImportError: ``math_verify`` is not installed.

    Example:
        >>> accuracy_reward([[{"content": r"\boxed{\frac{1}{3}}"}], [{"content": r"\boxed{\frac{1}{2}}"}]],
        ...                 [r"\frac{1}{3}", r"\frac{1}{3}"])
        [1.0, 0.0]
    """
    verifier = _Verifier("accuracy_reward")
    rewards, gold, answers = [], [], []
    for completion, truth in zip(completions, solution, strict=True):
        reward, gold_text, answer_text = verifier.score(completion_text(completion), truth)
        rewards.append(reward)
        gold.append(gold_text)
        answers.append(answer_text)
    _log_parsed(log_extra, solution, gold, answers)
    return rewards


def reasoning_accuracy_reward(completions: list[list[dict[str, str]]] | list[str], solution: list[str],
                              reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None,
                              **kwargs: Any) -> list[float | None]:
    r"""Whether the final answer, after the reasoning, equals the ground truth.

    The answer is the text after the first of ``reasoning_delimiters`` found in the completion (its last
    occurrence); a completion without any delimiter scores ``0.0`` (unfinished reasoning is penalised, not skipped).

    Args:
        completions: conversational completions (``[[{"content": ...}], ...]``) or plain strings.
        solution: the ground-truth answers, one per completion.
        reasoning_delimiters: strings that end the reasoning (default ``["</think>"]``).
        log_extra: the trainer's hook adding columns to the completions table (``None`` outside a trainer).
        **kwargs: the other GRPO reward arguments (unused).

    Returns:
        ``1.0`` or ``0.0`` per completion; ``None`` when the solution cannot be parsed.

    Raises:
        ImportError: ``math_verify`` is not installed.
    """
    verifier = _Verifier("reasoning_accuracy_reward")
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    rewards, gold, answers = [], [], []
    for completion, truth in zip(completions, solution, strict=True):
        content = completion_text(completion)
        delimiter = next((d for d in delimiters if d in content), None)
        if delimiter is None:
            reward, gold_text, answer_text = 0.0, "[incomplete reasoning]", "[incomplete reasoning]"
        else:
            reward, gold_text, answer_text = verifier.score(content.split(delimiter)[-1], truth)
        rewards.append(reward)
        gold.append(gold_text)
        answers.append(answer_text)
    _log_parsed(log_extra, solution, gold, answers)
    return rewards


class CosineScaledReward:
    """Correctness scaled by completion length on a cosine schedule; see :func:`get_cosine_scaled_reward`."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        self.max_len = max_len
        self.min_value_wrong = min_value_wrong
        self.max_value_wrong = max_value_wrong
        self.min_value_correct = min_value_correct
        self.max_value_correct = max_value_correct

    def __call__(self, completions: list[list[dict[str, str]]] | list[str], solution: list[str],
                 completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
        rewards = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            # Clamped: cos is periodic, so past max_len the schedule would climb back up.
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            if correct:
                low, high = self.min_value_correct, self.max_value_correct
            else:  # bounds swapped: a short wrong answer is penalised more than a long one
                low, high = self.max_value_wrong, self.min_value_wrong
            rewards.append(float(low + 0.5 * (high - low) * (1.0 + cosine)))
        return rewards


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaledReward:
    """A correctness reward scaled by length on a cosine schedule, favouring short correct answers (Appendix C.1 of
    "Demystifying Long Chain-of-Thought Reasoning", https://huggingface.co/papers/2502.03373).

    ``R(y) = v_min + (v_max - v_min) * (1 + cos(pi * min(|y| / max_len, 1))) / 2`` with ``(v_min, v_max)`` =
    ``(min_value_correct, max_value_correct)`` for a correct answer and ``(max_value_wrong, min_value_wrong)`` for a
    wrong one; ``None`` when the solution cannot be parsed.

    Args:
        max_len: completion length (tokens) at which the schedule reaches its long-length bound.
        min_value_wrong: reward of a wrong completion of length 0.
        max_value_wrong: reward of a wrong completion of ``max_len`` tokens or more.
        min_value_correct: reward of a correct completion of ``max_len`` tokens or more.
        max_value_correct: reward of a correct completion of length 0.

    Returns:
        A reward function ``(completions, solution, completion_ids, **kwargs) -> list[float | None]``.
    """
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)
