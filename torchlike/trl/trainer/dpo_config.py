"""``DPOConfig``: TRL 1.16's DPO configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.DPOConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), normalises
values as TRL's ``__post_init__`` does, and checks at construction what TRL's trainer checks when it starts (loss
types, the f-divergence, ``exo_pair``'s label smoothing). What the trainer does with each field is in
``torchlike.trl.trainer.dpo_fields.DPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlike.adapters.losses.dpo import DPO_LOSS_TYPES as LOSS_TYPES
from torchlike.adapters.losses.dpo import F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCE_TYPES
from torchlike.training_args import TrainingArguments, check_choice, reject_removed_arguments, warn_from_config
from torchlike.trl.trainer.base_config import TRLConfig, normalise_pad_to_multiple_of
from torchlike.trl.trainer.dpo_fields import DPO_FIELD_SUPPORT

# The choices (``LOSS_TYPES``, ``F_DIVERGENCE_TYPES``, ``F_DIVERGENCE_LOSS_TYPES``: the loss types that accept an
# f-divergence other than reverse KL, TRL's list) are the loss module's tables (torchlike.adapters.losses.dpo).

#: ``truncation_mode`` values (``"keep_end"`` is deprecated in TRL and warns).
TRUNCATION_MODES: tuple[str, ...] = ("keep_start", "keep_end")

_REMOVED_DPO_ARGUMENTS: dict[str, str] = {
    "max_prompt_length": "TRL 0.29 removed it; max_length now bounds prompt + completion together",
    "max_completion_length": "TRL 0.29 removed it; max_length now bounds prompt + completion together",
}


@dataclass
class DPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.DPOTrainer``, with TRL 1.16 ``DPOConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply. The DPO fields (see TRL's documentation, and ``DPO_FIELD_SUPPORT`` for
    what each does here):

    Args:
        beta (`float`, defaults to 0.1): the DPO temperature (``tau`` for IPO).
        loss_type (`list[str]`, defaults to ``["sigmoid"]``): one or more of ``LOSS_TYPES`` (a string is wrapped).
        loss_weights (`list[float]`, *optional*): one weight per loss type.
        label_smoothing (`float`, defaults to 0.0): ``eps`` of the robust, exo_pair, aot and aot_unpaired losses
            (TRL 1.16's sigmoid loss does not read it).
        f_divergence_type (`str`, defaults to ``"reverse_kl"``), f_alpha_divergence_coef (`float`): f-DPO.
        ld_alpha (`float`, *optional*): LD-DPO weight of the tokens past the shorter response, in ``[0, 1]``.
        discopop_tau (`float`, defaults to 0.05): DiscoPOP temperature.
        max_length (`int` or `None`, defaults to 1024): prompt + completion are truncated to it.
        truncation_mode (`str`, defaults to ``"keep_start"``): or the deprecated ``"keep_end"``.
        disable_dropout (`bool`, defaults to `True`): no dropout in the policy and reference models.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = DPO_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 1e-6

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = True

    # --- data ---
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    padding_free: bool = False
    pad_to_multiple_of: int | str | None = "auto"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None

    # --- loss ---
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    label_smoothing: float = 0.0
    beta: float = 0.1
    use_weighting: bool = False
    discopop_tau: float = 0.05
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    # --- deprecated ---
    pad_token: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError("`loss_weights` must have the same length as `loss_type` when combining multiple losses. "
                             f"Got {len(self.loss_weights)} weights for {len(self.loss_type)} loss types.")
        if self.pad_token is not None:
            warn_from_config("pad_token is deprecated in TRL (removal in v2.0.0): set tokenizer.pad_token and pass "
                             "the tokenizer as processing_class instead.", FutureWarning)
        self.truncation_mode = check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        if self.truncation_mode == "keep_end":
            warn_from_config("truncation_mode='keep_end' is deprecated in TRL (removal in v2.0.0); use "
                             "truncation_mode='keep_start' (the default).", FutureWarning)
        super().__post_init__()
        self.pad_to_multiple_of = normalise_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ValueError(f"max_length={self.max_length!r}: expected a positive integer, or None for no "
                             "truncation.")
        self._check_loss()

    def _check_loss(self) -> None:
        """What TRL's DPOTrainer checks when it starts, checked here at construction."""
        self.loss_type = [check_choice("loss_type", name, LOSS_TYPES) for name in self.loss_type]
        self.f_divergence_type = check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= set(F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} is only supported for the loss types "
                             f"{sorted(F_DIVERGENCE_LOSS_TYPES)}. You provided {self.loss_type}. Use the default "
                             "f_divergence_type='reverse_kl' with these losses.")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError("Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper "
                             "recommends a value of 1e-3.")
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            warn_from_config(f"label_smoothing should lie in [0.0, 0.5) for the 'robust' loss; got "
                             f"{self.label_smoothing}.", UserWarning)
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha={self.ld_alpha!r} must be in [0.0, 1.0] (1.0 weighs every token fully, 0.0 "
                             "drops the tokens past the shorter response), or None.")


reject_removed_arguments(DPOConfig, _REMOVED_DPO_ARGUMENTS)
