"""What TRL 1.0.0's XPO and Nash-MD trainers share on top of online DPO: one judge or one reward ranking a pair of
completions of each prompt (one from the policy, one from a second sampler), prompts after the tokenizer's BOS token,
the judge's inputs rendered as TRL renders them, and settings given per epoch."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar

import jinja2
import numpy as np

from ....type_aliases import PairwiseJudge, RewardFunc, Tokenizer
from ...data_utils import is_conversational
from ...online.rollouts import Rollout

__all__ = ["JUDGE_CHAT_TEMPLATE", "epoch_value", "judge_inputs", "joined", "one_judge_or_reward", "with_bos_first"]

#: TRL's ``SIMPLE_CHAT_TEMPLATE``: how TRL 1.0.0's XPO and Nash-MD render conversational prompts and completions for a
#: judge.
JUDGE_CHAT_TEMPLATE = ("{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + "
                       "'\n\n'}}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

T = TypeVar("T")


def one_judge_or_reward(judge: PairwiseJudge | None, reward_funcs: RewardFunc | list[RewardFunc] | None,
                        trainer_name: str) -> list[RewardFunc] | RewardFunc:
    """The reward functions a judge-or-reward trainer passes on, validated as TRL 1.0.0's XPO and Nash-MD trainers
    validate them (their words): a judge wins over rewards (with TRL's warning), and at most one reward.

    Args:
        judge: the pairwise judge, or ``None``.
        reward_funcs: one reward function or model, a one-element list, or ``None``.
        trainer_name: the trainer's class name, for TRL's message.

    Returns:
        ``reward_funcs``, or ``[]`` when the judge ranks the pairs.

    Raises:
        ValueError: neither a judge nor rewards, or more than one reward.
    """
    if judge is None and reward_funcs is None:
        raise ValueError("One of `judge` or `reward_funcs` must be provided.")
    if judge is not None and reward_funcs is not None:
        warnings.warn("Both `judge` and `reward_funcs` are provided. Using `judge` and ignoring `reward_funcs`.",
                      UserWarning, stacklevel=3)
        reward_funcs = None
    if reward_funcs is not None and isinstance(reward_funcs, list) and len(reward_funcs) != 1:
        raise ValueError(f"{trainer_name} only supports one reward function/model.")
    return [] if reward_funcs is None else reward_funcs


def with_bos_first(rows: list[dict], bos_token_id: int | None) -> list[dict]:
    """Puts ``bos_token_id`` before each row's ``prompt_ids`` unless it starts with it, as TRL 1.0.0's ``tokenize_row``
    (which XPO's and Nash-MD's ``training_step`` tokenise with); the rows, changed in place."""
    if bos_token_id is not None:
        for row in rows:
            if not row["prompt_ids"] or row["prompt_ids"][0] != bos_token_id:
                row["prompt_ids"] = [bos_token_id, *row["prompt_ids"]]
    return rows


def epoch_value(value: T | list[T], epoch: int) -> T:
    """A setting TRL takes as one value or one per epoch: ``value``, or its entry for ``epoch`` (the last one after
    the list ends)."""
    if isinstance(value, list):
        return value[min(epoch, len(value) - 1)]
    return value


def joined(first: Rollout, second: Rollout) -> Rollout:
    """Two rollouts of the same prompts as one: ``first``'s completions, then ``second``'s."""
    def stacked(name: str) -> np.ndarray:
        return np.concatenate([getattr(first, name), getattr(second, name)])

    return dataclasses.replace(first, rows=first.rows + second.rows, prompt_ids=stacked("prompt_ids"),
                               prompt_mask=stacked("prompt_mask"), tokens=stacked("tokens"),
                               completion_mask=stacked("completion_mask"), ended=stacked("ended"),
                               completion_ids=first.completion_ids + second.completion_ids, sampling_logps=None)


def judge_inputs(record: Rollout, tokenizer: Tokenizer) -> tuple[list[Any], list[tuple[str, str]]]:
    """The prompts and completion pairs of a :func:`joined` record as TRL 1.0.0's ``_compute_judge`` gives them to a
    judge: completions decoded without special tokens and stripped; conversational prompts and completions rendered
    with :data:`JUDGE_CHAT_TEMPLATE`.

    Returns:
        ``(prompts, pairs)``: one prompt and one ``(first's completion, second's completion)`` pair per prompt.
    """
    half = len(record.rows) // 2
    prompts = [row["prompt"] for row in record.rows[:half]]
    texts = [text.strip() for text in tokenizer.batch_decode(record.completion_ids, skip_special_tokens=True)]
    if is_conversational({"prompt": prompts[0]}):
        template = jinja2.Environment().from_string(JUDGE_CHAT_TEMPLATE)
        prompts = [template.render(messages=prompt) for prompt in prompts]
        texts = [template.render(messages=[{"role": "assistant", "content": text}]) for text in texts]
    return prompts, list(zip(texts[:half], texts[half:], strict=True))
