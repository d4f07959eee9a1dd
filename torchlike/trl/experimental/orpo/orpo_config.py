"""``ORPOConfig``: TRL 1.16's ``trl.experimental.orpo.ORPOConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``). What the
trainer does with each field is in ``torchlike.trl.experimental.orpo.orpo_fields.ORPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .orpo_fields import ORPO_FIELD_SUPPORT


@dataclass
class ORPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.orpo.ORPOTrainer``, with TRL 1.16 ``ORPOConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        max_length (`int` or `None`, defaults to 1024): prompt + completion; a completion is cut to fit.
        max_completion_length (`int`, *optional*): encoder-decoder models only (ignored).
        beta (`float`, defaults to 0.1): the weight of the odds-ratio term (lambda in the ORPO paper).
        disable_dropout (`bool`, defaults to `True`): no dropout in the model.
        padding_value (`int`, *optional*): the token id that pads ``input_ids`` (default: the tokenizer's pad token).
        generate_during_eval (`bool`, defaults to `False`): TRL's W&B/Comet completion table (refused).
        is_encoder_decoder (`bool`, *optional*): for ``model_init`` (ignored).
        model_init_kwargs (`dict`, *optional*): for ``from_pretrained`` when ``model`` is a string.
        trust_remote_code (`bool`, defaults to `False`): forwarded to ``from_pretrained`` in TRL.
        dataset_num_proc (`int`, *optional*): processes for tokenising.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = ORPO_FIELD_SUPPORT

    learning_rate: float = 1e-6
    max_length: int | None = 1024
    max_completion_length: int | None = None
    beta: float = 0.1
    disable_dropout: bool = True
    padding_value: int | None = None
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    dataset_num_proc: int | None = None
