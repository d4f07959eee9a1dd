"""``TPOConfig``: TRL 1.16's ``trl.experimental.tpo.TPOConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=5e-7``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``). What the
trainer does with each field is in ``torchlike.trl.experimental.tpo.tpo_fields.TPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....training_args import TrainingArguments, check_choice
from ...trainer.base_config import TRLConfig
from .tpo_fields import TPO_FIELD_SUPPORT

#: ``truncation_mode`` values, as TRL's field lists them.
TRUNCATION_MODES: tuple[str, ...] = ("keep_start", "keep_end")


@dataclass
class TPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.tpo.TPOTrainer``, with TRL 1.16 ``TPOConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        model_init_kwargs (`dict`, *optional*): for ``from_pretrained`` when ``model`` is a string.
        trust_remote_code (`bool`, defaults to `False`): forwarded to ``from_pretrained`` in TRL.
        disable_dropout (`bool`, defaults to `True`): no dropout in the model.
        dataset_num_proc (`int`, *optional*): processes for tokenising.
        max_length (`int` or `None`, defaults to 1024): prompt + response are truncated to it.
        truncation_mode (`str`, defaults to ``"keep_start"``): or ``"keep_end"``.
        pad_to_multiple_of (`int`, *optional*): batches are padded to a multiple of it.
        loss_type (`str`, defaults to ``"sigmoid"``): ``"sigmoid"``, ``"hinge"``, ``"ipo"`` or ``"tpo-l"``.
        beta (`float`, defaults to 0.01): the temperature of the preference term (``tau`` for IPO).
        label_smoothing (`float`, defaults to 0.0): ``eps`` of the sigmoid and tpo-l losses.
        tpo_alpha (`float`, defaults to 1.0): weight of the gold (``reference``) response's NLL; 0 skips its rows.
        tpo_l_gamma (`float`, defaults to 0.5): the target reward margin of ``tpo-l``.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = TPO_FIELD_SUPPORT

    learning_rate: float = 5e-7
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    loss_type: str = "sigmoid"
    beta: float = 0.01
    label_smoothing: float = 0.0
    tpo_alpha: float = 1.0
    tpo_l_gamma: float = 0.5

    def __post_init__(self) -> None:
        self.truncation_mode = check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        super().__post_init__()
