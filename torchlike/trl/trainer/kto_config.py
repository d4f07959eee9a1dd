"""``KTOConfig``: TRL 1.16's KTO configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.KTOConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``train_sampling_strategy="sequential"``, ``logging_steps=10``,
``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), normalises values as TRL's ``__post_init__`` does,
and checks at construction what TRL's trainer checks when it starts (the loss type; for the loss types that estimate
the KL term, sequential sampling and a batch of more than one example). What the trainer does with each field is in
``torchlike.trl.trainer.kto_fields.KTO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.adapters.losses.kto import KL_LOSS_TYPES
from torchlike.adapters.losses.kto import KTO_LOSS_TYPES as LOSS_TYPES
from torchlike.training_args import TrainingArguments, check_choice
from torchlike.trl.trainer.base_config import TRLConfig, normalise_pad_to_multiple_of
from torchlike.trl.trainer.kto_fields import KTO_FIELD_SUPPORT

# The choices (``LOSS_TYPES``, and ``KL_LOSS_TYPES``: those that estimate the KL term from mismatched (prompt,
# completion) pairs, TRL's ``calculate_KL``) are the loss module's tables (torchlike.adapters.losses.kto).


@dataclass
class KTOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.KTOTrainer``, with TRL 1.16 ``KTOConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply. The KTO fields (see TRL's documentation, and ``KTO_FIELD_SUPPORT`` for
    what each does here):

    Args:
        beta (`float`, defaults to 0.1): the temperature of the implied reward ``beta * log(pi / pi_ref)``.
        loss_type (`str`, defaults to ``"kto"``): ``"kto"`` or ``"apo_zero_unpaired"``.
        desirable_weight (`float`, defaults to 1.0): weight of the losses of desirable examples.
        undesirable_weight (`float`, defaults to 1.0): weight of the losses of undesirable examples.
        max_length (`int` or `None`, defaults to 1024): prompt + completion keep their first ``max_length`` tokens.
        train_sampling_strategy (`str`, defaults to ``"sequential"``): ``"kto"`` needs ``"sequential"``, because each
            example's KL completion comes from its neighbour in a fixed-order batch.
        disable_dropout (`bool`, defaults to `True`): no dropout in the policy and reference models.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = KTO_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 1e-6
    train_sampling_strategy: str = "sequential"

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = True

    # --- data ---
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    pad_to_multiple_of: int | str | None = "auto"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None

    # --- loss ---
    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pad_to_multiple_of = normalise_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ValueError(f"max_length={self.max_length!r}: expected a positive integer, or None for no "
                             "truncation.")
        self._check_loss()

    @property
    def estimates_kl(self) -> bool:
        """Whether ``loss_type`` estimates the KL term (TRL's ``calculate_KL``)."""
        return self.loss_type in KL_LOSS_TYPES

    def _check_loss(self) -> None:
        """What TRL's KTOTrainer checks when it starts, with its wording, checked here at construction."""
        self.loss_type = check_choice("loss_type", self.loss_type, LOSS_TYPES)
        if not self.estimates_kl:
            return
        if self.train_sampling_strategy != "sequential":
            raise ValueError(f"Loss type `'{self.loss_type}'` estimates the KL divergence term and requires "
                             "`train_sampling_strategy='sequential'` because the KL completion for each example is "
                             "precomputed against its neighbors in a fixed-order batch; any other strategy breaks "
                             "that pairing. Got "
                             f"`train_sampling_strategy='{self.train_sampling_strategy}'`.")
        if self.per_device_train_batch_size <= 1:
            raise ValueError("Actual (not effective) batch size must be > 1. KTO will not work properly because the KL "
                             "term will be equivalent to the implied reward. Set per_device_train_batch_size to 2 or "
                             "more, or use loss_type='apo_zero_unpaired' (no KL term).")
