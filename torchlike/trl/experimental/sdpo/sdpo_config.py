"""``SDPOConfig``: TRL 1.16's ``trl.experimental.sdpo.SDPOConfig``, field for field, on ``TrainingArguments``.

SDFT's shared fields (``SelfDistillationConfig``, with SDPO's defaults: an ``"ema"`` teacher, ``"sampled_token"``
reverse KL) plus the policy term's (``loss_type``, ``epsilon``, ``scale_rewards``...) and the teacher context's
(``success_reward_threshold``, the reprompt templates, environment feedback). ``__post_init__`` checks and normalises
them as TRL does. What the trainer does with each field is in
``torchlike.trl.experimental.sdpo.sdpo_fields.SDPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....adapters.losses.self_distillation import SDPO_LOSS_TYPES
from ....training_args import check_choice
from ..sdft.sdft_config import SelfDistillationConfig
from .sdpo_fields import SDPO_FIELD_SUPPORT

#: ``scale_rewards`` values once TRL has mapped ``True``/``False`` to ``"group"``/``"none"``.
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
#: ``importance_sampling_level`` values.
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


@dataclass
class SDPOConfig(SelfDistillationConfig):
    """Configuration of ``torchlike.trl.experimental.sdpo.SDPOTrainer``, with TRL 1.16 ``SDPOConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply, and SDFT's sampling, teacher and distillation fields.

    Args:
        distillation_weight (`float`, defaults to 1.0): the distillation term's share of the loss (0: policy only).
        loss_type (`str`, defaults to ``"dapo"``): ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"``.
        epsilon (`float`, defaults to 0.2), epsilon_high (`float`, *optional*): the policy term's clip range.
        importance_sampling_level (`str`, defaults to ``"token"``): or ``"sequence"``.
        scale_rewards (`str` or `bool`, defaults to ``"group"``): ``"group"``, ``"batch"`` or ``"none"``.
        reward_weights (`list[float]`, *optional*): one weight per reward function.
        mask_truncated_completions (`bool`, defaults to `False`): completions without an end token are not trained.
        beta (`float`, defaults to 0.0): stored as TRL stores it (its SDPO loss has no KL term).
        use_successful_as_teacher (`bool`, defaults to `True`), success_reward_threshold (`float`, defaults to 1.0),
            dont_reprompt_on_self_success (`bool`, defaults to `True`): a rollout's teacher context shows a successful
            rollout of its group.
        reprompt_template, solution_template, feedback_template (`str`): how the teacher prompt is built.
        max_reprompt_len (`int`, defaults to 10240): teacher prompts keep their last ``max_reprompt_len`` tokens.
        include_environment_feedback (`bool`, defaults to `False`), environment_feedback_only_without_solution
            (`bool`): the row's ``privileged_context`` as feedback in the teacher prompt.
        remove_thinking_from_demonstration (`bool`, defaults to `False`): ``<think>...</think>`` removed from the shown
            solution.
        diagnostics_warning_interval (`int`, defaults to 10), diagnostics_flat_tolerance (`float`, defaults to 1e-8):
            warnings on degenerate rewards.
    """

    _FIELD_SUPPORT = SDPO_FIELD_SUPPORT
    _algorithm = "SDPO"

    teacher_model_kind: str = "ema"
    distillation_alpha: float = 1.0
    distillation_mode: str = "sampled_token"
    distillation_topk: int | None = None
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    dont_reprompt_on_self_success: bool = True
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    reward_weights: list[float] | None = None
    scale_rewards: str | bool = "group"
    distillation_weight: float = 1.0
    max_reprompt_len: int = 10240
    use_successful_as_teacher: bool = True
    success_reward_threshold: float = 1.0
    reprompt_template: str = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
    solution_template: str = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
    feedback_template: str = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"
    include_environment_feedback: bool = False
    environment_feedback_only_without_solution: bool = False
    remove_thinking_from_demonstration: bool = False
    diagnostics_warning_interval: int = 10
    diagnostics_flat_tolerance: float = 1e-8

    def __post_init__(self) -> None:
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"`distillation_weight` must be in [0, 1], got {self.distillation_weight}.")
        super().__post_init__()
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        self.scale_rewards = check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.loss_type = check_choice("loss_type", self.loss_type, SDPO_LOSS_TYPES)
        self.importance_sampling_level = check_choice("importance_sampling_level", self.importance_sampling_level,
                                                      IMPORTANCE_SAMPLING_LEVELS)
