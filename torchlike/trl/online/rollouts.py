"""What the online trainers' parts hand each other: a generation batch's :class:`Rollout` (its completions, as every
online trainer reads them) and the :class:`GenerationSchedule` that says how it is trained on."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["GenerationSchedule", "Rollout"]


@dataclasses.dataclass(frozen=True)
class GenerationSchedule:
    """How one generation batch is trained on.

    Args:
        micro_size: completions per micro-batch (``per_device_train_batch_size x`` data-parallel size).
        micro_batches: micro-batches one generation batch is split into (GRPO's ``steps_per_generation``;
            Distillation's ``gradient_accumulation_steps``).
        passes: passes over each generation batch (GRPO's ``num_iterations``).
        completions_per_prompt: completions sampled for each prompt (GRPO's ``num_generations``).
    """

    micro_size: int
    micro_batches: int
    passes: int
    completions_per_prompt: int

    @property
    def completions(self) -> int:
        """Completions per generation batch."""
        return self.micro_size * self.micro_batches

    @property
    def prompts(self) -> int:
        """Dataset rows per generation batch."""
        return self.completions // self.completions_per_prompt


@dataclasses.dataclass
class Rollout:
    """One generation batch's completions, as every online trainer reads them.

    Args:
        rows: the dataset row of each completion (a prompt's row repeated once per completion).
        seed: the seed the batch was sampled with.
        prompt_ids, prompt_mask: ``[N, P]`` left-padded prompts.
        tokens, completion_mask: ``[N, C]`` completions right-padded to the completion width; the mask is 1 on
            every completion token (the model's and, with tools, the tool results').
        ended: ``[N]`` whether each completion ended (TRL's rule: its last token is an end or pad token).
        completion_ids: each completion's tokens.
        tool_mask: ``[N, C]``, 0 on tokens the model did not write (tool results, ``rollout_func``'s ``env_mask``);
            ``None`` when every token is the model's.
        completions: what reward functions receive in place of the decoded completions (the tool loop's message
            lists), or ``None``.
        tool_loop: the tool loop's result (its call and failure counts), or ``None``.
        sampling_logps: ``[N, C]`` the engine's per-token log-probs (0 past a completion's end), or ``None`` for
            completions a ``rollout_func`` gave.
        sampling_versions: ``[N, C]`` the optimizer step whose weights drew each token (``-1`` past a completion's
            end): a batch sampled ahead on a paged engine's stream, whose weights change between decode calls;
            ``None`` otherwise.
        extra: ``rollout_func``'s extra per-completion fields (passed to the reward functions).
        environments: each rollout's environment instance (``environment_factory``; the reward functions receive
            them as ``environments``), or ``None``.
        images: ``[N, slots, H, W, C]`` each prompt's images (image prompts, :mod:`.prompt_vision`), or ``None``.
        prompt_token_types: ``[N, P]`` 1 on the prompts' image tokens, or ``None``.
    """

    rows: list[dict]
    seed: int
    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    tokens: np.ndarray
    completion_mask: np.ndarray
    ended: np.ndarray
    completion_ids: list[list[int]]
    tool_mask: np.ndarray | None = None
    completions: list | None = None
    tool_loop: Any = None
    sampling_logps: np.ndarray | None = None
    sampling_versions: np.ndarray | None = None
    extra: dict[str, list] = dataclasses.field(default_factory=dict)
    environments: list | None = None
    images: np.ndarray | None = None
    prompt_token_types: np.ndarray | None = None

    @property
    def model_tokens(self) -> np.ndarray:
        """``[N, C]`` 0/1: the completion tokens the model wrote (``completion_mask x tool_mask``)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def columns(self) -> dict[str, np.ndarray]:
        """The step's token columns: ``input_ids`` and ``attention_mask`` ``[N, P + C]`` and ``completion_mask``; with
        image prompts also ``images`` and ``token_type_ids`` (the prompts' types, 0 on the completions)."""
        columns = {"input_ids": np.concatenate([self.prompt_ids, self.tokens], axis=1),
                   "attention_mask": np.concatenate([self.prompt_mask, self.completion_mask], axis=1),
                   "completion_mask": self.completion_mask}
        if self.images is not None:
            columns["images"] = self.images
            columns["token_type_ids"] = np.concatenate([self.prompt_token_types, np.zeros_like(self.tokens)], axis=1)
        return columns
