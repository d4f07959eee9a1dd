"""``NashMDTrainer``: TRL 1.0.0's ``trl.experimental.nash_md.NashMDTrainer`` (Nash-MD, "Nash Learning from Human
Feedback") on torchlike's ``OnlineDPOTrainer``.

Each micro-batch takes ``per_device_train_batch_size`` prompts (per data-parallel shard) and samples one completion of
each with the policy and one with the geometric mixture of policy and reference (per-token
``log_softmax(mixture_coef * reference + (1 - mixture_coef) * policy)``, TRL's ``GeometricMixtureWrapper``:
``adapters.rollout.mixture``), both with the static rollout engine (``NashMDConfig`` has no ``rollout_engine``). A
judge (``judge.judge(prompts, pairs, return_scores=True)``, the probability that the first completion is better) or
one reward function or model (the sigmoid of the reward difference, less ``missing_eos_penalty`` for a completion
without an end token) gives the probability that the policy's completion beats the mixture's; the loss is TRL's
REINFORCE score term plus ``beta`` times its KL term, on the policy's completions (``adapters.losses.nash_md``). TRL
1.0.0's ``loss/*``, ``objective/entropy``, ``rewards/*``, ``logps/*``, ``val/*``, ``beta`` and ``mixture_coef``
metrics are logged, as means over the micro-batches since the last log.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....adapters.losses import nash_md as nash_md_losses
from ....adapters.rollout import derived_seed
from ....adapters.rollout.mixture import GeometricMixture
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PairwiseJudge,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RewardFunc,
)
from ...online.rollout_worker import RolloutWorker
from ...online.rollouts import Rollout
from ..online_dpo.judged_pairs import epoch_value, joined, judge_inputs, one_judge_or_reward
from ..online_dpo.online_dpo_data import contains_end_token
from ..online_dpo.online_dpo_trainer import OnlineDPOTrainer, OnlinePreferenceAlgorithm
from .nash_md_config import NashMDConfig

__all__ = ["NashMD", "NashMDTrainer"]


class NashMD(OnlinePreferenceAlgorithm):
    """TRL 1.0.0's Nash-MD on Online DPO's loop (see the module's docstring): the geometric mixture samples the second
    completion of each prompt with a rollout worker of its own; the step trains on the policy's completions only."""

    completions_per_prompt = 1
    bos_first = True

    def __init__(self, trainer: OnlineDPOTrainer):
        super().__init__(trainer)
        self.mixture_worker: RolloutWorker | None = None

    def mixture_coef_of(self, epoch: int) -> float:
        """The mixture coefficient in ``epoch``: ``args.mixture_coef``, or with a list its entry for the epoch (the
        last one after it)."""
        return epoch_value(self.trainer.args.mixture_coef, epoch)

    def generate_with_mixture(self, rows: list[dict], seed: int, mixture_coef: float) -> Rollout:
        """One completion per row sampled from the geometric mixture (TRL 1.0.0's ``GeometricMixtureWrapper``): the
        policy and the reference as one :class:`~torchlike.adapters.rollout.mixture.GeometricMixture` decoder, with
        a rollout worker of its own (its KV cache holds both models' layers) and a seed of its own."""
        trainer = self.trainer
        mixture = GeometricMixture(trainer._trainable_model.module, trainer.reference.module, mixture_coef,
                                   trainer.reference.lora)
        if self.mixture_worker is None:
            self.mixture_worker = trainer._new_worker(lambda: mixture)
        return trainer._generate(rows, derived_seed(seed, 1), worker=self.mixture_worker.sampling_from(mixture))

    def generation_batch(self, prompt_rows: list[dict], epoch: int, seed: int) -> dict[str, np.ndarray]:
        """Samples one completion of each prompt with the policy, then one with the mixture, and takes the probability
        that the policy's wins (judge or rewards); the columns are the policy's completions."""
        trainer, args = self.trainer, self.trainer.args
        rows = list(prompt_rows)
        mixture_coef = self.mixture_coef_of(epoch)
        policy = trainer._generate(rows, seed)
        mixture = self.generate_with_mixture(rows, seed, mixture_coef)
        contain_eos, mixture_contain_eos = (contains_end_token(record.tokens, record.tokens.shape[1],
                                                               trainer.eos_token_ids) for record in (policy, mixture))
        size = len(rows)
        rewards = mixture_rewards = np.zeros(size, np.float32)
        if trainer.judge is not None:
            probability = self.judged(joined(policy, mixture))
        else:
            scores = np.nansum(trainer.reward_scorer.score(joined(policy, mixture)), axis=1).astype(np.float32)
            if args.missing_eos_penalty is not None:
                scores = scores - np.float32(args.missing_eos_penalty) * ~np.concatenate(
                    [contain_eos, mixture_contain_eos])
            rewards, mixture_rewards = scores[:size], scores[size:]
            probability = 0.5 * (1.0 + np.tanh(0.5 * (rewards - mixture_rewards)))  # the sigmoid, overflow-free
        ids = np.concatenate([policy.prompt_ids, policy.tokens], axis=1)
        return {
            "input_ids": ids,
            "attention_mask": np.concatenate([policy.prompt_mask, policy.completion_mask], axis=1),
            "position_ids": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy(),
            "completion_mask": policy.completion_mask,
            "completion_window": policy.completion_mask,
            "probability": np.asarray(probability, np.float32),
            "contain_eos": contain_eos.astype(np.float32),
            "mixture_contain_eos": mixture_contain_eos.astype(np.float32),
            "rewards": rewards,
            "mixture_rewards": mixture_rewards,
            "beta": np.full(size, trainer._beta_of(epoch), np.float32),
            "mixture_coef": np.full(size, mixture_coef, np.float32),
        }

    def judged(self, record: Rollout) -> np.ndarray:
        """``[B]`` the judge's probability that the policy's completion of each prompt beats the mixture's, asked as
        TRL 1.0.0's ``_compute_judge`` asks (:func:`~..online_dpo.judged_pairs.judge_inputs`)."""
        return np.asarray(self.trainer.judge.judge(*judge_inputs(record, self.trainer.tokenizer), return_scores=True),
                          np.float32)

    def step_loss(self) -> Callable:
        """TRL 1.0.0's Nash-MD loss (:func:`adapters.losses.nash_md.nash_md_step_loss`) with the config's settings."""
        trainer = self.trainer
        return nash_md_losses.nash_md_step_loss(trainer.model.family, trainer.args.gradient_accumulation_steps,
                                                scored=trainer.judge is None)


class NashMDTrainer(OnlineDPOTrainer):
    """``trl.experimental.nash_md.NashMDTrainer`` with TRL 1.0.0's signature, training a torchlike model on a JAX mesh.

    Args:
        model, ref_model, args, train_dataset, processing_class, peft_config, callbacks, optimizers,
            quantization_config: as :class:`~torchlike.trl.experimental.online_dpo.OnlineDPOTrainer` takes them
            (``args`` a :class:`NashMDConfig`).
        reward_funcs: one reward function or model (a one-element list too), as ``OnlineDPOTrainer`` calls them (a
            reward model reads the policy's tokenizer, as TRL 1.0.0 passes it); TRL 1.0.0 takes a reward model only.
        judge: an object with ``judge(prompts, completion_pairs, return_scores=True) -> list[float]`` (TRL's
            ``BasePairwiseJudge``): the probability that each pair's first completion (the policy's) is better. Given
            with ``reward_funcs``, the judge is used (TRL's warning).
        data_collator, compute_metrics, preprocess_logits_for_metrics: refused, as by ``OnlineDPOTrainer``.
        eval_dataset: kept as ``trainer.eval_dataset`` (as TRL keeps it); evaluating is refused, as by
            ``OnlineDPOTrainer``.

    With ``peft_config`` (and no ``ref_model``) the reference of both the loss and the mixture is the base model with
    the adapter off. TRL 1.0.0 mixes with the PEFT model's ``get_base_model()``, whose adapter layers stay active, so
    its mixture samples the adapted policy whatever ``mixture_coef`` is; torchlike samples the mixture it documents.

    Raises:
        ValueError: neither ``judge`` nor ``reward_funcs``, or more than one reward function (TRL's messages), the
            policy and reference vocabularies of different sizes (at the first mixture sample), and
            ``OnlineDPOTrainer``'s errors.

    Example:

    ```python
    >>> from torchlike.trl.experimental.nash_md import NashMDConfig, NashMDTrainer
    >>> class LongerJudge:
    ...     def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
    ...         return [1.0 if len(first) >= len(second) else 0.0 for first, second in completions]
    >>> trainer = NashMDTrainer(model="path/to/Qwen2.5-0.5B-Instruct", judge=LongerJudge(),
    ...                         args=NashMDConfig("out", max_new_tokens=32, mixture_coef=0.5),
    ...                         train_dataset=[{"prompt": "Say hello."}] * 64, processing_class=tokenizer)
    >>> trainer.train()
    ```
    """

    algorithm_class = NashMD
    _config_class = NashMDConfig
    _output_suffix = "NashMD"
    _tag_names = ["trl", "nash-md"]

    def __init__(self, model: ModelLike, ref_model: ModelLike | None = None,
                 reward_funcs: RewardFunc | list[RewardFunc] | None = None, judge: PairwiseJudge | None = None,
                 args: NashMDConfig | None = None, data_collator: Callable | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, peft_config: PeftConfigLike | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: QuantizationConfig | None = None):
        reward_funcs = one_judge_or_reward(judge, reward_funcs, "NashMDTrainer")
        self.judge = judge
        super().__init__(model=model, ref_model=ref_model, reward_funcs=reward_funcs,
                         args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=processing_class if reward_funcs else None,
                         peft_config=peft_config,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config)

    @property
    def mixture_coef(self) -> float:
        """The mixture coefficient of the current epoch: ``args.mixture_coef``, or with a list its entry for the epoch
        (the last one after it)."""
        return self.algorithm.mixture_coef_of(int(self.state.epoch or 0))
