"""The reward scorer of an online trainer: TRL's reward functions (reward models wrapped as functions by
:mod:`.reward_models`) called TRL's way on a generation batch, each process scoring its own rows and every process
then holding the whole table, with TRL's warning about a completion no function could score."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence

import numpy as np

from ...adapters.distributed import multihost
from ...type_aliases import Tokenizer
from ..data.prompt_data import is_conversational_prompt
from ..data.prompt_vision import PIXEL_VALUES, TOKEN_TYPES, VISION_OUTPUTS
from .rollouts import Rollout

__all__ = ["RewardScorer", "reward_name"]

logger = logging.getLogger(__name__)


def reward_name(function: Callable) -> str:
    """The name a reward function's metrics are logged under (TRL's: the function's ``__name__``)."""
    return getattr(function, "__name__", None) or type(function).__name__


class RewardScorer:
    """Scores completions with reward functions.

    Args:
        functions: the reward functions (``(prompts, completions, **columns) -> list[float | None]``, async ones
            too); the trainer's list, read at each call (environments add theirs).
        tokenizer: decodes the completions the functions receive.
        keep_columns: pass the dataset's other columns to the functions (TRL's ``remove_unused_columns=False``).
        trainer_state: returns the trainer's ``TrainerState`` (the functions' ``trainer_state`` argument).
        log_metric: TRL's ``log_metric(name, value)`` the functions may call.
        internal_columns: row keys the trainer added (beside ``prompt_ids``), not passed as dataset columns.
        logging_callbacks: pass ``log_metric`` and ``log_extra`` (GRPO's; TRL's SDPO passes neither).
    """

    def __init__(self, functions: Sequence[Callable], tokenizer: Tokenizer, *, keep_columns: bool,
                 trainer_state: Callable[[], object], log_metric: Callable[[str, float], None],
                 internal_columns: tuple[str, ...] = (), logging_callbacks: bool = True):
        self.functions = functions
        self.internal_columns = ("prompt", "completion", "completion_ids", "prompt_ids", PIXEL_VALUES, TOKEN_TYPES,
                                 VISION_OUTPUTS, *internal_columns)
        self.logging_callbacks = logging_callbacks
        self.tokenizer = tokenizer
        self.keep_columns = keep_columns
        self._trainer_state = trainer_state
        self._log_metric = log_metric

    def score(self, record: Rollout) -> np.ndarray:
        """``[N, F]`` rewards of a rollout: each process scores its own rows (:meth:`rewards`) and every process then
        holds the whole table, as one process would. Logs TRL's warning (Python's ``logging``) about a completion
        every reward function returned ``None`` for (it gets advantage 0, as in TRL)."""
        own = multihost.process_rows(len(record.rows))
        extra = {key: value[own] for key, value in record.extra.items()}
        completions = {} if record.completions is None else {"completions": record.completions[own]}
        if record.environments is not None:
            extra["environments"] = record.environments[own]
        own_rewards = self.rewards(record.rows[own], record.completion_ids[own], extra, **completions)
        rewards = np.concatenate(multihost.allgather_objects(own_rewards))
        unscorable = np.flatnonzero(np.isnan(rewards).all(axis=1))
        if unscorable.size:
            row = record.rows[unscorable[0]]
            details = {key: value for key, value in row.items() if key not in ("prompt", "prompt_ids")}
            details.update(prompt=row["prompt"], completion=self.tokenizer.decode(
                record.completion_ids[unscorable[0]], skip_special_tokens=True))
            logger.warning(f"All reward functions returned None for the following kwargs:\n{details}\nPlease ensure "
                           "that at least one reward function returns a valid reward.")
        return rewards

    def rewards(self, rows: list[dict], completion_ids: list[list[int]], extra: dict[str, list],
                completions: list | None = None) -> np.ndarray:
        """``[N, F]`` rewards, calling each function TRL's way (dataset columns and ``rollout_func``'s ``extra``
        fields as keyword arguments); ``None`` becomes NaN. ``completions`` are those the functions receive (with
        tools: the message lists of the tool loop); by default the decoded ``completion_ids``, as assistant messages
        for conversational prompts."""
        if not rows:  # a process with no rows of a small (last) eval batch
            return np.empty((0, len(self.functions)), np.float32)
        if completions is None:
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            conversational = is_conversational_prompt(rows[0]["prompt"])
            completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        columns = {} if not self.keep_columns else {
            key: [row[key] for row in rows] for key in rows[0] if key not in self.internal_columns}
        columns.update(extra)
        if self.logging_callbacks:
            columns.update(log_metric=self._log_metric, log_extra=lambda column, values: None)
        kwargs = {"prompts": [row["prompt"] for row in rows], "completions": completions,
                  "completion_ids": completion_ids, "trainer_state": self._trainer_state(), **columns}
        results = [function(**kwargs) for function in self.functions]
        pending = [index for index, result in enumerate(results) if inspect.isawaitable(result)]
        if pending:
            async def gather():
                return await asyncio.gather(*(results[index] for index in pending))

            for index, value in zip(pending, asyncio.run(gather()), strict=True):
                results[index] = value
        table = np.full((len(rows), len(self.functions)), np.nan, np.float32)
        for index, (function, values) in enumerate(zip(self.functions, results, strict=True)):
            values = list(values) if values is not None else None
            if values is None or len(values) != len(rows):
                raise ValueError(f"reward function {reward_name(function)!r} returned "
                                 f"{'None' if values is None else len(values)} values for {len(rows)} completions; "
                                 "return one float (or None to skip) per completion.")
            table[:, index] = [np.nan if value is None else float(value) for value in values]
        return table
