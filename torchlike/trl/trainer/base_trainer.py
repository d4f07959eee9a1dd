"""``TRLTrainer``: what every TRL trainer shares, on torchlike's ``Trainer``.

The config (the default ``"<model>-<SUFFIX>"`` one, a ``TrainingArguments`` converted, its fields checked once), the
model (a path or hub id loaded with ``args.model_init_kwargs``, float32 unless they set ``dtype``, as TRL's
``create_model_from_path``; a LoRA adapter from ``peft_config``; the trainer's tags), the default tokenizer, the pad
token, the token-id check against every model's vocabulary, ``disable_dropout``, the reference policy
(``adapters.training.reference_policy``: a ``ref_model``, the adapter-off base, a frozen copy or the initial weights)
with its precomputed log-prob columns, and TR-DPO's reference sync. SFT, DPO and GRPO (and each new TRL trainer) are
subclasses that add their data preparation and step loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...adapters.distributed import mesh as mesh_lib
from ...adapters.training import reference_policy, step_metrics, train_step
from ...training import Trainer, step_logs
from ...training_args import TrainingArguments
from ...type_aliases import (
    DatasetLike,
    EvalRowsLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    QuantizationConfig,
    RowsLike,
    Tokenizer,
    TRLArgs,
)
from ..data_utils import pad_token_id_for
from ..models import check_causal_lm, create_reference_model, frozen_copy_model
from .callbacks import SyncRefModelCallback

if TYPE_CHECKING:

    from ...adapters.families.base import Family
    from ...modeling import CausalLM

__all__ = ["NOT_A_VISION_MODEL", "TRLTrainer", "check_reference_sync", "check_text_dataset", "check_vision_model",
           "converted_if_transformers", "create_reference_model", "default_output_dir", "is_vision_dataset",
           "load_model", "vision_processor"]


def default_output_dir(model: ModelLike, suffix: str) -> str:
    """TRL's default ``output_dir``: ``"<last part of the model id>-<suffix>"`` (e.g. ``"Qwen2.5-0.5B-SFT"``)."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or "model"
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


def load_model(model: ModelLike, args: TrainingArguments, quantization_config: QuantizationConfig | None,
               trainer: str) -> CausalLM:
    """``model`` as a torchlike model.

    Args:
        model: a loaded torchlike model, a path / hub id, or a ``transformers`` model object (as TRL scripts such as
            ``orpo.py`` pass it): converted to the torchlike model of the same weights, dtype and
            ``name_or_path`` (the default tokenizer is then loaded from that path, as TRL loads it).
        args: the trainer config (its ``model_init_kwargs`` apply to a path or hub id).
        quantization_config: a ``BitsAndBytesConfig``-like request for a path or hub id.
        trainer: the trainer's name, for messages.

    Returns:
        The loaded (or given) model.
    """
    from ... import AutoModelForCausalLM

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
    model = converted_if_transformers(model)
    check_causal_lm(model, "model", trainer)
    return model


def converted_if_transformers(model: ModelLike) -> ModelLike:
    """``model`` as the torchlike model of the same weights, dtype and ``name_or_path`` when it is a ``transformers``
    model object (as TRL scripts pass ``model`` and ``ref_model``); anything else as it is."""
    from ... import AutoModelForCausalLM
    from ...adapters.checkpoint.hf_source import is_transformers_model

    if is_transformers_model(model):
        return AutoModelForCausalLM.from_pretrained(model, dtype=model.dtype)
    return model


def is_vision_dataset(dataset: DatasetLike | list[dict] | None) -> bool:
    """Whether a dataset has TRL's vision columns (``image`` or ``images``); a plain iterator is not read, so that no
    row is consumed."""
    if dataset is None:
        return False
    names = getattr(dataset, "column_names", None)
    if names is None:
        first = dataset[0] if isinstance(dataset, list) and dataset else None
        names = list(first) if isinstance(first, dict) else []
    return "image" in names or "images" in names


NOT_A_VISION_MODEL = ("The dataset appears to be vision-related (contains 'image' or 'images' keys), but the provided "
                      "model does not seem to be a vision-language model. Please check your model and dataset.")
"""TRL's refusal of vision data for a model that is not a vision-language one."""


def check_text_dataset(dataset: DatasetLike | list[dict] | None) -> None:
    """TRL's refusal of vision data (an ``image`` or ``images`` column), for the trainers that take text data only."""
    if is_vision_dataset(dataset):
        raise ValueError(f"{NOT_A_VISION_MODEL} (In torchlike, SFTTrainer, DPOTrainer, GRPOTrainer and RLOOTrainer "
                         "train vision-language data, on a checkpoint with a vision tower; this trainer takes text "
                         "data.)")


