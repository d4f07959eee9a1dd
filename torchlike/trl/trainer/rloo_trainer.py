"""``RLOOTrainer``: TRL 1.16's REINFORCE Leave-One-Out trainer, with TRL's constructor, on torchlike's policy-gradient
loop (:mod:`.policy_gradient_trainer`), and :class:`RLOO`, the algorithm it trains with.

Generation, reward functions, ``rollout_func``, the reference policy and the batch schedule are the loop's (as for
:class:`~torchlike.trl.GRPOTrainer`). What RLOO decides, as TRL 1.16's ``RLOOTrainer``: the sampling policy's
summed completion log-probabilities are stored with every generation batch; with ``beta != 0`` each completion's
reward loses ``beta x sum_t log(pi_old / pi_ref)``; the advantage is the reward minus the mean reward of the other
completions of its prompt (``adapters.losses.rloo.rloo_advantages``, optionally normalised over the batch); the loss is
a PPO-clipped objective on sequence ratios, averaged over sequences (``adapters.losses.rloo.rloo_step_loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...adapters.losses import grpo as grpo_losses
from ...adapters.losses import rloo as rloo_losses
from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RewardFunc,
    Tokenizer,
)
from .policy_gradient_trainer import LogProbs, PolicyGradientAlgorithm, PolicyGradientTrainer
from .rloo_config import RLOOConfig

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from ...adapters.families.base import Family

__all__ = ["RLOO", "RLOOTrainer"]


class RLOO(PolicyGradientAlgorithm):
    """TRL 1.16's RLOO on the policy-gradient loop (see the module's docstring). Its step loss reads nothing beyond the
    advantages and ``old_logps`` (added with them), in training and evaluation alike: no token normaliser, no
    reference term."""

    args: RLOOConfig

    def advantages(self, rewards: np.ndarray, batch: dict[str, np.ndarray], log_probs: LogProbs,
                   reward_weights: list[float] | None, num_generations: int) -> tuple[np.ndarray, dict[str, float]]:
        """TRL's RLOO advantages, in training and evaluation alike: the sampling policy's summed log-probabilities
        are stored in ``batch["old_logps"]`` and, with ``beta != 0``, the KL penalty
        ``sum_t (log pi_old - log pi_ref)`` enters the rewards (reported as ``kl``, the per-token mean)."""
        args = self.args
        kl = None
        mask = grpo_losses.loss_mask(batch)  # the completion tokens the model wrote (not tool results)
        # Sampled ahead (max_staleness >= 1), the ratio is taken against the sampler's log-probs, as TRL's
        # AsyncGRPOTrainer does; otherwise against the policy that sampled them, recomputed.
        old = batch["sampling_logps"] if "sampling_logps" in batch else log_probs.policy(batch)
        old = old * mask  # [N, C]
        batch["old_logps"] = old.sum(axis=1)
        if log_probs.reference is not None:
            per_token_kl = (old - log_probs.reference(batch)) * mask
            kl = per_token_kl.sum(axis=1)
        advantages, metrics = rloo_losses.rloo_advantages(
            rewards, num_generations, reward_weights=reward_weights, reward_clip_range=args.reward_clip_range,
            kl=kl, beta=args.beta, normalize_advantages=args.normalize_advantages)
        if kl is not None:
            metrics["kl"] = float(kl.sum() / max(float(mask.sum()), 1.0))
        return advantages, metrics

    def step_loss(self, family: Family, temperature: float, decoder_dtype: DTypeLike | None,
                  router_aux_loss_coef: float) -> Callable:
        """TRL's RLOO loss (:func:`adapters.losses.rloo.rloo_step_loss`) with the config's settings."""
        settings = rloo_losses.RLOOLossSettings.from_config(self.args, temperature=temperature,
                                                            router_aux_loss_coef=router_aux_loss_coef)
        return rloo_losses.rloo_step_loss(family, settings)


class RLOOTrainer(PolicyGradientTrainer):
    """``trl.RLOOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless ``dtype`` is given, as in TRL).
        reward_funcs: a function or a list of them, called as in :class:`~torchlike.trl.GRPOTrainer`
            (``f(prompts=..., completions=..., completion_ids=..., <dataset columns>=..., **)``, one ``float`` or
            ``None`` per completion).
        args: :class:`~torchlike.trl.RLOOConfig` (default: ``RLOOConfig("<model>-RLOO")``).
        train_dataset, eval_dataset: rows with a ``prompt`` (text or chat messages) and any other columns the reward
            functions read.
        processing_class: the tokenizer (default: loaded from the model's path).
        reward_processing_classes: only for reward models given by id.
        callbacks, optimizers: as for :class:`~torchlike.Trainer`.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`; the reference (``beta != 0``) is then the base weights
            with the adapter off.
        rollout_func: TRL's ``rollout_func(prompts, trainer) -> dict`` (see :class:`~torchlike.trl.GRPOTrainer`).

    Example:

    ```python
    >>> from torchlike.trl import RLOOConfig, RLOOTrainer
    >>> def short(completions, **kwargs):
    ...     return [-len(text) / 100 for text in completions]
    >>> trainer = RLOOTrainer("path/to/qwen2", reward_funcs=short, train_dataset=[{"prompt": "Hi"}] * 64,
    ...                       args=RLOOConfig("out", max_completion_length=32))
    >>> trainer.train()
    ```
    """

    algorithm_class = RLOO
    _config_class = RLOOConfig
    _trl_fields = (*PolicyGradientTrainer._trl_fields, "normalize_advantages", "reward_clip_range")
    _output_suffix = "RLOO"
    _tag_names = ["trl", "rloo"]

    def __init__(self, model: ModelLike, reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: RLOOConfig | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 reward_processing_classes: Tokenizer | list[Tokenizer] | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: QuantizationConfig | None = None,
                 peft_config: PeftConfigLike | None = None, rollout_func: Callable | None = None):
        if train_dataset is None:  # TRL's RLOO takes no environment_factory to own the data
            raise ValueError("`train_dataset` is required")
        super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config,
                         rollout_func=rollout_func)
