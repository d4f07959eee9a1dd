"""``GRPOTrainer``: TRL's Group Relative Policy Optimization trainer, with TRL's constructor, on torchlike's Trainer.

One generation batch (``per_device_train_batch_size x data-parallel size x steps_per_generation`` completions,
``num_generations`` per prompt) is sampled by torchlike's rollout engine (``adapters.rollout``: the static engine
unless ``rollout_engine="paged"``; temperature, top-p, top-k, min-p, decode-time repetition penalty, KV cache sized
from the prompt and ``max_completion_length``) or taken from the user's ``rollout_func``, continued through the
model's tool calls when ``tools`` are given (:mod:`.tool_calling`; an ``environment_factory``'s environments reset
each rollout's prompt and lend it their methods as tools and their ``get_reward`` as a reward, :mod:`.environments`),
scored by the reward functions called TRL's way, turned into advantages (``adapters.losses.grpo``, TRL's estimator),
then split into ``steps_per_generation`` micro-batches that the jitted step consumes ``gradient_accumulation_steps``
at a time, ``num_iterations`` times over.
When generation and optimizer steps do not line up (TRL's rule: ``gradient_accumulation_steps % (steps_per_generation
* num_iterations) != 0``), the log-probs of the policy that sampled the batch are kept for the ratio and clipping, as
TRL does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np

from ..adapters.distributed import mesh as mesh_lib
from ..adapters.lora import runtime as lora_runtime
from ..adapters.losses import grpo as grpo_losses
from ..adapters.rollout import sampling
from ..adapters.training import reference_policy, train_step
from ..training import batches, checkpoints, step_logs
from ..type_aliases import (
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
from . import entropy_control, prompt_vision, reward_models
from .base_trainer import is_vision_dataset, vision_processor
from .environments import EMPTY_PROMPT, EnvironmentPool
from .grpo_config import GRPOConfig
from .online_trainer import OnlineTrainer
from .prompt_data import prepare_prompts
from .reward_scorer import reward_name
from .rollouts import GenerationSchedule

if TYPE_CHECKING:
    from ..modeling import CausalLM

__all__ = ["GRPOTrainer"]

logger = logging.getLogger(__name__)

#: Step-loss metrics that are not evaluation metrics: TRL logs ``entropy_coef`` in training only, and the adaptive
#: entropy controller's sums are read by the trainer.
_NOT_EVAL_METRICS = ("entropy_coef", *grpo_losses.ADAPTIVE_ENTROPY_SUMS)


class GRPOTrainer(OnlineTrainer):
    """``trl.GRPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless ``dtype`` is given, as in TRL).
        reward_funcs: a function or a list of them, called as
            ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., <dataset columns>=..., **)``
            and returning one ``float`` or ``None`` per completion (``async def`` functions too), or a reward model:
            a path / hub id (loaded with ``AutoModelForSequenceClassification.from_pretrained(num_labels=1,
            **args.model_init_kwargs)``) or a loaded sequence classifier, scoring prompt + completion as TRL does
            (:mod:`torchlike.trl.reward_models`).
        args: :class:`~torchlike.trl.GRPOConfig` (default: ``GRPOConfig("<model>-GRPO")``).
        train_dataset: rows with a ``prompt`` (text, or chat messages rendered with the chat template and
            ``add_generation_prompt=True``) and any other columns the reward functions read.
        eval_dataset: the same format; ``evaluate()`` samples ``num_generations_eval`` completions per prompt
            and reports their rewards.
        processing_class: the tokenizer (default: loaded from the model's path).
        reward_processing_classes: the reward models' tokenizers: one (for a single reward function) or a list
            with one entry per reward function; ``None`` entries load the reward model's own.
        callbacks, optimizers: as for :class:`~torchlike.Trainer`.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.
        peft_config: a :class:`~torchlike.peft.LoraConfig`; the reference model (``beta != 0``) is then
            the base weights with the adapter disabled.
        tools: functions the model may call (sync or ``async def``; their type hints and docstrings give the JSON
            schemas the chat template renders), as TRL 1.16 runs them (:mod:`torchlike.trl.tool_calling`): the
            model's tool calls are parsed from its turns, run, answered with ``tool`` messages, and each sample is
            continued with the sampler up to ``args.max_tool_calling_iterations`` rounds within
            ``max_completion_length``; the tool-result tokens are left out of the loss (TRL's ``tool_mask``) and the
            reward functions receive each completion as its message list. Needs conversational prompts.
        rollout_func: TRL's ``rollout_func(prompts, trainer) -> dict``, replacing the sampler: it gets the prompts of a
            generation batch (each repeated ``num_generations`` times, conversational prompts untemplated) and returns
            ``prompt_ids`` and ``completion_ids`` (one token list per prompt; a completion is trained as given, its
            last token deciding whether it ended, as TRL does), ``logprobs`` (accepted, not used: there is no separate
            inference engine to correct for) and any extra per-completion lists, which reach the reward functions
            as keyword arguments, except ``env_mask`` (one 0/1 per completion token; 0 keeps a token out of the loss,
            as TRL's ``tool_mask``).
        environment_factory: TRL's agent environments (:mod:`torchlike.trl.environments`): a callable returning an
            environment, or a dict of them selected by each row's ``environment`` column. An environment defines
            ``reset(**row) -> str | None`` (called with the row's columns before each rollout; what it returns is
            appended to the prompt's last message) and public methods that become that rollout's tools, run on its
            own instance; an optional ``get_reward()`` adds a reward function named after the class (weight 1).
            Reward functions receive the rollouts' instances as ``environments``. Without ``train_dataset`` a single
            environment owns the data (its ``reset`` gives the prompts) and ``max_steps`` sets the run's length.
    """

    _allow_prefetch = False  # a rollout must see the weights of the steps before it
    _config_class = GRPOConfig
    _output_suffix = "GRPO"
    _tag_names = ["trl", "grpo"]

    def __init__(self, model: ModelLike, reward_funcs: RewardFunc | list[RewardFunc] | None = None,
                 args: GRPOConfig | None = None, train_dataset: DatasetLike | None = None,
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
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, quantization_config)
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
        self._check_algorithm(args, model)
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
        self._entropy_control = self._adaptive_entropy_control(args)

    # ------------------------------------------------------------------ set-up
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

    def _check_algorithm(self, args: TRLArgs, model: CausalLM) -> None:
        """TRL's checks of the algorithm settings against each other and the model, with its wording (its warnings
        through Python's ``logging``, as TRL's logger emits them)."""
        if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
            logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
                           "mirror the paper's setup.")
        if args.loss_type == "vespo" and args.importance_sampling_level != "token":
            logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                           "should be set to `'token'` (the default).")
        if args.importance_sampling_level == "sequence" and args.loss_type in grpo_losses.LENGTH_WEIGHTED_LOSSES:
            logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums "
                           "per-token contributions, which effectively weights each sequence by its completion length "
                           "instead of optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
                           "`loss_type='grpo'` (see https://huggingface.co/docs/trl/main/en/paper_index"
                           "#group-sequence-policy-optimization).")
        self._check_reference_use(args)

    def _check_sampling_ahead(self, args: TRLArgs) -> None:
        """``max_staleness >= 1`` needs the built-in sampler (tools and ``rollout_func`` sample themselves) and no
        more optimizer steps per generation batch than it allows (each batch is sampled one batch ahead)."""
        if args.max_staleness == 0:
            return
        if self.tools or self.rollout_func is not None or self.environment_pool is not None:
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
        """TRL's GRPO loss (:func:`adapters.losses.grpo.grpo_step_loss`) with the config's settings."""
        settings = grpo_losses.GRPOLossSettings.from_config(
            self.args, temperature=self.sampling.temperature,
            compute_dtype=self._decoder_dtype if self.args.cast_lm_head_to_fp32 else None,
            router_aux_loss_coef=self._router_loss_weight())
        return grpo_losses.grpo_step_loss(self.model.family, settings), None

    # ------------------------------------------------------------------ adaptive entropy control
    def _adaptive_entropy_control(self, args: GRPOConfig) -> entropy_control.AdaptiveEntropyControl | None:
        """TRL's adaptive entropy controller (:mod:`.entropy_control`) with ``use_adaptive_entropy``, else ``None``."""
        return entropy_control.AdaptiveEntropyControl.from_config(args) if args.use_adaptive_entropy else None

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

    def _save_checkpoint(self, step: int) -> Path:
        """The checkpoint folder, plus TRL's ``entropy_ctrl_state.json`` with adaptive entropy control."""
        folder = super()._save_checkpoint(step)
        if self._entropy_control is not None and self.state.is_world_process_zero:
            self._entropy_control.save(folder)
        return folder

    def _resume(self, checkpoint: str | bool) -> int:
        """Restores the checkpoint, and the adaptive entropy controller from its ``entropy_ctrl_state.json``."""
        step = super()._resume(checkpoint)
        if self._entropy_control is not None:
            self._entropy_control.load(checkpoints.find_checkpoint(self.args.output_dir, checkpoint))
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
        if record.sampling_logps is not None and self._samples_ahead and train:
            batch["sampling_logps"] = record.sampling_logps  # read by the sampler correction, then dropped
        advantages, reward_metrics = self._advantages(rewards, num_generations, batch, train)
        batch["advantages"] = np.asarray(advantages, np.float32)
        prefix = "" if train else f"{metric_key_prefix}_"
        self._record_completion_metrics(record, prefix, train)
        metrics = {"reward": reward_metrics["reward"], "reward_std": reward_metrics["reward_std"],
                   "frac_reward_zero_std": reward_metrics["frac_reward_zero_std"]}
        if "kl" in reward_metrics:  # RLOO's KL penalty on the rewards
            metrics["kl"] = reward_metrics["kl"]
        for index, function in enumerate(self.reward_funcs):
            name = reward_name(function)
            metrics[f"rewards/{name}/mean"] = reward_metrics["rewards_per_func/mean"][index]
            metrics[f"rewards/{name}/std"] = reward_metrics["rewards_per_func/std"][index]
        for key, value in metrics.items():
            self._pending_metrics.setdefault(prefix + key, []).append(float(value))
        if args.log_completions and train and self.state.is_world_process_zero:
            self._print_completions(record.rows, record.completion_ids, rewards, np.asarray(advantages))
        if not train:
            self._add_eval_columns(batch)
            return batch
        self._add_step_columns(batch)
        batch.pop("sampling_logps", None)
        self._last_rollout = self._shuffled(batch, seed)  # kept for inspection and tests
        return self._last_rollout

    @property
    def _samples_ahead(self) -> bool:
        """The next generation batch is sampled while the current one trains (``max_staleness >= 1``)."""
        return self.args.max_staleness > 0

    def _sampler_correction(self, batch: dict[str, np.ndarray], old_logps: np.ndarray) -> None:
        """TRL's vLLM importance-sampling correction of a batch sampled ahead: ``batch["importance_sampling_ratio"]``
        (:func:`adapters.losses.grpo.sampler_importance_ratio` of the trainer's and the engine's log-probs) and TRL's
        ``sampling/*`` metrics."""
        args = self.args
        mask = grpo_losses.loss_mask(batch).astype(bool)
        sampling_logps = batch["sampling_logps"]
        ratio = grpo_losses.sampler_importance_ratio(old_logps, sampling_logps, mask,
                                                     args.vllm_importance_sampling_mode,
                                                     args.vllm_importance_sampling_clip_min,
                                                     args.vllm_importance_sampling_clip_max)
        batch["importance_sampling_ratio"] = np.broadcast_to(ratio, mask.shape).astype(np.float32)
        delta = np.abs(old_logps - sampling_logps)[mask]
        flat = ratio.ravel() if ratio.shape[1] == 1 else ratio[mask]
        metrics = {"sampling/sampling_logp_difference/mean": delta.mean() if delta.size else 0.0,
                   "sampling/sampling_logp_difference/max": delta.max() if delta.size else 0.0,
                   "sampling/importance_sampling_ratio/min": flat.min() if flat.size else 0.0,
                   "sampling/importance_sampling_ratio/mean": flat.mean() if flat.size else 0.0,
                   "sampling/importance_sampling_ratio/max": flat.max() if flat.size else 0.0}
        for key, value in metrics.items():
            self._pending_metrics.setdefault(key, []).append(float(value))

    def _advantages(self, rewards: np.ndarray, num_generations: int, batch: dict[str, np.ndarray],
                    train: bool) -> tuple[np.ndarray, dict]:
        """``(advantages [N], reward metrics)`` of a generation batch (``adapters.losses.grpo.grpo_advantages``);
        ``batch`` holds its ``input_ids``, ``attention_mask`` and ``completion_mask``."""
        args = self.args
        return grpo_losses.grpo_advantages(rewards, num_generations, reward_weights=self.reward_weights,
                                           scale_rewards=args.scale_rewards,
                                           multi_objective_aggregation=args.multi_objective_aggregation)

    def _add_step_columns(self, batch: dict[str, np.ndarray]) -> None:
        """Adds what the step loss reads besides the tokens and advantages: the token normaliser and step weight,
        the sampling policy's log-probs (TRL's rule for when they are kept) and the reference's."""
        args = self.args
        accumulation = args.gradient_accumulation_steps
        completion_mask = grpo_losses.loss_mask(batch)  # TRL's num_items_in_batch counts the trained tokens
        normaliser = max(float(completion_mask.sum()), 1.0) * accumulation / args.steps_per_generation
        batch[grpo_losses.NUM_ITEMS_COLUMN] = np.full(len(completion_mask), normaliser, np.float32)
        token_sum = args.loss_type in grpo_losses.NUM_ITEMS_NORMALISED_LOSSES
        batch["step_weight"] = np.full(len(completion_mask), 1.0 / accumulation if token_sum else 1.0, np.float32)
        corrected = "sampling_logps" in batch and args.vllm_importance_sampling_correction
        # TRL's rule for old log-probs, and (as TRL with vLLM's correction) always when the sampler's are corrected.
        if accumulation % (args.steps_per_generation * args.num_iterations) != 0 or corrected:
            batch["old_logps"] = self._log_probs(batch, lora_runtime.EVAL, self._module)
        if corrected:
            self._sampler_correction(batch, batch["old_logps"])
        if self.reference is not None:
            batch["ref_logps"] = self._log_probs(batch, self.reference.lora, self.reference.module)

    def _add_eval_columns(self, batch: dict[str, np.ndarray]) -> None:
        """The columns an evaluation batch's loss reads besides the tokens and advantages: the token normaliser of the
        whole batch and step weight 1 (TRL's eval batch is neither split nor accumulated), and the reference's
        log-probs; there are no old log-probs (the ratio is 1). With adaptive entropy control, the coefficient the
        next optimizer step would apply (TRL's evaluation applies it and leaves the controller as it is)."""
        rows = len(batch["input_ids"])
        batch[grpo_losses.NUM_ITEMS_COLUMN] = np.full(rows, max(float(grpo_losses.loss_mask(batch).sum()), 1.0),
                                                      np.float32)
        batch["step_weight"] = np.ones(rows, np.float32)
        if self._entropy_control is not None:
            batch["entropy_coef"] = np.full(rows, self._entropy_control.applied_coefficient, np.float32)
        if self.reference is not None:
            batch["ref_logps"] = self._log_probs(batch, self.reference.lora, self.reference.module)

    @staticmethod
    def _shuffled(batch: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
        """The rows of a generation batch in a seeded random order (TRL's ``shuffle_sequence_dict``), so the
        micro-batches it is split into mix prompts."""
        order = np.random.default_rng(seed).permutation(len(batch["input_ids"]))
        return {key: value[order] for key, value in batch.items()}

    def _log_probs(self, batch: dict[str, np.ndarray], lora: str, module) -> np.ndarray:
        """Per-token log-probs of the completions, one micro-batch at a time (the training shape)."""
        key = (lora, id(module))
        passes = self.__dict__.setdefault("_log_prob_passes", {})
        if key not in passes:
            passes[key] = grpo_losses.make_log_prob_pass(self.model.family, self.sampling.temperature, lora,
                                                        self._decoder_dtype,
                                                        lm_head_in_float32=self._lm_head_in_float32)
        size = self._global_batch_size()
        inputs = {name: batch[name] for name in ("input_ids", "attention_mask", "completion_mask")}
        parts = []
        with mesh_lib.entered(self.mesh):
            for start in range(0, len(batch["input_ids"]), size):
                chunk = {name: value[start:start + size] for name, value in inputs.items()}
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
