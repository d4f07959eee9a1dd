"""``IWOPDConfig``: TRL 1.16's ``trl.experimental.iw_opd.IWOPDConfig``, field for field, on ``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), and
``__post_init__`` checks and derives what TRL's does (``max_prompt_length`` from ``max_length``,
``generation_batch_size``, the objective's requirements), in TRL's words. What the trainer does with each field is in
``torchlike.trl.experimental.iw_opd.iw_opd_fields.IW_OPD_FIELD_SUPPORT``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .iw_opd_fields import IW_OPD_FIELD_SUPPORT


@dataclass
class IWOPDConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.iw_opd.IWOPDTrainer``, with TRL 1.16 ``IWOPDConfig``'s fields and
    defaults. All ``TrainingArguments`` fields apply.

    Args:
        max_length (`int`, defaults to 1024): prompt + completion tokens.
        temperature (`float`, defaults to 1.0): sampling temperature and the loss's softmax temperature.
        lmbda (`float`, defaults to 1.0): the probability that a micro-batch is the student's own completions.
        beta (`float`, defaults to 1.0): the generalized JSD's interpolation (0 forward KL, 1 reverse KL).
        distillation_objective (`str`, defaults to ``"iw_opd"``): ``"iw_opd"`` or ``"jsd"``.
        iw_opd_gamma (`float`, defaults to 0.5), iw_opd_epsilon (`float`, defaults to 1e-8): IW-OPD's weights.
        reverse_kl_top_1_mode (`str`, defaults to ``"sampled"``): the reverse term's top-1 token (``"argmax"``: the
            student's most likely one).
        max_completion_length (`int`, defaults to 512), max_prompt_length (`int`, *optional*): the token budgets.
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: the teacher to load.
        loss_top_k (`int`, defaults to 1), loss_add_tail (`bool`, defaults to `True`): the divergence's support.
        num_generations (`int`, defaults to 1), generation_batch_size (`int`, *optional*): completions per prompt and
            unique prompts per optimizer step.
        top_p (`float`, defaults to 0.95), top_k (`int`, defaults to 0): the sampling.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "teacher_model_init_kwargs")
    _FIELD_SUPPORT = IW_OPD_FIELD_SUPPORT

    learning_rate: float = 1e-6
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    max_length: int | None = 1024
    temperature: float = 1.0
    lmbda: float = 1.0
    beta: float = 1.0
    distillation_objective: str = "iw_opd"
    iw_opd_gamma: float = 0.5
    iw_opd_epsilon: float = 1e-8
    reverse_kl_top_1_mode: str = "sampled"
    max_completion_length: int = 512
    max_prompt_length: int | None = None
    disable_dropout: bool = True
    teacher_model_name_or_path: str | None = None
    teacher_model_revision: str | None = None
    teacher_model_init_kwargs: dict[str, Any] | str | None = None
    use_teacher_server: bool = False
    teacher_model_server_url: str | None = None
    loss_top_k: int = 1
    loss_add_tail: bool = True
    num_generations: int = 1
    generation_batch_size: int | None = None
    top_p: float = 0.95
    top_k: int = 0
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8001
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    vllm_max_model_length: int | None = None
    vllm_model_impl: str = "vllm"
    vllm_structured_outputs_regex: str | None = None
    vllm_sync_frequency: int = 1
    vllm_enable_sleep_mode: bool = False
    log_completions: bool = False
    log_completions_steps: int = 100
    num_completions_to_print: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low, high in (("lmbda", 0.0, 1.0), ("beta", 0.0, 1.0)):
            value = getattr(self, name)
            if value < low or value > high:
                raise ValueError(f"{name} must be in [0.0, 1.0], got {value}.")
        if self.distillation_objective not in {"jsd", "iw_opd"}:
            raise ValueError("distillation_objective must be one of: 'jsd', 'iw_opd'")
        if self.iw_opd_gamma < 0.0:
            raise ValueError(f"iw_opd_gamma must be non-negative, got {self.iw_opd_gamma}.")
        if self.iw_opd_epsilon <= 0.0:
            raise ValueError(f"iw_opd_epsilon must be positive, got {self.iw_opd_epsilon}.")
        if self.reverse_kl_top_1_mode not in {"sampled", "argmax"}:
            raise ValueError("reverse_kl_top_1_mode must be one of: 'sampled', 'argmax'")
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(f"max_completion_length ({self.max_completion_length}) must be smaller than max_length "
                             f"({self.max_length}) to leave room for the prompt.")
        if self.max_prompt_length is None and self.max_length is not None:
            self.max_prompt_length = self.max_length - self.max_completion_length
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {self.num_generations}.")
        sequences = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            self.generation_batch_size = sequences // self.num_generations
        if self.generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be at least 1, got {self.generation_batch_size}.")
        if self.generation_batch_size * self.num_generations != sequences:
            raise ValueError("generation_batch_size * num_generations must equal per_device_train_batch_size * "
                             f"gradient_accumulation_steps. Got {self.generation_batch_size} * {self.num_generations} "
                             f"!= {self.per_device_train_batch_size} * {self.gradient_accumulation_steps}.")
        if self.distillation_objective == "iw_opd" and self.lmbda < 1.0:
            raise ValueError("distillation_objective='iw_opd' requires lmbda=1.0 because IW-OPD is an on-policy "
                             "objective.")
        if self.distillation_objective == "iw_opd" and self.reverse_kl_top_1_mode != "sampled":
            raise ValueError("distillation_objective='iw_opd' requires reverse_kl_top_1_mode='sampled' because IW-OPD "
                             "is defined on sampled completion tokens.")
        if self.reverse_kl_top_1_mode != "sampled" and (self.beta == 0 or self.loss_top_k != 1):
            warnings.warn(f"reverse_kl_top_1_mode='{self.reverse_kl_top_1_mode}' has no effect when beta={self.beta} "
                          f"and loss_top_k={self.loss_top_k}. It only applies when beta > 0 and loss_top_k == 1.",
                          UserWarning, stacklevel=2)
        if self.num_generations > 1 and self.lmbda < 1.0:
            warnings.warn(f"num_generations={self.num_generations} with lmbda={self.lmbda} means off-policy batches "
                          f"include {self.num_generations} copies of each sample. Consider lmbda=1.0 when "
                          "num_generations > 1.", UserWarning, stacklevel=2)