def check_vision_model(family: Family | None, processing_class: ProcessingClass | None = None,
                       which: str = "model") -> None:
    """TRL's refusal of vision data for a model that is not a vision-language one: a model family that takes no
    images (with the family's reason, e.g. a tower Tunix lacks), or a ``processing_class`` without an image processor
    (a tokenizer).

    Args:
        family: the model's adapter family (``Family.images`` is ``None`` for a text-only one).
        processing_class: the trainer's processing class (``None``: not checked).
        which: the model's name in the message (``"model"`` or ``"ref_model"``).

    Raises:
        ValueError: TRL's message, with torchlike's reason.
    """
    if family is None or family.images is None:
        reason = f" ({family.no_images_reason}.)" if family is not None and family.no_images_reason else ""
        raise ValueError(f"{NOT_A_VISION_MODEL} (The {which} takes no images.){reason}")
    if processing_class is not None and not hasattr(processing_class, "image_processor"):
        raise ValueError(f"{NOT_A_VISION_MODEL} (The processing_class is a {type(processing_class).__name__}; pass "
                         "the model's processor: torchlike.AutoProcessor.from_pretrained(<model>).)")


def vision_processor(model: CausalLM, processing_class: ProcessingClass | None) -> ProcessingClass:
    """The processor a trainer of vision data uses: ``processing_class``, or, as TRL loads it for a vision-language
    model, the model's (``AutoProcessor`` on its path) when none is given; after :func:`check_vision_model` and
    checked against the checkpoint (:func:`~torchlike.processing.check_processor_matches`).

    Raises:
        ValueError: TRL's refusal (a text-only model or a tokenizer), or a processor that does not match the
            checkpoint.
    """
    from ...processing import AutoProcessor, check_processor_matches

    check_vision_model(model.family, processing_class)
    if processing_class is None:
        processing_class = AutoProcessor.from_pretrained(model.name_or_path)
        check_vision_model(model.family, processing_class)
    check_processor_matches(processing_class, model.config)
    return processing_class


