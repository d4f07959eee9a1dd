"""``GRPOTrainer``: TRL's Group Relative Policy Optimization trainer, with TRL's constructor, on torchlike's
policy-gradient loop (:mod:`.policy_gradient_trainer`), and :class:`GRPO`, the algorithm it trains with.

What one GRPO step does, beyond the loop's sampling, scoring and scheduling: the advantages are TRL's group-normalised
rewards (``adapters.losses.grpo.grpo_advantages``: ``scale_rewards``, ``multi_objective_aggregation``); each micro-batch
carries TRL's token normaliser and step weight for its ``loss_type``, the reference's log-probabilities (``beta != 0``)
and, by TRL's rule (``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``), the log-probs of
the policy that sampled the batch, kept for the ratio and clipping; a batch sampled ahead (``max_staleness >= 1``) gets
TRL's vLLM importance-sampling correction; the loss is ``adapters.losses.grpo.grpo_step_loss`` (every TRL
``loss_type``, importance sampling level, clipping and entropy setting), with TRL's adaptive entropy controller when
``use_adaptive_entropy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...adapters.losses import grpo as grpo_losses
from ..online.entropy_control import AdaptiveEntropyControl
from .grpo_config import GRPOConfig
from .policy_gradient_trainer import LogProbs, PolicyGradientAlgorithm, PolicyGradientTrainer

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from ...adapters.families.base import Family

__all__ = ["GRPO", "GRPOTrainer"]

logger = logging.getLogger(__name__)


class GRPO(PolicyGradientAlgorithm):
    """TRL 1.16's GRPO on the policy-gradient loop (see the module's docstring)."""

    args: GRPOConfig

    def check(self) -> None:
        """TRL's checks of the loss settings against each other, with its wording (its warnings through Python's
        ``logging``, as TRL's logger emits them)."""
        args = self.args
        if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
            logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
                           "mirror the paper's setup.")
        if args.loss_type == "vespo" and args.importance_sampling_level != "token":
            logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                           "should be set to `'token'` (the default).")
        if args.importance_sampling_level == "sequence" and args.loss_type in grpo_losses.LENGTH_WEIGHTED_LOSSES:
            logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums "
                           "per-token contributions, which effectively weights each sequence by its completion length "
                           "instead of optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
                           "`loss_type='grpo'` (see https://huggingface.co/docs/trl/main/en/paper_index"
                           "#group-sequence-policy-optimization).")

    def entropy_control(self) -> AdaptiveEntropyControl | None:
        """TRL's adaptive entropy controller (:mod:`.entropy_control`) with ``use_adaptive_entropy``, else ``None``."""
        return AdaptiveEntropyControl.from_config(self.args) if self.args.use_adaptive_entropy else None

    def advantages(self, rewards: np.ndarray, batch: dict[str, np.ndarray], log_probs: LogProbs,
                   reward_weights: list[float] | None, num_generations: int) -> tuple[np.ndarray, dict[str, float]]:
        """TRL's group-relative advantages (``adapters.losses.grpo.grpo_advantages``)."""
        return grpo_losses.grpo_advantages(rewards, num_generations, reward_weights=reward_weights,
                                           scale_rewards=self.args.scale_rewards,
                                           multi_objective_aggregation=self.args.multi_objective_aggregation)

    def step_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs) -> None:
        """The token normaliser and step weight, the sampling policy's log-probs (TRL's rule for when they are kept)
        and the reference's; a batch sampled ahead is corrected (:meth:`sampler_correction`)."""
        args = self.args
        accumulation = args.gradient_accumulation_steps
        completion_mask = grpo_losses.loss_mask(batch)  # TRL's num_items_in_batch counts the trained tokens
        normaliser = max(float(completion_mask.sum()), 1.0) * accumulation / args.steps_per_generation
        batch[grpo_losses.NUM_ITEMS_COLUMN] = np.full(len(completion_mask), normaliser, np.float32)
        token_sum = args.loss_type in grpo_losses.NUM_ITEMS_NORMALISED_LOSSES
        batch["step_weight"] = np.full(len(completion_mask), 1.0 / accumulation if token_sum else 1.0, np.float32)
        corrected = "sampling_logps" in batch and args.vllm_importance_sampling_correction
        # TRL's rule for old log-probs, and (as TRL with vLLM's correction) always when the sampler's are corrected.
        if accumulation % (args.steps_per_generation * args.num_iterations) != 0 or corrected:
            batch["old_logps"] = log_probs.policy(batch)
        if corrected:
            self.sampler_correction(batch, batch["old_logps"])
        if log_probs.reference is not None:
            batch["ref_logps"] = log_probs.reference(batch)

    def eval_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs,
                     entropy_coefficient: float | None) -> None:
        """The token normaliser of the whole batch and step weight 1 (TRL's eval batch is neither split nor
        accumulated), and the reference's log-probs; there are no old log-probs (the ratio is 1). With adaptive
        entropy control, the coefficient the next optimizer step would apply (TRL's evaluation applies it and leaves
        the controller as it is)."""
        rows = len(batch["input_ids"])
        batch[grpo_losses.NUM_ITEMS_COLUMN] = np.full(rows, max(float(grpo_losses.loss_mask(batch).sum()), 1.0),
                                                      np.float32)
        batch["step_weight"] = np.ones(rows, np.float32)
        if entropy_coefficient is not None:
            batch["entropy_coef"] = np.full(rows, entropy_coefficient, np.float32)
        if log_probs.reference is not None:
            batch["ref_logps"] = log_probs.reference(batch)

    def sampler_correction(self, batch: dict[str, np.ndarray], old_logps: np.ndarray) -> None:
        """TRL's vLLM importance-sampling correction of a batch sampled ahead: ``batch["importance_sampling_ratio"]``
        (:func:`adapters.losses.grpo.sampler_importance_ratio` of the trainer's and the engine's log-probs) and TRL's
        ``sampling/*`` metrics."""
        args = self.args
        mask = grpo_losses.loss_mask(batch).astype(bool)
        sampling_logps = batch["sampling_logps"]
        ratio = grpo_losses.sampler_importance_ratio(old_logps, sampling_logps, mask,
                                                     args.vllm_importance_sampling_mode,
                                                     args.vllm_importance_sampling_clip_min,
                                                     args.vllm_importance_sampling_clip_max)
        batch["importance_sampling_ratio"] = np.broadcast_to(ratio, mask.shape).astype(np.float32)
        delta = np.abs(old_logps - sampling_logps)[mask]
        flat = ratio.ravel() if ratio.shape[1] == 1 else ratio[mask]
        metrics = {"sampling/sampling_logp_difference/mean": delta.mean() if delta.size else 0.0,
                   "sampling/sampling_logp_difference/max": delta.max() if delta.size else 0.0,
                   "sampling/importance_sampling_ratio/min": flat.min() if flat.size else 0.0,
                   "sampling/importance_sampling_ratio/mean": flat.mean() if flat.size else 0.0,
                   "sampling/importance_sampling_ratio/max": flat.max() if flat.size else 0.0}
        for key, value in metrics.items():
            self.log_metric(key, float(value))

    def step_loss(self, family: Family, temperature: float, decoder_dtype: DTypeLike | None,
                  router_aux_loss_coef: float) -> Callable:
        """TRL's GRPO loss (:func:`adapters.losses.grpo.grpo_step_loss`) with the config's settings."""
        settings = grpo_losses.GRPOLossSettings.from_config(self.args, temperature=temperature,
                                                            compute_dtype=decoder_dtype,
                                                            router_aux_loss_coef=router_aux_loss_coef)
        return grpo_losses.grpo_step_loss(family, settings)


