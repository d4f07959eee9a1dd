"""``GKDConfig``: TRL 1.16's ``trl.experimental.gkd.GKDConfig`` (``SFTConfig`` plus GKD's fields), field for field.

What the trainer does with each field is in ``torchlike.trl.experimental.gkd.gkd_fields.GKD_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.trl.experimental.gkd.gkd_fields import GKD_FIELD_SUPPORT
from torchlike.trl.trainer.sft_config import SFTConfig


@dataclass
class GKDConfig(SFTConfig):
    """Configuration of ``torchlike.trl.experimental.gkd.GKDTrainer``, with TRL 1.16 ``GKDConfig``'s fields and
    defaults.

    All ``SFTConfig`` fields apply (see ``GKD_FIELD_SUPPORT`` for what each does in GKD). GKD's own:

    Args:
        temperature (`float`, defaults to 0.9): sampling temperature of the on-policy (and ``seq_kd``) completions;
            as in TRL, the loss compares the untempered distributions.
        lmbda (`float`, defaults to 0.5): the probability that a micro-batch is replaced by the student's own
            completions of its prompts (the on-policy fraction).
        beta (`float`, defaults to 0.5): the generalized Jensen-Shannon divergence's interpolation: 0 is
            ``KL(teacher || student)``, 1 is ``KL(student || teacher)``.
        max_new_tokens (`int`, defaults to 128): tokens sampled per completion at most.
        teacher_model_name_or_path (`str`, *optional*): the teacher, loaded when the trainer gets no
            ``teacher_model``.
        teacher_model_init_kwargs (`dict` or `str`, *optional*): keyword arguments for
            ``torchlike.AutoModelForCausalLM.from_pretrained`` when the teacher is given as a string.
        disable_dropout (`bool`, defaults to `True`): no LoRA dropout in the student's train steps.
        seq_kd (`bool`, defaults to `False`): sequence-level KD: a micro-batch that is not on-policy trains on the
            teacher's completions of its prompts instead of the dataset's.

    Raises:
        ValueError: ``lmbda`` or ``beta`` outside ``[0, 1]`` (TRL's messages).
    """

    _VALID_DICT_FIELDS = (*SFTConfig._VALID_DICT_FIELDS, "teacher_model_init_kwargs")
    _FIELD_SUPPORT = GKD_FIELD_SUPPORT

    temperature: float = 0.9
    lmbda: float = 0.5
    beta: float = 0.5
    max_new_tokens: int = 128
    teacher_model_name_or_path: str | None = None
    teacher_model_init_kwargs: dict[str, Any] | str | None = None
    disable_dropout: bool = True
    seq_kd: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lmbda < 0.0 or self.lmbda > 1.0:
            raise ValueError("lmbda must be in the range [0.0, 1.0].")
        if self.beta < 0.0 or self.beta > 1.0:
            raise ValueError("beta must be in the range [0.0, 1.0].")
