"""``SDPOTrainer``: TRL 1.16's ``trl.experimental.sdpo.SDPOTrainer`` (SDPO, self-distillation policy optimisation) on
torchlike's self-distillation loop (SDFT's, :mod:`torchlike.trl.experimental.self_distillation_trainer`) with the
:class:`SDPO` algorithm: rewards, advantages and teacher contexts.

Each generation batch's completions are scored by the reward functions (callables or reward models, as GRPO calls
them) and turned into group-normalised advantages. A rollout's teacher prompt is built from its group: the first other
rollout whose reward reaches ``success_reward_threshold`` is shown as the correct solution (and, with
``include_environment_feedback``, the row's ``privileged_context`` as feedback), through ``reprompt_template``;
rollouts with neither keep their own prompt and are left out of the distillation (``self_distillation_mask``). The
loss mixes a PPO-clipped policy term on the advantages with the self-distillation term
(``adapters.losses.self_distillation.sdpo_step_loss``, ``distillation_weight``). TRL's reward and teacher-context
diagnostics are logged (``self_distillation/*``), with its warnings on flat rewards and inactive self-distillation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import re
from collections.abc import Callable

import numpy as np

from ....adapters.losses.self_distillation import SDPOLossSettings, sdpo_step_loss
from ....type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    RewardFunc,
    Tokenizer,
)
from ...data.prompt_data import is_conversational_prompt
from ...online import reward_models
from ...online.reward_scorer import RewardScorer, reward_name
from ...online.rollouts import Rollout
from ..self_distillation_trainer import SelfDistillationAlgorithm, SelfDistillationTrainer, message_text
from .sdpo_config import SDPOConfig

__all__ = ["SDPO", "SDPOTrainer"]

logger = logging.getLogger(__name__)


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages [N], group_std [N / G])`` as TRL's SDPO computes them: ``(r - group mean) / (std + 1e-4)``, the
    standard deviation (with Bessel's correction) the group's, the whole batch's (``"batch"``) or 1 (``"none"``)."""
    grouped = rewards.reshape(-1, num_generations).astype(np.float64)
    means = np.repeat(grouped.mean(axis=1), num_generations)
    with np.errstate(invalid="ignore", divide="ignore"):
        group_std = grouped.std(axis=1, ddof=1) if num_generations > 1 else np.full(len(grouped), np.nan)
        if scale_rewards == "batch":
            std = np.full(len(rewards), rewards.std(ddof=1) if len(rewards) > 1 else 0.0)
        elif scale_rewards == "none":
            std, group_std = np.ones(len(rewards)), np.ones(len(grouped))
        else:
            std = np.repeat(group_std, num_generations)
    return ((rewards - means) / (std + 1e-4)).astype(np.float32), group_std.astype(np.float32)


