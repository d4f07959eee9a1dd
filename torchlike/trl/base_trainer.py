"""``TRLTrainer``: what every TRL trainer shares, on torchlike's ``Trainer``.

The config (the default ``"<model>-<SUFFIX>"`` one, a ``TrainingArguments`` converted, its fields checked once), the
model (a path or hub id loaded with ``args.model_init_kwargs``, float32 unless they set ``dtype``, as TRL's
``create_model_from_path``; a LoRA adapter from ``peft_config``; the trainer's tags), the default tokenizer, the pad
token, the token-id check against every model's vocabulary, ``disable_dropout``, the reference policy
(``adapters.reference_policy``: a ``ref_model``, the adapter-off base, a frozen copy or the initial weights) with its
precomputed log-prob columns, and TR-DPO's reference sync. SFT, DPO and GRPO (and each new TRL trainer) are subclasses
that add their data preparation and step loss.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from transformers import TrainerCallback

from ..adapters import mesh as mesh_lib
from ..adapters import (
    multihost,
    reference_policy,
    reference_sync,
    rollout,
    sampling,
    step_metrics,
    train_step,
    tunix_grpo,
)
from ..adapters.lora import runtime as lora_runtime
from ..training import Trainer
from ..training_args import TrainingArguments
from ..version import repetition_penalty_skips_left_padding
from .base_config import round_up_to_multiple
from .grpo_data import left_padded
from .sft_data import pad_token_id_for

__all__ = ["OnlineTrainer", "PrecomputedReferenceTrainer", "SyncRefModelCallback", "TRLTrainer", "check_reference_sync",
           "check_text_dataset", "default_output_dir", "load_model"]


def default_output_dir(model: Any, suffix: str) -> str:
    """TRL's default ``output_dir``: ``"<last part of the model id>-<suffix>"`` (e.g. ``"Qwen2.5-0.5B-SFT"``)."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or "model"
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


def check_causal_lm(model: Any, name: str, trainer: str) -> None:
    """Raises ``TypeError`` unless ``model`` is a torchlike causal LM (``CausalLM`` or ``PeftModel``)."""
    if getattr(model, "family", None) is None:
        raise TypeError(f"{trainer}'s {name} must be a torchlike causal LM; got {type(model).__name__}. Load it "
                        "with torchlike.AutoModelForCausalLM.from_pretrained(...).")


def load_model(model: Any, args: Any, quantization_config: Any, trainer: str) -> Any:
    """``model`` as a torchlike model.

    Args:
        model: a loaded torchlike model, or a path / hub id.
        args: the trainer config (its ``model_init_kwargs`` apply to a path or hub id).
        quantization_config: a ``BitsAndBytesConfig``-like request for a path or hub id.
        trainer: the trainer's name, for messages.

    Returns:
        The loaded (or given) model.
    """
    from .. import AutoModelForCausalLM

    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError("quantization_config was given both to the trainer and in args.model_init_kwargs; "
                                 "set it in one place, preferably the trainer argument.")
            init_kwargs["quantization_config"] = quantization_config
        init_kwargs.setdefault("dtype", "float32")
        return AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
    if quantization_config is not None:
        raise ValueError("quantization_config only applies when the model is loaded from a path or hub id (a str); "
                         "the model passed is already loaded. Pass its path, or omit quantization_config.")
    if args.model_init_kwargs is not None:
        warnings.warn("args.model_init_kwargs is ignored: the model is already loaded (pass a path or hub id to "
                      "load it with these arguments).", UserWarning, stacklevel=3)
    check_causal_lm(model, "model", trainer)
    return model


def check_text_dataset(dataset: Any) -> None:
    """TRL's refusal of vision data (an ``image`` or ``images`` column) for a text model: torchlike's models are
    text-only."""
    if dataset is None:
        return
    names = getattr(dataset, "column_names", None)
    if names is None:  # a list of rows; a plain iterator is not read, so that no row is consumed
        first = dataset[0] if isinstance(dataset, list) and dataset else None
        names = list(first) if isinstance(first, dict) else []
    if "image" in names or "images" in names:
        raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys), but the "
                         "provided model does not seem to be a vision-language model. Please check your model and "
                         "dataset. (torchlike's model families are text-only.)")


