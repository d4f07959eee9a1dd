"""``GOLDConfig``: TRL 1.16's ``trl.experimental.gold.GOLDConfig`` (``SFTConfig`` plus GOLD's fields), field for field.

It has every field of TRL's class with TRL's name and default (and TRL's ``learning_rate=1e-7``), and
``__post_init__`` checks and derives what TRL's does (``generation_batch_size``, the ULD settings), in TRL's words.
What the trainer does with each field is in ``torchlike.trl.experimental.gold.gold_fields.GOLD_FIELD_SUPPORT``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ...trainer.sft_config import SFTConfig
from .gold_fields import GOLD_FIELD_SUPPORT


@dataclass
class GOLDConfig(SFTConfig):
    """Configuration of ``torchlike.trl.experimental.gold.GOLDTrainer``, with TRL 1.16 ``GOLDConfig``'s fields and
    defaults. All ``SFTConfig`` fields apply (see ``GOLD_FIELD_SUPPORT`` for what each does in GOLD). GOLD's own:

    Args:
        temperature (`float`, defaults to 0.9): sampling temperature of the student's completions and the softmax
            temperature of both models in the generalized JSD.
        top_p (`float`, defaults to 0.95), top_k (`int`, defaults to 0): the sampling's nucleus and top-k (0: off).
        lmbda (`float`, defaults to 0.5): the probability that a micro-batch is the student's own completions.
        beta (`float`, defaults to 0.5): the generalized JSD's interpolation (0 forward KL, 1 reverse KL).
        max_completion_length (`int`, defaults to 128): tokens sampled per completion at most.
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: the teacher to load.
        teacher_tokenizer_name_or_path (`str`, *optional*): the teacher's tokenizer for ULD (default: the teacher's
            path).
        disable_dropout (`bool`, defaults to `True`): no LoRA dropout in the student's train steps.
        seq_kd (`bool`, defaults to `False`): kept for TRL's signature; TRL's GOLDTrainer never reads it.
        num_generations (`int`, defaults to 1), generation_batch_size (`int`, *optional*): completions per prompt and
            unique prompts per optimizer step.
        use_uld_loss (`bool`, defaults to `False`): Universal Logit Distillation across tokenizers instead of the
            generalized JSD.
        use_extended_uld (`bool`, defaults to `True`), uld_token_merge_strategy (`str`, defaults to ``"observed"``):
            byte-offset alignment of the two tokenizations and how split tokens' probabilities merge.
        uld_use_hybrid_loss (`bool`, defaults to `False`), uld_hybrid_matched_weight, uld_hybrid_unmatched_weight
            (`float`, *optional*): JSD on the tokens both vocabularies share, sorted-probability L1 on the rest.
        uld_crossentropy_weight (`float`, defaults to 0.0), uld_distillation_weight (`float`, defaults to 1.0),
        uld_student_temperature, uld_teacher_temperature (`float`, defaults to 1.0), uld_skip_student_eos,
            uld_skip_teacher_eos (`bool`, defaults to `True`): the ULD loss's terms.

    Raises:
        ValueError: TRL's checks (``lmbda``/``beta`` outside ``[0, 1]``, ``max_completion_length >= max_length``,
            a generation batch that does not partition the step, bad ULD weights or temperatures).
    """

    _VALID_DICT_FIELDS = (*SFTConfig._VALID_DICT_FIELDS, "teacher_model_init_kwargs")
    _FIELD_SUPPORT = GOLD_FIELD_SUPPORT

    learning_rate: float = 1e-7
    temperature: float = 0.9
    top_p: float = 0.95
    top_k: int = 0
    lmbda: float = 0.5
    beta: float = 0.5
    max_completion_length: int = 128
    teacher_model_name_or_path: str | None = None
    teacher_model_revision: str | None = None
    teacher_model_init_kwargs: dict[str, Any] | str | None = None
    teacher_tokenizer_name_or_path: str | None = None
    disable_dropout: bool = True
    seq_kd: bool = False
    num_generations: int = 1
    generation_batch_size: int | None = None
    use_uld_loss: bool = False
    uld_token_merge_strategy: str = "observed"
    use_extended_uld: bool = True
    uld_use_hybrid_loss: bool = False
    uld_hybrid_matched_weight: float | None = None
    uld_hybrid_unmatched_weight: float | None = None
    uld_crossentropy_weight: float = 0.0
    uld_distillation_weight: float = 1.0
    uld_student_temperature: float = 1.0
    uld_teacher_temperature: float = 1.0
    uld_skip_student_eos: bool = True
    uld_skip_teacher_eos: bool = True
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8001
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.9
    vllm_tensor_parallel_size: int = 1
    vllm_max_model_length: int | None = None
    vllm_model_impl: str = "vllm"
    vllm_structured_outputs_regex: str | None = None
    vllm_sync_frequency: int = 1
    vllm_enable_sleep_mode: bool = False
    log_completions: bool = False
    log_completions_steps: int = 100
    num_completions_to_print: int | None = None
    wandb_log_unique_prompts: bool = True
    callbacks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lmbda < 0.0 or self.lmbda > 1.0:
            raise ValueError("lmbda must be in the range [0.0, 1.0].")
        if self.beta < 0.0 or self.beta > 1.0:
            raise ValueError("beta must be in the range [0.0, 1.0].")
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(f"max_completion_length ({self.max_completion_length}) must be smaller than max_length "
                             f"({self.max_length}) to leave room for the prompt. Consider increasing max_length or "
                             "reducing max_completion_length.")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        sequences = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = sequences // self.num_generations
        if self.generation_batch_size < 1:
            raise ValueError("generation_batch_size must be at least 1. Got "
                             f"generation_batch_size={self.generation_batch_size}.")
        if self.generation_batch_size * self.num_generations != sequences:
            raise ValueError("generation_batch_size and num_generations must exactly partition the local "
                             "optimizer-step batch. Expected generation_batch_size * num_generations == "
                             "per_device_train_batch_size * gradient_accumulation_steps, got "
                             f"{self.generation_batch_size} * {self.num_generations} != "
                             f"{self.per_device_train_batch_size} * {self.gradient_accumulation_steps}.")
        if self.num_generations > 1 and self.lmbda < 1.0:
            warnings.warn(f"num_generations={self.num_generations} with lmbda={self.lmbda} means off-policy batches "
                          f"include {self.num_generations} copies of each sample; consider lmbda=1.0 when "
                          "num_generations > 1.", UserWarning, stacklevel=2)
        if self.use_uld_loss:
            self._check_uld()

    def _check_uld(self) -> None:
        """TRL's checks of the ULD settings."""
        for name in ("uld_crossentropy_weight", "uld_distillation_weight"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must be non-negative.")
        for name in ("uld_student_temperature", "uld_teacher_temperature"):
            if getattr(self, name) <= 0.0:
                raise ValueError(f"{name} must be positive.")
        if self.uld_token_merge_strategy not in ("observed", "bayesian"):
            raise ValueError('uld_token_merge_strategy must be either "observed" or "bayesian", got '
                             f'"{self.uld_token_merge_strategy}".')
        if not self.uld_use_hybrid_loss:
            return
        if (self.uld_hybrid_matched_weight is None) != (self.uld_hybrid_unmatched_weight is None):
            raise ValueError("uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must both be None (for "
                             "adaptive weighting) or both be set to numeric values. Got uld_hybrid_matched_weight="
                             f"{self.uld_hybrid_matched_weight} and uld_hybrid_unmatched_weight="
                             f"{self.uld_hybrid_unmatched_weight}.")
        if self.uld_hybrid_matched_weight is not None:
            for name in ("uld_hybrid_matched_weight", "uld_hybrid_unmatched_weight"):
                if getattr(self, name) < 0.0:
                    raise ValueError(f"{name} must be non-negative.")
