"""``AsyncGRPOConfig``: TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOConfig``, field for field, plus torchlike's
rollout-engine fields.

It has every field of TRL's class with TRL's name and default (and its changed ``TrainingArguments`` defaults:
``learning_rate=1e-6``, ``logging_steps=1``, ``lr_scheduler_type="constant"``, ``ignore_data_skip=True``,
``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``), and the ``rollout_*`` fields of torchlike's engine, which
samples in place of TRL's vLLM server (``rollout_engine="paged"`` by default: its stream is what samples ahead). What
the trainer does with each field is in ``torchlike.trl.experimental.async_grpo.async_grpo_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...trainer.base_config import TRLConfig
from ...trainer.grpo_config import check_rollout_fields, resolve_generation_batch
from .async_grpo_fields import ASYNC_GRPO_FIELD_SUPPORT

__all__ = ["AsyncGRPOConfig"]


@dataclass
class AsyncGRPOConfig(TRLConfig):
    """Configuration of ``torchlike.trl.experimental.async_grpo.AsyncGRPOTrainer``, with TRL 1.16
    ``AsyncGRPOConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply. An optimizer step trains ``per_device_train_batch_size x`` data-parallel
    size ``x gradient_accumulation_steps`` completions (TRL's samples per step), sampled as one generation batch of
    whole prompt groups. The AsyncGRPO fields (``ASYNC_GRPO_FIELD_SUPPORT`` says what each does here):

    Args:
        model_init_kwargs (`dict` or `str`, *optional*): keyword arguments of ``from_pretrained`` for a model given
            by path.
        dtype (`str`, defaults to ``"float32"``): the dtype a model given by path is loaded in (a ``dtype`` in
            ``model_init_kwargs`` wins).
        router_aux_loss_coef (`float`, *optional*): weight of a mixture-of-experts model's router loss (``None``: the
            model config's).
        num_generations (`int`, defaults to 8): completions per prompt.
        max_completion_length (`int`, defaults to 2048): tokens generated per completion at most.
        temperature, top_p, top_k, min_p, repetition_penalty, chat_template_kwargs: sampling.
        max_tool_calling_iterations (`int`, *optional*): rounds of tool calls per completion with tools.
        epsilon (`float`, defaults to 0.2), epsilon_high (`float`, *optional*): the ratio's clipping range,
            ``[1 - epsilon, 1 + epsilon_high]``.
        max_staleness (`int`, defaults to 4): a completion drawn more than this many weight versions before the step
            that would train it is dropped (left out of the loss, counted as ``sample/dropped_stale_total``).
        max_inflight_tasks (`int`, defaults to -1): completions sampled ahead of the one training, in whole generation
            batches (``-1``: ``max_staleness`` generation batches).
        queue_maxsize (`int`, defaults to 1024): the most completions held sampled ahead (``<= 0``: no bound).
        weight_sync_steps (`int`, defaults to 1): optimizer steps between two hand-overs of the weights to the
            sampler; each is a new weight version.
        log_completions (`bool`, defaults to `False`), num_completions_to_print (`int`, *optional*): print sample
            completions.
        rollout_engine (`str`, defaults to ``"paged"``): torchlike only; the engine that samples (as
            ``GRPOConfig.rollout_engine``; the paged engine's stream samples ahead with weight versions).
        rollout_max_num_seqs, rollout_page_size, rollout_kv_cache_tokens, rollout_max_num_batched_tokens,
            rollout_attention, rollout_gpu_memory_utilization, rollout_async_scheduling: torchlike only; the engine's
            settings, as in ``GRPOConfig``.

    TRL's vLLM server fields (``vllm_server_base_url``, ``vllm_server_timeout``, ``request_timeout``,
    ``weight_sync_timeout``, ``heartbeat_stale_after_s``) are accepted and not used: no server is involved.
    """

    _FIELD_SUPPORT = ASYNC_GRPO_FIELD_SUPPORT
    _VALID_DICT_FIELDS = (*TRLConfig._VALID_DICT_FIELDS, "model_init_kwargs", "chat_template_kwargs")
    _algorithm = "AsyncGRPO"

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None

    # --- TrainingArguments defaults AsyncGRPO changes ---
    learning_rate: float = 1e-6
    logging_steps: float = 1
    lr_scheduler_type: str = "constant"
    ignore_data_skip: bool = True

    # --- generation ---
    num_generations: int = 8
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict | str | None = None
    max_tool_calling_iterations: int | None = None
    fork_threshold_tokens: int = 1024

    # --- TRL's vLLM server (not used by torchlike) ---
    vllm_server_base_url: str = "http://localhost:8000"
    vllm_server_timeout: float = 240.0
    request_timeout: int = 600
    weight_sync_timeout: int = 1800

    # --- training ---
    epsilon: float = 0.2
    epsilon_high: float | None = None
    token_budget: int | None = None

    # --- the async rollout pipeline ---
    max_inflight_tasks: int = -1
    max_staleness: int = 4
    queue_maxsize: int = 1024
    weight_sync_steps: int = 1
    heartbeat_stale_after_s: float = 300.0

    # --- logging ---
    log_completions: bool = False
    num_completions_to_print: int | None = None

    # --- torchlike's rollout engine ---
    rollout_engine: str | None = "paged"
    rollout_max_num_seqs: int = 256
    rollout_page_size: int = 16
    rollout_kv_cache_tokens: int | None = None
    rollout_max_num_batched_tokens: int = 2048
    rollout_attention: str | None = None
    rollout_gpu_memory_utilization: float | None = None
    rollout_async_scheduling: bool | None = None

    # --- what the policy-gradient loop reads and TRL's AsyncGRPOConfig has no field for: AsyncGRPO's fixed values
    # (class attributes, not fields, so the config takes exactly TRL's arguments) ---
    num_iterations = 1  # each completion is trained on once
    beta = 0.0  # no reference model
    sync_ref_model = False
    reward_weights = None  # the reward functions are summed with weight 1
    mask_truncated_completions = False
    shuffle_dataset = False  # TRL's rollout worker cycles through the prompts in dataset order
    generation_kwargs = None
    cache_implementation = None
    num_generations_eval = None
    generation_batch_size = None  # __post_init__: one optimizer step's completions
    steps_per_generation = None  # __post_init__: gradient_accumulation_steps

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature!r} must be positive: completions are sampled from, and "
                             "scored with, softmax(logits / temperature).")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length!r} must be a positive integer.")
        resolve_generation_batch(self, self._algorithm, min_generations=1)
        check_rollout_fields(self)
        if self.rollout_engine == "vllm_server":
            raise ValueError("rollout_engine='vllm_server': AsyncGRPOTrainer samples with torchlike's own engines "
                             "(TRL's vLLM server is what they replace); use rollout_engine='paged' (the default).")
        if not isinstance(self.weight_sync_steps, int) or self.weight_sync_steps < 1:
            raise ValueError(f"weight_sync_steps={self.weight_sync_steps!r}: expected a positive integer (optimizer "
                             "steps between two hand-overs of the weights to the sampler).")
        if not isinstance(self.max_inflight_tasks, int):
            raise ValueError(f"max_inflight_tasks={self.max_inflight_tasks!r}: expected an integer (negative: "
                             "max_staleness generation batches).")
        if self.token_budget is not None and self.token_budget > 0:
            raise ValueError(f"token_budget={self.token_budget}: torchlike's micro-batches hold a fixed "
                             "per_device_train_batch_size completions each (TRL's token_budget <= 0), not a number of "
                             "tokens; set token_budget=0 (or leave it None) and size the micro-batches with "
                             "per_device_train_batch_size.")
