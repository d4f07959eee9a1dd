"""``CPOConfig``: TRL 1.16's ``trl.experimental.cpo.CPOConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), and turns
``loss_type="alphapo"`` into SimPO without the NLL term as TRL's ``__post_init__`` does. What the trainer does with
each field is in ``torchlike.trl.experimental.cpo.cpo_fields.CPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .cpo_fields import CPO_FIELD_SUPPORT


@dataclass
class CPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.cpo.CPOTrainer``, with TRL 1.16 ``CPOConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        max_length (`int` or `None`, defaults to 1024): prompt + completion; a completion is cut to fit.
        max_completion_length (`int`, *optional*): encoder-decoder models only (ignored).
        beta (`float`, defaults to 0.1): the loss temperature (``tau`` for IPO).
        label_smoothing (`float`, defaults to 0.0): ``eps`` of the sigmoid and simpo losses.
        loss_type (`str`, defaults to ``"sigmoid"``): ``"sigmoid"``, ``"hinge"``, ``"ipo"``, ``"simpo"`` or
            ``"alphapo"`` (becomes ``"simpo"`` with ``cpo_alpha=0``).
        disable_dropout (`bool`, defaults to `True`): no dropout in the model.
        cpo_alpha (`float`, defaults to 1.0): weight of the behaviour-cloning (chosen NLL) term.
        simpo_gamma (`float`, defaults to 0.5): SimPO's target reward margin.
        alpha (`float`, defaults to 0.0): AlphaPO's reward shape (0: log-probability rewards).
        generate_during_eval (`bool`, defaults to `False`): TRL's W&B/Comet completion table (refused).
        is_encoder_decoder (`bool`, *optional*): for ``model_init`` (ignored).
        model_init_kwargs (`dict`, *optional*): for ``from_pretrained`` when ``model`` is a string.
        trust_remote_code (`bool`, defaults to `False`): forwarded to ``from_pretrained`` in TRL.
        dataset_num_proc (`int`, *optional*): processes for tokenising.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = CPO_FIELD_SUPPORT

    learning_rate: float = 1e-6
    max_length: int | None = 1024
    max_completion_length: int | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    disable_dropout: bool = True
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    dataset_num_proc: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type == "alphapo":
            self.loss_type = "simpo"
            self.cpo_alpha = 0.0
        super().__post_init__()
