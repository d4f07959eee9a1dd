"""``A2POConfig``: TRL 1.16's ``trl.experimental.a2po.A2POConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``, ``remove_unused_columns=False``).
What the trainer does with each field is in ``torchlike.trl.experimental.a2po.a2po_fields.A2PO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .a2po_fields import A2PO_FIELD_SUPPORT


@dataclass
class A2POConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.a2po.A2POTrainer``, with TRL 1.16 ``A2POConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        model_init_kwargs (`dict`, *optional*): for ``from_pretrained`` when ``model`` is a string.
        trust_remote_code (`bool`, defaults to `False`): forwarded to ``from_pretrained`` in TRL.
        remove_unused_columns (`bool`, defaults to `False`): keep only the ``prompt`` column (the reward functions
            then get no other column).
        max_prompt_length (`int` or `None`, defaults to 512): prompts are truncated to it (on the tokenizer's
            ``truncation_side``).
        max_completion_length (`int`, defaults to 256): the most tokens sampled per completion.
        temperature (`float`, defaults to 1.0), top_p (`float`, defaults to 1.0), top_k (`int`, *optional*): the
            sampling of both stages.
        num_value_samples (`int`, defaults to 8): reference completions per prompt in stage 1.
        beta1 (`float`, defaults to 0.5): the KL temperature of the optimal-value estimate.
        filter_all_incorrect (`bool`, defaults to `True`): drop the training prompts whose reference completions all
            scored 0.
        beta2 (`float`, defaults to 1e-3): the KL temperature of the stage-2 regression.
        reward_weights (`list[float]`, *optional*): one weight per reward function (default 1.0 each).
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = A2PO_FIELD_SUPPORT

    model_init_kwargs: dict | None = None
    trust_remote_code: bool = False
    remove_unused_columns: bool = False
    max_prompt_length: int | None = 512
    max_completion_length: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    num_value_samples: int = 8
    beta1: float = 0.5
    filter_all_incorrect: bool = True
    beta2: float = 1e-3
    reward_weights: list[float] | None = None
