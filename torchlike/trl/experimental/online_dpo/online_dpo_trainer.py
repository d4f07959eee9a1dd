"""``OnlineDPOTrainer``: TRL 1.16's ``trl.experimental.online_dpo.OnlineDPOTrainer`` (Online DPO, "Direct Language
Model Alignment from Online AI Feedback") on torchlike's online trainer.

Each micro-batch takes ``per_device_train_batch_size`` prompts (per data-parallel shard) and samples two completions of
each with the policy (the rollout engine, with the weights of the steps before it). The reward functions (callables or
reward models, weighted by ``reward_weights``, minus ``missing_eos_penalty`` for a completion without an end token)
rank each pair into chosen and rejected; the loss is DPO's on the pair (``sigmoid`` or ``ipo``, ``beta`` per epoch)
against a frozen reference: ``ref_model``, the base weights with the LoRA adapter off when ``peft_config`` is given,
else a frozen copy of the initial policy (``adapters.losses.online_dpo``). TRL's ``objective/*``, ``rewards/*``,
``logps/*``, ``val/contain_eos_token`` and ``beta`` metrics are logged, as means over the micro-batches since the last
log.

The loop here is what Online DPO, XPO and Nash-MD share (sampling, scoring, the reference's log-probabilities, one
generation per micro-batch, the summed gradient); what each samples, how it ranks and what its loss is, is its
:class:`OnlinePreferenceAlgorithm` (:class:`OnlineDPO` here, ``XPO`` and ``NashMD`` in their packages). XPO's and
Nash-MD's trainers subclass this one, as in TRL, and override none of its methods.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np

from ....adapters.distributed import mesh as mesh_lib
from ....adapters.losses import online_dpo as online_dpo_losses
from ....adapters.rollout import sampling
from ....training.trainer import Trainer
from ....type_aliases import (
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
)
from ...data import prompt_vision
from ...online import reward_models
from ...online.reward_scorer import reward_name
from ...online.rollouts import GenerationSchedule
from ...trainer.base_trainer import check_causal_lm, is_vision_dataset, vision_processor
from ...trainer.online_trainer import OnlineTrainer
from .judged_pairs import epoch_value, with_bos_first
from .online_dpo_config import OnlineDPOConfig
from .online_dpo_data import preference_columns, prepare_prompt_rows

__all__ = ["OnlineDPO", "OnlineDPOTrainer", "OnlinePreferenceAlgorithm"]

#: Why the online preference trainers do not evaluate.
_NO_EVALUATION = ("TRL's OnlineDPOTrainer, XPOTrainer and NashMDTrainer have no evaluation loop (transformers' "
                  "prediction_step calls the model on the prompt batch and fails there), so torchlike's do not "
                  "evaluate either.")


class OnlinePreferenceAlgorithm:
    """What one online preference algorithm decides on :class:`OnlineDPOTrainer`'s loop: how its prompt rows are
    tokenised, what one micro-batch samples and how it is ranked into the step's columns, and the step loss.

    Args:
        trainer: the loop it runs in; the algorithm samples through its :meth:`~OnlineDPOTrainer._generate` (with
            rollout workers of its own for a second model), scores with its ``reward_scorer`` and reads its
            tokenizer, end tokens, reference and config.
    """

    completions_per_prompt = 2
    """Rows of the step's columns per prompt (a micro-batch of ``per_device_train_batch_size`` prompts per
    data-parallel shard has this many times as many rows)."""
    takes_images = False
    """Whether image prompts (an ``image`` or ``images`` column) are trained on; TRL 1.0.0's XPO and Nash-MD take
    text prompts only."""
    bos_first = False
    """Whether each prompt gets the tokenizer's BOS token first unless it starts with it, as TRL 1.0.0's
    ``tokenize_row`` does for XPO and Nash-MD (their ``training_step`` tokenises with it)."""

    def __init__(self, trainer: OnlineDPOTrainer):
        self.trainer = trainer

    def prepare(self, rows: list[dict]) -> list[dict]:
        """The prompt rows as the algorithm tokenises them: as Online DPO's ``prepare_prompt_rows`` does, BOS first with
        :attr:`bos_first`."""
        return with_bos_first(rows, self.trainer.tokenizer.bos_token_id) if self.bos_first else rows

    def generation_batch(self, prompt_rows: list[dict], epoch: int, seed: int) -> dict[str, np.ndarray]:
        """The step's columns of one micro-batch of ``prompt_rows``, sampled with ``seed`` in ``epoch``."""
        raise NotImplementedError

    def step_loss(self) -> Callable:
        """The jitted step's loss, ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)``."""
        raise NotImplementedError


