"""``AsyncGRPOTrainer``: TRL 1.16's asynchronous GRPO (``trl.experimental.async_grpo``) with TRL's constructor, on
torchlike's policy-gradient loop, and :class:`AsyncGRPO`, the algorithm it trains with.

TRL's AsyncGRPO samples through a vLLM server in a child process while the trainer trains, hands the server the
weights every ``weight_sync_steps`` steps (each hand-over a new ``model_version``) and drops the samples more than
``max_staleness`` versions old. Here torchlike's own engine samples in the training process: the loop keeps
``max_inflight_tasks`` worth of generation batches sampled ahead on the paged engine's stream, which takes the new
weights between two decode calls and tags every token with the version that drew it
(:class:`~torchlike.trl.online.rollout_worker.RolloutWorker`). What AsyncGRPO decides on that loop:

- the advantages of TRL's rollout worker and the loss of its ``compute_loss``
  (:mod:`torchlike.adapters.losses.async_grpo`: a group's population standard deviation, 1e-8, NaN rewards at 0; the
  ratio against the sampler's log-probs, a token mean per micro-batch, no KL);
- the weight versions (:meth:`AsyncGRPO.sampler_weights_version`), saved in each checkpoint's ``rollout_state.json``
  as TRL saves them and restored on resume;
- the stale completions, dropped from the loss and counted (:meth:`AsyncGRPO.stale_completions`), and TRL's metric
  names and window reductions.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ....adapters import rollout
from ....adapters.distributed import multihost
from ....adapters.losses import async_grpo as async_losses
from ...trainer.policy_gradient_trainer import LogProbs, PolicyGradientAlgorithm, PolicyGradientTrainer
from .async_grpo_config import AsyncGRPOConfig

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from ....adapters.families.base import Family
    from ....type_aliases import DatasetLike, ModelLike, PeftConfigLike, ProcessingClass, RewardFunc

__all__ = ["ROLLOUT_STATE_NAME", "AsyncGRPO", "AsyncGRPOTrainer"]

logger = logging.getLogger(__name__)

#: The checkpoint file holding the weight version (TRL's name and key, ``{"model_version": N}``).
ROLLOUT_STATE_NAME = "rollout_state.json"


class AsyncGRPO(PolicyGradientAlgorithm):
    """TRL 1.16's AsyncGRPO on the policy-gradient loop (see the module's docstring).

    Attributes:
        model_version: TRL's: the weight hand-overs to the sampler so far (1 once training starts).
    """

    args: AsyncGRPOConfig
    reads_sampler_log_probs = True

    def __init__(self, args: AsyncGRPOConfig, log_metric: Callable[[str, float], None]):
        super().__init__(args, log_metric)
        self.model_version = 0
        self._handed_at: int | None = None  # the optimizer step of the last hand-over

    def generations_ahead(self, samples_in_loop: bool) -> int:
        """``max_inflight_tasks`` completions (``-1``: ``max_staleness`` generation batches), at most ``queue_maxsize``
        of them (when positive), in whole generation batches, rounded up; none when tools or environments sample in
        the loop.

        Raises:
            ValueError: ``weight_sync_steps > 1`` or more batches ahead than ``max_staleness`` where the tokens carry
                no weight versions (no batch ahead, or no paged engine's stream: another engine, several processes).
        """
        args = self.args
        batch = args.generation_batch_size
        if samples_in_loop:
            ahead = 0
        else:
            completions = args.max_inflight_tasks if args.max_inflight_tasks >= 0 else args.max_staleness * batch
            if args.queue_maxsize > 0:
                completions = min(completions, args.queue_maxsize)
            ahead = -(-completions // batch)
        engine = args.rollout_engine or rollout.default_engine()
        streamed = ahead > 0 and engine == "paged" and multihost.process_count() == 1
        if not streamed and args.weight_sync_steps > 1:
            raise ValueError(f"weight_sync_steps={args.weight_sync_steps} keeps the sampler on older weights between "
                             "hand-overs, which torchlike does on the paged engine's stream only (rollout_engine="
                             "'paged', one process, max_inflight_tasks != 0 and no tools); here each batch is sampled "
                             f"with the current weights (rollout_engine={engine!r}, {ahead} batch(es) ahead). Set "
                             "weight_sync_steps=1.")
        if not streamed and ahead > args.max_staleness:
            raise ValueError(f"{ahead} generation batches sampled ahead (max_inflight_tasks={args.max_inflight_tasks}) "
                             f"are more than max_staleness={args.max_staleness} optimizer steps stale when they train, "
                             f"and rollout_engine={engine!r} (or several processes) tags no weight versions to drop "
                             "them by. Lower max_inflight_tasks, or sample on the paged engine in one process.")
        return ahead

    def sampler_weights_version(self, global_step: int, starting: bool) -> int | None:
        """A hand-over every ``weight_sync_steps`` optimizer steps, and when a loop starts (TRL's first hand-over
        before the rollout worker starts; after an epoch or a resume, when the weights changed since the last one):
        each one is the next ``model_version``."""
        due = self._handed_at != global_step if starting else global_step % self.args.weight_sync_steps == 0
        if not due:
            return None
        self.model_version += 1
        self._handed_at = global_step
        return self.model_version

    def stale_completions(self, versions: np.ndarray, current: int) -> np.ndarray:
        """TRL's ``RolloutQueueDataset``: a completion's staleness is ``current`` minus the version of its first
        (oldest) token; those staler than ``max_staleness`` are dropped (``sample/dropped_stale_total``), the others'
        staleness logged as ``sample/staleness_mean`` and ``sample/staleness_max``."""
        drawn = versions >= 0
        oldest = np.where(drawn, versions, current).min(axis=1)
        staleness = current - oldest
        dropped = staleness > self.args.max_staleness
        for value in staleness[drawn.any(axis=1) & ~dropped]:
            self.log_metric("sample/staleness_mean", float(value))
            self.log_metric("sample/staleness_max", float(value))
        if dropped.any():
            logger.info("dropping %d stale completions (staleness up to %d, max_staleness=%d)", int(dropped.sum()),
                        int(staleness.max()), self.args.max_staleness)
            self.log_metric("sample/dropped_stale_total", float(dropped.sum()))
        return dropped

    def advantages(self, rewards: np.ndarray, batch: dict[str, np.ndarray], log_probs: LogProbs,
                   reward_weights: list[float] | None, num_generations: int) -> tuple[np.ndarray, dict]:
        """TRL's rollout-worker advantages (:func:`adapters.losses.async_grpo.async_grpo_advantages`); the reward
        functions weigh 1 each, as in TRL."""
        return async_losses.async_grpo_advantages(rewards, num_generations)

    def reward_logs(self, reward_metrics: dict, reward_names: list[str]) -> dict[str, float]:
        """TRL's AsyncGRPO names: ``reward``, ``reward_std`` and ``rewards/<function>``."""
        logs = {"reward": reward_metrics["reward"], "reward_std": reward_metrics["reward_std"]}
        for index, name in enumerate(reward_names):
            logs[f"rewards/{name}"] = reward_metrics["rewards_per_func/mean"][index]
        return {key: float(value) for key, value in logs.items()}

    def window_value(self, key: str, values: list[float]) -> float:
        """TRL's ``_reduce_metric`` over the values that are not NaN: a ``total`` word in the key's last part sums
        them, ``max`` / ``min`` take the extreme, anything else the mean (NaN when none is left)."""
        valid = [value for value in values if not math.isnan(value)]
        if not valid:
            return float("nan")
        words = key.split("/")[-1].split("_")
        if "total" in words:
            return float(sum(valid))
        if "max" in words:
            return float(max(valid))
        if "min" in words:
            return float(min(valid))
        return float(np.mean(valid))

    def step_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs) -> None:
        """The sampler's log-probs as the ratio's denominator (TRL's ``old_log_probs``); completions sampled without
        them (with tools, in the loop with the current weights) take the policy's own (ratio 1)."""
        if "sampling_logps" in batch:
            batch["old_logps"] = batch["sampling_logps"]

    def step_loss(self, family: Family, temperature: float, decoder_dtype: DTypeLike | None,
                  router_aux_loss_coef: float) -> Callable:
        """TRL's AsyncGRPO loss (:func:`adapters.losses.async_grpo.async_grpo_step_loss`); ``decoder_dtype`` is always
        ``None`` (AsyncGRPO has no ``cast_lm_head_to_fp32``)."""
        settings = async_losses.AsyncGRPOLossSettings.from_config(self.args, temperature=temperature,
                                                                  router_aux_loss_coef=router_aux_loss_coef)
        return async_losses.async_grpo_step_loss(family, settings)

    def save_extras(self, folder: Path) -> None:
        """TRL's ``rollout_state.json`` with ``model_version``, written by process 0."""
        if jax.process_index() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ROLLOUT_STATE_NAME).write_text(json.dumps({"model_version": self.model_version}))

    def resumed(self, folder: Path) -> None:
        """``model_version`` from the checkpoint's ``rollout_state.json``; without one (a checkpoint of another
        trainer) it starts again from 0, with a warning, as TRL."""
        path = Path(folder) / ROLLOUT_STATE_NAME
        if not path.is_file():
            logger.warning("%s not found in the checkpoint %s; the weight versions start again from 1.",
                           ROLLOUT_STATE_NAME, folder)
            return
        self.model_version = int(json.loads(path.read_text())["model_version"])