def check_reference_sync(args: Any, model: Any, trainer: str) -> None:
    """TRL's refusal of ``sync_ref_model`` with a LoRA adapter (the reference is the adapter switched off, so there
    is no reference model to update)."""
    if getattr(args, "sync_ref_model", False) and hasattr(model, "peft_config"):
        raise NotImplementedError(
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
            f"{trainer} does not keep a separate reference model in memory; instead, it recovers reference behavior "
            "by temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to "
            "synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference "
            "model.")


class SyncRefModelCallback(TrainerCallback):
    """TRL's ``SyncRefModelCallback`` (TR-DPO): after every ``ref_model_sync_steps``-th optimizer step the reference
    becomes ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``.

    Args:
        reference: the reference NNX module, updated in place.
        policy: returns the NNX module being trained.
    """

    def __init__(self, reference: Any, policy: Callable[[], Any]):
        self.reference = reference
        self.policy = policy

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            reference_sync.mix_into(self.reference, self.policy(), args.ref_model_mixup_alpha)


class TRLTrainer(Trainer):
    """The base of torchlike's TRL trainers: a subclass calls :meth:`_trl_args` first, its own input checks, then
    :meth:`_trl_model`, prepares its data, calls ``Trainer.__init__`` and, when it has a reference policy,
    :meth:`_init_reference`.

    Subclasses set ``_config_class`` (their config), ``_output_suffix`` (TRL's default ``output_dir`` suffix) and
    ``_tag_names`` (the tags added to the model card).
    """

    _config_class: type = TrainingArguments
    _output_suffix: str = "trainer"
    _tag_names: list[str] = ["trl"]
    #: Whether the step loss reports ``num_tokens`` per micro-batch, which :meth:`log` makes TRL's running total.
    _counts_step_tokens = False

    @property
    def _trainer_name(self) -> str:
        return type(self).__name__

    def _trl_args(self, model: Any, args: Any) -> Any:
        """The trainer's config: ``args``; ``None`` becomes TRL's default (``output_dir="<model>-<SUFFIX>"``), a
        ``TrainingArguments`` of another class the trainer's config with its values (as TRL's ``SFTTrainer``). Its
        fields are checked here, once (ignored fields warn, refused ones raise), and ``Trainer.__init__`` does not
        check them again."""
        from ..field_support import check_unsupported

        config_class = self._config_class
        if args is None:
            args = config_class(output_dir=default_output_dir(model, self._output_suffix))
        elif isinstance(args, TrainingArguments) and not isinstance(args, config_class):
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides the hub_token
            args = config_class(**values)
        check_unsupported(args)
        self.args = self._checked_args = args
        return args

    def _trl_model(self, model: Any, args: Any, processing_class: Any, peft_config: Any,
                   quantization_config: Any) -> tuple[Any, Any]:
        """``(model, processing_class)``: the model loaded (a path or hub id) or checked, a new LoRA adapter added
        for ``peft_config`` (seeded with ``args.seed``, as TRL seeds before creating it), ``sync_ref_model`` refused
        with an adapter, the trainer's tags added, and the tokenizer of the model's path when none is given."""
        from .. import AutoTokenizer
        from ..peft import get_peft_model

        model = self._load_model(model, args, quantization_config)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.name_or_path)
        if peft_config is not None:
            if hasattr(model, "peft_config"):
                raise ValueError("You passed a `PeftModel` instance together with a `peft_config` to the trainer. "
                                 "Please first merge and unload the existing adapter, save the resulting base model, "
                                 "and then pass that base model along with the new `peft_config` to the trainer. (Or "
                                 "omit peft_config to train the existing adapter.)")
            model = get_peft_model(model, peft_config, seed=args.seed)
            self._check_new_adapter(model)
        check_reference_sync(args, model, self._trainer_name)
        model.add_model_tags(self._tag_names)
        return model, processing_class

    def _load_model(self, model: Any, args: Any, quantization_config: Any) -> Any:
        """The trainer's model from a path or hub id, or the loaded model checked (:func:`load_model`: a causal
        LM)."""
        return load_model(model, args, quantization_config, self._trainer_name)

    def _check_new_adapter(self, model: Any) -> None:
        """Called with the model once ``peft_config`` has added its adapter (warnings about it go here)."""

    @staticmethod
    def _pad_token_id(tokenizer: Any, pad_token: str | None, eos_token: str | None = None) -> int:
        """TRL's pad token: ``pad_token`` (the deprecated config field; set on the tokenizer), else the tokenizer's
        pad token, else ``eos_token`` or the tokenizer's eos token."""
        if pad_token is not None:
            if pad_token not in tokenizer.get_vocab():
                raise ValueError(f"pad_token={pad_token!r} is not in the vocabulary of the processing_class "
                                 f"({type(tokenizer).__name__}); pass a token it has, or leave pad_token unset to pad "
                                 "with its pad (or eos) token.")
            tokenizer.pad_token = pad_token
        return pad_token_id_for(tokenizer, eos_token)

    @staticmethod
    def _check_token_ids(largest: int, tokenizer: Any, models: dict[str, Any]) -> None:
        """Raises ``ValueError`` when ``largest`` (the largest token id the data or the special tokens use) is
        outside the vocabulary of one of ``models`` (``{"model": ..., "ref_model": ...}``; ``None`` entries are
        skipped)."""
        for which, checked in models.items():
            vocab_size = getattr(getattr(checked, "config", None), "vocab_size", None)
            if vocab_size is not None and largest >= vocab_size:
                raise ValueError(f"token id {largest} is outside the {which}'s vocab_size={vocab_size} (the tokenizer "
                                 f"has {len(tokenizer)} tokens; pad token {tokenizer.pad_token!r}). Use the tokenizer "
                                 "that belongs to the model, or set tokenizer.pad_token to a token the model knows.")

    def _lora_dropout(self) -> bool:
        """LoRA dropout in training steps, unless the config sets TRL's ``disable_dropout``."""
        return super()._lora_dropout() and not getattr(self.args, "disable_dropout", False)

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` with TRL's values: each metric that only some micro-batches record as the mean over those
        (``adapters.step_metrics.finish_metrics``) and, when the step loss counts ``num_tokens`` per micro-batch
        (``_counts_step_tokens``), ``num_tokens`` as TRL's running total of training tokens.

        The step metrics arrive averaged over micro-batches and over the steps since the previous log, so the tokens
        of those steps are that mean times both counts; the total so far is read back from ``state.log_history``,
        which a resumed run restores.
        """
        logs = step_metrics.finish_metrics(logs)
        if self._counts_step_tokens:
            previous = next((entry for entry in reversed(self.state.log_history) if "num_tokens" in entry),
                            {"step": 0, "num_tokens": 0})
            if "num_tokens" in logs:
                steps = self.state.global_step - previous["step"]
                added = round(logs["num_tokens"] * self.args.gradient_accumulation_steps * steps)
                logs = {**logs, "num_tokens": previous["num_tokens"] + added}
            elif "eval_num_tokens" in logs:  # TRL reports the training total in evaluation too
                logs = {**logs, "eval_num_tokens": previous["num_tokens"]}
        super().log(logs)

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation, its metrics finished as :meth:`log` finishes them."""
        return step_metrics.finish_metrics(super()._evaluation_loop(examples, metric_key_prefix))

    # ------------------------------------------------------------------ reference policy
    def _init_reference(self, ref_model: Any = None, *, adapter_off: bool = False,
                        copy: bool = False) -> reference_policy.ReferencePolicy:
        """Sets ``self.reference`` (``adapters.reference_policy.choose``) and, with ``args.sync_ref_model``, TRL's
        ``SyncRefModelCallback`` on it (a separate ``ref_model`` or a frozen copy of the policy).

        Args:
            ref_model: a separate reference model (placed on the trainer's mesh when it has none).
            adapter_off: the reference is the policy's base weights (its LoRA adapter off).
            copy: keep a frozen copy of the initial policy (also implied by ``sync_ref_model``).
        """
        sync = bool(getattr(self.args, "sync_ref_model", False))
        self.reference = reference_policy.choose(self._module, self._trainable_model.family, self.mesh,
                                                 ref_model=ref_model, adapter_off=adapter_off and not sync,
                                                 copy=copy or sync)
        if sync:
            self.add_callback(SyncRefModelCallback(self.reference.module, lambda: self._module))
        return self.reference

    def _add_reference_columns(self, examples: list[dict], reference_pass: Callable, names: tuple[str, ...],
                               per_device_batch_size: int) -> None:
        """Adds the columns ``names`` to every example: ``reference_pass(module, batch)`` returns one ``[B]`` array
        per name, run jitted on the reference's mesh one global batch at a time (TRL's ``compute_ref_log_probs``).

        Raises:
            ValueError: the reference is the initial policy and training has already changed it.
        """
        reference = self.reference
        if not reference.outlives_training and self.state.global_step > 0:
            raise ValueError("Cannot compute reference log-probabilities for new data after training has started: "
                             "without ref_model the reference is the initial model, which training has changed "
                             "(full fine-tuning, or an adapter that was not new). Pass this dataset as eval_dataset "
                             "when creating the trainer, or pass a ref_model.")
        step = train_step.make_eval_step(reference_pass, self._compute_dtype())
        size = per_device_batch_size * mesh_lib.data_parallel_size(reference.mesh)
        outputs = self._run_in_batches(examples, step, reference.module, reference.mesh, size, "reference")
        for start, values in zip(range(0, len(examples), size), outputs, strict=True):
            for offset, example in enumerate(examples[start:start + size]):
                for name, column in zip(names, values, strict=True):
                    example[name] = float(column[offset])


class PrecomputedReferenceTrainer(TRLTrainer):
    """The offline preference trainers (DPO, KTO): the examples are tokenised once, their reference log-probabilities
    are stored as columns (``_reference_columns``) before training, or, with ``sync_ref_model``, computed for each
    batch by the reference TRL's ``SyncRefModelCallback`` moves; the logs carry TRL's running ``num_tokens``.

    A subclass provides ``_tokenize(dataset, tokenizer, args, model) -> list[dict]``, ``_padded_length(examples)``,
    ``_reference_pass()`` (jitted inside: ``(module, batch) -> one [B] array per reference column``) and
    ``_reference_columns`` (the column names), and calls :meth:`_prepare_examples` and :meth:`_start_reference`.
    """

    _reference_columns: tuple[str, ...] = ()
    _counts_step_tokens = True

    def _check_reference_settings(self, args: Any, model: Any, ref_model: Any, train_dataset: Any,
                                  eval_dataset: Any) -> None:
        """TRL's checks of the datasets and the reference settings, with its wording."""
        import datasets

        from ..training.batches import check_single_dataset, each_dataset

        check_single_dataset(train_dataset, "train_dataset")
        if args.precompute_ref_log_probs and any(isinstance(dataset, datasets.IterableDataset) for dataset in
                                                 [train_dataset, *each_dataset(eval_dataset)]):
            raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
        check_text_dataset(train_dataset)
        if args.sync_ref_model and args.precompute_ref_log_probs:
            raise ValueError("You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                             "`precompute_ref_log_probs=True` assumes a fixed reference model, but with "
                             "`sync_ref_model=True` the reference model is periodically updated during training, "
                             "making any precomputed reference log-probs stale. Set `precompute_ref_log_probs=False` "
                             "or disable `sync_ref_model`.")
        if ref_model is not None:
            if ref_model is model:
                raise ValueError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                                 "`ref_model` and the initial model will be the reference.")
            check_causal_lm(ref_model, "ref_model", self._trainer_name)

    def _prepare_examples(self, train_dataset: Any, eval_dataset: Any, processing_class: Any,
                          model: Any) -> tuple[list[dict], Any]:
        """``(train examples, eval examples)`` tokenised, with ``self.padded_length`` fitting all of them (one padded
        length for training and evaluation, so XLA compiles each step once)."""
        from ..training.batches import each_dataset, map_datasets

        args = self.args
        train_examples = self._tokenize(train_dataset, processing_class, args, model)
        eval_examples = map_datasets(eval_dataset, lambda dataset: self._tokenize(dataset, processing_class, args,
                                                                                  model))
        every_eval_example = [example for examples in each_dataset(eval_examples) for example in examples]
        self.padded_length = self._padded_length([*train_examples, *every_eval_example])
        return train_examples, eval_examples

    def _start_reference(self, ref_model: Any, train_examples: list[dict], eval_examples: Any) -> None:
        """The reference (``ref_model``; else the base weights of a new adapter, valid all run long; else the
        initial weights, valid until the first step, or a frozen copy with ``sync_ref_model``) and its columns on
        the examples (with ``sync_ref_model`` the training batches are scored as they are used instead)."""
        from ..training.batches import each_dataset

        self._init_reference(ref_model, adapter_off=reference_policy.lora_is_new(self._module))
        if self.args.sync_ref_model:
            self._start_reference_sync()
        else:
            self._add_reference_log_probs(train_examples, self.args.per_device_train_batch_size)
        for examples in each_dataset(eval_examples):
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)

    def _add_reference_log_probs(self, examples: list[dict], per_device_batch_size: int) -> None:
        """Adds the reference columns to every example (TRL's ``compute_ref_log_probs``)."""
        self._add_reference_columns(examples, self._reference_pass(), self._reference_columns,
                                    per_device_batch_size)

    def _start_reference_sync(self) -> None:
        """``sync_ref_model``: each training batch is scored by the current reference when it is used (so batches
        are not prepared ahead), and each evaluation again."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self._allow_prefetch = False
        pass_ = self._reference_pass()
        compute_dtype = self._compute_dtype()

        @nnx.jit
        def group_log_probs(module, micro_batches):
            module = train_step.cast_floating(module, compute_dtype)
            count = jax.tree.leaves(micro_batches)[0].shape[0]
            outputs = [pass_(module, {key: value[index] for key, value in micro_batches.items()})
                       for index in range(count)]
            return tuple(jnp.stack(values) for values in zip(*outputs, strict=True))

        self._group_reference_log_probs = group_log_probs

    def _batches(self, epoch: int, skip: int = 0):
        """The Trainer's batches; with ``sync_ref_model``, each scored by the current reference when it is used."""
        for group in super()._batches(epoch, skip):
            if self.args.sync_ref_model:
                scored = self._group_reference_log_probs(self.reference.module, group)
                group = {**group, **dict(zip(self._reference_columns, scored, strict=True))}
            yield group

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation; with ``sync_ref_model`` the examples are first scored by the current
        reference, as TRL's reference forward in each evaluation step."""
        if self.args.sync_ref_model:
            self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return super()._evaluation_loop(examples, metric_key_prefix)

    def _prepare_eval_dataset(self, dataset: Any) -> list[dict]:
        """Raw data prepared and scored by the reference (TRL's ``evaluate`` does too); examples that carry the
        reference columns already (the trainer's ``eval_dataset``) as they are."""
        if all(name in next(iter(dataset), {}) for name in self._reference_columns):
            return super()._prepare_eval_dataset(dataset)
        examples = self._tokenize(dataset, self.processing_class, self.args, self.model)
        self.padded_length = max(self.padded_length, self._padded_length(examples))
        self._add_reference_log_probs(examples, self.args.per_device_eval_batch_size)
        return examples

    def _signature_columns(self) -> None:
        """Every column: the prepared examples hold only token ids, labels and reference log-probabilities."""
        return None

    def _step_metric_prefix(self, metric_key_prefix: str) -> str:
        """``"eval"``: TRL logs its metrics (``rewards/chosen``...) as ``eval_<metric>`` whatever the dataset, so with a
        dict of eval datasets only the loss, runtime and speed carry the dataset's name."""
        return "eval"


class OnlineTrainer(TRLTrainer):
    """The trainers that sample completions from the policy (GRPO, RLOO, Distillation): the sampling settings, pad
    and end tokens, prompt widths, eval rows prepared like training rows, and the generation metrics gathered between
    logs (means over the generation batches since the last training log, added to it as TRL's ``log`` does).

    A subclass calls :meth:`_setup_sampling` before preparing its prompts and provides ``_prepare(dataset, name)``.
    """

    def _setup_sampling(self, args: Any, model: Any, processing_class: Any) -> None:
        """Sets ``sampling`` (the config's sampling fields, ``generation_kwargs`` over them, sampling on as in TRL),
        ``tokenizer``, ``pad_token_id`` and ``eos_token_ids`` (the tokenizer's eos first, then the generation
        config's)."""
        names = sampling.SamplingSettings.names()
        extra = dict(args.generation_kwargs or {})
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"generation_kwargs {unknown} are not supported by torchlike's sampler; it takes "
                             f"{', '.join(names)} (max_completion_length sets the length).")
        config_fields = {field.name for field in dataclasses.fields(args)}
        from_config = {name: getattr(args, name) for name in names if name in config_fields}
        self.sampling = sampling.SamplingSettings.from_mapping({**from_config, "do_sample": True, **extra})
        self.tokenizer = processing_class
        self.pad_token_id = self._pad_token_id(processing_class, None)
        eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = eos if processing_class.eos_token_id in eos else [processing_class.eos_token_id, *eos]
        self._pending_metrics: dict[str, list[float]] = {}
        self._rollout_engine: rollout.RolloutEngine | None = None
        self._background_engine: rollout.RolloutEngine | None = None
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self._sampled_ahead: dict[tuple, tuple[list, concurrent.futures.Future]] = {}

    def _padded(self, length: int) -> int:
        """A prompt or completion width rounded up as ``pad_to_multiple_of`` asks (padding is masked)."""
        return round_up_to_multiple(length, self.args.pad_to_multiple_of)

    def _prepare_eval_dataset(self, dataset: Any) -> list[dict]:
        """Raw eval rows prepared as the train rows are (rows prepared at construction are kept as they are)."""
        from ..training import batches

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
            logs = {**logs, **{key: float(np.nanmean(values)) for key, values in train_metrics.items()}}
            for key in train_metrics:
                del self._pending_metrics[key]
            self._on_train_log()
        super().log(logs)

    def _on_train_log(self) -> None:
        """Called when a training log takes the gathered generation metrics (e.g. to print the latest completions)."""

    # ------------------------------------------------------------------ sampling and tools
    @property
    def _sampling_module(self):
        """The NNX module completions are sampled from: the policy (the student in distillation)."""
        return self._trainable_model.module

    def _setup_tools(self, tools: list | None, processing_class: Any, args: Any) -> None:
        """Sets ``tools`` and ``tool_calling`` (:class:`.tool_calling.ToolCalling`, TRL's checks run) when tools are
        given, else ``None``."""
        from . import tool_calling

        self.tools = list(tools or [])
        self.tool_calling = tool_calling.ToolCalling.create(processing_class, self.tools, args.chat_template_kwargs,
                                                            trainer_name=self._trainer_name) if self.tools else None

    def _check_tool_prompts(self, row_lists: list) -> None:
        """With tools, every prompt must be a list of chat messages."""
        from .grpo_data import is_conversational_prompt

        if self.tools and not all(is_conversational_prompt(row["prompt"]) for rows in row_lists for row in rows or []):
            raise ValueError("tools need conversational prompts (lists of chat messages): the chat template renders "
                             "the tools' schemas, and the model's turns are parsed as assistant messages.")

    def _completion_arrays(self, completions: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, completion_mask, ended)`` of completions given as token lists (each at most
        ``max_completion_length``), right-padded to the completion width; ``ended`` by TRL's rule: the last token is
        an end or pad token."""
        tokens = np.full((len(completions), self._padded(self.args.max_completion_length)), self.pad_token_id,
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
        """The engine completions are sampled with (``args.rollout_engine``; built on first use, then handed the
        policy before each generation round)."""
        if self._rollout_engine is None:
            self._rollout_engine = self._build_rollout_engine()
        return self._rollout_engine

    def _build_rollout_engine(self) -> rollout.RolloutEngine:
        settings = {item.name: getattr(self.args, item.name) for item in dataclasses.fields(self.args)
                    if item.name.startswith("rollout_")}
        common = {"eos_token_ids": self.eos_token_ids, "pad_token_id": self.pad_token_id, "lora": lora_runtime.EVAL}
        if settings.get("rollout_engine", "static") == "static":
            return rollout.StaticEngine(self._sampling_module, batch_sharding=mesh_lib.batch_sharding(self.mesh),
                                        data_parallel_size=mesh_lib.data_parallel_size(self.mesh),
                                        repetition_penalty_skips_left_padding=repetition_penalty_skips_left_padding(),
                                        **common)
        return rollout.PagedEngine(self._sampling_module,
                                   rollout.PagedEngineConfig.from_mapping(settings, prefix="rollout_"),
                                   mesh=self.mesh, **common)

    @staticmethod
    def _generation_key(prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int) -> tuple:
        return (int(seed), int(max_new_tokens), np.asarray(prompt_ids).tobytes(), np.asarray(prompt_mask).tobytes())

    def _sample(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [N, steps], log-probs [N, steps])`` sampled by the policy after left-padded prompts (pad and
        log-prob 0 after a row's end token); the rows of one prompt in a row are one request's samples (one prefill).
        Prompts :meth:`_sample_ahead` started are taken from there (sampled with the weights of that moment)."""
        ahead = self._sampled_ahead.pop(self._generation_key(prompt_ids, prompt_mask, max_new_tokens, seed), None)
        if ahead is not None:
            places, pending = ahead
            outputs = pending.result()
        else:
            requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed)
            engine = self.rollout_engine
            engine.update_weights(self._sampling_module)
            outputs = engine.generate(requests, self.sampling)
        return rollout.rows_from_outputs(outputs, places, self.pad_token_id)

    def _sample_ahead(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int) -> None:
        """Starts sampling these prompts in a background thread with a snapshot of the policy's current weights
        (generation overlapped with training); the :meth:`_sample` call with the same arguments takes the result.
        With several processes they are sampled at once, in this thread, with the same snapshot."""
        if self._background_engine is None:
            self._background_engine = self._build_rollout_engine()
            self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchlike-rollout")
        requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed)
        self._background_engine.update_weights(rollout.weights_snapshot(self._sampling_module))
        if multihost.process_count() > 1:
            # Every process must issue JAX's cross-process collectives in the same order, which a second thread
            # would not: the batch is sampled now, with the same weights and seeds, so only the overlap is lost.
            pending = concurrent.futures.Future()
            pending.set_result(self._background_engine.generate(requests, self.sampling))
        else:
            pending = self._background.submit(self._background_engine.generate, requests, self.sampling)
        self._sampled_ahead[self._generation_key(prompt_ids, prompt_mask, max_new_tokens, seed)] = (places, pending)

    def _drop_samples_ahead(self) -> None:
        """Waits for the background samples no step will use (training stopped) and drops them."""
        for _, pending in self._sampled_ahead.values():
            pending.result()
        self._sampled_ahead.clear()

    def _call_tools(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray,
                    completion_mask: np.ndarray, seed: int) -> tuple:
        """Runs TRL's tool-calling loop (:meth:`.tool_calling.ToolCalling.run`) on the first completions, continuing
        each sample with the policy's sampler. With several processes each runs the tools of its own samples.

        Returns:
            ``(tokens, completion_mask, ended, tool_mask, loop result)`` of the completions with their tool turns.
        """
        prompts = [ids[mask.astype(bool)].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        first = [row[:int(mask.sum())].tolist() for row, mask in zip(tokens, completion_mask, strict=True)]
        rounds = itertools.count(1)

        def generate(prompt_id_lists: list[list[int]], max_new_tokens: int) -> list[list[int]]:
            length = self._padded(sampling.bucket_length(max(len(ids) for ids in prompt_id_lists)))
            round_seed = int(np.random.SeedSequence([seed, next(rounds)]).generate_state(1)[0])
            sampled, _ = self._sample(*self._left_padded(prompt_id_lists, length), max_new_tokens, round_seed)
            mask, _ = tunix_grpo.completion_mask(sampled, self.eos_token_ids)
            return [row[:int(row_mask.sum())].tolist() for row, row_mask in zip(sampled, mask, strict=True)]

        def call_rows(calls: list[list[dict]]) -> list[tuple[list[dict], int]]:
            own = [self.tool_calling.call(row_calls) for row_calls in calls[multihost.process_rows(len(calls))]]
            return [result for piece in multihost.allgather_objects(own) for result in piece]

        loop = self.tool_calling.run(prompts, first, generate, max_completion_length=self.args.max_completion_length,
                                     max_model_length=self.model.config.max_position_embeddings,
                                     max_iterations=self.args.max_tool_calling_iterations, call_rows=call_rows)
        tokens, completion_mask, ended = self._completion_arrays(loop.completion_ids)
        return tokens, completion_mask, ended, self._mask_array(loop.tool_mask, completion_mask, "tool_mask"), loop

    def _left_padded(self, sequences: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
        return left_padded(sequences, length, self.pad_token_id)

