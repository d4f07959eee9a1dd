"""``PolicyGradientTrainer``: the training loop of TRL's reward-driven online trainers (GRPO, RLOO), and the contract of
the algorithm each plugs into it.

One step of any of them, in this file: a generation batch (``per_device_train_batch_size x data-parallel size x
steps_per_generation`` completions, ``num_generations`` per prompt) is sampled by the policy's rollout worker
(:class:`~.rollout_worker.RolloutWorker`: the rollout engine, or the user's ``rollout_func``; tools and environments
continue it), scored by the :class:`~.reward_scorer.RewardScorer`, handed to the **algorithm**
(:class:`PolicyGradientAlgorithm`: its advantages, the columns its step loss reads, the loss itself), shuffled, then
split into ``steps_per_generation`` micro-batches that the jitted step consumes ``gradient_accumulation_steps`` at a
time, ``num_iterations`` times over (:meth:`.online_trainer.OnlineTrainer._batches`).

A trainer on this loop (``GRPOTrainer``, ``RLOOTrainer``) is its TRL signature, its config and its algorithm class;
it overrides none of the loop's methods (``tests/test_architecture.py`` holds that). A new algorithm of this kind is a
:class:`PolicyGradientAlgorithm` subclass and a trainer class in its ``<name>_trainer.py``, its config and field table,
and one registry row.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import jax
import numpy as np

from ...adapters.distributed import mesh as mesh_lib
from ...adapters.lora import runtime as lora_runtime
from ...adapters.losses import grpo as grpo_losses
from ...adapters.rollout import sampling
from ...adapters.training import reference_policy, train_step
from ...training import batches, step_logs
from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    EvalRowsLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RewardFunc,
    RowsLike,
    Tokenizer,
    TRLArgs,
)
from ..data import prompt_vision
from ..data.prompt_data import prepare_prompts
from ..online import reward_models
from ..online.entropy_control import AdaptiveEntropyControl
from ..online.environments import EMPTY_PROMPT, EnvironmentPool
from ..online.reward_scorer import reward_name
from ..online.rollouts import GenerationSchedule
from .base_trainer import is_vision_dataset, vision_processor
from .online_trainer import OnlineTrainer

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from ...adapters.families.base import Family
    from ...modeling import CausalLM

__all__ = ["LogProbs", "PolicyGradientAlgorithm", "PolicyGradientTrainer"]

#: Step-loss metrics that are not evaluation metrics: TRL logs ``entropy_coef`` in training only, and the adaptive
#: entropy controller's sums are read by the trainer.
_NOT_EVAL_METRICS = ("entropy_coef", *grpo_losses.ADAPTIVE_ENTROPY_SUMS)


@dataclasses.dataclass(frozen=True)
class LogProbs:
    """The per-token log-probabilities an algorithm may ask of a generation batch's completions (``[N, C]`` float32,
    computed one micro-batch at a time in the training shape, at the sampling temperature).

    Args:
        policy: the current policy's, ``policy(batch)`` for a batch with ``input_ids``, ``attention_mask`` and
            ``completion_mask``.
        reference: the reference model's (TRL's ``ref_model``; the adapter-off base with a new LoRA adapter), ``None``
            when there is none (``beta == 0``).
    """

    policy: Callable[[dict[str, np.ndarray]], np.ndarray]
    reference: Callable[[dict[str, np.ndarray]], np.ndarray] | None


class PolicyGradientAlgorithm:
    """What one reward-driven online algorithm decides on :class:`PolicyGradientTrainer`'s loop: its checks, the
    advantages of a scored generation batch, the columns its step loss reads, and that loss. A subclass overrides what
    its algorithm changes; the defaults are what every such algorithm does (no checks, no entropy controller).

    Args:
        args: the trainer's config (its algorithm fields are read as TRL reads them).
        log_metric: ``log_metric(name, value)``: a value for the next training log (a mean over the generation
            batches since the last one).
    """

    #: Whether :meth:`step_columns` reads the sampler's log-probs (``batch["sampling_logps"]``) of every training
    #: batch; otherwise only a batch sampled ahead carries them.
    reads_sampler_log_probs = False

    def __init__(self, args: TRLArgs, log_metric: Callable[[str, float], None]):
        self.args = args
        self.log_metric = log_metric

    def check(self) -> None:
        """TRL's checks of the algorithm's settings against each other (warnings through ``logging``, errors)."""

    def entropy_control(self) -> AdaptiveEntropyControl | None:
        """The adaptive entropy controller the step's ``entropy_coef`` column comes from, or ``None``."""
        return None

    def generations_ahead(self, samples_in_loop: bool) -> int:
        """How many generation batches the loop keeps sampling ahead of the one training (0: each is sampled when it
        is due). GRPO's rule: one with ``max_staleness >= 1``, which needs the built-in sampler and no more optimizer
        steps per generation batch than ``max_staleness`` (each batch is sampled one batch ahead).

        Args:
            samples_in_loop: tools, environments or a ``rollout_func`` sample in the training loop.

        Raises:
            ValueError: ``max_staleness >= 1`` with ``samples_in_loop``, or with more steps per generation batch.
        """
        args = self.args
        if args.max_staleness == 0:
            return 0
        if samples_in_loop:
            raise ValueError(f"max_staleness={args.max_staleness} samples the next generation batch in the background "
                             "with torchlike's engine; tools, environments and rollout_func sample in the training "
                             "loop. Use max_staleness=0 with them.")
        steps = args.steps_per_generation * args.num_iterations / args.gradient_accumulation_steps
        if steps > args.max_staleness:
            raise ValueError(f"A generation batch trains {steps:g} optimizer steps (steps_per_generation="
                             f"{args.steps_per_generation} x num_iterations={args.num_iterations} / "
                             f"gradient_accumulation_steps={args.gradient_accumulation_steps}), so the batch sampled "
                             f"ahead is {steps:g} steps stale, more than max_staleness={args.max_staleness}; raise "
                             "max_staleness or lower steps_per_generation / num_iterations.")
        return 1

    def sampler_weights_version(self, global_step: int, starting: bool) -> int | None:
        """The version of the weights the sampler takes when the loop starts (``starting``) and after each optimizer
        step, or ``None`` to keep sampling ahead with the weights it has. Each token sampled ahead is tagged with the
        version that drew it, and staleness is counted in versions. GRPO: every step's weights, versioned by the
        step."""
        return global_step

    def stale_completions(self, versions: np.ndarray, current: int) -> np.ndarray | None:
        """Looks at a batch sampled ahead before it trains, given ``versions`` (``[N, C]`` the weights version that
        drew each token, ``-1`` past a completion's end) and the sampler's ``current`` version; returns the completions
        to leave out of the loss (``[N]`` bool) or ``None``. GRPO: TRL's ``sample/staleness_mean`` and
        ``sample/staleness_max`` per token, and a token more than ``max_staleness`` versions stale is refused (the
        loop samples one batch ahead, so that is a bug)."""
        drawn = versions[versions >= 0]
        staleness = current - drawn
        if not staleness.size:
            return None
        if staleness.max() > self.args.max_staleness:
            raise RuntimeError(f"a generation batch due at step {current} holds a token drawn with the weights of "
                               f"step {int(drawn.min())}, {int(staleness.max())} steps stale, more than max_staleness="
                               f"{self.args.max_staleness}; this is a bug in how batches are sampled ahead (raise "
                               "max_staleness to go on).")
        self.log_metric("sample/staleness_mean", float(staleness.mean()))
        self.log_metric("sample/staleness_max", float(staleness.max()))
        return None

    def reward_logs(self, reward_metrics: dict, reward_names: list[str]) -> dict[str, float]:
        """The reward metrics a training log shows for a generation batch (:meth:`advantages`' ``reward_metrics``):
        TRL's GRPO names ``reward``, ``reward_std``, ``frac_reward_zero_std`` (and ``kl`` for RLOO's penalty), and
        ``rewards/<function>/mean`` and ``/std``."""
        logs = {key: reward_metrics[key] for key in ("reward", "reward_std", "frac_reward_zero_std", "kl")
                if key in reward_metrics}
        for index, name in enumerate(reward_names):
            logs[f"rewards/{name}/mean"] = reward_metrics["rewards_per_func/mean"][index]
            logs[f"rewards/{name}/std"] = reward_metrics["rewards_per_func/std"][index]
        return {key: float(value) for key, value in logs.items()}

    def window_value(self, key: str, values: list[float]) -> float:
        """A generation metric's value in a training log from its values since the last one: their NaN-skipping mean
        (TRL's GRPO)."""
        return float(np.nanmean(values))

    def save_extras(self, folder: Path) -> None:
        """Writes the algorithm's own state into a checkpoint being written (called on every process, before the
        checkpoint counts as complete; nothing by default)."""

    def resumed(self, folder: Path) -> None:
        """Restores the algorithm's own state from the checkpoint training resumes from (nothing by default)."""

    def advantages(self, rewards: np.ndarray, batch: dict[str, np.ndarray], log_probs: LogProbs,
                   reward_weights: list[float] | None, num_generations: int) -> tuple[np.ndarray, dict[str, float]]:
        """``(advantages [N], reward metrics)`` of a scored generation batch: ``reward``, ``reward_std``,
        ``frac_reward_zero_std``, ``rewards_per_func/mean`` and ``/std`` (one entry per reward function), and ``kl``
        when the rewards carry a KL penalty. May add columns to ``batch`` (its step loss's inputs).

        Args:
            rewards: ``[N, reward functions]``, NaN where a function returned ``None``.
            batch: the generation batch's columns (``input_ids``, ``attention_mask``, ``completion_mask``, and
                ``tool_mask`` / ``sampling_logps`` when present).
            log_probs: the policy's and the reference's log-probabilities of the completions.
            reward_weights: one weight per reward function (``None``: all 1).
            num_generations: completions per prompt (consecutive rows).
        """
        raise NotImplementedError

    def step_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs) -> None:
        """Adds to a training generation batch what the step loss reads besides the tokens and advantages."""

    def eval_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs,
                     entropy_coefficient: float | None) -> None:
        """Adds to an evaluation batch (neither split nor accumulated) what the step loss reads; ``entropy_coefficient``
        is what the next optimizer step would apply with adaptive entropy control, else ``None``."""

    def step_loss(self, family: Family, temperature: float, decoder_dtype: DTypeLike | None,
                  router_aux_loss_coef: float) -> Callable:
        """The jitted step's loss, ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)``.

        Args:
            family: the model's family (its forward pass and head).
            temperature: the sampling temperature the log-probabilities are taken at.
            decoder_dtype: the decoder's compute dtype when the loss casts it itself (``cast_lm_head_to_fp32``),
                else ``None``.
            router_aux_loss_coef: the mixture-of-experts router loss weight (0: none).
        """
        raise NotImplementedError