class OnlineDPO(OnlinePreferenceAlgorithm):
    """TRL 1.16's Online DPO: two policy completions of each prompt (all first completions, then all second ones, as
    TRL's ``prompt_ids.repeat(2, 1)``), ranked by the weighted rewards into chosen and rejected; DPO's loss on the
    pair (``adapters.losses.online_dpo``). Image prompts are sampled and scored with their images, as TRL's vision
    path does."""

    takes_images = True

    def generation_batch(self, prompt_rows: list[dict], epoch: int, seed: int) -> dict[str, np.ndarray]:
        trainer = self.trainer
        record = trainer._generate(list(prompt_rows) * 2, seed)
        window = int(record.completion_mask.sum(axis=1).max())
        # TRL's reward functions get the completions as generated: padded to the longest one of the micro-batch.
        padded_ids = [row.tolist() for row in record.tokens[:, :window]]
        table = trainer.reward_scorer.score(dataclasses.replace(record, completion_ids=padded_ids))
        rewards = np.nansum(table * trainer.reward_weights[None], axis=1)
        return preference_columns(record.prompt_ids, record.prompt_mask, record.tokens, record.completion_mask,
                                  rewards, trainer.args.missing_eos_penalty, trainer._beta_of(epoch),
                                  trainer.eos_token_ids, trainer.args.max_length, record.images,
                                  record.prompt_token_types)

    def step_loss(self) -> Callable:
        """TRL's online DPO loss (:func:`adapters.losses.online_dpo.online_dpo_step_loss`) with the config's
        settings."""
        settings = online_dpo_losses.OnlineDPOLossSettings.from_config(self.trainer.args)
        return online_dpo_losses.online_dpo_step_loss(self.trainer.model.family, settings)