class SDPO(SelfDistillationAlgorithm):
    """TRL 1.16's SDPO on the self-distillation loop: each generation scored by the reward functions, group
    advantages, teacher prompts built from the group's successful rollouts and the row's feedback, TRL's
    diagnostics and warnings, and SDPO's loss (:func:`adapters.losses.self_distillation.sdpo_step_loss`)."""

    metric_prefix = "sdpo"
    trainer: SDPOTrainer

    def __init__(self, trainer: SDPOTrainer):
        super().__init__(trainer)
        self._diagnostic_counters = {"train": collections.Counter(), "eval": collections.Counter()}
        self._warned_feedback_ignored = False

    # ------------------------------------------------------------------ set-up
    @functools.cached_property
    def reward_scorer(self) -> RewardScorer:
        """The reward functions called as TRL's SDPO calls them (no ``log_metric``/``log_extra``)."""
        trainer = self.trainer
        return RewardScorer(trainer.reward_funcs, trainer.tokenizer,
                            keep_columns=not trainer.args.remove_unused_columns, trainer_state=lambda: trainer.state,
                            log_metric=trainer._log_metric,
                            internal_columns=("student_prompt_ids", "untruncated_prompt_ids"), logging_callbacks=False)

    def prompt_columns(self, row: dict) -> dict[str, list[int]]:
        """The student prompt's token ids (truncated to ``max_prompt_length``; sampled from) and the untruncated ones
        a rollout without a teacher context shows the teacher."""
        student = self.trainer._prompt_token_ids(row["prompt"])
        return {"student_prompt_ids": student, "prompt_ids": student,
                "untruncated_prompt_ids": self.trainer._prompt_token_ids(row["prompt"], truncate=False)}

    def step_loss(self) -> tuple[Callable, None]:
        """SDPO's loss (:func:`adapters.losses.self_distillation.sdpo_step_loss`)."""
        trainer = self.trainer
        settings = SDPOLossSettings.from_config(trainer.args, teacher_lora=trainer._teacher_lora,
                                                metric_prefix=self.metric_prefix)
        return sdpo_step_loss(trainer.model.family, trainer.model.family, settings), None

    @property
    def keeps_rollout_log_probs(self) -> bool:
        """TRL's rule: the rollout's log-probabilities are kept when the weights change within a generation batch's
        steps."""
        args = self.trainer.args
        return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0

    # ------------------------------------------------------------------ a generation's columns
    def generation_columns(self, rows: list[dict], seed: int, prefix: str) -> dict[str, np.ndarray]:
        """A generation's step columns: the completions after the student prompt, their rewards and advantages, and
        after each rollout's teacher prompt (:meth:`teacher_prompts`) with its ``self_distillation_mask``; the
        reward, completion and teacher-context metrics join the next log."""
        trainer, mode = self.trainer, "eval" if prefix else "train"
        record = trainer._generate(rows, seed)
        completion_mask = record.completion_mask.copy()
        if trainer.args.mask_truncated_completions:
            completion_mask *= record.ended[:, None]
        table = self.reward_scorer.score(record)
        rewards = np.nansum(table * trainer.reward_weights[None], axis=1).astype(np.float32)
        generations = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        advantages, group_std = group_advantages(rewards, generations, trainer.args.scale_rewards)
        self.record_reward_metrics(prefix, rewards, table, group_std, mode)
        trainer._record_completion_metrics(record, prefix, train=not prefix)
        teacher_ids, sd_mask = self.teacher_prompts(record, rewards, generations, prefix, mode)
        ids, mask = trainer._prompts(rows, "student_prompt_ids")
        teacher, teacher_mask = trainer._prompts([{"teacher": value} for value in teacher_ids], "teacher")
        columns = {"completion_ids": record.tokens, "completion_mask": completion_mask,
                   "input_ids": np.concatenate([ids, record.tokens], axis=1),
                   "attention_mask": np.concatenate([mask, completion_mask], axis=1),
                   "teacher_input_ids": np.concatenate([teacher, record.tokens], axis=1),
                   "teacher_attention_mask": np.concatenate([teacher_mask, completion_mask], axis=1),
                   "advantages": advantages, "self_distillation_mask": sd_mask}
        if self.keeps_rollout_log_probs:
            masked = dataclasses.replace(record, completion_mask=completion_mask)
            columns["old_logps"] = trainer._rollout_log_probs(columns, masked)
        return {key: np.ascontiguousarray(value) for key, value in columns.items()}

    def teacher_prompts(self, record: Rollout, rewards: np.ndarray, generations: int, prefix: str, mode: str
                         ) -> tuple[list[list[int]], np.ndarray]:
        """``(teacher prompt ids, self_distillation_mask)`` of each rollout, as TRL's
        ``SuccessfulRolloutTeacherContextBuilder`` builds them, with its ``self_distillation/*`` fractions logged."""
        trainer, args, rows = self.trainer, self.trainer.args, record.rows
        total = len(rows)
        threshold = args.success_reward_threshold
        mask = np.zeros(total, np.float32)
        solutions = successes = feedback_available = feedback_used = 0
        teacher_ids = []
        for index, row in enumerate(rows):
            start = index // generations * generations
            group = range(start, start + generations)
            successful = [other for other in group if args.use_successful_as_teacher
                          and not (args.dont_reprompt_on_self_success and other == index)
                          and rewards[other] >= threshold]
            if index % generations == 0 and any(rewards[other] >= threshold for other in group):
                successes += 1
            feedback = row.get("privileged_context")
            has_feedback = isinstance(feedback, str) and feedback.strip() != ""
            feedback_available += has_feedback
            use_feedback = args.include_environment_feedback and has_feedback and \
                (not args.environment_feedback_only_without_solution or not successful)
            feedback_used += use_feedback
            solutions += bool(successful)
            if not successful and not use_feedback:
                teacher_ids.append(list(row["untruncated_prompt_ids"])[-args.max_reprompt_len:])
                continue
            mask[index] = 1.0
            solution = ""
            if successful:
                demonstration = trainer.tokenizer.decode(
                    [token for token in record.tokens[successful[0]] if token != trainer.pad_token_id],
                    skip_special_tokens=True)
                if args.remove_thinking_from_demonstration:
                    demonstration = re.sub(r"<think>.*?</think>", "", demonstration, flags=re.DOTALL).strip()
                solution = args.solution_template.format(successful_previous_attempt=demonstration)
            feedback_text = args.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
            prompt = row["prompt"]
            if is_conversational_prompt(prompt):
                last = prompt[-1]
                if last.get("role") != "user":
                    raise ValueError("Self-distillation teacher prompt construction expects the conversation to end "
                                     f"with a user turn, but the last message has role '{last.get('role')}'. Prompts "
                                     "ending with assistant prefills or tool turns are not supported.")
                text = args.reprompt_template.format(prompt=message_text(last), solution=solution,
                                                     feedback=feedback_text)
                reprompt = [*prompt[:-1], {"role": "user", "content": text}]
            else:
                reprompt = args.reprompt_template.format(prompt=prompt, solution=solution, feedback=feedback_text)
            teacher_ids.append(trainer._prompt_token_ids(reprompt, truncate=False)[-args.max_reprompt_len:])
        if feedback_available and not args.include_environment_feedback and not self._warned_feedback_ignored:
            self._warned_feedback_ignored = True
            logger.warning("SDPO received environment feedback (`privileged_context`) in the batch, but "
                           "`include_environment_feedback=False`, so it is being ignored (no reprompting from "
                           "feedback). Set `include_environment_feedback=True` to use it.")
        count, groups = max(total, 1), max(1, total // max(1, generations))
        fractions = {"success_group_fraction": successes / groups, "success_sample_fraction": solutions / count,
                     "feedback_available_fraction": feedback_available / count,
                     "feedback_used_fraction": feedback_used / count, "reprompt_sample_fraction": float(mask.mean())}
        for key, value in fractions.items():
            trainer._log_metric(f"{prefix}self_distillation/{key}", value)
        self.warn_if_inactive(fractions, mode)
        return teacher_ids, mask

    # ------------------------------------------------------------------ diagnostics
    def record_reward_metrics(self, prefix: str, rewards: np.ndarray, table: np.ndarray, group_std: np.ndarray,
                               mode: str) -> None:
        """TRL's ``_record_reward_diagnostics``: the rewards' mean, std, min and max, the groups' mean std and the
        fraction of flat groups, each reward function's mean, and the warning on flat rewards."""
        trainer = self.trainer
        tolerance = trainer.args.diagnostics_flat_tolerance
        std = float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0
        flat = float((group_std <= tolerance).mean()) if group_std.size else 1.0
        metrics = {"reward_mean": float(rewards.mean()), "reward_std": std, "reward_min": float(rewards.min()),
                   "reward_max": float(rewards.max()),
                   "group_reward_std_mean": float(group_std.mean()) if group_std.size else std,
                   "flat_group_fraction": flat}
        with np.errstate(invalid="ignore"):
            for name, column in zip(trainer.reward_func_names, table.T, strict=True):
                metrics[f"rewards/{name}"] = float(np.nanmean(column))
        for key, value in metrics.items():
            trainer._log_metric(f"{prefix}self_distillation/{key}", value)
        if std <= tolerance and flat >= 1.0 - tolerance:
            self.warn_degenerate(mode, "flat_rewards", "Observed flat SDPO rewards across all sampled generations. "
                                  "Policy advantages will collapse to zero, and SDPO will not learn. Check reward "
                                  "density, reward shaping, or `success_reward_threshold`.")
        else:
            self._diagnostic_counters[mode]["flat_rewards"] = 0

    def warn_if_inactive(self, fractions: dict[str, float], mode: str) -> None:
        """TRL's ``_warn_on_inactive_self_distillation``."""
        tolerance = self.trainer.args.diagnostics_flat_tolerance
        if fractions["reprompt_sample_fraction"] <= tolerance:
            self.warn_degenerate(mode, "inactive_self_distillation", "SDPO self-distillation is inactive because no "
                                  "reprompted samples were constructed. This usually means no rollout exceeded "
                                  "`success_reward_threshold` and no usable privileged feedback was available.")
        else:
            self._diagnostic_counters[mode]["inactive_self_distillation"] = 0
        if fractions["success_group_fraction"] <= tolerance:
            self.warn_degenerate(mode, "no_successful_rollouts", "SDPO did not find any successful rollouts in the "
                                  "current generation groups. If this persists, reduce task difficulty, adjust reward "
                                  "shaping, or lower `success_reward_threshold`.")
        else:
            self._diagnostic_counters[mode]["no_successful_rollouts"] = 0

    def warn_degenerate(self, mode: str, key: str, message: str) -> None:
        """Warns on the first degenerate generation batch in a row and every ``diagnostics_warning_interval``-th."""
        interval = self.trainer.args.diagnostics_warning_interval
        if interval == 0:
            return
        self._diagnostic_counters[mode][key] += 1
        count = self._diagnostic_counters[mode][key]
        if count == 1 or count % interval == 0:
            logger.warning("%s Consecutive degenerate steps: %s.", message, count)


class SDPOTrainer(SelfDistillationTrainer):
    """``trl.experimental.sdpo.SDPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted), or a
            path / hub id loaded with ``args.model_init_kwargs``.
        reward_funcs: a reward function or model, or a list of them, called as GRPO's are (``prompts``,
            ``completions``, ``completion_ids``, ``trainer_state`` and the dataset's other columns); required.
        args: :class:`SDPOConfig` (default: one with ``output_dir="<model>-SDPO"``).
        train_dataset, eval_dataset: rows with a ``prompt`` (text or chat messages ending with a user turn), an
            optional ``privileged_context`` (environment feedback) and any columns the rewards read.
        processing_class: the tokenizer (default: loaded from the model's path).
        reward_processing_classes: the reward models' tokenizers (one, or one per reward function).
        callbacks, optimizers, peft_config: as :class:`~torchlike.trl.experimental.sdft.SDFTTrainer` takes them.

    Raises:
        ValueError: no ``reward_funcs`` or ``train_dataset`` (TRL's messages), or ``reward_weights`` /
            ``reward_processing_classes`` not one per reward function.

    Example:

    ```python
    >>> from torchlike.trl.experimental.sdpo import SDPOConfig, SDPOTrainer
    >>> def solved(completions, answer, **kwargs):
    ...     return [float(answer[i] in text) for i, text in enumerate(completions)]
    >>> trainer = SDPOTrainer(model="path/to/Qwen2.5-0.5B-Instruct", reward_funcs=solved,
    ...                       train_dataset=[{"prompt": "2 + 2 =", "answer": "4"}] * 64,
    ...                       args=SDPOConfig("out", num_generations=4, max_completion_length=64))
    >>> trainer.train()
    ```
    """

    algorithm_class = SDPO
    _config_class = SDPOConfig
    _output_suffix = "SDPO"
    _tag_names = ["trl", "sdpo"]

    def __init__(self, model: ModelLike, reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: SDPOConfig | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 reward_processing_classes: Tokenizer | list[Tokenizer] | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: PeftConfigLike | None = None):
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            raise ValueError("`reward_funcs` is required for SDPOTrainer because SDPO must score rollouts.")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        if isinstance(reward_processing_classes, list) and len(reward_processing_classes) != len(reward_funcs):
            raise ValueError("Number of reward processing classes must match number of reward functions")
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config)
        args = self.args
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ValueError("Number of reward weights must match number of reward functions")
        self.reward_funcs = reward_models.reward_functions(reward_funcs, reward_processing_classes, args, self.model)
        self.reward_func_names = [reward_name(function) for function in self.reward_funcs]
        self.reward_weights = np.asarray(args.reward_weights or [1.0] * len(self.reward_funcs), np.float32)
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo"):
            logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums "
                           "per-token contributions, which effectively weights each sequence by its completion "
                           "length instead of optimizing the per-sequence objective. To reproduce the GSPO paper's "
                           "setup, set `loss_type='grpo'` (see "
                           "https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization).")
        # TRL's attributes.
        self.loss_type, self.mask_truncated_completions = args.loss_type, args.mask_truncated_completions
        self.importance_sampling_level, self.scale_rewards = args.importance_sampling_level, args.scale_rewards
        self.epsilon_low, self.epsilon_high, self.beta = args.epsilon, args.epsilon_high, args.beta
        # Teacher prompts are built per generation batch; their width starts at the untruncated prompts' bucket.
        self._prompt_widths["teacher"] = self._prompt_widths["untruncated_prompt_ids"]