def check_reference_sync(args: TrainingArguments, model: CausalLM, trainer: str) -> None:
    """TRL's refusal of ``sync_ref_model`` with a LoRA adapter (the reference is the adapter switched off, so there
    is no reference model to update)."""
    if getattr(args, "sync_ref_model", False) and hasattr(model, "peft_config"):
        raise NotImplementedError(
            "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With PEFT, "
            f"{trainer} does not keep a separate reference model in memory; instead, it recovers reference behavior "
            "by temporarily disabling the adapter. As a result, there is no standalone `ref_model` instance to "
            "synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you need a synced reference "
            "model.")


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
    #: The batch column (``[rows, positions]``) whose rows with any position set are a batch's examples when
    #: ``evaluate()`` weighs each batch's loss by them, as transformers' evaluation loop repeats a batch's loss once per
    #: example (training averages the micro-batches, as TRL); ``None``: every batch weighs alike.
    _evaluation_rows_key: str | None = None
    _evaluating: bool = False
    #: TRL's attribute: whether the Mixture-of-Experts router loss is added to the step loss (set by
    #: :meth:`_setup_router_loss` in the trainers that add it).
    aux_loss_enabled: bool = False
    #: TRL's attribute: the router loss weight (``router_aux_loss_coef``, else the model config's).
    router_aux_loss_coef: float = 0.0
    #: TRL's attribute: the separate reference model the trainer keeps (the user's ``ref_model``, or a frozen copy of
    #: the initial policy where TRL loads a second model), ``None`` where there is none (no reference, or the
    #: reference is the policy with its LoRA adapter off).
    ref_model: Any = None

    @property
    def _trainer_name(self) -> str:
        return type(self).__name__

    def _trl_args(self, model: ModelLike, args: TrainingArguments | None) -> TRLArgs:
        """The trainer's config: ``args``; ``None`` becomes TRL's default (``output_dir="<model>-<SUFFIX>"``), a
        ``TrainingArguments`` of another class the trainer's config with its values (as TRL's ``SFTTrainer``). Its
        fields are checked here, once (ignored fields warn, refused ones raise), and ``Trainer.__init__`` does not
        check them again."""
        from ...field_support import check_unsupported

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

    def _trl_model(self, model: ModelLike, args: TRLArgs, processing_class: ProcessingClass | None,
                   peft_config: PeftConfigLike | None, quantization_config: QuantizationConfig | None,
                   load_processor: bool = False) -> tuple[CausalLM, ProcessingClass]:
        """``(model, processing_class)``: the model loaded (a path or hub id) or checked, a new LoRA adapter added
        for ``peft_config`` (seeded with ``args.seed``, as TRL seeds before creating it), ``sync_ref_model`` refused
        with an adapter, the trainer's tags added, and, when none is given, the tokenizer of the model's path (with
        ``load_processor``, a vision-language model's processor, as TRL's ``AutoProcessor`` gives it)."""
        from ... import AutoTokenizer
        from ...peft import get_peft_model
        from ...processing import AutoProcessor

        model = self._load_model(model, args, quantization_config)
        if processing_class is None:
            takes_images = load_processor and model.family is not None and model.family.images is not None
            processing_class = (AutoProcessor if takes_images else AutoTokenizer).from_pretrained(model.name_or_path)
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

    def _load_model(self, model: ModelLike, args: TRLArgs,
                    quantization_config: QuantizationConfig | None) -> CausalLM:
        """The trainer's model from a path or hub id, or the loaded model checked (:func:`load_model`: a causal
        LM)."""
        return load_model(model, args, quantization_config, self._trainer_name)

    def _check_new_adapter(self, model: CausalLM) -> None:
        """Called with the model once ``peft_config`` has added its adapter (warnings about it go here)."""

    @staticmethod
    def _pad_token_id(tokenizer: Tokenizer, pad_token: str | None, eos_token: str | None = None) -> int:
        """TRL's pad token: ``pad_token`` (the deprecated config field; set on the tokenizer), else the tokenizer's
        pad token, else ``eos_token`` or the tokenizer's eos token."""
        if pad_token is not None:
            if pad_token not in tokenizer.get_vocab():
                raise ValueError(f"pad_token={pad_token!r} is not in the vocabulary of the processing_class "
                                 f"({type(tokenizer).__name__}); pass a token it has, or leave pad_token unset to pad "
                                 "with its pad (or eos) token.")
            tokenizer.pad_token = pad_token
        return pad_token_id_for(tokenizer, eos_token)

    def _setup_router_loss(self, model: CausalLM, args: TRLArgs) -> None:
        """TRL 1.16's rule for the Mixture-of-Experts load-balancing loss (transformers' ``load_balancing_loss_func``,
        ``adapters/losses/router.py``): on when the model returns router logits (Qwen3 MoE) and the coefficient
        (``args.router_aux_loss_coef``, else the model config's) is not 0; a coefficient for a model without a router
        is refused in TRL's words, and the config is kept in sync (``output_router_logits``)."""
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        coefficient = args.router_aux_loss_coef
        self.router_aux_loss_coef = (getattr(text_config, "router_aux_loss_coef", 0.0) if coefficient is None
                                     else coefficient)
        if coefficient and not hasattr(text_config, "output_router_logits"):
            raise ValueError(f"`router_aux_loss_coef` is set to {coefficient} but {type(model).__name__} "
                             f"({model.family.name}) is not a Mixture-of-Experts model that returns its router "
                             "logits, so there is no auxiliary loss to weight.")
        self.aux_loss_enabled = hasattr(text_config, "output_router_logits") and self.router_aux_loss_coef != 0.0
        if hasattr(text_config, "router_aux_loss_coef"):
            text_config.output_router_logits = self.aux_loss_enabled
            text_config.router_aux_loss_coef = self.router_aux_loss_coef

    def _router_loss_weight(self) -> float:
        """The weight the step loss gives the router loss (0 when it is not added)."""
        return self.router_aux_loss_coef if self.aux_loss_enabled else 0.0

    @staticmethod
    def _check_token_ids(largest: int, tokenizer: Tokenizer, models: dict[str, Any]) -> None:
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

    def _prepare_examples(self, train_dataset: RowsLike, eval_dataset: EvalRowsLike | None,
                          processing_class: ProcessingClass,
                          model: CausalLM) -> tuple[list[dict], Any]:
        """``(train examples, eval examples)`` tokenised by the subclass's ``_tokenize(dataset, tokenizer, args,
        model)``, with ``self.padded_length`` (its ``_padded_length(examples)``) fitting all of them (one padded
        length for training and evaluation, so XLA compiles each step once)."""
        from ...training.batches import each_dataset, map_datasets

        args = self.args
        train_examples = self._tokenize(train_dataset, processing_class, args, model)
        eval_examples = map_datasets(eval_dataset, lambda dataset: self._tokenize(dataset, processing_class, args,
                                                                                  model))
        every_eval_example = [example for examples in each_dataset(eval_examples) for example in examples]
        self.padded_length = self._padded_length([*train_examples, *every_eval_example])
        return train_examples, eval_examples

    def _show_prepared_datasets(self, train_examples: list[dict],
                                eval_examples: list[dict] | dict[str, list[dict]] | None) -> None:
        """What TRL users read in ``train_dataset`` and ``eval_dataset`` of an offline trainer: its prepared examples
        as ``datasets.Dataset`` (a dict of them for a dict of eval datasets), as TRL's ``_prepare_dataset`` leaves
        them. Training and evaluation keep reading the examples."""
        import datasets

        from ...training.batches import map_datasets

        self.train_dataset = datasets.Dataset.from_list(train_examples)
        self._show_eval_dataset(map_datasets(eval_examples, datasets.Dataset.from_list))

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float]) -> None:
        """Records ``logs`` with TRL's values: each metric that only some micro-batches record as the mean over those
        (``adapters.training.step_metrics.finish_metrics``) and, when the step loss counts ``num_tokens`` per
        micro-batch (``_counts_step_tokens``), ``num_tokens`` as TRL's running total of training tokens.

        The step metrics arrive averaged over micro-batches and over the steps since the previous log, so the tokens
        of those steps are that mean times both counts; the total so far is read back from ``state.log_history``,
        which a resumed run restores. ``logs`` itself is updated (TRL's ``log`` updates its argument, so the dict
        ``evaluate()`` returns holds what was logged).
        """
        given, logs = logs, step_metrics.finish_metrics(logs)
        if self._counts_step_tokens:
            previous = next((entry for entry in reversed(self.state.log_history) if "num_tokens" in entry),
                            {"step": 0, "num_tokens": 0})
            if "num_tokens" in logs:
                steps = self.state.global_step - previous["step"]
                added = round(logs["num_tokens"] * self.args.gradient_accumulation_steps * steps)
                logs = {**logs, "num_tokens": previous["num_tokens"] + added}
            elif "eval_num_tokens" in logs:  # TRL reports the training total in evaluation too
                logs = {**logs, "eval_num_tokens": previous["num_tokens"]}
        # In place, as TRL's log() updates its argument: evaluate() returns the dict it logged.
        given.clear()
        given.update(logs)
        super().log(given)

    def _unlogged_step_metrics(self, values: list[dict]) -> dict[str, float]:
        """TRL's ``log`` adds the metrics recorded since the last log to every log, the run's final one included: the
        mean of each step metric of the steps after the last logging step (``aux_loss``, ``entropy``...), as a
        training log has them."""
        return step_logs.window_metrics(values)

    def _evaluation_loop(self, examples, metric_key_prefix: str) -> dict[str, float]:
        """The Trainer's evaluation, its metrics finished as :meth:`log` finishes them."""
        self._evaluating = True
        try:
            return step_metrics.finish_metrics(super()._evaluation_loop(examples, metric_key_prefix))
        finally:
            self._evaluating = False

    def _loss(self) -> tuple[Callable, Callable | None]:
        """The Trainer's loss; in evaluation, with ``_evaluation_rows_key``, each batch's loss weighed by its
        examples."""
        loss, count_items = super()._loss()
        if not self._evaluating or self._evaluation_rows_key is None:
            return loss, count_items
        rows_key = self._evaluation_rows_key

        def weighed_by_examples(module, batch, num_items_in_batch=None):
            import jax.numpy as jnp

            value, _, metrics = loss(module, batch, num_items_in_batch)
            examples = batch[rows_key].any(-1).sum().astype(jnp.float32)
            return value * examples, examples, metrics

        return weighed_by_examples, count_items

    # ------------------------------------------------------------------ reference policy
    def _init_reference(self, ref_model: ModelLike | None = None, *, adapter_off: bool = False,
                        copy: bool = False) -> reference_policy.ReferencePolicy:
        """Sets ``self.reference`` (``adapters.training.reference_policy.choose``) and, with ``args.sync_ref_model``,
        TRL's ``SyncRefModelCallback`` on it (a separate ``ref_model`` or a frozen copy of the policy).

        Args:
            ref_model: a separate reference model (placed on the trainer's mesh when it has none).
            adapter_off: the reference is the policy's base weights (its LoRA adapter off).
            copy: keep a frozen copy of the initial policy (also implied by ``sync_ref_model``).
        """
        sync = bool(getattr(self.args, "sync_ref_model", False))
        self.reference = reference_policy.choose(self._module, self._trainable_model.family, self.mesh,
                                                 ref_model=ref_model, adapter_off=adapter_off and not sync,
                                                 copy=copy or sync)
        if self.reference.kind == reference_policy.SEPARATE:
            self.ref_model = ref_model
        elif self.reference.kind == reference_policy.COPY:
            self.ref_model = frozen_copy_model(self._trainable_model, self.reference.module)
        else:
            self.ref_model = None
        if sync:
            self.add_callback(SyncRefModelCallback(self.reference.module, self.accelerator))
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
