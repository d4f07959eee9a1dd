"""What torchlike does with each field of ``trl.experimental.sdpo.SDPOConfig``: SDFT's rows for the fields the two
share, and SDPO's own. A test holds the table against the fields of the real class."""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT
from ..sdft.sdft_fields import SDFT_FIELD_SUPPORT

_SDFT_ONLY = ("generate_from_teacher", "teacher_prompt_template", "num_loss_tokens_to_skip")

SDPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: support for name, support in SDFT_FIELD_SUPPORT.items() if name not in _SDFT_ONLY},
    "remove_unused_columns": honoured("False (TRL's default here): every dataset column but prompt and completion "
                                      "reaches the reward functions; True keeps only prompt and privileged_context."),
    # --- the policy term ---
    "distillation_weight": honoured("The loss is (1 - w) x the policy term + w x the distillation term; at 1 only the "
                                    "distillation is computed, at 0 only the policy term (no teacher pass), as TRL."),
    "loss_type": honoured("How the policy term's per-token losses are reduced: grpo (per sequence, then the mean), "
                          "bnpo and dapo (over the micro-batch's tokens), dr_grpo (over rows x max_completion_length), "
                          "as TRL's SDPO computes them."),
    "epsilon": GRPO_FIELD_SUPPORT["epsilon"],
    "epsilon_high": GRPO_FIELD_SUPPORT["epsilon_high"],
    "importance_sampling_level": honoured("'token' ratios, or 'sequence': the log-ratio averaged over the "
                                          "completion, as TRL's SDPO (a warning with bnpo, dr_grpo and dapo)."),
    "reward_weights": honoured("Weights of the reward functions in each completion's reward (default 1.0 each)."),
    "scale_rewards": honoured("Advantages are (r - group mean) / (std + 1e-4), std the group's ('group'), the "
                              "generation batch's ('batch') or 1 ('none'); True/False map to 'group'/'none'."),
    "mask_truncated_completions": honoured("Completions without an end token are left out of both terms."),
    "beta": ignored("TRL's SDPOTrainer stores it and its loss has no KL term, so it changes nothing there either."),
    # --- the teacher context ---
    "use_successful_as_teacher": honoured("A rollout's teacher prompt shows the first other rollout of its group whose "
                                          "reward reaches success_reward_threshold."),
    "success_reward_threshold": honoured("The reward a rollout needs to count as successful."),
    "dont_reprompt_on_self_success": honoured("A rollout is not shown itself as the successful solution."),
    "max_reprompt_len": honoured("Teacher prompts keep their last max_reprompt_len tokens."),
    "reprompt_template": honoured("The teacher prompt: reprompt_template.format(prompt, solution, feedback); for a "
                                  "conversation, the last user turn's text is formatted and replaces it."),
    "solution_template": honoured("The shown solution: solution_template.format(successful_previous_attempt=...), "
                                  "the successful completion decoded without special tokens."),
    "feedback_template": honoured("The shown feedback: feedback_template.format(feedback_raw=<privileged_context>)."),
    "include_environment_feedback": honoured("A non-empty privileged_context text is shown as feedback (without it, "
                                             "TRL's warning that it is ignored)."),
    "environment_feedback_only_without_solution": honoured("Feedback is shown only to rollouts without a successful "
                                                           "solution."),
    "remove_thinking_from_demonstration": honoured("<think>...</think> blocks are removed from the shown solution."),
    "diagnostics_warning_interval": honoured("TRL's warnings about flat rewards and inactive self-distillation: on "
                                             "the first degenerate generation batch and every interval-th in a row "
                                             "(0: never)."),
    "diagnostics_flat_tolerance": honoured("The reward standard deviation (and the reprompt and success fractions) "
                                           "under which a generation batch counts as degenerate."),
}
