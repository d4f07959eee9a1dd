"""``XPOTrainer``: TRL 1.0.0's ``trl.experimental.xpo.XPOTrainer`` (Exploratory Preference Optimization) on torchlike's
``OnlineDPOTrainer``.

Each micro-batch takes ``per_device_train_batch_size`` prompts (per data-parallel shard) and samples one completion of
each with the policy and one with the reference (the frozen reference, or the base with the adapter off). A judge
(``judge.judge(prompts, pairs)``, TRL's ``BasePairwiseJudge``) or one reward function or model (less
``missing_eos_penalty`` for a completion without an end token) picks the chosen one of each pair; the loss is online
DPO's on the pair plus ``alpha`` times the policy's summed log-probability of the reference's completion
(``adapters.losses.xpo``). TRL 1.0.0's ``loss/*``, ``objective/*``, ``rewards/*``, ``logps/*``, ``val/*``, ``alpha``
and ``beta`` metrics are logged, as means over the micro-batches since the last log.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....adapters.losses import online_dpo as online_dpo_losses
from ....adapters.losses import xpo as xpo_losses
from ....adapters.rollout import derived_seed
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PairwiseJudge,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RewardFunc,
    Tokenizer,
)
from ...online.rollout_worker import RolloutWorker
from ...online.rollouts import Rollout
from ..online_dpo.judged_pairs import epoch_value, joined, judge_inputs, one_judge_or_reward
from ..online_dpo.online_dpo_data import contains_end_token, preference_columns, ranked_order
from ..online_dpo.online_dpo_trainer import OnlineDPOTrainer, OnlinePreferenceAlgorithm
from .xpo_config import XPOConfig

__all__ = ["XPO", "XPOTrainer"]


class XPO(OnlinePreferenceAlgorithm):
    """TRL 1.0.0's XPO on Online DPO's loop (see the module's docstring): the reference samples the second completion
    of each pair with a rollout worker of its own."""

    bos_first = True

    def __init__(self, trainer: OnlineDPOTrainer):
        super().__init__(trainer)
        self.reference_worker: RolloutWorker | None = None

    def generate_with_reference(self, rows: list[dict], seed: int) -> Rollout:
        """One completion per row sampled by the reference (TRL 1.0.0's ``ref_model.generate``), with a rollout worker
        of its own (in the reference's LoRA mode) and a seed of its own."""
        trainer = self.trainer
        if self.reference_worker is None:
            self.reference_worker = trainer._new_worker(lambda: trainer.reference.module,
                                                         lora=trainer.reference.lora)
        return trainer._generate(rows, derived_seed(seed, 1), worker=self.reference_worker)

    def generation_batch(self, prompt_rows: list[dict], epoch: int, seed: int) -> dict[str, np.ndarray]:
        """Samples one completion of each prompt with the policy, then one with the reference, and picks the chosen
        one of each pair (judge or reward)."""
        trainer, args = self.trainer, self.trainer.args
        rows = list(prompt_rows)
        record = joined(trainer._generate(rows, seed), self.generate_with_reference(rows, seed))
        half = len(rows)
        contain_eos = contains_end_token(record.tokens, record.tokens.shape[1], trainer.eos_token_ids)
        if trainer.judge is not None:
            policy_wins = self.judged(record)
            rewards = np.zeros(2 * half, np.float32)
            ranking = np.concatenate([policy_wins, ~policy_wins]).astype(np.float32)
        else:
            rewards = np.nansum(trainer.reward_scorer.score(record), axis=1).astype(np.float32)
            if args.missing_eos_penalty is not None:
                rewards = rewards - np.float32(args.missing_eos_penalty) * ~contain_eos
            ranking = rewards
        # TRL 1.0.0's XPO scores prompt and completion whole: a max_length that cuts nothing.
        uncut = record.prompt_ids.shape[1] + record.tokens.shape[1]
        columns = preference_columns(record.prompt_ids, record.prompt_mask, record.tokens, record.completion_mask,
                                     ranking, None, trainer._beta_of(epoch), trainer.eos_token_ids, uncut)
        order = ranked_order(ranking)
        columns["rewards"] = rewards[order]
        columns["from_reference"] = (order >= half).astype(np.float32)
        columns["alpha"] = np.full(2 * half, self.alpha_of(epoch), np.float32)
        return columns

    def alpha_of(self, epoch: int) -> float:
        """XPO's weight in ``epoch``: ``args.alpha``, or with a list its entry for the epoch (the last one after it)."""
        return epoch_value(self.trainer.args.alpha, epoch)

    def judged(self, record: Rollout) -> np.ndarray:
        """``[B]`` whether the judge prefers the policy's completion of each prompt, asked as TRL 1.0.0's
        ``_compute_judge`` asks (:func:`~.judged_pairs.judge_inputs`)."""
        ranks = self.trainer.judge.judge(*judge_inputs(record, self.trainer.tokenizer))
        return np.array([rank == 0 for rank in ranks])

    def step_loss(self) -> Callable:
        """TRL 1.0.0's XPO loss (:func:`adapters.losses.xpo.xpo_step_loss`) with the config's settings."""
        settings = online_dpo_losses.OnlineDPOLossSettings.from_config(self.trainer.args)
        return xpo_losses.xpo_step_loss(self.trainer.model.family, settings, scored=self.trainer.judge is None)


class XPOTrainer(OnlineDPOTrainer):
    """``trl.experimental.xpo.XPOTrainer`` with TRL 1.0.0's signature, training a torchlike model on a JAX mesh.

    Args:
        model, ref_model, args, train_dataset, processing_class, peft_config, callbacks, optimizers,
            quantization_config: as :class:`~torchlike.trl.experimental.online_dpo.OnlineDPOTrainer` takes them
            (``args`` an :class:`XPOConfig`).
        reward_funcs: one reward function or model (a one-element list too), as ``OnlineDPOTrainer`` calls them; TRL
            1.0.0 takes a reward model only.
        judge: an object with ``judge(prompts, completion_pairs) -> list[int]`` (TRL's ``BasePairwiseJudge``); rank 0
            prefers the policy's completion. Given with ``reward_funcs``, the judge is used (TRL's warning).
        data_collator, compute_metrics, preprocess_logits_for_metrics: refused, as by ``OnlineDPOTrainer``.
        eval_dataset: kept as ``trainer.eval_dataset`` (as TRL keeps it); evaluating is refused, as by
            ``OnlineDPOTrainer``.
        reward_processing_classes: the reward model's tokenizer (``None``: its own).

    Raises:
        ValueError: neither ``judge`` nor ``reward_funcs``, or more than one reward function (TRL's messages), and
            ``OnlineDPOTrainer``'s errors.
        NotImplementedError: a ``loss_type`` other than ``"sigmoid"`` and ``"ipo"`` (TRL's message).

    Example:

    ```python
    >>> from torchlike.trl.experimental.xpo import XPOConfig, XPOTrainer
    >>> class LongerJudge:
    ...     def judge(self, prompts, completions, shuffle_order=True):
    ...         return [0 if len(first) >= len(second) else 1 for first, second in completions]
    >>> trainer = XPOTrainer(model="path/to/Qwen2.5-0.5B-Instruct", judge=LongerJudge(),
    ...                      args=XPOConfig("out", max_new_tokens=32, alpha=1e-5),
    ...                      train_dataset=[{"prompt": "Say hello."}] * 64, processing_class=tokenizer)
    >>> trainer.train()
    ```
    """

    algorithm_class = XPO
    _config_class = XPOConfig
    _output_suffix = "XPO"
    _tag_names = ["trl", "xpo"]

    def __init__(self, model: ModelLike, ref_model: ModelLike | None = None,
                 reward_funcs: RewardFunc | list[RewardFunc] | None = None, judge: PairwiseJudge | None = None,
                 args: XPOConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None,
                 reward_processing_classes: Tokenizer | list[Tokenizer] | None = None,
                 peft_config: PeftConfigLike | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: QuantizationConfig | None = None):
        reward_funcs = one_judge_or_reward(judge, reward_funcs, "XPOTrainer")
        self.judge = judge
        super().__init__(model=model, ref_model=ref_model, reward_funcs=reward_funcs,
                         args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config)

    @property
    def alpha(self) -> float:
        """XPO's weight of the current epoch: ``args.alpha``, or with a list its entry for the epoch (the last one
        after it)."""
        return self.algorithm.alpha_of(int(self.state.epoch or 0))