class OnlineDPOTrainer(OnlineTrainer):
    """``trl.experimental.online_dpo.OnlineDPOTrainer`` with TRL 1.16's signature, training a torchlike model on a
    JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``).
        ref_model: the reference, a loaded :class:`~torchlike.CausalLM` other than ``model``; ``None`` uses the base
            weights with the adapter off when ``peft_config`` is given, else a frozen copy of the initial policy.
        reward_funcs: a reward function or a list of them, called as ``f(prompts=..., completions=...,
            completion_ids=..., trainer_state=..., <dataset columns>=..., **)`` with the two completions of every
            prompt (``completion_ids`` padded to the micro-batch's longest completion, as TRL gives them), returning
            one ``float`` or ``None`` per completion; or a reward model (a path / hub id or a loaded sequence
            classifier) scoring prompt + completion.
        args: :class:`OnlineDPOConfig` (default: one with ``output_dir="<model>-OnlineDPO"``).
        data_collator, compute_metrics, preprocess_logits_for_metrics: refused: the micro-batches are the sampled
            pairs, and TRL's online DPO has no evaluation loop.
        train_dataset: rows with a ``prompt`` (text, or chat messages rendered with the chat template and the
            generation prompt) and any columns the reward functions read. With an ``image`` (or ``images``) column,
            as in TRL's vision path, the prompts are chat messages whose first user turn gets the images, rendered
            and processed by ``processing_class`` (the model's processor); completions are sampled and scored with
            the images, and no prompt token is cut by ``max_length``.
        eval_dataset: kept as ``trainer.eval_dataset``, as TRL keeps it; evaluating is refused (TRL's
            ``OnlineDPOTrainer`` cannot evaluate: transformers' ``prediction_step`` calls the model on the prompt
            batch), as is an ``eval_strategy`` other than ``"no"`` in the config.
        processing_class: the tokenizer, or a vision-language model's processor for image prompts (required, as in
            TRL); without a pad token the tokenizer's eos token pads.
        reward_processing_classes: the reward models' tokenizers: one, or a list with one entry per reward function;
            ``None`` entries load the reward model's own.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter; the reference is then the base.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        quantization_config: a ``BitsAndBytesConfig``-like request applied when ``model`` is a string.

    Raises:
        ValueError: TRL's errors (no ``train_dataset``, ``ref_model`` being ``model``, no ``reward_funcs``, reward
            processing classes or ``reward_weights`` not one per reward function, no ``processing_class``,
            ``model_init_kwargs`` with a loaded model) or a refused argument.
        NotImplementedError: a ``loss_type`` other than ``"sigmoid"`` and ``"ipo"`` (TRL's message).

    Example:

    ```python
    >>> from torchlike.trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    >>> def short(completions, **kwargs):
    ...     return [-len(completion) for completion in completions]
    >>> trainer = OnlineDPOTrainer(model="path/to/Qwen2.5-0.5B-Instruct", reward_funcs=short,
    ...                            args=OnlineDPOConfig("out", max_new_tokens=32, beta=0.1),
    ...                            train_dataset=[{"prompt": "Say hello."}] * 64, processing_class=tokenizer)
    >>> trainer.train()
    ```
    """

    algorithm_class: type[OnlinePreferenceAlgorithm] = OnlineDPO
    """The algorithm the loop trains with (an instance is :attr:`algorithm`)."""
    _allow_prefetch = False  # each micro-batch samples with the weights of the steps before it
    _config_class = OnlineDPOConfig
    _output_suffix = "OnlineDPO"
    _tag_names = ["trl", "online-dpo"]
    num_generations = 2
    """TRL's attribute: completions sampled per prompt."""

    def __init__(self, model: ModelLike, ref_model: ModelLike | None = None,
                 reward_funcs: RewardFunc | list[RewardFunc] | None = None, args: OnlineDPOConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 reward_processing_classes: Tokenizer | list[Tokenizer] | None = None,
                 peft_config: PeftConfigLike | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: QuantizationConfig | None = None):
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
                             "same as `model`, either omit the `ref_model` argument or pass `None`.")
        if reward_funcs is None:
            raise ValueError("`reward_funcs` must be provided.")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        if isinstance(reward_processing_classes, list) and len(reward_processing_classes) != len(reward_funcs):
            raise ValueError("The number of reward processing classes must match the number of reward functions.")
        refused = {name: value for name, value in (("data_collator", data_collator),
                                                   ("compute_metrics", compute_metrics),
                                                   ("preprocess_logits_for_metrics", preprocess_logits_for_metrics))
                   if value is not None}
        if refused:
            raise ValueError(f"OnlineDPOTrainer does not take {', '.join(refused)}: its micro-batches are the pairs "
                             "it samples and ranks, and TRL's OnlineDPOTrainer has no evaluation loop of its own "
                             "(transformers' prediction_step calls the model on the prompt batch and fails).")
        args = self._trl_args(model, args)
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ValueError(f"Number of reward weights ({len(args.reward_weights)}) must match number of reward "
                             f"functions ({len(reward_funcs)})")
        if processing_class is None:
            raise ValueError("`processing_class` must be provided.")
        if not isinstance(model, str | os.PathLike) and args.model_init_kwargs is not None:
            raise ValueError("You passed `model_init_kwargs` to the `OnlineDPOConfig`, but your model is already "
                             "instantiated. This argument can only be used when the `model` argument is a string.")
        online_dpo_losses.check_loss_type(args.loss_type)
        with_images = is_vision_dataset(train_dataset)
        if with_images and not self.algorithm_class.takes_images:
            raise ValueError(f"{self._trainer_name} trains on text prompts only (TRL's has no vision path); drop the "
                             "'image'/'images' column, or train on images with OnlineDPOTrainer.")
        if ref_model is not None:
            check_causal_lm(ref_model, "ref_model", self._trainer_name)
        model, processing_class = self._trl_model(str(model) if isinstance(model, os.PathLike) else model, args,
                                                  processing_class, peft_config, quantization_config)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if tokenizer.pad_token is None:  # TRL pads with the eos token then, on the tokenizer itself
            tokenizer.pad_token = tokenizer.eos_token
        self._processor = vision_processor(model, processing_class) if with_images else None
        self.reward_funcs = reward_models.reward_functions(reward_funcs, reward_processing_classes, args, model)
        self.reward_func_names = [reward_name(function) for function in self.reward_funcs]
        given = reward_processing_classes if isinstance(reward_processing_classes, list) else \
            [reward_processing_classes] * len(self.reward_funcs)
        self.reward_processing_classes = [function.tokenizer if isinstance(function, reward_models.RewardModel)
                                          else entry for function, entry in zip(self.reward_funcs, given, strict=True)]
        self.reward_weights = np.asarray(args.reward_weights or [1.0] * len(self.reward_funcs), np.float32)
        self._setup_sampling(args, model, processing_class)
        self.tools, self.tool_calling = [], None
        self.algorithm = self.algorithm_class(self)
        train_rows = self._prepare(train_dataset, "train_dataset")
        self.prompt_length = sampling.bucket_length(max(len(row["prompt_ids"]) for row in train_rows))
        largest = max([self.pad_token_id, *self.eos_token_ids, *(max(row["prompt_ids"], default=0)
                                                                 for row in train_rows)])
        self._check_token_ids(largest, processing_class, {"model": model, "ref_model": ref_model})
        super().__init__(model=model, args=args, train_dataset=train_rows, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers)
        self.eval_dataset = eval_dataset  # kept as TRL keeps it; evaluate() is refused
        self._init_reference(ref_model, adapter_off=peft_config is not None, copy=True)
        self._reference_pass = online_dpo_losses.make_reference_pass(self.reference.family, self.reference.lora,
                                                                     self._compute_dtype())
        # TRL's attributes.
        self._beta = args.beta
        self.max_length = args.max_length

    def evaluate(self, eval_dataset: EvalRowsLike | str | None = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Refused: TRL's ``OnlineDPOTrainer`` (and XPO and Nash-MD) has no evaluation loop.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{self._trainer_name}.evaluate(): {_NO_EVALUATION}")

    @property
    def beta(self) -> float:
        """The DPO temperature of the current epoch: ``args.beta``, or with a list its entry for the epoch (the last
        one after it)."""
        return self._beta_of(int(self.state.epoch or 0))

    def _beta_of(self, epoch: int) -> float:
        return epoch_value(self._beta, epoch)

    # ------------------------------------------------------------------ set-up
    def _prepare(self, dataset: RowsLike, name: str) -> list[dict]:
        if self._processor is not None and is_vision_dataset(dataset):
            rows = prompt_vision.prepare_vision_prompts(dataset, self._processor, name)
            self._image_slots = max(self._image_slots, *(len(prompt_vision.row_images(row)) for row in rows))
            return self.algorithm.prepare(rows)
        return self.algorithm.prepare(prepare_prompt_rows(dataset, self.tokenizer, name))

    @property
    def _completion_limit(self) -> int:
        return self.args.max_new_tokens

    def _step_loss(self) -> tuple[Callable, None]:
        """The algorithm's step loss."""
        return self.algorithm.step_loss(), None

    def _run_step(self, step_fn: Callable, batch: dict, step: int) -> dict:
        """The optimizer step, whose gradient is the sum of its micro-batches' (as TRL's), with the logged loss their
        mean (TRL's ``loss / gradient_accumulation_steps`` per micro-batch)."""
        outputs = super()._run_step(step_fn, batch, step)
        return {**outputs, "loss": outputs["loss"] / self.args.gradient_accumulation_steps}

    def log(self, logs: dict[str, float]) -> None:
        """Logs as TRL's ``_maybe_log_save_evaluate``, which rounds the training loss to 4 decimals."""
        if "loss" in logs:
            logs["loss"] = round(logs["loss"], 4)
        super().log(logs)

    # ------------------------------------------------------------------ batches
    _generation_batch_fields = "per_device_train_batch_size x data-parallel size"

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """transformers' order of the prompts (TRL's online DPO uses the Trainer's sampler)."""
        return Trainer._get_train_sampler(self, epoch)

    def _generation_schedule(self) -> GenerationSchedule:
        """One generation per micro-batch, trained on once: the algorithm's rows per prompt for each of its
        prompts."""
        per_prompt = self.algorithm.completions_per_prompt
        return GenerationSchedule(per_prompt * self._global_batch_size(), 1, 1, per_prompt)

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        """The algorithm's columns of one micro-batch, with the reference's log-probabilities."""
        columns = self.algorithm.generation_batch(prompt_rows, epoch, self._generation_seed(epoch, generation_index))
        columns["ref_logps"] = self._reference_log_probs(columns)
        return columns

    def _reference_log_probs(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """``[2B, C]`` the reference's per-token log-probabilities over the generation window."""
        inputs = {name: columns[name] for name in ("input_ids", "attention_mask", "position_ids", "completion_window",
                                                   *online_dpo_losses.VISION_COLUMNS) if name in columns}
        rows = len(inputs["input_ids"])
        with mesh_lib.entered(self.mesh):
            placed = mesh_lib.place_batch(inputs, mesh_lib.rows_sharding(self.mesh, rows), rows)
            values = self._reference_pass(self.reference.module, placed)
        return np.asarray(mesh_lib.to_host(values), np.float32)

    def _evaluation_loop(self, examples: Sequence[dict], metric_key_prefix: str) -> dict[str, float]:
        raise ValueError("OnlineDPOTrainer has no evaluation, as TRL's: sample and score held-out prompts yourself.")
