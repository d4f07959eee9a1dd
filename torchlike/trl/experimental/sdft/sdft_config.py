"""``SDFTConfig``: TRL 1.16's ``trl.experimental.sdft.SDFTConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), resolves the generation batch as
TRL does (``generation_batch_size`` / ``steps_per_generation``) and checks at construction what TRL checks (the
``sampled_token`` mode's ``distillation_alpha``, the teacher prompt template's placeholders) and what TRL's trainer
checks later (``distillation_mode``, ``teacher_model_kind``, ``use_teacher_server``). What the trainer does with each
field is in ``torchlike.trl.experimental.sdft.sdft_fields.SDFT_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....adapters.losses.self_distillation import DISTILLATION_MODES
from ....training_args import TrainingArguments, check_choice
from ...trainer.base_config import TRLConfig
from ...trainer.grpo_config import resolve_generation_batch
from .sdft_fields import SDFT_FIELD_SUPPORT

#: ``teacher_model_kind`` values: the initial student, the current student, or an average of the student's weights.
TEACHER_MODEL_KINDS: tuple[str, ...] = ("base", "live", "ema")


@dataclass
class SelfDistillationConfig(TRLConfig):
    """The fields TRL 1.16's ``SDFTConfig`` and ``SDPOConfig`` share (their model, sampling, vLLM, teacher and
    distillation fields, with SDFT's defaults), and their checks: the generation batch resolved as TRL does, the
    ``sampled_token`` mode's ``distillation_alpha``, and at construction what TRL's trainers check later
    (``distillation_mode``, ``teacher_model_kind``). Subclasses set ``_algorithm`` and add their own fields.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _algorithm = "SDFT"

    model_init_kwargs: dict[str, Any] | None = None
    trust_remote_code: bool = False
    disable_dropout: bool = True
    remove_unused_columns: bool = False
    max_prompt_length: int | None = 512
    num_generations: int = 8
    num_generations_eval: int | None = None
    max_completion_length: int = 256
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool = True
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    use_vllm: bool = False
    use_teacher_server: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_group_port: int = 51216
    vllm_server_timeout: float = 240.0
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    num_iterations: int = 1
    teacher_model_kind: str = "base"
    teacher_update_rate: float = 0.05
    teacher_sync_steps: int = 1
    distillation_alpha: float = 0.5
    distillation_mode: str = "topk_logits"
    distillation_topk: int | None = 100
    distillation_is_clip: float | None = 2.0
    distillation_add_tail: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError("`distillation_mode='sampled_token'` only supports reverse KL, so it requires "
                             f"`distillation_alpha=1.0`, got {self.distillation_alpha}.")
        resolve_generation_batch(self, self._algorithm, min_generations=1)
        self.distillation_mode = check_choice("distillation_mode", self.distillation_mode, DISTILLATION_MODES)
        self.teacher_model_kind = check_choice("teacher_model_kind", self.teacher_model_kind, TEACHER_MODEL_KINDS)
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature!r} must be positive: completions are sampled from, and "
                             "distilled with, softmax(logits / temperature).")


@dataclass
class SDFTConfig(SelfDistillationConfig):
    """Configuration of ``torchlike.trl.experimental.sdft.SDFTTrainer``, with TRL 1.16 ``SDFTConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        distillation_alpha (`float`, defaults to 0.5): the divergence's interpolation (0 forward KL, 1 reverse KL).
        distillation_mode (`str`, defaults to ``"topk_logits"``): ``"sampled_token"``, ``"full_logits"`` or
            ``"topk_logits"``.
        distillation_topk (`int`, defaults to 100): the student's top tokens of ``"topk_logits"``.
        distillation_is_clip (`float`, defaults to 2.0): the importance ratio's clip (``None``: not weighted).
        distillation_add_tail (`bool`, defaults to `False`): a bucket for the mass outside the top k.
        num_loss_tokens_to_skip (`int`, defaults to 0): leading completion tokens left out of the loss.
        teacher_model_kind (`str`, defaults to ``"base"``): ``"base"`` (the initial student), ``"live"`` (the current
            student) or ``"ema"`` (an exponential average of the student).
        teacher_update_rate (`float`, defaults to 0.05), teacher_sync_steps (`int`, defaults to 1): the ``"ema"``
            teacher's update.
        generate_from_teacher (`bool`, defaults to `False`): sample from the teacher prompt.
        teacher_prompt_template (`str`): how the teacher prompt combines ``{prompt}`` and ``{privileged_context}``.
        max_prompt_length (`int`, defaults to 512): prompts keep their last ``max_prompt_length`` tokens.
        num_generations (`int`, defaults to 8), num_generations_eval, max_completion_length (`int`, defaults to 256),
            generation_batch_size, steps_per_generation, num_iterations, shuffle_dataset, temperature, top_p, top_k,
            min_p, repetition_penalty, generation_kwargs, chat_template_kwargs: the sampling, as in ``GRPOConfig``.
    """

    _FIELD_SUPPORT = SDFT_FIELD_SUPPORT

    generate_from_teacher: bool = False
    teacher_prompt_template: str = "{prompt}\n\n{privileged_context}"
    num_loss_tokens_to_skip: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if "{prompt}" not in self.teacher_prompt_template or "{privileged_context}" not in \
                self.teacher_prompt_template:
            raise ValueError("teacher_prompt_template must contain both `{prompt}` and `{privileged_context}` "
                             "placeholders")