class GRPOTrainer(PolicyGradientTrainer):
    """``trl.GRPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless ``dtype`` is given, as in TRL).
        reward_funcs: a function or a list of them, called as
            ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., <dataset columns>=..., **)``
            and returning one ``float`` or ``None`` per completion (``async def`` functions too), or a reward model:
            a path / hub id (loaded with ``AutoModelForSequenceClassification.from_pretrained(num_labels=1,
            **args.model_init_kwargs)``) or a loaded sequence classifier, scoring prompt + completion as TRL does
            (:mod:`torchlike.trl.online.reward_models`).
        args: :class:`~torchlike.trl.GRPOConfig` (default: ``GRPOConfig("<model>-GRPO")``).
        train_dataset: rows with a ``prompt`` (text, or chat messages rendered with the chat template and
            ``add_generation_prompt=True``) and any other columns the reward functions read.
        eval_dataset: the same format; ``evaluate()`` samples ``num_generations_eval`` completions per prompt
            and reports their rewards.
        processing_class: the tokenizer (default: loaded from the model's path).
        reward_processing_classes: the reward models' tokenizers: one (for a single reward function) or a list
            with one entry per reward function; ``None`` entries load the reward model's own.
        callbacks, optimizers: as for :class:`~torchlike.Trainer`.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`; the reference model (``beta != 0``) is then
            the base weights with the adapter disabled.
        tools: functions the model may call (sync or ``async def``; their type hints and docstrings give the JSON
            schemas the chat template renders), as TRL 1.16 runs them (:mod:`torchlike.trl.online.tool_calling`): the
            model's tool calls are parsed from its turns, run, answered with ``tool`` messages, and each sample is
            continued with the sampler up to ``args.max_tool_calling_iterations`` rounds within
            ``max_completion_length``; the tool-result tokens are left out of the loss (TRL's ``tool_mask``) and the
            reward functions receive each completion as its message list. Needs conversational prompts.
        rollout_func: TRL's ``rollout_func(prompts, trainer) -> dict``, replacing the sampler: it gets the prompts of a
            generation batch (each repeated ``num_generations`` times, conversational prompts untemplated) and returns
            ``prompt_ids`` and ``completion_ids`` (one token list per prompt; a completion is trained as given, its
            last token deciding whether it ended, as TRL does), ``logprobs`` (accepted, not used: there is no separate
            inference engine to correct for) and any extra per-completion lists, which reach the reward functions
            as keyword arguments, except ``env_mask`` (one 0/1 per completion token; 0 keeps a token out of the loss,
            as TRL's ``tool_mask``).
        environment_factory: TRL's agent environments (:mod:`torchlike.trl.online.environments`): a callable returning
            an environment, or a dict of them selected by each row's ``environment`` column. An environment defines
            ``reset(**row) -> str | None`` (called with the row's columns before each rollout; what it returns is
            appended to the prompt's last message) and public methods that become that rollout's tools, run on its
            own instance; an optional ``get_reward()`` adds a reward function named after the class (weight 1).
            Reward functions receive the rollouts' instances as ``environments``. Without ``train_dataset`` a single
            environment owns the data (its ``reset`` gives the prompts) and ``max_steps`` sets the run's length.
    """

    algorithm_class = GRPO
    _config_class = GRPOConfig
    _trl_fields = (*PolicyGradientTrainer._trl_fields, "loss_type", "multi_objective_aggregation", "scale_rewards",
                   "importance_sampling_level", "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef",
                   "use_adaptive_entropy", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                   "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")
    _output_suffix = "GRPO"
    _tag_names = ["trl", "grpo"]
