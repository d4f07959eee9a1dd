"""``DistillationConfig``: TRL 1.16's on-policy distillation configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.DistillationConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments``
defaults: ``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``,
``remove_unused_columns=False``) and normalises and checks values as TRL's ``__post_init__`` does. What the trainer
does with each field is in ``torchlike.trl.trainer.distillation_fields.DISTILLATION_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.training_args import TrainingArguments
from torchlike.trl.trainer.base_config import TRLConfig, normalise_pad_to_multiple_of
from torchlike.trl.trainer.distillation_fields import DISTILLATION_FIELD_SUPPORT


@dataclass
class DistillationConfig(TRLConfig):
    """Configuration of ``torchlike.trl.DistillationTrainer``, with TRL 1.16 ``DistillationConfig``'s fields and
    defaults.

    All ``TrainingArguments`` fields apply. The distillation fields (see TRL's documentation, and
    ``DISTILLATION_FIELD_SUPPORT`` for what each does here):

    Args:
        model_init_kwargs (`dict` or `str`, *optional*): keyword arguments for
            ``torchlike.AutoModelForCausalLM.from_pretrained`` when the student is given as a string.
        teacher_model_name_or_path (`str`, *optional*): the teacher, loaded when the trainer gets no
            ``teacher_model``.
        teacher_model_revision (`str`, *optional*): hub revision of a teacher given as a string.
        teacher_model_init_kwargs (`dict` or `str`, *optional*): keyword arguments for
            ``torchlike.AutoModelForCausalLM.from_pretrained`` when the teacher is given as a string.
        disable_dropout (`bool`, defaults to `False`): no LoRA dropout in the student's train steps.
        max_completion_length (`int`, defaults to 512): tokens sampled per on-policy completion at most.
        shuffle_dataset (`bool`, defaults to `True`): shuffle the prompts every epoch (seeded by ``seed``).
        pad_to_multiple_of (`int` or `str`, defaults to ``"auto"``): round padded lengths up to a multiple of it
            (``"auto"`` becomes ``None``, as in TRL off Neuron).
        temperature (`float`, defaults to 1.0): sampling temperature and the softmax temperature of both models in
            the loss.
        top_p (`float`, defaults to 1.0), top_k (`int`, defaults to 0), min_p (`float`, *optional*),
            repetition_penalty (`float`, defaults to 1.0), generation_kwargs (`dict`, *optional*): sampling settings
            of the on-policy completions.
        chat_template_kwargs (`dict`, *optional*): keyword arguments for ``apply_chat_template`` on conversational
            prompts.
        beta (`float`, defaults to 1.0): the generalized JSD's interpolation: 0 is the forward KL
            ``KL(teacher || student)``, 1 the reverse KL ``KL(student || teacher)``, 0.5 the symmetric JSD.
        log_completions (`bool`, defaults to `False`), num_completions_to_print (`int`, *optional*): print (and
            save) the latest generation batch's prompts and completions at each training log.

    Raises:
        ValueError: ``beta`` outside ``[0, 1]`` (TRL's message), or ``max_completion_length`` not a positive integer.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "teacher_model_init_kwargs",
                          "generation_kwargs", "chat_template_kwargs")
    _FIELD_SUPPORT = DISTILLATION_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 1e-6
    remove_unused_columns: bool | None = False

    # --- model and teacher ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    teacher_model_name_or_path: str | None = None
    teacher_model_revision: str | None = None
    teacher_model_init_kwargs: dict[str, Any] | str | None = None
    disable_dropout: bool = False

    # --- data ---
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    pad_to_multiple_of: int | str | None = "auto"

    # --- generation ---
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None

    # --- vLLM (not used: completions come from torchlike's JAX sampler) ---
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1

    # --- loss ---
    beta: float = 1.0
    max_tool_calling_iterations: int | None = None

    # --- logging ---
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pad_to_multiple_of = normalise_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.beta < 0.0 or self.beta > 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        length = self.max_completion_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"max_completion_length={length!r}: expected a positive integer (the most tokens sampled "
                             "per completion; torchlike sizes the completion buffer and KV cache from it).")
