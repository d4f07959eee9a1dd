"""``A2POTrainer``: TRL 1.16's ``trl.experimental.a2po.A2POTrainer`` (A*-PO, "Accelerating RL for LLM Reasoning with
Optimal Advantage Regression") on torchlike's online trainer.

Stage 1, when training (or evaluation) first starts: ``num_value_samples`` completions of every train and eval prompt
are sampled from the reference, a frozen copy of the initial policy, and scored by the reward functions; each prompt's
optimal value ``V*`` is kept (``adapters.losses.a2po.optimal_values``), and with ``filter_all_incorrect`` the training
prompts whose completions all scored 0 are dropped. Stage 2: each micro-batch samples one completion per prompt with
the policy (the weights of the steps before it), scores it, and regresses ``beta2 * log(pi / pi_ref)`` onto
``r - V*`` (``adapters.losses.a2po.a2po_step_loss``). The reward functions are called as TRL calls them:
``f(prompts=..., completions=..., <dataset columns>=...)``, the completions decoded text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ....adapters.distributed import mesh as mesh_lib
from ....adapters.losses.a2po import A2POLossSettings, a2po_step_loss, optimal_values
from ....adapters.losses.grpo import make_log_prob_pass
from ....adapters.rollout import derived_seed, sampling
from ....adapters.training import train_step
from ....training import step_logs
from ....training.batches import each_dataset, map_datasets
from ....training.trainer import Trainer
from ....type_aliases import DatasetLike, EvalDatasetLike, ModelLike, ProcessingClass, RowsLike, TRLArgs
from ...data_utils import get_dataset_column_names, is_message_list
from ...online.rollouts import GenerationSchedule, Rollout
from ...trainer.base_trainer import check_text_dataset
from ...trainer.online_trainer import OnlineTrainer
from ..online_dpo.online_dpo_data import prompt_text
from .a2po_config import A2POConfig

if TYPE_CHECKING:
    from ....training.trainer import TrainOutput

__all__ = ["A2POTrainer"]

#: Row keys the trainer adds (not dataset columns: the reward functions do not get them).
_ADDED = ("prompt_ids", "prompt_text")
#: Columns TRL does not pass to the reward functions.
_NOT_REWARD_KWARGS = ("prompt", "completion", *_ADDED)


class A2POTrainer(OnlineTrainer):
    """``trl.experimental.a2po.A2POTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM`, a ``transformers`` model object (converted: the same weights, dtype and
            ``name_or_path``), or a path / hub id loaded with ``args.model_init_kwargs``.
        reward_funcs: a reward function or a list of them, called as ``f(prompts=..., completions=..., <dataset
            columns>=...)`` (``completions`` the decoded texts) and returning one float per completion; their
            weighted sum (``reward_weights``) is the reward, which A*-PO assumes to be 0 or 1.
        args: :class:`A2POConfig` (default: one with ``output_dir="<model>-A2PO"``).
        train_dataset: rows with a ``prompt`` (text, or chat messages rendered with the chat template and the
            generation prompt) and any columns the reward functions read.
        eval_dataset: the same kind of rows (or a dict of such datasets); their ``V*`` is estimated in stage 1 too.
        processing_class: the tokenizer (default: loaded from the model's path); without a pad token its eos token
            pads.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.

    Raises:
        ValueError: no ``train_dataset``, no ``prompt`` column, ``reward_weights`` not one per reward function, or
            every training prompt dropped by ``filter_all_incorrect``.
        TypeError: a reward that is not a callable.

    Example:

    ```python
    >>> from torchlike.trl.experimental.a2po import A2POConfig, A2POTrainer
    >>> def correct(completions, answer, **kwargs):
    ...     return [float(text.strip() == value) for text, value in zip(completions, answer)]
    >>> trainer = A2POTrainer(model="path/to/Qwen2.5-0.5B-Instruct", reward_funcs=correct,
    ...                       args=A2POConfig("out", num_value_samples=8, max_completion_length=64),
    ...                       train_dataset=[{"prompt": "2 + 2 =", "answer": "4"}] * 64)
    >>> trainer.train()
    ```
    """

    _allow_prefetch = False  # each micro-batch samples with the weights of the steps before it
    _config_class = A2POConfig
    _output_suffix = "A2PO"
    _tag_names = ["trl", "a2po"]

    def __init__(self, model: ModelLike, reward_funcs: Callable | list[Callable], args: A2POConfig | None = None,
                 train_dataset: DatasetLike | None = None, eval_dataset: EvalDatasetLike | None = None,
                 processing_class: ProcessingClass | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None)):
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: rows with a 'prompt' column.")
        args = self._trl_args(model, args)
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        for function in reward_funcs:
            if not callable(function):
                raise TypeError(f"A2POTrainer's reward_funcs are callables f(prompts, completions, **columns) -> "
                                f"list[float], as in TRL; got {type(function).__name__}. Wrap a reward model in such "
                                "a function.")
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ValueError(f"Number of reward weights ({len(args.reward_weights)}) must match number of reward "
                             f"functions ({len(reward_funcs)})")
        check_text_dataset(train_dataset)
        model, processing_class = self._trl_model(model, args, processing_class, None, None)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        self.reward_funcs = reward_funcs
        self.reward_weights = np.asarray(args.reward_weights or [1.0] * len(reward_funcs), np.float32)
        self._setup_sampling(args, model, processing_class)
        self.tools, self.tool_calling = [], None
        train_rows = self._prepare(train_dataset, "train_dataset")
        eval_rows = map_datasets(eval_dataset, lambda dataset: self._prepare(dataset, "eval_dataset"))
        every_row = [*train_rows, *(row for rows in each_dataset(eval_rows) for row in rows)]
        self.prompt_length = sampling.bucket_length(max(len(row["prompt_ids"]) for row in every_row))
        largest = max([self.pad_token_id, *self.eos_token_ids, *(max(row["prompt_ids"], default=0)
                                                                 for row in every_row)])
        self._check_token_ids(largest, processing_class, {"model": model})
        super().__init__(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        self._init_reference(copy=True)
        self._reference_pass = make_log_prob_pass(self.reference.family, 1.0, self.reference.lora,
                                                  self._compute_dtype())
        self._optimal_values: dict[str, float] | None = None

    # ------------------------------------------------------------------ set-up
    def _sampling_overrides(self, args: TRLArgs) -> dict:
        """None: ``A2POConfig`` has no ``generation_kwargs``."""
        return {}

    def _prepare(self, dataset: RowsLike, name: str) -> list[dict]:
        """The rows with their rendered prompt (TRL's ``maybe_apply_chat_template``) and its token ids (no special
        tokens, truncated to ``max_prompt_length`` as the tokenizer truncates); only ``prompt`` with
        ``remove_unused_columns``."""
        columns = get_dataset_column_names(dataset)
        if "prompt" not in columns:
            raise ValueError(f"{name} has no 'prompt' column (found {columns}); A*-PO samples completions of "
                             "'prompt' (text or a list of chat messages); other columns reach the reward functions.")
        tokenizer, limit = self.tokenizer, self.args.max_prompt_length
        rows = []
        for index, row in enumerate(dataset):
            prompt = row["prompt"]
            if not isinstance(prompt, str) and not is_message_list(prompt):
                raise ValueError(f"{name} row {index}: 'prompt' must be a string or a list of chat messages, got "
                                 f"{type(prompt).__name__}.")
            row = {"prompt": prompt} if self.args.remove_unused_columns else dict(row)
            row["prompt_text"] = prompt_text(prompt, tokenizer)
            truncation = {} if limit is None else {"truncation": True, "max_length": limit}
            row["prompt_ids"] = tokenizer(row["prompt_text"], add_special_tokens=False, **truncation)["input_ids"]
            rows.append(row)
        if not rows:
            raise ValueError(f"{name} is empty.")
        return rows

    def _step_loss(self) -> tuple[Callable, None]:
        """The stage-2 regression loss (:func:`adapters.losses.a2po.a2po_step_loss`)."""
        return a2po_step_loss(self.model.family, A2POLossSettings.from_config(self.args)), None

    # ------------------------------------------------------------------ stage 1
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Stage 1 (when it has not run yet), then stage 2: transformers' training loop."""
        self._ensure_optimal_values()
        return super().train(resume_from_checkpoint=resume_from_checkpoint)

    @functools.cached_property
    def reference_worker(self) -> object:
        """The reference's :class:`~torchlike.trl.online.rollout_worker.RolloutWorker` (stage 1 samples from it)."""
        return self._new_worker(lambda: self.reference.module, lora=self.reference.lora)

    def _ensure_optimal_values(self) -> None:
        """Stage 1 on first use: ``V*`` of every train and eval prompt, then ``filter_all_incorrect``."""
        if self._optimal_values is not None:
            return
        self._optimal_values, all_incorrect = {}, set()
        for rows in [self.train_dataset, *each_dataset(self._eval_examples)]:
            all_incorrect |= self._estimate_optimal_values(rows)
        if self.args.filter_all_incorrect:
            kept = [row for row in self.train_dataset if row["prompt_text"] not in all_incorrect]
            if not kept:
                raise ValueError(f"filter_all_incorrect dropped all {len(self.train_dataset)} training prompts: every "
                                 "reference completion scored 0, so no prompt has a learning signal. Check the reward "
                                 "functions, raise num_value_samples or max_completion_length, or set "
                                 "filter_all_incorrect=False.")
            self.train_dataset = kept

    def _estimate_optimal_values(self, rows: Sequence[dict]) -> set[str]:
        """Samples ``num_value_samples`` reference completions of each row's prompt (``per_device_train_batch_size``
        prompts at a time, as TRL's stage-1 dataloader), records each prompt's ``V*`` and returns the prompts whose
        completions all scored 0."""
        args = self.args
        count = args.num_value_samples
        size = self._global_batch_size()
        all_incorrect = set()
        for index, start in enumerate(range(0, len(rows), size)):
            batch = list(rows[start:start + size])
            repeated = [row for row in batch for _ in range(count)]
            record = self._generate(repeated, derived_seed(args.seed, index, 2), worker=self.reference_worker)
            rewards = self._rewards(record).reshape(len(batch), count)
            for row, value, row_rewards in zip(batch, optimal_values(rewards, args.beta1), rewards, strict=True):
                self._optimal_values[row["prompt_text"]] = float(value)
                if row_rewards.sum() == 0:
                    all_incorrect.add(row["prompt_text"])
        return all_incorrect

    def _rewards(self, record: Rollout) -> np.ndarray:
        """``[N]`` the weighted sum of the reward functions on the record's decoded completions, called as TRL calls
        them (the prompts as given, the completions as text, the other dataset columns by name)."""
        completions = self.tokenizer.batch_decode(record.completion_ids, skip_special_tokens=True)
        prompts = [row["prompt"] for row in record.rows]
        keys = [key for key in record.rows[0] if key not in _NOT_REWARD_KWARGS]
        columns = {key: [row[key] for row in record.rows] for key in keys}
        table = np.stack([np.asarray(function(prompts=prompts, completions=completions, **columns), np.float32)
                          for function in self.reward_funcs], axis=1)
        return (table * self.reward_weights[None]).sum(axis=1)

    # ------------------------------------------------------------------ stage 2
    _generation_batch_fields = "per_device_train_batch_size x data-parallel size"

    def _generation_schedule(self) -> GenerationSchedule:
        """One completion per prompt, one generation per micro-batch, trained on once."""
        return GenerationSchedule(self._global_batch_size(), 1, 1, 1)

    def _get_train_sampler(self, epoch: int) -> np.ndarray:
        """transformers' order of the prompts (TRL's A*-PO uses the Trainer's sampler)."""
        return Trainer._get_train_sampler(self, epoch)

    def _generations_per_epoch(self) -> int:
        """Micro-batches per epoch as transformers' dataloader makes them: a partial last one too (unless
        ``dataloader_drop_last``), padded with empty rows."""
        size = self._generation_schedule().prompts
        whole, partial = divmod(len(self.train_dataset), size)
        return whole if self.args.dataloader_drop_last else whole + bool(partial)

    def _generation_batch(self, prompt_rows: list[dict], epoch: int, generation_index: int) -> dict[str, np.ndarray]:
        return self._regression_columns(prompt_rows, self._generation_seed(epoch, generation_index))

    def _regression_columns(self, prompt_rows: list[dict], seed: int, size: int | None = None
                            ) -> dict[str, np.ndarray]:
        """The step columns of one micro-batch: a policy completion per prompt, its reward, the prompt's ``V*`` and
        the reference's log-probability, padded with empty rows to ``size`` (default the micro-batch size)."""
        record = self._generate(list(prompt_rows), seed)
        ids = np.concatenate([record.prompt_ids, record.tokens], axis=1)
        columns = {
            "input_ids": ids,
            "attention_mask": np.concatenate([record.prompt_mask, record.completion_mask], axis=1),
            "position_ids": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape),
            "completion_mask": record.completion_mask,
            "rewards": self._rewards(record),
            "v_star": np.asarray([self._optimal_values[row["prompt_text"]] for row in prompt_rows], np.float32),
        }
        columns["ref_logps"] = self._reference_log_probs(columns)
        missing = (size or self._generation_schedule().prompts) - len(prompt_rows)
        if missing > 0:  # a partial last batch: rows without attention, left out of the loss
            columns = {key: np.concatenate([value, np.zeros((missing, *value.shape[1:]), value.dtype)])
                       for key, value in columns.items()}
        return {key: np.ascontiguousarray(value) for key, value in columns.items()}

    def _reference_log_probs(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """``[B]`` the reference's summed log-probabilities of the completions."""
        inputs = {name: columns[name] for name in ("input_ids", "attention_mask", "position_ids", "completion_mask")}
        rows = len(inputs["input_ids"])
        with mesh_lib.entered(self.mesh):
            placed = mesh_lib.place_batch(inputs, mesh_lib.rows_sharding(self.mesh, rows), rows)
            per_token = np.asarray(mesh_lib.to_host(self._reference_pass(self.reference.module, placed)), np.float32)
        return (per_token * columns["completion_mask"]).sum(axis=1).astype(np.float32)

    # ------------------------------------------------------------------ evaluation
    def _prepare_eval_dataset(self, dataset: RowsLike) -> list[dict]:
        """Raw eval rows prepared as the train rows are; their ``V*`` is estimated when they are new."""
        rows = super()._prepare_eval_dataset(dataset)
        if self._optimal_values is not None:
            self._estimate_optimal_values([row for row in rows if row["prompt_text"] not in self._optimal_values])
        return rows

    def _evaluation_loop(self, examples: Sequence[dict], metric_key_prefix: str) -> dict[str, float]:
        """TRL's evaluation (its ``prediction_step``): stage 1 first if it has not run, then for each batch of
        ``per_device_eval_batch_size x`` data-parallel size prompts one policy completion each and the loss on it.
        ``<prefix>_loss`` is the mean over prompts of their batch's loss; ``reward``, ``v_star``,
        ``implicit_reward`` and ``advantage`` are means over batches, as TRL's logged lists."""
        self._ensure_optimal_values()
        size = self.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(self.mesh)
        if "_eval_step" not in self.__dict__:  # one jitted step for every evaluation
            self._eval_step = train_step.make_eval_step(self._loss()[0], self._compute_dtype())
        outputs, rows = [], []
        with mesh_lib.entered(self.mesh):
            for index, start in enumerate(range(0, len(examples), size)):
                batch_rows = list(examples[start:start + size])
                seed = self._generation_seed(int(self.state.epoch or 0), index, train=False)
                batch = self._regression_columns(batch_rows, seed, size)
                placed = mesh_lib.place_batch(batch, mesh_lib.rows_sharding(self.mesh, size), size)
                outputs.append(self._eval_step(self._module, placed))
                rows.append(len(batch_rows))
        outputs = mesh_lib.to_host(outputs)
        losses = [float(value) / max(float(weight), 1e-12) for value, weight, _ in outputs]
        metrics = {f"{metric_key_prefix}_{key.removeprefix('eval_')}": value
                   for key, value in step_logs.evaluation_metrics(outputs, runtime=0.0).items()
                   if key not in ("eval_loss", "eval_runtime")}
        metrics[f"{metric_key_prefix}_loss"] = float(np.average(losses, weights=rows))
        return metrics