class PolicyGradientTrainer(OnlineTrainer):
    """The loop of ``GRPOTrainer`` and ``RLOOTrainer`` (TRL 1.16's constructor; see ``GRPOTrainer`` for its
    arguments): sampling, reward scoring, the algorithm's advantages and columns, the generation schedule, adaptive
    entropy control, evaluation and logging. A trainer on it sets :attr:`algorithm_class`, its config class and names.
    """

    algorithm_class: type[PolicyGradientAlgorithm]
    """The algorithm the loop trains with (an instance is :attr:`algorithm`)."""

    _allow_prefetch = False  # a rollout must see the weights of the steps before it

    def __init__(self, model: ModelLike, reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: TRLArgs | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 reward_processing_classes: Tokenizer | list[Tokenizer] | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: QuantizationConfig | None = None,
                 peft_config: PeftConfigLike | None = None, tools: list | None = None,
                 rollout_func: Callable | None = None,
                 environment_factory: Callable | dict[str, Callable] | None = None):
        if rollout_func is not None and not callable(rollout_func):
            raise TypeError(f"rollout_func must be callable as rollout_func(prompts, trainer); got "
                            f"{type(rollout_func).__name__}.")
        self.rollout_func = rollout_func
        args = self._trl_args(model, args)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config,
                                                  load_processor=True)
        self._setup_router_loss(model, args)
        self.reward_funcs = self._check_reward_functions(reward_funcs, reward_processing_classes, args, model)
        # TRL's attribute: one entry per reward function, a reward model's tokenizer (loaded when not given).
        given = reward_processing_classes if isinstance(reward_processing_classes, list) else \
            [reward_processing_classes] * len(self.reward_funcs)
        self.reward_processing_classes = [function.tokenizer if isinstance(function, reward_models.RewardModel)
                                          else entry for function, entry in zip(self.reward_funcs, given, strict=True)]
        weights = args.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(self.reward_funcs)} "
                             "reward functions; give one weight per function.")
        environments = None if environment_factory is None else EnvironmentPool.create(
            environment_factory, tools or [], processing_class, self._trainer_name)
        environment_rewards = environments.reward_functions if environments is not None else []
        self.reward_funcs += environment_rewards  # TRL's: extra reward sources of weight 1, without a tokenizer
        self.reward_processing_classes += [None] * len(environment_rewards)
        self.reward_weights = None if weights is None else [*weights, *[1.0] * len(environment_rewards)]
        if not self.reward_funcs:
            raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                             "environment defines a `get_reward` method.")
        if train_dataset is None:
            train_dataset = self._environment_dataset(environments, args)
        self.algorithm = self.algorithm_class(args, self._log_metric)
        self.algorithm.check()
        self._check_reference_use(args)
        self._setup_sampling(args, model, processing_class)
        self._setup_tools(tools, processing_class, args, environments)
        self._processor = self._vision_processor(train_dataset, eval_dataset, model, processing_class)
        self._check_sampling_ahead(args)
        train_rows = self._prepare(train_dataset, "train_dataset")
        eval_rows = batches.map_datasets(eval_dataset, lambda dataset: self._prepare(dataset, "eval_dataset"))
        self._check_tool_prompts([train_rows, *batches.each_dataset(eval_rows)])
        lengths = [len(row["prompt_ids"]) for rows in [train_rows or [], *batches.each_dataset(eval_rows)]
                   for row in rows]
        self.prompt_length = self._padded(sampling.bucket_length(max(lengths, default=1)))
        self._check_token_ids(max([self.pad_token_id, *self.eos_token_ids, *(max(r["prompt_ids"], default=0)
                                                                           for r in (train_rows or []))]),
                              processing_class, {"model": model})
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._show_eval_dataset(eval_dataset)  # TRL does not prepare an online trainer's data
        if isinstance(train_dataset, datasets.Dataset):  # TRL keeps the user's Dataset: its columns, plus prompt_ids
            self.train_dataset = datasets.Dataset.from_list(train_rows)
        # The reference (beta != 0), TRL's rule: the adapter-off base for a new LoRA adapter; a frozen copy of the
        # initial policy otherwise, a pretrained adapter included (TRL's "ref" adapter, a copy of "default").
        new_adapter = self._is_lora() and reference_policy.lora_is_new(self._module)
        self.reference = self._init_reference(adapter_off=new_adapter, copy=True) if args.beta != 0.0 else None
        self._generation_count = 0
        self._entropy_control = self.algorithm.entropy_control()
        self._set_trl_attributes(args, processing_class)

    # ------------------------------------------------------------------ set-up
    #: The config fields TRL's trainer copies to attributes of its own (users' callbacks read ``trainer.beta``...).
    _trl_fields: tuple[str, ...] = (
        "max_completion_length", "num_generations", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "use_transformers_continuous_batching", "pad_to_multiple_of", "use_vllm", "vllm_mode",
        "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "mask_truncated_completions", "shuffle_dataset",
        "num_iterations", "beta", "log_completions", "log_multimodal", "log_unique_prompts", "num_completions_to_print")

    def _set_trl_attributes(self, args: TRLArgs, processing_class: ProcessingClass) -> None:
        """The attributes TRL's trainer sets from its config (:attr:`_trl_fields`, the clipping bounds, the
        evaluation group size), ``reward_func_names`` and the ``generation_config`` TRL samples with."""
        import transformers

        for name in self._trl_fields:
            setattr(self, name, getattr(args, name))
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        if hasattr(args, "max_tool_calling_iterations"):  # GRPO's
            self.max_tool_calling_iterations = sys.maxsize if args.max_tool_calling_iterations is None else \
                args.max_tool_calling_iterations
        self.reward_func_names = [reward_name(function) for function in self.reward_funcs]
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.generation_kwargs = {"max_new_tokens": args.max_completion_length, "do_sample": True,
                                  "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                                  "eos_token_id": self.eos_token_ids, "temperature": args.temperature,
                                  "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                                  "repetition_penalty": args.repetition_penalty,
                                  "cache_implementation": args.cache_implementation,
                                  **(args.generation_kwargs or {})}
        self.generation_config = transformers.GenerationConfig(**self.generation_kwargs, disable_compile=True)
    @staticmethod
    def _check_reward_functions(reward_funcs: list[RewardFunc],
                                reward_processing_classes: list[ProcessingClass | None], args: TRLArgs,
                                model: CausalLM) -> list[Callable]:
        """The reward functions, reward models wrapped as ones (``reward_models.reward_functions``), checked (none
        is allowed here: an environment's ``get_reward`` may be the reward source)."""
        functions = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        functions = reward_models.reward_functions(functions, reward_processing_classes, args, model)
        for function in functions:
            if not callable(function):
                raise ValueError(f"reward function {function!r} is not callable: pass a Python function "
                                 "f(prompts, completions, **kwargs), or a reward model (its path or a loaded "
                                 "sequence classifier).")
            parameters = inspect.signature(function).parameters.values()
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
                raise TypeError(f"reward function {reward_name(function)!r} must accept **kwargs: it is called with "
                                "keyword arguments prompts, completions, completion_ids, trainer_state and every "
                                "dataset column, e.g. def reward(completions, **kwargs).")
        return functions

    @staticmethod
    def _environment_dataset(environments: EnvironmentPool | None, args: TRLArgs) -> datasets.Dataset:
        """TRL's stand-in ``train_dataset`` when a single environment owns the data: one generation batch of empty
        prompts (its ``reset`` gives each rollout's prompt), cycled for ``max_steps`` steps; TRL's errors otherwise."""
        if environments is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        if environments.routed:
            raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with "
                             "an `environment` column to route each example to its environment. Provide a dataset, or "
                             "pass a single environment factory.")
        if args.max_steps <= 0:
            raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                             "prompt from `reset()`), `max_steps` must be set to a positive value to define the "
                             "training length. Set it via `GRPOConfig(max_steps=...)`.")
        return datasets.Dataset.from_dict({"prompt": [EMPTY_PROMPT] * (args.generation_batch_size //
                                                                        args.num_generations)})

    def _check_sampling_ahead(self, args: TRLArgs) -> None:
        """Sets how many generation batches are sampled ahead of the one training, by the algorithm's rule
        (:meth:`PolicyGradientAlgorithm.generations_ahead`; tools, environments and ``rollout_func`` sample in the
        training loop)."""
        in_loop = bool(self.tools) or self.rollout_func is not None or self.environment_pool is not None
        self._ahead = self.algorithm.generations_ahead(in_loop)

    def _check_reference_use(self, args: TRLArgs) -> None:
        """TRL's refusal of ``sync_ref_model`` without a reference (``beta=0``)."""
        if args.sync_ref_model and args.beta == 0.0:
            raise ValueError("You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is "
                             f"not used during training. Consequently, {self._trainer_name} does not create a "
                             "`ref_model` instance, and there is nothing to synchronize. Please set "
                             "`sync_ref_model=False`, or set `beta` to a non-zero value.")

    def _compute_dtype(self):
        """The train step's dtype; ``None`` with ``cast_lm_head_to_fp32``, where the GRPO loss casts the decoder to
        bf16 itself and keeps the head in float32 (:attr:`_decoder_dtype`)."""
        return None if self._lm_head_in_float32 else self._decoder_dtype

    @property
    def _lm_head_in_float32(self) -> bool:
        return bool(getattr(self.args, "cast_lm_head_to_fp32", False))  # GRPO's field; RLOO has none

    @property
    def _decoder_dtype(self):
        return super()._compute_dtype()

    def _prepare(self, dataset: RowsLike, name: str) -> list[dict] | None:
        """Rows with ``prompt_ids`` next to the original columns (:func:`.prompt_data.prepare_prompts`); with tools the
        chat template also renders their schemas, as TRL does. With environments a row may have no ``prompt`` (its
        environment's ``reset`` gives it); the prompts are tokenised again, after ``reset``, for each rollout."""
        template_kwargs = dict(self.args.chat_template_kwargs or {})
        if self.tools:  # with TRL's training copy of the chat template where the tokenizer's is not prefix-preserving
            template_kwargs = {**self.tool_calling.chat_template_kwargs, "tools": self.tools}
        default_prompt = EMPTY_PROMPT if self.environment_pool is not None else None
        if self._processor is not None and dataset is not None and is_vision_dataset(dataset):
            rows = prompt_vision.prepare_vision_prompts(dataset, self._processor, name, template_kwargs)
            self._image_slots = max(self._image_slots, *(len(prompt_vision.row_images(row)) for row in rows))
            return rows
        return prepare_prompts(dataset, self.tokenizer, name, getattr(self.args, "max_prompt_length", None),
                               template_kwargs, default_prompt)

    def _vision_processor(self, train_dataset: RowsLike | None, eval_dataset: EvalRowsLike | None, model: CausalLM,
                          processing_class: ProcessingClass | None) -> Any:
        """The processor that prepares image prompts (TRL's ``images``/``image`` column), or ``None`` for text data.

        Raises:
            ValueError: image prompts for a model without a vision tower (TRL's words, and torchlike's reason), with
                tools or environments, or without the model's processor as ``processing_class``.
        """
        if not any(is_vision_dataset(dataset) for dataset in [train_dataset, *batches.each_dataset(eval_dataset)]):
            return None
        processor = vision_processor(model, processing_class)
        if self.tools or self.environment_pool is not None:
            raise ValueError("image prompts with tools or an environment_factory are not supported by torchlike yet "
                             "(the tool results would need their images merged into the completions); train without "
                             "tools, or on text prompts.")
        return processor

    # ------------------------------------------------------------------ batches
    _generation_batch_fields = ("per_device_train_batch_size x data-parallel size x steps_per_generation / "
                                "num_generations")

    def _generation_schedule(self) -> GenerationSchedule:
        """A micro-batch of ``per_device_train_batch_size x`` data-parallel size completions; ``steps_per_generation``
        of them per generation batch, trained on ``num_iterations`` times; ``num_generations`` per prompt."""
        args = self.args
        return GenerationSchedule(self._global_batch_size(), args.steps_per_generation, args.num_iterations,
                                  args.num_generations)

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        return self._rollout(prompt_rows, epoch, generation_index)

    def _step_loss(self) -> tuple[Callable, None]:
        """The algorithm's step loss with this trainer's model, temperature and dtypes."""
        decoder_dtype = self._decoder_dtype if self._lm_head_in_float32 else None
        return self.algorithm.step_loss(self.model.family, self.sampling.temperature, decoder_dtype,
                                        self._router_loss_weight()), None

    # ------------------------------------------------------------------ adaptive entropy control
    def _run_step(self, step_fn: Callable, batch: dict, step: int) -> dict:
        """With adaptive entropy control, the step gets the coefficient it applies as the ``entropy_coef`` column (an
        input of the compiled step, so it changes without a new compilation); then its entropy sums are taken out of
        its outputs, the controller is updated with the entropy of all its micro-batches (TRL's window-global token
        mean) and TRL's ``entropy_coef`` metric records the coefficient after the update."""
        if self._entropy_control is None:
            return super()._run_step(step_fn, batch, step)
        weights = batch["step_weight"]
        coefficient = np.full(weights.shape, self._entropy_control.applied_coefficient, np.float32)
        outputs = super()._run_step(step_fn, {**batch, "entropy_coef": mesh_lib.place_array(coefficient,
                                                                                             weights.sharding)}, step)
        means = mesh_lib.to_host([outputs.pop(key) for key in grpo_losses.ADAPTIVE_ENTROPY_SUMS])
        # The step averages its metrics over the micro-batches; the controller takes their totals.
        entropy_sum, tokens = (float(mean) * self.args.gradient_accumulation_steps for mean in means)
        self._entropy_control.update(entropy_sum, tokens)
        self._pending_metrics.setdefault("entropy_coef", []).append(self._entropy_control.coefficient)
        return outputs

    def _save_checkpoint_extras(self, folder: Path) -> None:
        """TRL's ``entropy_ctrl_state.json`` with adaptive entropy control, and the algorithm's own state
        (:meth:`PolicyGradientAlgorithm.save_extras`), written with the checkpoint (before it counts as complete)."""
        super()._save_checkpoint_extras(folder)
        if self._entropy_control is not None and self.state.is_world_process_zero:
            self._entropy_control.save(folder)
        self.algorithm.save_extras(folder)

    def _resume(self, checkpoint: str | bool) -> int:
        """Restores the checkpoint, the adaptive entropy controller from its ``entropy_ctrl_state.json`` and the
        algorithm's own state (:meth:`PolicyGradientAlgorithm.resumed`)."""
        step = super()._resume(checkpoint)
        if self._entropy_control is not None:
            self._entropy_control.load(self._resumed_from)
        self.algorithm.resumed(self._resumed_from)
        return step

    # ------------------------------------------------------------------ rollouts
    def _rollout(self, prompt_rows: list[dict], epoch: int, generation_index: int, num_generations: int | None = None,
                 train: bool = True, metric_key_prefix: str = "eval") -> dict[str, np.ndarray]:
        """Samples ``num_generations`` completions per prompt, scores them and returns the training rows
        (shuffled, TRL's ``shuffle_sequence_dict``), keeping the metrics for the next log."""
        args = self.args
        num_generations = num_generations or args.num_generations
        rows = self._generation_rows(prompt_rows, num_generations)
        seed = self._generation_seed(epoch, generation_index, train)
        record = self._generate(rows, seed)
        rewards = self.reward_scorer.score(record)
        completion_mask, ended, tool_mask = record.completion_mask, record.ended, record.tool_mask
        if args.mask_truncated_completions:
            completion_mask = completion_mask * ended[:, None].astype(np.int32)
        batch = dataclasses.replace(record, completion_mask=completion_mask).columns()
        if tool_mask is not None:
            batch["tool_mask"] = tool_mask
        if record.sampling_logps is not None and train and (self._samples_ahead
                                                             or self.algorithm.reads_sampler_log_probs):
            batch["sampling_logps"] = record.sampling_logps  # read by the algorithm's columns, then dropped
        stale = None
        if record.sampling_versions is not None and train:
            stale = self._record_staleness(record.sampling_versions)
        log_probs = self._algorithm_log_probs
        advantages, reward_metrics = self.algorithm.advantages(rewards, batch, log_probs, self.reward_weights,
                                                               num_generations)
        batch["advantages"] = np.asarray(advantages, np.float32)
        prefix = "" if train else f"{metric_key_prefix}_"
        self._record_completion_metrics(record, prefix, train)
        metrics = self.algorithm.reward_logs(reward_metrics, [reward_name(function) for function in self.reward_funcs])
        for key, value in metrics.items():
            self._pending_metrics.setdefault(prefix + key, []).append(float(value))
        if args.log_completions and train and self.state.is_world_process_zero:
            self._print_completions(record.rows, record.completion_ids, rewards, np.asarray(advantages))
        if not train:
            control = self._entropy_control
            self.algorithm.eval_columns(batch, log_probs, None if control is None else control.applied_coefficient)
            return batch
        if stale is not None:  # left out of the loss, scored with their group as they were
            batch["completion_mask"] = batch["completion_mask"] * ~stale[:, None]
        self.algorithm.step_columns(batch, log_probs)
        batch.pop("sampling_logps", None)
        self._last_rollout = self._shuffled(batch, seed)  # kept for inspection and tests
        return self._last_rollout

    def _record_staleness(self, versions: np.ndarray) -> np.ndarray | None:
        """A batch sampled ahead, before it trains: the versions of the weights that drew its tokens (``versions
        [N, C]``, ``-1`` past an end) against the sampler's current version, as the algorithm reads them
        (:meth:`PolicyGradientAlgorithm.stale_completions`: TRL's ``sample/staleness_*`` metrics; GRPO refuses a token
        staler than ``max_staleness``). Returns the completions to leave out of the loss (``[N]`` bool) or ``None``."""
        return self.algorithm.stale_completions(versions, self.rollout_worker.weights_version)

    @property
    def _generations_ahead(self) -> int:
        """Generation batches sampled ahead of the one training (:meth:`PolicyGradientAlgorithm.generations_ahead`)."""
        return self._ahead

    def _sampler_weights_version(self, starting: bool) -> int | None:
        """The algorithm's version of the weights the sampler takes now
        (:meth:`PolicyGradientAlgorithm.sampler_weights_version`)."""
        return self.algorithm.sampler_weights_version(self.state.global_step, starting)

    def _window_value(self, key: str, values: list[float]) -> float:
        """The algorithm's reduction of a generation metric over a logging window
        (:meth:`PolicyGradientAlgorithm.window_value`)."""
        return self.algorithm.window_value(key, values)

    @property
    def _algorithm_log_probs(self) -> LogProbs:
        """The policy's and the reference's log-probabilities, as the algorithm asks for them."""
        reference = self.reference
        return LogProbs(
            policy=lambda batch: self._log_probs(batch, lora_runtime.EVAL, self._module),
            reference=None if reference is None else lambda batch: self._log_probs(batch, reference.lora,
                                                                                    reference.module))

    @staticmethod
    def _shuffled(batch: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
        """The rows of a generation batch in a seeded random order (TRL's ``shuffle_sequence_dict``), so the
        micro-batches it is split into mix prompts."""
        order = np.random.default_rng(seed).permutation(len(batch["input_ids"]))
        return jax.tree.map(lambda value: value[order], batch)  # image columns may be dicts of arrays

    def _log_probs(self, batch: dict[str, np.ndarray], lora: str, module) -> np.ndarray:
        """Per-token log-probs of the completions, one micro-batch at a time (the training shape)."""
        key = (lora, id(module))
        passes = self.__dict__.setdefault("_log_prob_passes", {})
        if key not in passes:
            passes[key] = grpo_losses.make_log_prob_pass(self.model.family, self.sampling.temperature, lora,
                                                        self._decoder_dtype,
                                                        lm_head_in_float32=self._lm_head_in_float32)
        size = self._global_batch_size()
        # An image batch's images (and token types) go with its tokens: the old and reference log-probs see them.
        inputs = {name: batch[name] for name in ("input_ids", "attention_mask", "completion_mask", "images",
                                                 "token_type_ids") if name in batch}
        parts = []
        with mesh_lib.entered(self.mesh):
            for start in range(0, len(batch["input_ids"]), size):
                chunk = jax.tree.map(lambda value, start=start: value[start:start + size], inputs)
                rows = len(chunk["input_ids"])  # a short last eval batch may not split over the data axes
                parts.append(passes[key](module, mesh_lib.place_batch(chunk, mesh_lib.rows_sharding(self.mesh, rows),
                                                                      rows)))
        return np.concatenate([np.asarray(part) for part in mesh_lib.to_host(parts)]).astype(np.float32)

    def _print_completions(self, rows, completion_ids, rewards, advantages) -> None:
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        shown = len(rows) if self.args.num_completions_to_print is None else self.args.num_completions_to_print
        print(f"step {self.state.global_step}: prompt | completion | rewards | advantage")
        for row, text, reward, advantage in list(zip(rows, texts, rewards, advantages, strict=True))[:shown]:
            print(f"  {row['prompt']!r} | {text!r} | {np.round(reward, 4).tolist()} | {advantage:.4f}")

    # ------------------------------------------------------------------ logging and evaluation
    def _evaluation_loop(self, examples: list[dict], metric_key_prefix: str) -> dict[str, float]:
        """TRL's evaluation (its ``prediction_step``): ``num_generations_eval`` completions per eval prompt, in batches
        of ``per_device_eval_batch_size x`` data-parallel size completions, each scored and turned into advantages as
        in training, then the step loss on it with the policy as its own old policy (ratio 1, the reference's KL
        with ``beta != 0``). ``eval_loss`` is the mean over completions of their batch's loss; the loss's metrics
        (``eval_entropy``, ``eval_kl``, ``eval_clip_ratio/*``) are means over batches, beside the rewards and
        completion metrics (each ``eval_<name>_<metric>`` for a dict of eval datasets). Prompts go in dataset order
        (TRL's eval sampler shuffles them with ``seed``; with one batch holding every prompt the two agree)."""
        generations = self.args.num_generations_eval or self.args.num_generations
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        prompts = max(1, size // generations)
        if "_eval_step" not in self.__dict__:  # one jitted step for every evaluation
            self._eval_step = train_step.make_eval_step(self._loss()[0], self._compute_dtype())
        step = self._eval_step
        outputs, rows = [], []
        with mesh_lib.entered(self.mesh):
            for index, start in enumerate(range(0, len(examples), prompts)):
                batch = self._rollout(examples[start:start + prompts], self.state.global_step, index, generations,
                                      train=False, metric_key_prefix=metric_key_prefix)
                count = len(batch["input_ids"])
                placed = mesh_lib.place_batch(batch, mesh_lib.rows_sharding(self.mesh, count), count)
                outputs.append(step(self._module, placed))
                rows.append(count)
        outputs = mesh_lib.to_host(outputs)
        losses = [float(value) / max(float(weight), 1e-12) for value, weight, _ in outputs]
        prefix = f"{metric_key_prefix}_"
        metrics = {f"{prefix}{key.removeprefix('eval_')}": value
                   for key, value in step_logs.evaluation_metrics(outputs, runtime=0.0).items()
                   if key not in ("eval_loss", "eval_runtime")
                   and key.removeprefix("eval_") not in _NOT_EVAL_METRICS}
        metrics.update({key: float(np.nanmean(values)) for key, values in self._pending_metrics.items()
                        if key.startswith(prefix)})
        for key in [key for key in self._pending_metrics if key.startswith(prefix)]:
            del self._pending_metrics[key]
        metrics[f"{metric_key_prefix}_loss"] = float(np.average(losses, weights=rows))
        return metrics
