"""``RLOOConfig``: TRL 1.16's RLOO configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.RLOOConfig`` with TRL's name and default; the fields it shares with ``GRPOConfig`` (model,
data, generation, vLLM, reference sync, logging) and TRL's generation-batch rules come from
``torchlike.trl.trainer.grpo_config.OnlineRLConfig``. What the trainer does with each field is in
``torchlike.trl.trainer.rloo_fields.RLOO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchlike.trl.trainer.grpo_config import OnlineRLConfig
from torchlike.trl.trainer.rloo_fields import RLOO_FIELD_SUPPORT


@dataclass
class RLOOConfig(OnlineRLConfig):
    """Configuration of ``torchlike.trl.RLOOTrainer``, with TRL 1.16 ``RLOOConfig``'s fields and defaults.

    The generation, batch and reference fields are ``GRPOConfig``'s (see its documentation); RLOO's own:

    Args:
        num_generations (`int`, defaults to 2): completions per prompt, at least 2 (the leave-one-out baseline of a
            completion is the mean reward of the others of its prompt).
        beta (`float`, defaults to 0.05): KL coefficient: ``beta x sum_t log(pi_old / pi_ref)`` is subtracted from
            each completion's reward; 0 needs no reference model.
        num_iterations (`int`, defaults to 1): optimizer passes per generation batch.
        epsilon (`float`, defaults to 0.2), epsilon_high (`float`, *optional*): clipping of the sequence ratio.
        reward_weights (`list[float]`, *optional*): one weight per reward function.
        normalize_advantages (`bool`, defaults to `False`): normalise the advantages of each generation batch.
        reward_clip_range (`tuple[float, float]`, *optional*): clip the summed rewards to ``(min, max)``.
        mask_truncated_completions (`bool`, defaults to `False`): leave completions without EOS out of the loss.
    """

    _FIELD_SUPPORT = RLOO_FIELD_SUPPORT
    _algorithm = "RLOO"

    num_generations: int | None = 2
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_clip_range is not None:
            low, high = (float(value) for value in self.reward_clip_range)
            if low > high:
                raise ValueError(f"reward_clip_range={tuple(self.reward_clip_range)!r}: the minimum must not exceed "
                                 "the maximum; pass (min, max).")
            self.reward_clip_range = (low, high)
