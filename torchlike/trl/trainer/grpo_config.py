"""``GRPOConfig``: TRL 1.16's GRPO configuration, field for field, on ``TrainingArguments``.

It has every field of ``trl.GRPOConfig`` with TRL's name and default (and TRL's changed ``TrainingArguments``
defaults: ``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` on unless ``fp16``,
``remove_unused_columns=False``), plus ``max_prompt_length``, which TRL removed in 0.28 and torchlike still accepts.
``__post_init__`` resolves and checks the generation batch as TRL does, with errors that list the values that work.
What the trainer does with each field is in ``torchlike.trl.trainer.grpo_fields.GRPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchlike.adapters.losses.grpo import GRPO_LOSS_TYPES as LOSS_TYPES
from torchlike.adapters.losses.grpo import (
    IMPORTANCE_SAMPLING_LEVELS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
)
from torchlike.adapters.model.paged_attention import ATTENTION_KINDS
from torchlike.generation import rollout_engine_names
from torchlike.training_args import TrainingArguments, check_choice, warn_from_config
from torchlike.trl.trainer.base_config import TRLConfig, normalise_pad_to_multiple_of
from torchlike.trl.trainer.grpo_fields import GRPO_FIELD_SUPPORT

# The choices (``LOSS_TYPES``: all of TRL 1.16's loss types, ``IMPORTANCE_SAMPLING_LEVELS``, ``SCALE_REWARDS`` after
# TRL's mapping of True/False, ``MULTI_OBJECTIVE_AGGREGATIONS``) are the loss module's tables
# (torchlike.adapters.losses.grpo), the one list of what the loss computes.
__all__ = ["GRPOConfig", "IMPORTANCE_SAMPLING_LEVELS", "LOSS_TYPES", "MULTI_OBJECTIVE_AGGREGATIONS", "SCALE_REWARDS",
           "check_rollout_fields", "resolve_generation_batch"]


def _group_sizes(batch: int, smallest: int = 2) -> str:
    """The ``num_generations`` values (>= ``smallest``) that split ``batch`` completions into whole groups."""
    sizes = [size for size in range(smallest, batch + 1) if batch % size == 0]
    return ", ".join(map(str, sizes)) if sizes else "none (a batch of one completion cannot hold a group)"


def _smallest_multiplier(current: int, other: int, num_generations: int) -> int:
    """The smallest ``value >= current`` with ``value * other`` divisible by ``num_generations``."""
    step = num_generations // math.gcd(num_generations, other)
    return -(-current // step) * step


@dataclass
class OnlineRLConfig(TRLConfig):
    """The fields ``trl.GRPOConfig`` and ``trl.RLOOConfig`` share (TRL's names and defaults; the model, data,
    generation, vLLM, reference-sync and logging fields), and TRL's generation-batch rules.

    Subclasses set ``_algorithm`` (``"GRPO"``, ``"RLOO"``: named in messages) and add their algorithm's fields.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs",
                          "transformers_continuous_batching_config", "generation_kwargs", "chat_template_kwargs")
    _algorithm = "GRPO"

    # --- TrainingArguments defaults TRL changes ---
    learning_rate: float = 1e-6
    remove_unused_columns: bool | None = False

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = False

    # --- data ---
    num_generations: int | None = 8
    num_generations_eval: int | None = None
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    pad_to_multiple_of: int | str | None = "auto"

    # --- generation ---
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None

    # --- vLLM (not used by torchlike) ---
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

    # --- algorithm ---
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    # --- logging ---
    log_completions: bool = False
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False

    # --- transformers generation engines (not used by torchlike) ---
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | str | None = None

    # --- deprecated in TRL ---
    use_transformers_paged: bool = False

    # --- removed from TRL (0.28), kept by torchlike ---
    max_prompt_length: int | None = None

    # --- torchlike's rollout engine (TRL's vllm_* fields name vLLM's) ---
    rollout_engine: str | None = None
    rollout_max_num_seqs: int = 256
    rollout_page_size: int = 16
    rollout_kv_cache_tokens: int | None = None
    rollout_max_num_batched_tokens: int = 2048
    rollout_attention: str | None = None
    rollout_gpu_memory_utilization: float | None = None
    rollout_async_scheduling: bool | None = None
    rollout_vllm_adapter_dir: str | None = None
    max_staleness: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pad_to_multiple_of = normalise_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.use_transformers_paged:
            warn_from_config("use_transformers_paged is deprecated in TRL (removal in v2.0.0); use "
                             "use_transformers_continuous_batching instead.", FutureWarning)
            self.use_transformers_continuous_batching = True
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature!r} must be positive: completions are sampled from, and "
                             "scored with, softmax(logits / temperature).")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length!r} must be a positive integer.")
        if self.auto_find_batch_size:
            raise ValueError(f"auto_find_batch_size is not supported by {self._algorithm}, because the generation "
                             "batch must contain full prompt groups of num_generations completions, and reducing the "
                             "batch size on out-of-memory breaks this invariant. Set auto_find_batch_size=False and "
                             "lower per_device_train_batch_size instead.")
        self._resolve_generation_batch()
        check_rollout_fields(self)
        if self.max_prompt_length is not None:
            if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
                raise ValueError(f"max_prompt_length={self.max_prompt_length!r}: expected a positive integer or None.")
            warn_from_config(f"max_prompt_length was removed from TRL's {self._algorithm}Config in 0.28 (TRL no "
                             f"longer truncates prompts; filter long ones out of the dataset instead). torchlike still "
                             f"accepts it: prompts keep their last {self.max_prompt_length} tokens.", FutureWarning)

    def _resolve_generation_batch(self) -> None:
        """TRL's generation-batch rules (:func:`resolve_generation_batch`)."""
        resolve_generation_batch(self, self._algorithm)


