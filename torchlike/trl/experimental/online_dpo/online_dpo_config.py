"""``OnlineDPOConfig``: TRL 1.16's ``trl.experimental.online_dpo.OnlineDPOConfig``, field for field, on
``TrainingArguments``.

It has every field of TRL's class with TRL's name and default (and TRL's changed ``TrainingArguments`` defaults:
``learning_rate=5e-7``, ``remove_unused_columns=False``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16``
on unless ``fp16``). What the trainer does with each field is in
``torchlike.trl.experimental.online_dpo.online_dpo_fields.ONLINE_DPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ....training_args import TrainingArguments
from ...trainer.base_config import TRLConfig
from .online_dpo_fields import ONLINE_DPO_FIELD_SUPPORT


@dataclass
class OnlineDPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.online_dpo.OnlineDPOTrainer``, with TRL 1.16
    ``OnlineDPOConfig``'s fields and defaults. All ``TrainingArguments`` fields apply.

    Args:
        reward_model_path (`str`, *optional*): a reward model, read by the ``torchlike online_dpo`` command (the
            trainer takes ``reward_funcs``, as TRL's).
        max_new_tokens (`int`, defaults to 64): tokens sampled per completion at most.
        max_length (`int`, defaults to 512): prompt + completion kept for the log-probabilities; longer batches lose
            their prompts' leftmost tokens.
        temperature (`float`, defaults to 0.9): sampling temperature (the loss reads the untempered policy, as TRL).
        missing_eos_penalty (`float`, *optional*): subtracted from the reward of a completion without an end token.
        beta (`float` or `list[float]`, defaults to 0.1): the DPO temperature (IPO's tau); a list gives one value per
            epoch, the last for the epochs after it. A one-element list becomes its value.
        loss_type (`str`, defaults to `"sigmoid"`): ``"sigmoid"`` or ``"ipo"``.
        disable_dropout (`bool`, defaults to `True`): no LoRA dropout in the train steps.
        top_p, top_k, min_p, repetition_penalty: sampling filters, as in ``transformers.GenerationConfig``.
        cache_implementation (`str`, *optional*): transformers' KV cache (ignored).
        generation_kwargs (`dict`, *optional*): further sampling settings, over the fields above.
        use_vllm, vllm_* (vLLM generation): as in ``GRPOConfig``: ``vllm_mode="server"`` samples the policy through a
            vLLM server (its LoRA adapter loaded after each step), ``"colocate"`` with torchlike's own engine.
        ds3_gather_for_generation (`bool`, defaults to `True`): DeepSpeed ZeRO-3 (ignored).
        model_init_kwargs (`dict`, *optional*): for ``from_pretrained`` when ``model`` is a string.
        trust_remote_code (`bool`, defaults to `False`): forwarded to ``from_pretrained`` in TRL.
        reward_weights (`list[float]`, *optional*): one weight per reward function (default 1 each).

    Warns:
        UserWarning: ``max_new_tokens >= max_length`` (TRL's message).
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs")
    _FIELD_SUPPORT = ONLINE_DPO_FIELD_SUPPORT

    learning_rate: float = 5e-7
    remove_unused_columns: bool = False
    reward_model_path: str | None = None
    max_new_tokens: int = 64
    max_length: int = 512
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None
    cache_implementation: str | None = None
    missing_eos_penalty: float | None = None
    beta: list[float] = field(default_factory=lambda: [0.1])  # TRL's type (for the parser); one value becomes a float
    loss_type: str = "sigmoid"
    disable_dropout: bool = True
    use_vllm: bool = False
    vllm_model_impl: str = "vllm"
    vllm_structured_outputs_regex: str | None = None
    vllm_gpu_memory_utilization: float | None = 0.55
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_tensor_parallel_size: int = 1
    vllm_enable_sleep_mode: bool = False
    ds3_gather_for_generation: bool = True
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    reward_weights: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if hasattr(self.beta, "__len__") and len(self.beta) == 1:
            self.beta = self.beta[0]
        if self.max_new_tokens >= self.max_length:
            warnings.warn(
                f"The configuration has `max_new_tokens` ({self.max_new_tokens}) >= `max_length` ({self.max_length}). "
                "This will cause prompts to be truncated or completely removed in the forward pass. "
                "To preserve prompts, ensure  e.g. `max_length > max_new_tokens + 512`. ", stacklevel=3)
