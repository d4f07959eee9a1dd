"""``torchlike.trl.rewards`` gives what ``trl.rewards`` gives, imports without optional packages, and says what to
install when a math reward runs without ``math_verify``."""

from __future__ import annotations

import sys

import pytest
import trl.rewards

from torchlike.trl import rewards

CONVERSATIONAL = [
    [{"role": "assistant", "content": "<think>\nreasoning\n</think>\nanswer"}],
    [{"role": "assistant", "content": "<think>\nreasoning without an end"}],
    [{"role": "assistant", "content": "<think>a</think><think>b</think>"}],
    [{"role": "assistant", "content": "answer first <think>x</think>"}],
    [{"role": "assistant", "content": "<think>\nmulti\nline\n</think>\n\nanswer\nmore"}],
]
COMPLETION_IDS = [[], [1], [1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2, 1, 2], list(range(30)), [7] * 40]


def test_exports_the_same_names_as_trl():
    assert set(rewards.__all__) == set(trl.rewards._import_structure["accuracy_rewards"]
                                       + trl.rewards._import_structure["format_rewards"]
                                       + trl.rewards._import_structure["other_rewards"])


def test_think_format_reward_equals_trl():
    assert rewards.think_format_reward(CONVERSATIONAL) == trl.rewards.think_format_reward(CONVERSATIONAL)
    assert rewards.think_format_reward(CONVERSATIONAL) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_think_format_reward_also_reads_standard_string_completions():
    texts = [completion[0]["content"] for completion in CONVERSATIONAL]
    assert rewards.think_format_reward(texts) == rewards.think_format_reward(CONVERSATIONAL)


@pytest.mark.parametrize("ngram_size, max_penalty", [(3, -1.0), (2, -0.5), (1, -2.0)])
def test_repetition_penalty_equals_trl(ngram_size, max_penalty):
    ours = rewards.get_repetition_penalty_reward(ngram_size, max_penalty)
    theirs = trl.rewards.get_repetition_penalty_reward(ngram_size, max_penalty)
    assert ours(completion_ids=COMPLETION_IDS, prompts=None) == theirs(completion_ids=COMPLETION_IDS)
    assert ours.__name__ == theirs.__name__


def test_repetition_penalty_refuses_a_positive_penalty():
    with pytest.raises(ValueError, match="should not be positive"):
        rewards.get_repetition_penalty_reward(max_penalty=0.5)


@pytest.mark.parametrize("max_completion_len, soft_punish_cache", [(20, 5), (4, 0), (30, 30)])
def test_soft_overlong_punishment_equals_trl(max_completion_len, soft_punish_cache):
    ours = rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)
    theirs = trl.rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)
    assert ours(completion_ids=COMPLETION_IDS) == theirs(completion_ids=COMPLETION_IDS)
    assert ours.__name__ == theirs.__name__


def test_reward_objects_keep_trls_logging_names():
    assert rewards.get_cosine_scaled_reward(10).__name__ == trl.rewards.get_cosine_scaled_reward(10).__name__


@pytest.mark.parametrize("call", [
    lambda: rewards.accuracy_reward([[{"content": r"\boxed{1}"}]], ["1"]),
    lambda: rewards.reasoning_accuracy_reward([[{"content": r"</think>\boxed{1}"}]], ["1"]),
    lambda: rewards.get_cosine_scaled_reward(10)([[{"content": r"\boxed{1}"}]], ["1"], [[1, 2]]),
], ids=["accuracy", "reasoning_accuracy", "cosine_scaled"])
def test_math_rewards_without_math_verify_raise_import_error_saying_what_to_install(call, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # absent, even where it is installed
    with pytest.raises(ImportError, match="pip install math-verify"):
        call()


def test_math_rewards_equal_trl_when_math_verify_is_installed():
    import math_verify  # noqa: F401  (a test dependency: the reference is installed)

    completions = [[{"content": r"<think>x</think> so \boxed{\frac{1}{3}}"}],
                   [{"content": r"<think>x</think> so \boxed{\frac{1}{2}}"}],
                   [{"content": r"no reasoning \boxed{\frac{1}{3}}"}]]
    solution = [r"\frac{1}{3}"] * 3
    ids = [[1] * 5, [1] * 50, [1] * 120]
    assert rewards.accuracy_reward(completions, solution) == trl.rewards.accuracy_reward(completions, solution)
    assert (rewards.reasoning_accuracy_reward(completions, solution)
            == trl.rewards.reasoning_accuracy_reward(completions, solution))
    assert (rewards.get_cosine_scaled_reward(100)(completions, solution, ids)
            == trl.rewards.get_cosine_scaled_reward(100)(completions, solution, ids))