class AsyncGRPOTrainer(PolicyGradientTrainer):
    """``trl.experimental.async_grpo.AsyncGRPOTrainer`` with TRL 1.16's signature, sampling with torchlike's engine
    (no vLLM server) and training with the :class:`AsyncGRPO` algorithm.

    Args:
        model: a path or hub id (loaded in ``args.dtype`` unless ``args.model_init_kwargs`` gives one), a
            :class:`~torchlike.CausalLM` or a ``transformers`` model object.
        reward_funcs: a function or a list of them (sync or ``async``), as ``GRPOTrainer`` takes them; their rewards
            are summed with weight 1, ``None`` skipped. Optional with an ``environment_factory`` whose environment
            has ``get_reward``.
        args: :class:`AsyncGRPOConfig` (default: ``AsyncGRPOConfig("<model>-AsyncGRPO")``).
        train_dataset: rows with a ``prompt`` and any other columns, which reach the reward functions.
        processing_class: the tokenizer (default: loaded from the model's path).
        callbacks, optimizers: as for :class:`~torchlike.Trainer`.
        peft_config: a :class:`~torchlike.peft.LoraConfig`.
        tools, environment_factory: as ``GRPOTrainer`` runs them; those batches are sampled in the training loop
            when due (nothing ahead, so nothing stale).
        rollout_worker, weight_transfer: TRL's plug-ins for its vLLM rollout worker process and its weight transfer
            to the server; refused (anything but ``None``): torchlike's engine samples in this process.

    Example:

    ```python
    >>> from torchlike.trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    >>> def short(completions, **kwargs):
    ...     return [-len(text) / 100 for text in completions]
    >>> trainer = AsyncGRPOTrainer("path/to/qwen2", reward_funcs=short, train_dataset=[{"prompt": "Hi"}] * 64,
    ...                            args=AsyncGRPOConfig("out", max_completion_length=32))
    >>> trainer.train()
    ```
    """

    algorithm_class = AsyncGRPO
    algorithm: AsyncGRPO
    _config_class = AsyncGRPOConfig
    _output_suffix = "AsyncGRPO"
    _tag_names = ["trl", "async-grpo"]
    _trl_fields = ("temperature",)

    def __init__(self, model: ModelLike, reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: AsyncGRPOConfig | None = None, train_dataset: DatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: PeftConfigLike | None = None,
                 tools: list | None = None, environment_factory: Callable | dict[str, Callable] | None = None,
                 rollout_worker: Any = None, weight_transfer: Any = None):  # Any: TRL's vLLM plug-ins, refused
        for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise ValueError(f"{name} plugs a custom vLLM rollout worker / weight transfer into TRL's "
                                 "AsyncGRPOTrainer; torchlike samples with its own engine in this process "
                                 "(AsyncGRPOConfig.rollout_engine), so there is nothing to plug it into. Pass "
                                 f"{name}=None.")
        if isinstance(args, AsyncGRPOConfig) and isinstance(model, str) and args.dtype != "float32":
            # TRL's rule: args.dtype for a model loaded by path, unless model_init_kwargs gives one.
            args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, tools=tools, environment_factory=environment_factory)
        # TRL's AsyncGRPO hands every dataset column to the reward functions and never replays skipped data.
        self.args.remove_unused_columns = False
        if not self.args.ignore_data_skip:
            logger.warning("`ignore_data_skip` is forced to `True` for AsyncGRPO because the base Trainer's "
                           "skip-and-replay loop does not apply to a live rollout queue.")
            self.args.ignore_data_skip = True

    @property
    def model_version(self) -> int:
        """TRL's attribute: the weight hand-overs to the sampler so far (:attr:`AsyncGRPO.model_version`)."""
        return self.algorithm.model_version
