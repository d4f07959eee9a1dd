"""``BCOConfig``: TRL 1.0.0's ``trl.experimental.bco.BCOConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL 1.0.0's ``BCOConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments``
defaults: ``learning_rate=5e-7``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``).
What the trainer does with each field is in ``torchlike.trl.experimental.bco.bco_fields.BCO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .bco_fields import BCO_FIELD_SUPPORT


@dataclass
class BCOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.bco.BCOTrainer``, with TRL 1.0.0 ``BCOConfig``'s fields and
    defaults.

    All ``TrainingArguments`` fields apply. The BCO fields (see TRL's documentation, and ``BCO_FIELD_SUPPORT`` for
    what each does here):

    Args:
        max_length (`int` or `None`, defaults to 1024): prompt + completion (with the BOS and EOS tokens TRL adds)
            fit it by cutting the completion; `None` means 512, with TRL's warning.
        beta (`float`, defaults to 0.1): the temperature of the implied reward ``beta * log(pi / pi_ref)``.
        disable_dropout (`bool`, defaults to `True`): no dropout in the policy and reference models.
        precompute_ref_log_probs (`bool`, defaults to `False`): whether the starting weights score the data once
            before training and are then dropped (without ``ref_model`` in full fine-tuning).
        model_init_kwargs (`dict`, *optional*): keyword arguments of ``from_pretrained`` when ``model`` is a path.
        dataset_num_proc (`int`, *optional*): processes for ``datasets.Dataset.map`` while preparing the data.
        prompt_sample_size (`int`, defaults to 1024): prompts of each label embedded to fit the UDM density-ratio
            classifier.
        min_density_ratio (`float`, defaults to 0.5): the UDM weights are clamped to at least this value.
        max_density_ratio (`float`, defaults to 10.0): the UDM weights are clamped to at most this value.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = BCO_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 5e-7

    max_length: int | None = 1024
    max_completion_length: int | None = None
    beta: float = 0.1
    disable_dropout: bool = True
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    precompute_ref_log_probs: bool = False
    model_init_kwargs: dict[str, Any] | str | None = None
    dataset_num_proc: int | None = None
    prompt_sample_size: int = 1024
    min_density_ratio: float = 0.5
    max_density_ratio: float = 10.0

    @property
    def sync_ref_model(self) -> bool:
        """Always `False`: TRL 1.0.0's BCO has no reference syncing (the preference trainers' shared code reads it)."""
        return False

    @property
    def router_aux_loss_coef(self) -> None:
        """Always `None`: BCO has no such field; a mixture-of-experts model's router loss follows its own config, as
        TRL 1.0.0's BCOTrainer reads ``output_router_logits`` and ``router_aux_loss_coef`` there."""
        return None
