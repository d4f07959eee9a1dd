"""``RewardConfig``: TRL 1.16's reward-model configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.RewardConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments``
defaults: ``learning_rate=1e-4``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``)
and normalises values as TRL's ``__post_init__`` does. What the trainer does with each field is in
``torchlike.trl.trainer.reward_fields.REWARD_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.training_args import TrainingArguments, warn_from_config
from torchlike.trl.trainer.base_config import TRLConfig, normalise_pad_to_multiple_of
from torchlike.trl.trainer.reward_fields import REWARD_FIELD_SUPPORT


@dataclass
class RewardConfig(TRLConfig):
    """Configuration of ``torchlike.trl.RewardTrainer``, with TRL 1.16 ``RewardConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply. The reward-modelling fields (see TRL's documentation, and
    ``REWARD_FIELD_SUPPORT`` for what each does here):

    Args:
        model_init_kwargs (`dict`, *optional*): keyword arguments for
            ``torchlike.AutoModelForSequenceClassification.from_pretrained`` when the trainer's ``model`` is a string.
        chat_template_path (`str`, *optional*): a ``.jinja`` file, or a tokenizer whose chat template is copied.
        disable_dropout (`bool`, defaults to `True`): no dropout in the model.
        dataset_num_proc (`int`, *optional*): processes for tokenising a ``datasets.Dataset``.
        eos_token (`str`, *optional*): the end-of-sequence token appended to standard texts (default: the
            tokenizer's).
        max_length (`int` or `None`, defaults to 1024): pairs with a longer chosen or rejected sequence are dropped.
        pad_to_multiple_of (`int`, *optional*, defaults to ``"auto"``): padded lengths are rounded up to a multiple of
            it (``"auto"`` is ``None`` off Neuron, as in TRL).
        center_rewards_coefficient (`float`, *optional*): weight of the term ``mean((r_chosen + r_rejected)^2)`` that
            pulls rewards towards zero (0.01 is TRL's recommendation).
        pad_token (`str`, *optional*): deprecated in TRL; sets the tokenizer's pad token.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = REWARD_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 1e-4

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    chat_template_path: str | None = None
    disable_dropout: bool = True

    # --- data ---
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    max_length: int | None = 1024
    pad_to_multiple_of: int | str | None = "auto"

    # --- training ---
    center_rewards_coefficient: float | None = None
    activation_offloading: bool = False

    # --- deprecated ---
    pad_token: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pad_to_multiple_of = normalise_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ValueError(f"max_length={self.max_length!r}: expected a positive integer, or None to keep every "
                             "pair.")
        if self.pad_token is not None:
            warn_from_config("`pad_token` is deprecated and will be removed in v2.0.0. Set `tokenizer.pad_token` "
                             "directly and pass it as `processing_class` to the trainer instead.", FutureWarning)
