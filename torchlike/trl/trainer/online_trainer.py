"""``OnlineTrainer``: what the trainers that sample from the policy share (GRPO, RLOO, Distillation, and the next
online TRL trainer).

A generation batch goes through one path: the prompts of ``GenerationSchedule.prompts`` dataset rows, each repeated
``completions_per_prompt`` times, are sampled by the rollout engine (or the user's ``rollout_func``), continued through
the model's tool calls when there are tools, and gathered into one :class:`Rollout` record; a trainer with reward
functions scores it (:meth:`OnlineTrainer._score`); the subclass turns the record into its step's columns (GRPO and
RLOO add advantages, Distillation the divergence mask), and :meth:`OnlineTrainer._batches` splits those columns into
micro-batches on one schedule (:meth:`OnlineTrainer._generation_schedule`: ``micro_batches`` per generation batch,
``passes`` over it). A subclass provides ``_prepare(dataset, name)``, ``_generation_schedule()`` and
``_generation_batch(prompt_rows, epoch, generation_index)``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ...adapters import rollout
from ...adapters.distributed import mesh as mesh_lib
from ...adapters.distributed import multihost
from ...adapters.lora import runtime as lora_runtime
from ...adapters.rollout import images as rollout_images
from ...adapters.rollout import sampling
from ...peft.config import LoraConfig
from ...training.batches import sampler_order
from ...training.model_interface import active_lora_config
from ...type_aliases import ProcessingClass, RowsLike, TRLArgs
from ...version import repetition_penalty_skips_left_padding
from ..data import prompt_vision
from ..data.model_images import ModelImages
from ..data.prompt_data import is_conversational_prompt, left_padded, prepare_prompts
from ..online.environments import EMPTY_PROMPT, EnvironmentPool
from ..online.reward_scorer import RewardScorer
from ..online.rollout_worker import RolloutWorker
from ..online.rollouts import GenerationSchedule, Rollout
from ..online.vllm_mode import vllm_engine_settings
from .base_config import round_up_to_multiple
from .base_trainer import TRLTrainer

if TYPE_CHECKING:
    from ...modeling import CausalLM

__all__ = ["OnlineTrainer"]



class OnlineTrainer(TRLTrainer):
    """The trainers that sample completions from the policy (GRPO, RLOO, Distillation): the sampling settings, pad
    and end tokens, prompt widths, eval rows prepared like training rows, the generation path (engine or
    ``rollout_func``, tools) into a :class:`Rollout`, reward scoring, the generation schedule, and the generation
    metrics gathered between logs (means over the generation batches since the last training log, added to it as TRL's
    ``log`` does).

    A subclass calls :meth:`_setup_sampling` before preparing its prompts and provides ``_prepare(dataset, name)``,
    :meth:`_generation_schedule` and :meth:`_generation_batch`.
    """

    rollout_func: Callable | None = None
    """TRL's ``rollout_func(prompts, trainer) -> dict`` replacing the engine (GRPO and RLOO take one)."""
    reward_funcs: Sequence[Callable] = ()
    """The reward functions :meth:`_score` calls (reward models wrapped as functions); none for Distillation."""
    environment_pool: EnvironmentPool | None = None
    """TRL's ``environment_factory`` (GRPO takes one): each rollout's prompt, tools and reward state."""

    def _setup_sampling(self, args: TRLArgs, model: CausalLM, processing_class: ProcessingClass) -> None:
        """Sets ``sampling`` (the config's sampling fields, ``generation_kwargs`` over them, sampling on as in TRL),
        ``tokenizer``, ``pad_token_id`` and ``eos_token_ids`` (the tokenizer's eos first, then the generation
        config's), and reads the config's vLLM fields once (:func:`~..online.vllm_mode.vllm_engine_settings`: the
        server mode's engine, colocate's warning)."""
        names = sampling.SamplingSettings.names()
        extra = self._sampling_overrides(args)
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"generation_kwargs {unknown} are not supported by torchlike's sampler; it takes "
                             f"{', '.join(names)} (max_completion_length sets the length).")
        config_fields = {field.name for field in dataclasses.fields(args)}
        from_config = {name: getattr(args, name) for name in names if name in config_fields}
        self.sampling = sampling.SamplingSettings.from_mapping({**from_config, "do_sample": True, **extra})
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor's tokenizer
        self.tokenizer = tokenizer
        self.pad_token_id = self._pad_token_id(tokenizer, None)
        eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = eos if tokenizer.eos_token_id in eos else [tokenizer.eos_token_id, *eos]
        self._pending_metrics: dict[str, list[float]] = {}
        self._vllm_engine_settings = vllm_engine_settings(args)

    @functools.cached_property
    def rollout_worker(self) -> RolloutWorker:
        """The policy's :class:`~.rollout_worker.RolloutWorker` (the student in distillation): its engine, and the
        generation batches it samples ahead. Built on first use, with the trainer's final pad token."""
        return self._new_worker(lambda: self._trainable_model.module)

    def _new_worker(self, model: Callable[[], Any], lora: str | None = None) -> RolloutWorker:
        """A :class:`~.rollout_worker.RolloutWorker` sampling from ``model()`` with this trainer's settings and
        engine (the policy's, or a second model's that an algorithm hands to :meth:`_generate`)."""
        return RolloutWorker(model, self._build_rollout_engine, self.sampling, self.pad_token_id, lora=lora)

    def _sampling_overrides(self, args: TRLArgs) -> dict:
        """The sampling settings laid over the config's sampling fields: ``generation_kwargs``."""
        return dict(args.generation_kwargs or {})

    @property
    def _completion_limit(self) -> int:
        """The most tokens sampled per completion: ``max_completion_length``."""
        return self.args.max_completion_length

    def _padded(self, length: int) -> int:
        """A prompt or completion width rounded up as ``pad_to_multiple_of`` asks (padding is masked); as it is for a
        config without that field."""
        return round_up_to_multiple(length, getattr(self.args, "pad_to_multiple_of", None))

    def _prepare_eval_dataset(self, dataset: RowsLike) -> list[dict]:
        """Raw eval rows prepared as the train rows are (rows prepared at construction are kept as they are)."""
        from ...training import batches

        rows = batches.as_sequence(dataset)
        if len(rows) and isinstance(rows[0], dict) and "prompt_ids" in rows[0]:
            return rows
        return self._prepare(rows, "eval_dataset")

    def log(self, logs: dict[str, float]) -> None:
        """Adds the generation metrics gathered since the last training log (NaN-skipping means) to a training log,
        including the run's closing summary when generation happened after the last logging step, then calls
        :meth:`_on_train_log`."""
        if not any(key.startswith("eval_") for key in logs) and self._pending_metrics:
            train_metrics = {key: values for key, values in self._pending_metrics.items()
                             if not key.startswith("eval_")}
            logs = {**logs, **{key: self._window_value(key, values) for key, values in train_metrics.items()}}
            for key in train_metrics:
                del self._pending_metrics[key]
            self._on_train_log()
        super().log(logs)

    def _window_value(self, key: str, values: list[float]) -> float:
        """A generation metric's value in a training log from its values since the last one: their NaN-skipping
        mean."""
        return float(np.nanmean(values))

    def _on_train_log(self) -> None:
        """Called when a training log takes the gathered generation metrics (e.g. to print the latest completions)."""

    # ------------------------------------------------------------------ sampling and tools
    def _setup_tools(self, tools: list | None, processing_class: ProcessingClass, args: TRLArgs,
                     environment_pool: EnvironmentPool | None = None) -> None:
        """Sets ``environment_pool``, ``tools`` (the given ones, then every environment's methods) and
        ``tool_calling`` (:class:`.tool_calling.ToolCalling`, TRL's checks run) when there are tools, else ``None``."""
        from ..online import tool_calling

        self.environment_pool = environment_pool
        self.tools = list(tools or []) if environment_pool is None else environment_pool.tools
        self.tool_calling = tool_calling.ToolCalling.create(processing_class, self.tools, args.chat_template_kwargs,
                                                            trainer_name=self._trainer_name) if self.tools else None

    @property
    def chat_template(self) -> str | None:
        """TRL's attribute: with tools, the training copy of a chat template that is not prefix-preserving, which
        renders the prompts and tool turns in its place; else ``None`` (the tokenizer's own)."""
        return None if self.tool_calling is None else self.tool_calling.chat_template

    def _check_tool_prompts(self, row_lists: list) -> None:
        """With tools or environments, every prompt must be a list of chat messages (a row without one gets
        :data:`.environments.EMPTY_PROMPT`)."""
        prompts = [row.get("prompt", EMPTY_PROMPT) for rows in row_lists for row in rows or []]
        if (self.tools or self.environment_pool is not None) and not all(map(is_conversational_prompt, prompts)):
            raise ValueError("tools need conversational prompts (lists of chat messages): the chat template renders "
                             "the tools' schemas, and the model's turns are parsed as assistant messages; an "
                             "environment's observation is appended to the last message.")

    def _completion_arrays(self, completions: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, completion_mask, ended)`` of completions given as token lists (each at most
        ``max_completion_length``), right-padded to the completion width; ``ended`` by TRL's rule: the last token is
        an end or pad token."""
        tokens = np.full((len(completions), self._padded(self._completion_limit)), self.pad_token_id,
                         np.int32)
        completion_mask = np.zeros(tokens.shape, np.int32)
        for row, ids in enumerate(completions):
            tokens[row, :len(ids)] = ids
            completion_mask[row, :len(ids)] = 1
        stops = {*self.eos_token_ids, self.pad_token_id}
        ended = np.array([not ids or ids[-1] in stops for ids in completions])
        return tokens, completion_mask, ended

    @staticmethod
    def _mask_array(masks: list[list[int]], completion_mask: np.ndarray, name: str) -> np.ndarray:
        """Per-token 0/1 lists (one per completion, as long as it) as an array shaped like ``completion_mask``,
        padded with 1 as TRL pads ``tool_mask``."""
        array = np.ones(completion_mask.shape, np.int32)
        for row, (mask, length) in enumerate(zip(masks, completion_mask.sum(axis=1), strict=True)):
            if len(mask) != length:
                raise ValueError(f"{name} of completion {row} has {len(mask)} entries for its {length} tokens; give "
                                 "one 0/1 per completion token (1: the model's own, trained on).")
            array[row, :length] = mask
        return array

    @property
    def rollout_engine(self) -> rollout.RolloutEngine:
        """The engine the policy's completions are sampled with (``args.rollout_engine``; built on first use, then
        handed the policy before each generation round): :attr:`rollout_worker`'s."""
        return self.rollout_worker.engine

    def _build_rollout_engine(self, module: Any) -> rollout.RolloutEngine:  # Any: an NNX module or a wrapper
        """The engine ``args.rollout_engine`` names (the backend's default where it is ``None`` or the config has no
        such field: :func:`torchlike.adapters.rollout.default_engine`), from the one
        construction path ``generate`` takes too (:func:`torchlike.adapters.rollout.build_engine`), with the config's
        ``rollout_*`` settings and its vLLM fields' (``use_vllm=True, vllm_mode="server"``: the vLLM server engine,
        for the policy only: a second model samples with torchlike's engine); an engine of the policy can read its
        merged Hugging Face weights and their version (optimizer steps) from the context, and save its LoRA
        adapter."""
        settings = {item.name.removeprefix("rollout_"): getattr(self.args, item.name)
                    for item in dataclasses.fields(self.args) if item.name.startswith("rollout_")}
        policy = self._trainable_model
        samples_policy = module is policy.module
        vllm = dict(self._vllm_engine_settings)
        if not samples_policy:
            vllm.pop("engine", None)
        settings.update(vllm)
        name = settings.pop("engine", None)
        with_lora = samples_policy and isinstance(active_lora_config(policy), LoraConfig)
        context = rollout.EngineContext(
            eos_token_ids=tuple(self.eos_token_ids), pad_token_id=self.pad_token_id, lora=lora_runtime.EVAL,
            mesh=self.mesh, settings=settings, shard_rows=True,
            repetition_penalty_skips_left_padding=repetition_penalty_skips_left_padding(),
            hf_weights=policy.hf_tensors if samples_policy and hasattr(policy, "hf_tensors") else None,
            weights_version=lambda: self.state.global_step,
            save_adapter=policy.save_pretrained if with_lora else None)
        return rollout.build_engine(name, module, context)

    def _call_tools(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray,
                    completion_mask: np.ndarray, seed: int, row_tools: list[list[Callable]] | None = None,
                    worker: RolloutWorker | None = None) -> tuple:
        """Runs TRL's tool-calling loop (:meth:`.tool_calling.ToolCalling.run`) on the first completions, continuing
        each sample with ``worker`` (default: the policy's); ``row_tools`` are each sample's tools (default:
        ``tools``). With several processes each runs the tools of the samples it scores (an environment's state stays
        where it is read).

        Returns:
            ``(tokens, completion_mask, ended, tool_mask, loop result)`` of the completions with their tool turns.
        """
        prompts = [ids[mask.astype(bool)].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        first = [row[:int(mask.sum())].tolist() for row, mask in zip(tokens, completion_mask, strict=True)]
        rounds = itertools.count(1)

        def generate(prompt_id_lists: list[list[int]], max_new_tokens: int) -> list[list[int]]:
            length = self._padded(sampling.bucket_length(max(len(ids) for ids in prompt_id_lists)))
            round_seed = rollout.derived_seed(seed, next(rounds))
            sampled, _ = (worker or self.rollout_worker).sample(*self._left_padded(prompt_id_lists, length),
                                                                max_new_tokens, round_seed)
            mask, _ = rollout.completion_mask(sampled, self.eos_token_ids)
            return [row[:int(row_mask.sum())].tolist() for row, row_mask in zip(sampled, mask, strict=True)]

        tools = row_tools or [self.tools] * len(prompts)
        own = range(len(prompts))[multihost.process_rows(len(prompts))]

        def call_rows(rows: list[int], calls: list[list[dict]]) -> list[tuple[list[dict], int]]:
            mine = [self.tool_calling.call(row_calls, tools[row])
                    for row, row_calls in zip(rows, calls, strict=True) if row in own]
            return [result for piece in multihost.allgather_objects(mine) for result in piece]

        loop = self.tool_calling.run(prompts, first, generate, max_completion_length=self._completion_limit,
                                     max_model_length=self.model.config.get_text_config().max_position_embeddings,
                                     max_iterations=self.args.max_tool_calling_iterations, tools=tools,
                                     call_rows=call_rows)
        tokens, completion_mask, ended = self._completion_arrays(loop.completion_ids)
        return tokens, completion_mask, ended, self._mask_array(loop.tool_mask, completion_mask, "tool_mask"), loop

    def _left_padded(self, sequences: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
        return left_padded(sequences, length, self.pad_token_id)

    def _prompt_arrays(self, prompt_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of a generation batch's prompts, left-padded to the dataset's width (``prompt_length``), or
        a wider bucket for longer prompts (a ``rollout_func``'s, eval data prepared later). Sampling ahead and
        sampling build the same arrays, which is how a batch sampled ahead is found again."""
        width = max(self.prompt_length, self._padded(sampling.bucket_length(max(len(ids) for ids in prompt_ids))))
        return self._left_padded(prompt_ids, width)

    # ------------------------------------------------------------------ the generation path
    def _generate_single_turn(self, prompt_ids: list[list[int]], seed: int,
                              vision: tuple[np.ndarray, np.ndarray] | None = None,
                              worker: RolloutWorker | None = None
                              ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion per prompt from the rollout engine (TRL's ``_generate_single_turn``): sampled with the
        config's settings, cut after the first end token (kept), at most ``max_completion_length`` tokens; with
        the engine's log-prob of each token (``None`` where completions come without them). ``vision``: image
        prompts' ``(images, token types)``, laid out like :meth:`_prompt_arrays`. ``worker``: the
        :class:`~.rollout_worker.RolloutWorker` to sample with (default: the policy's)."""
        prompts, mask = self._prompt_arrays(prompt_ids)
        sampled, logps = (worker or self.rollout_worker).sample(prompts, mask, self._completion_limit, seed, vision)
        kept, _ = rollout.completion_mask(sampled, self.eos_token_ids)
        lengths = kept.sum(axis=1)
        return ([row[:int(n)].tolist() for row, n in zip(sampled, lengths, strict=True)],
                [row[:int(n)].tolist() for row, n in zip(logps, lengths, strict=True)])

    def _generate(self, rows: list[dict], seed: int, worker: RolloutWorker | None = None) -> Rollout:
        """Samples one completion per row (``worker``, by default the policy's :attr:`rollout_worker`, or
        ``rollout_func`` when given), continues each through the model's tool calls when there are tools, and returns
        the :class:`Rollout`. With environments each row first gets its rollout's instance, reset, and the prompt it
        returns (:meth:`_reset_environments`)."""
        limit = self._completion_limit
        environments = row_tools = None
        if self.environment_pool is not None:
            rows, environments = self._reset_environments(rows)
            row_tools = [self.environment_pool.tools_of(environment) for environment in environments]
        vision = None
        if self.rollout_func is not None:
            prompt_ids, completions, extra = self._custom_rollout(rows)
            logps = None
        else:
            prompt_ids = [list(row["prompt_ids"]) for row in rows]
            chosen = {} if worker is None else {"worker": worker}  # the policy's worker unless one is given
            if self._image_slots:
                vision = self._vision_inputs(rows, self._prompt_arrays(prompt_ids)[0])
                completions, logps = self._generate_single_turn(prompt_ids, seed, vision, **chosen)
            else:
                completions, logps = self._generate_single_turn(prompt_ids, seed, **chosen)
            extra = {}
        source = "rollout_func" if self.rollout_func is not None else "the sampler"
        if len(completions) != len(rows):
            raise ValueError(f"{source} returned {len(completions)} completions for {len(rows)} prompts; return one "
                             "list of token ids per prompt.")
        longest = max(map(len, completions), default=0)
        if longest > limit:
            raise ValueError(f"{source} returned a completion of {longest} tokens, longer than "
                             f"max_completion_length={limit}; truncate it or raise max_completion_length.")
        prompts, prompt_mask = self._prompt_arrays(prompt_ids)
        tokens, completion_mask, ended = self._completion_arrays(completions)
        sampling_logps = None
        if logps is not None:
            sampling_logps = np.zeros(tokens.shape, np.float32)
            for row, values in enumerate(logps):
                sampling_logps[row, :len(values)] = values
        record = Rollout(rows=rows, seed=seed, prompt_ids=prompts, prompt_mask=prompt_mask, tokens=tokens,
                         completion_mask=completion_mask, ended=ended, completion_ids=completions,
                         sampling_logps=sampling_logps, extra=extra, environments=environments,
                         sampling_versions=(worker or self.rollout_worker).sampled_versions(seed))
        if self._image_slots:  # the images the sampler was given, laid out like these prompts
            record.images, record.prompt_token_types = vision or self._vision_inputs(rows, prompts)
        # TRL's tool_mask: 0 on tokens the model did not write (tool results, rollout_func's env_mask): not trained.
        if self.tools:
            tokens, completion_mask, ended, tool_mask, loop = self._call_tools(prompts, prompt_mask, tokens,
                                                                               completion_mask, seed, row_tools,
                                                                               worker)
            record = dataclasses.replace(record, tokens=tokens, completion_mask=completion_mask, ended=ended,
                                         tool_mask=tool_mask, tool_loop=loop, completions=loop.completions,
                                         completion_ids=loop.completion_ids, sampling_logps=None)
        elif "env_mask" in extra:
            record.tool_mask = self._mask_array(extra.pop("env_mask"), completion_mask, "env_mask")
        return record

    _image_slots = 0
    """Image slots per prompt (the most images a prompt of the data has); 0: text prompts."""

    def _vision_inputs(self, rows: list[dict], prompt_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(images, token types)`` of a generation batch's image prompts (:func:`.prompt_vision.rows_vision_inputs`),
        the image size the processor's."""
        processor = self.processing_class.image_processor
        # The size of the images the model takes (a CLIP processor crops to crop_size); Qwen-VL's processor sizes
        # by pixel count, and its model takes no image slots.
        size = getattr(processor, "crop_size", None) or processor.size
        shape = (size.get("height", 0), size.get("width", 0), 3)
        return prompt_vision.rows_vision_inputs(rows, prompt_ids, ModelImages(self.model.family, self.model.config),
                                                self._image_slots, shape)

    def _reset_environments(self, rows: list[dict]) -> tuple[list[dict], list]:
        """Each row's environment instance (:meth:`.environments.EnvironmentPool.assign`), reset with the row's columns
        (those TRL's rows keep: all but ``prompt_ids``, only ``prompt`` with ``remove_unused_columns``), and the rows
        with the prompts ``reset`` returned, tokenised with their environment's tools. With several processes each
        resets the instances of the rows it scores, and the prompts are gathered.

        Returns:
            ``(rows, instances)``.
        """
        pool = self.environment_pool
        visible = [{key: value for key, value in row.items() if key != "prompt_ids"
                    and (key == "prompt" or not self.args.remove_unused_columns)} for row in rows]
        instances = pool.assign(visible)
        own = multihost.process_rows(len(rows))
        prompts = [pool.reset(instance, row) for instance, row in zip(instances[own], visible[own], strict=True)]
        prompts = [prompt for piece in multihost.allgather_objects(prompts) for prompt in piece]
        template_kwargs = dict(self.tool_calling.chat_template_kwargs if self.tool_calling is not None
                               else self.args.chat_template_kwargs or {})
        reset_rows = []
        for row, columns, prompt in zip(rows, visible, prompts, strict=True):
            tools = pool.schema_tools[pool.name_of(columns)]
            reset_rows += prepare_prompts([{**row, "prompt": prompt}], self.tokenizer, "environment prompt",
                                          getattr(self.args, "max_prompt_length", None),
                                          {**template_kwargs, "tools": tools or None})
        return reset_rows, instances

    def _custom_rollout(self, rows: list[dict]) -> tuple[list[list[int]], list[list[int]], dict[str, list]]:
        """Runs ``rollout_func`` on the prompts of ``rows``: ``(prompt_ids, completion_ids, extra columns)``, the
        completions taken as given. With several processes each calls it for its own rows (as TRL calls it per
        process) and the results are gathered."""
        own_rows = rows[multihost.process_rows(len(rows))]
        output = self.rollout_func([copy.deepcopy(row["prompt"]) for row in own_rows], self)
        missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(output))
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        prompts, completions = list(output["prompt_ids"]), [list(ids) for ids in output["completion_ids"]]
        for name, values in (("prompt_ids", prompts), ("completion_ids", completions)):
            if len(values) != len(own_rows):
                raise ValueError(f"rollout_func returned {len(values)} {name} for {len(own_rows)} prompts (each "
                                 "prompt repeated num_generations times); return one list of token ids per prompt.")
        extra = {key: value if isinstance(value, list) else [value] * len(own_rows)
                 for key, value in output.items() if key not in ("prompt_ids", "completion_ids", "logprobs")}
        pieces = multihost.allgather_objects((prompts, completions, extra))
        prompts = [list(ids) for piece in pieces for ids in piece[0]]
        completions = [ids for piece in pieces for ids in piece[1]]
        extra = {key: [value for piece in pieces for value in piece[2][key]] for key in extra}
        return prompts, completions, extra

    _logs_num_tokens = True
    """Whether the generation metrics include TRL's running ``num_tokens`` (TRL's SDFT logs none)."""

    def _record_completion_metrics(self, record: Rollout, prefix: str, train: bool, counted: int | None = None) -> None:
        """TRL's generation metrics of the first ``counted`` completions (default all; the rest pad an evaluation
        batch) for the next log: ``num_tokens`` (TRL's running count of prompt and model-written tokens, advanced in
        training), ``completions/*`` counting the model's own tokens, and ``tools/*`` with tools."""
        counted = len(record.rows) if counted is None else counted
        lengths = record.model_tokens[:counted].sum(axis=1).astype(np.float64)
        ended = record.ended[:counted]
        terminated = lengths[ended] if ended.any() else np.zeros(1)
        if train:
            self.state.num_input_tokens_seen += int(record.prompt_mask[:counted].sum() + lengths.sum())
        if self._logs_num_tokens:
            self._pending_metrics[prefix + "num_tokens"] = [float(self.state.num_input_tokens_seen)]
        metrics = {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                   "completions/max_length": lengths.max(), "completions/clipped_ratio": 1.0 - ended.mean(),
                   "completions/mean_terminated_length": terminated.mean(),
                   "completions/min_terminated_length": terminated.min(),
                   "completions/max_terminated_length": terminated.max()}
        loop = record.tool_loop
        if loop is not None:
            metrics["tools/call_frequency"] = loop.call_count / len(record.rows)
            metrics["tools/failure_frequency"] = loop.failure_count / loop.call_count if loop.call_count else 0.0
        for key, value in metrics.items():
            self._log_metric(prefix + key, value)

    # ------------------------------------------------------------------ rewards
    @functools.cached_property
    def reward_scorer(self) -> RewardScorer:
        """The :class:`~.reward_scorer.RewardScorer` of :attr:`reward_funcs` (built on first use, after the trainer
        has its reward functions)."""
        return RewardScorer(self.reward_funcs, self.tokenizer, keep_columns=not self.args.remove_unused_columns,
                            trainer_state=lambda: self.state, log_metric=self._log_metric)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric`` for reward functions: the value joins the metrics gathered for the next log."""
        self._pending_metrics.setdefault(name, []).append(float(value))

    # ------------------------------------------------------------------ the generation schedule
    def _generation_schedule(self) -> GenerationSchedule:
        """How a generation batch is sized and trained on (see :class:`GenerationSchedule`)."""
        raise NotImplementedError

    _generation_batch_fields = "per_device_train_batch_size x data-parallel size"
    """The fields that size a generation batch, named when the dataset cannot fill one."""

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        """The step columns of one training generation batch (``schedule.completions`` rows) for ``prompt_rows``."""
        raise NotImplementedError

    def _generation_rows(self, prompt_rows: list[dict], completions_per_prompt: int | None = None) -> list[dict]:
        """Each prompt row ``completions_per_prompt`` times in a row (by default the schedule's)."""
        count = completions_per_prompt or self._generation_schedule().completions_per_prompt
        return [row for row in prompt_rows for _ in range(count)]

    def _generation_seed(self, epoch: int, generation_index: int, train: bool = True) -> int:
        """The seed a generation batch is sampled with: ``args.seed`` and where the batch sits, so a resumed run
        samples what an uninterrupted one does with the same weights."""
        return rollout.derived_seed(self.args.seed, epoch, generation_index, int(train))

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """Prompt order for ``epoch``: seeded shuffle with ``shuffle_dataset`` (TRL's default), else dataset order."""
        return sampler_order(len(self.train_dataset), epoch, sequential=not self.args.shuffle_dataset,
                             seed=self.args.seed)

    def _generations_per_epoch(self) -> int:
        """Whole generation batches per epoch (TRL's sampler drops a partial last one)."""
        schedule = self._generation_schedule()
        generations = len(self.train_dataset) // schedule.prompts
        if generations == 0:
            raise ValueError(f"train_dataset has {len(self.train_dataset)} prompts but one generation batch needs "
                             f"{schedule.prompts} ({self._generation_batch_fields}); add prompts or lower those "
                             "settings.")
        return generations

    def _steps_per_epoch(self) -> int:
        schedule = self._generation_schedule()
        micro_batches = self._generations_per_epoch() * schedule.passes * schedule.micro_batches
        return max(1, micro_batches // self.args.gradient_accumulation_steps)

    @property
    def _samples_ahead(self) -> bool:
        """Whether the next generation batch is sampled while the current one trains."""
        return self._generations_ahead > 0

    @property
    def _generations_ahead(self) -> int:
        """How many generation batches the loop keeps sampling ahead of the one training (0: each is sampled when it
        is due)."""
        return 0

    def _sampler_weights_version(self, starting: bool) -> int | None:
        """When the loop starts (``starting``) and after each of its optimizer steps: the version of the weights the
        sampler takes now (the tag of the tokens it draws ahead from then on), or ``None`` to keep sampling ahead with
        the weights it has. Every step's weights, versioned by the optimizer step."""
        return self.state.global_step

    def _sample_generation_ahead(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> None:
        """Starts sampling a training generation batch in the background; :meth:`_generate` takes the result."""
        rows = self._generation_rows(prompt_rows)
        prompts, mask = self._prompt_arrays([list(row["prompt_ids"]) for row in rows])
        vision = self._vision_inputs(rows, prompts) if self._image_slots else None
        self.rollout_worker.sample_ahead(prompts, mask, self._completion_limit,
                                         self._generation_seed(epoch, generation_index), vision)

    def _batches(self, epoch: int, skip: int = 0) -> Iterable[dict]:
        """The generation batches of ``epoch`` (each sampled when its first micro-batch is due, with the weights of
        the steps before it), split into micro-batches, ``gradient_accumulation_steps`` of them stacked per optimizer
        step; each is trained on ``schedule.passes`` times. With :attr:`_generations_ahead` batches sampled ahead, the
        next ones are sampled while this one trains: they are asked for before this one is awaited (the loop's first
        batch is sampled ahead too), so on a paged engine's stream the slots this batch's completions free take the
        next one's. Sampling ahead, the worker gets the weights of :meth:`_sampler_weights_version` when the loop
        starts and after each optimizer step (:meth:`RolloutWorker.weights_changed`)."""
        schedule = self._generation_schedule()
        accumulation = self.args.gradient_accumulation_steps
        per_generation = schedule.passes * schedule.micro_batches
        order = self._get_train_sampler(epoch)
        first = skip * accumulation
        if first % per_generation:
            warnings.warn("resuming in the middle of a generation batch: it is sampled again with the restored "
                          "weights, so these steps differ from the uninterrupted run.", UserWarning, stacklevel=2)
        sharding = mesh_lib.batch_sharding(self.mesh, batch_axis=1)
        group: list[dict] = []
        buffered, buffered_index = None, -1
        last = self._steps_per_epoch() * accumulation
        size = schedule.micro_size
        ahead = self._generations_ahead
        asked = -1  # the last generation batch asked for ahead

        def prompt_rows(index: int) -> list[dict]:
            return [self.train_dataset[int(i)] for i in order[index * schedule.prompts:(index + 1) * schedule.prompts]]

        def sync_sampler(starting: bool) -> None:
            version = self._sampler_weights_version(starting)
            if version is not None and ahead:  # a batch sampled when due takes the current weights anyway
                self.rollout_worker.weights_changed(version)

        try:
            sync_sampler(starting=True)
            for micro in range(first, last):
                generation_index, within = divmod(micro, per_generation)
                if generation_index != buffered_index:
                    # This batch (at the loop's start) and the `ahead` after it are asked for before it is awaited.
                    upcoming = range(max(asked + 1, generation_index), generation_index + ahead + 1) if ahead else ()
                    for index in upcoming:
                        if index * per_generation < last:
                            self._sample_generation_ahead(prompt_rows(index), epoch, index)
                            asked = index
                    buffered = self._generation_batch(prompt_rows(generation_index), epoch, generation_index)
                    buffered_index = generation_index
                part = within % schedule.micro_batches
                # A column may be a dict of arrays (Qwen-VL's images): sliced and stacked leaf by leaf.
                rows = slice(part * size, (part + 1) * size)
                group.append(jax.tree.map(lambda value, rows=rows: value[rows], buffered))
                if len(group) == accumulation:
                    # Image arrays of micro-batches sampled apart may be bucketed to different patch counts.
                    stacked = jax.tree.map(rollout_images.stack_padded, *group)
                    group = []
                    yield mesh_lib.place_batch(stacked, sharding, size, batch_axis=1)
                    sync_sampler(starting=False)  # an optimizer step ran on the batch yielded
        finally:
            self.rollout_worker.drop_samples_ahead()