@dataclass
class GRPOConfig(OnlineRLConfig):
    """Configuration of ``torchlike.trl.GRPOTrainer``, with TRL 1.16 ``GRPOConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply; ``per_device_train_batch_size`` counts completions, not prompts, as in TRL.
    The main GRPO fields (see TRL's documentation for the rest, and ``GRPO_FIELD_SUPPORT`` for what each does here):

    Args:
        num_generations (`int`, defaults to 8): completions per prompt, at least 2.
        num_generations_eval (`int`, *optional*): completions per prompt in evaluation (``None``: ``num_generations``).
        max_completion_length (`int`, defaults to 512): tokens generated per completion at most.
        generation_batch_size (`int`, *optional*): completions generated at once; by default
            ``per_device_train_batch_size x data_parallel_size x steps_per_generation``. Must be divisible by
            ``num_generations`` and by the global batch. Exclusive with ``steps_per_generation``.
        steps_per_generation (`int`, *optional*): micro-steps per generation batch (``None``:
            ``gradient_accumulation_steps``).
        temperature, top_p, top_k, min_p, repetition_penalty, generation_kwargs, chat_template_kwargs: sampling.
        beta (`float`, defaults to 0.0): KL coefficient; 0 needs no reference model.
        num_iterations (`int`, defaults to 1): optimizer passes per generation batch.
        epsilon (`float`, defaults to 0.2), epsilon_high (`float`, *optional*), delta (`float`, *optional*): clipping.
        importance_sampling_level (`str`, defaults to ``"token"``): ``"token"`` or ``"sequence"`` (GSPO).
        reward_weights (`list[float]`, *optional*): one weight per reward function.
        scale_rewards (`str` or `bool`, defaults to ``"group"``): ``"group"``, ``"batch"``, ``"none"``; ``True``
            becomes ``"group"`` and ``False`` ``"none"``.
        loss_type (`str`, defaults to ``"dapo"``): one of ``LOSS_TYPES``.
        mask_truncated_completions (`bool`, defaults to `False`): leave completions without EOS out of the loss.
        log_completions (`bool`, defaults to `False`): log sample completions every ``logging_steps``.
        max_prompt_length (`int`, *optional*): torchlike only; removed from TRL in 0.28 and accepted here with a
            ``FutureWarning``: longer prompts keep their last ``max_prompt_length`` tokens.
        rollout_engine (`str`, *optional*): torchlike only. ``"static"``: one left-padded batch decoded to its
            longest row in one program (the fewest programs to compile); ``"paged"``: the paged, continuously batched
            engine (``torchlike.adapters.rollout``: a fraction of the KV memory, and faster when completion lengths
            are long-tailed, as ``benchmarks/rollout.py`` measures); or the name of an engine registered with
            ``torchlike.register_rollout_engine``. ``None`` (the default): the backend's fastest
            (``torchlike.adapters.rollout.default_engine``: ``"paged"`` on the CPU, ``"static"`` on a GPU or TPU
            until measured there). ``use_vllm=True, vllm_mode="server"`` picks
            ``"vllm_server"`` (a vLLM server's OpenAI API, ``torchlike.adapters.rollout.vllm_server``).
        rollout_max_num_seqs (`int`, defaults to 256): torchlike only; completions decoded together (vLLM's
            ``max_num_seqs``); the others wait for a slot.
        rollout_page_size (`int`, defaults to 16): torchlike only; tokens per KV-cache page (vLLM's ``block_size``).
        rollout_kv_cache_tokens (`int`, *optional*): torchlike only; the KV cache's size in tokens, shared by every
            slot and prompt (what ``vllm_gpu_memory_utilization`` sizes in vLLM). ``None``: room for every slot's
            longest completion.
        rollout_max_num_batched_tokens (`int`, defaults to 2048): torchlike only; with ``rollout_engine="paged"``, the
            most prompt tokens prefilled between two decode calls (vLLM's ``max_num_batched_tokens``): a longer prompt
            is prefilled in chunks while the running completions keep decoding.
        rollout_attention (`str`, *optional*): torchlike only; how the paged engine's decode reads its KV pages:
            ``"gather"`` (a dense view of each row's pages: the CPU's default), ``"pallas_gpu"`` / ``"pallas_tpu"``
            (JAX's paged-attention kernels reading the pages in place, each new key and value written straight into
            its page: the default on a GPU / TPU for Qwen2, Qwen3, Qwen3-MoE, Llama 3, Gemma 2/3/4 and the native
            decoder's families; GPT-OSS's attention sinks keep the gathered view). ``None``: the backend's own.
        rollout_gpu_memory_utilization (`float`, *optional*): torchlike only (vLLM's ``gpu_memory_utilization``);
            with ``rollout_kv_cache_tokens=None``, the paged engine's KV pool takes what this share of the device's
            memory leaves beside the memory in use when a round starts; completions are admitted as pages are free
            and preempted (recomputed later, same tokens) when they run out. A device without memory statistics (the
            CPU) warns and sizes the pool for every slot's longest completion.
        rollout_async_scheduling (`bool`, *optional*): torchlike only (vLLM's ``async_scheduling``); the paged engine
            dispatches each decode call before the host reads the previous one's tokens while its batch is unchanged
            (same tokens and log-probs). ``None``: the backend's default (on for a GPU or TPU, off on the CPU).
        rollout_vllm_adapter_dir (`str`, *optional*): torchlike only; with ``use_vllm=True, vllm_mode="server"``, the
            folder each optimizer step's LoRA adapter is written under for the vLLM server to load (it must read the
            same path: the same host or a shared mount). ``None``: a temporary folder.
        max_staleness (`int`, defaults to 0): torchlike only (TRL's ``AsyncGRPOConfig`` name). ``0``: each generation
            batch is sampled with the current policy before it trains (synchronous, as ``GRPOTrainer``). ``>= 1``:
            the next generation batch is sampled while the current one trains, with the weights from before its
            optimizer steps (their count per generation batch must not exceed ``max_staleness``), and TRL's
            ``vllm_importance_sampling_*`` correction applies to the sampler's log-probs.

    The generation batch is resolved from ``data_parallel_size`` (every JAX device without ``mesh_shape``), so a
    multi-host script must call ``jax.distributed.initialize()`` before building the config.
    """

    _FIELD_SUPPORT = GRPO_FIELD_SUPPORT

    # --- GRPO's algorithm fields ---
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True

    # --- model, logging, tools ---
    cast_lm_head_to_fp32: bool = False
    log_completions_hub_repo: str | None = None
    max_tool_calling_iterations: int | None = None

    # --- vLLM importance sampling (not used by torchlike) ---
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_algorithm()
        if self.log_completions_hub_repo is not None and not self.log_completions:
            raise ValueError("log_completions_hub_repo is set, but log_completions is False. Enable log_completions "
                             "to upload completions to the Hub, or unset log_completions_hub_repo.")
        self._check_vllm_importance_sampling()

    def _check_algorithm(self) -> None:
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        self.scale_rewards = check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        self.loss_type = check_choice("loss_type", self.loss_type, LOSS_TYPES)
        self.importance_sampling_level = check_choice("importance_sampling_level", self.importance_sampling_level,
                                                      IMPORTANCE_SAMPLING_LEVELS)
        self.multi_objective_aggregation = check_choice("multi_objective_aggregation",
                                                        self.multi_objective_aggregation,
                                                        MULTI_OBJECTIVE_AGGREGATIONS)

    def _check_vllm_importance_sampling(self) -> None:
        """TRL's checks of the (ignored) vLLM importance-sampling fields, so a config TRL rejects is rejected here."""
        if self.vllm_importance_sampling_cap is not None:
            warn_from_config("vllm_importance_sampling_cap is deprecated in TRL (removal in v2.0.0); use "
                             "vllm_importance_sampling_clip_max instead.", FutureWarning)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high}).")
        if (self.vllm_importance_sampling_correction and low is None and high is None
                and self.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")):
            raise ValueError("At least one of vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max "
                             "must be set when vllm_importance_sampling_mode is a *_truncate mode.")


def check_rollout_fields(self: TRLConfig) -> None:
    """Checks (and normalises) torchlike's rollout-engine fields of an online config (``rollout_*``, and
    ``max_staleness``), with messages that say what is expected.

    Raises:
        ValueError: an unknown engine or attention kind, a memory share outside (0, 1], a negative ``max_staleness``
            or a size that is not a positive integer.
    """
    if self.rollout_engine is not None:
        self.rollout_engine = check_choice("rollout_engine", self.rollout_engine, rollout_engine_names())
    share = self.rollout_gpu_memory_utilization
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
        raise ValueError(f"rollout_gpu_memory_utilization={share!r}: expected a share of the device's memory in "
                         "(0, 1], or None.")
    if self.rollout_attention is not None:
        self.rollout_attention = check_choice("rollout_attention", self.rollout_attention, ATTENTION_KINDS)
    if self.rollout_async_scheduling not in (None, True, False):
        raise ValueError(f"rollout_async_scheduling={self.rollout_async_scheduling!r}: expected True, False or None "
                         "(the backend's default).")
    if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
        raise ValueError(f"max_staleness={self.max_staleness!r}: expected an integer >= 0 (0: synchronous).")
    for name in ("rollout_max_num_seqs", "rollout_page_size", "rollout_kv_cache_tokens",
                 "rollout_max_num_batched_tokens"):
        value = getattr(self, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: expected a positive integer.")


def resolve_generation_batch(self: TRLConfig, algorithm: str, min_generations: int = 2) -> None:
    """TRL's generation-batch rules for an online config with ``num_generations``, ``generation_batch_size``,
    ``steps_per_generation`` and ``num_generations_eval`` (GRPO, RLOO, SDFT...), with messages that name the values
    that work: ``steps_per_generation`` and ``generation_batch_size`` derived from each other, whole prompt groups in
    every generation and evaluation batch.

    Args:
        self: the config, resolved in place.
        algorithm: its trainer's name, for messages.
        min_generations: the fewest completions per prompt the algorithm takes (2 where advantages are taken within
            a group).

    Raises:
        ValueError: values TRL refuses, saying which values work.
    """
    num_generations = self.num_generations
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or \
            num_generations < min_generations:
        if min_generations > 1:
            raise ValueError(f"{algorithm} requires at least {min_generations} generations per prompt to calculate "
                             f"the advantages. You provided num_generations={num_generations!r}, which is less "
                             f"than the minimum required. Set num_generations to {min_generations} or more.")
        raise ValueError(f"num_generations={num_generations!r} must be a positive integer (completions sampled "
                         "per prompt).")
    shards = self.data_parallel_size
    global_batch = self.per_device_train_batch_size * shards
    batch_text = (f"per_device_train_batch_size={self.per_device_train_batch_size} x {shards} data-parallel "
                  f"shard(s)")
    if self.generation_batch_size is not None and self.steps_per_generation is not None:
        raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                         "same time; set one of them (the other is derived from it).")
    if self.generation_batch_size is not None:
        if self.generation_batch_size < 1 or self.generation_batch_size % global_batch:
            lower = max(self.generation_batch_size // global_batch, 1) * global_batch
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                             f"global batch size ({global_batch} = {batch_text}): it is split into micro-batches "
                             f"of that size. Valid values near it: {lower}, {lower + global_batch}.")
        self.steps_per_generation = self.generation_batch_size // global_batch
        explicit = True
    else:
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if not isinstance(self.steps_per_generation, int) or self.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation={self.steps_per_generation!r} must be a positive integer.")
        self.generation_batch_size = global_batch * self.steps_per_generation
        explicit = False

    if self.do_eval and self.eval_strategy != "no":
        eval_generations = self.num_generations_eval or num_generations
        eval_batch = self.per_device_eval_batch_size * shards
        if eval_batch % eval_generations:
            fix = _smallest_multiplier(self.per_device_eval_batch_size, shards, eval_generations)
            raise ValueError(f"The global eval batch size ({eval_batch} = per_device_eval_batch_size="
                             f"{self.per_device_eval_batch_size} x {shards} data-parallel shard(s)) must be "
                             f"divisible by the number of generations used for evaluation ({eval_generations}). "
                             "Valid num_generations_eval for this batch: "
                             f"{_group_sizes(eval_batch, min_generations)}; or set per_device_eval_batch_size={fix}.")

    if self.generation_batch_size % num_generations:
        if explicit:
            step = math.lcm(global_batch, num_generations)
            fix = f"set generation_batch_size={-(-self.generation_batch_size // step) * step}"
            made_of = ""
        else:
            per_device = _smallest_multiplier(self.per_device_train_batch_size, shards * self.steps_per_generation,
                                              num_generations)
            steps = _smallest_multiplier(self.steps_per_generation, global_batch, num_generations)
            fix = f"set per_device_train_batch_size={per_device} or steps_per_generation={steps}"
            made_of = f" = {batch_text} x steps_per_generation={self.steps_per_generation}"
        raise ValueError(f"generation_batch_size ({self.generation_batch_size}{made_of}) must be divisible by "
                         f"num_generations ({num_generations}), so that every prompt's completions are generated "
                         "together. Valid num_generations for this batch: "
                         f"{_group_sizes(self.generation_batch_size, min_generations)}; or keep "
                         f"num_generations={num_generations} and {fix}.")
