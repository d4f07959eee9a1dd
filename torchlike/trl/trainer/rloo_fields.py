"""What torchlike does with each field ``trl.RLOOConfig`` adds to ``TrainingArguments``.

RLOO shares GRPO's rollout (sampling, reward functions, reference) and most of its fields, so the rows are
``GRPO_FIELD_SUPPORT``'s, except where RLOO gives a field another meaning, plus RLOO's own fields. A test holds the
table against the fields of the real ``trl.RLOOConfig``.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured
from .grpo_fields import GRPO_FIELD_SUPPORT

#: The GRPO fields that ``trl.RLOOConfig`` does not have.
_GRPO_ONLY = ("cast_lm_head_to_fp32", "delta", "entropy_coef", "entropy_coef_delta", "entropy_coef_max",
              "entropy_coef_min", "entropy_target", "importance_sampling_level", "log_completions_hub_repo",
              "loss_type", "max_tool_calling_iterations", "multi_objective_aggregation", "off_policy_mask_threshold",
              "sapo_temperature_neg", "sapo_temperature_pos", "scale_rewards", "top_entropy_quantile",
              "use_adaptive_entropy", "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg",
              "vespo_lambda_pos", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_clip_min", "vllm_importance_sampling_correction",
              "vllm_importance_sampling_mode")

RLOO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: support for name, support in GRPO_FIELD_SUPPORT.items() if name not in _GRPO_ONLY},
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; each micro-batch's loss is the mean "
                                            "over its sequences and the step averages them, as TRL's Trainer divides "
                                            "by the accumulation steps."),
    "max_completion_length": honoured("Generation stops after this many tokens; with the prompt length it sizes the "
                                      "KV cache."),
    "steps_per_generation": honoured("Micro-steps each generation batch feeds (default gradient_accumulation_steps); "
                                     "the sampling policy's sequence log-probabilities are stored with every "
                                     "generation batch, as TRL does, and each step's ratio is taken against them."),
    "beta": honoured("KL coefficient: beta != 0 keeps a frozen reference model (the base model with LoRA off for "
                     "PEFT) and subtracts beta x the sequence's summed log(pi_old / pi_ref) from its reward, as TRL's "
                     "RLOO (first-order estimate, in the reward, not the loss)."),
    "epsilon_high": honoured("Upper clip of the sequence ratio, 1 + epsilon_high (None: epsilon)."),
    "reward_weights": honoured("Weight of each reward function in the NaN-skipping sum of rewards (default 1.0 "
                               "each); None rewards are left out, and a completion no function scores is left out "
                               "of its group's baseline and gets advantage 0, as in TRL."),
    "normalize_advantages": honoured("Normalise the advantages of each generation batch to mean 0 and standard "
                                     "deviation 1 (NaN-skipping, plus 1e-4), as TRL."),
    "reward_clip_range": honoured("Clip each completion's summed reward to (min, max) before the KL penalty and the "
                                  "leave-one-out baseline."),
}
