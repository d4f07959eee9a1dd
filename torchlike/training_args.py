"""``TrainingArguments``: transformers' training configuration (5.12 to 5.24), field for field, validated for torchlike.

The dataclass has every field ``transformers.TrainingArguments`` has had from 5.12 to 5.24 with the same name and
default, then torchlike's own fields (device mesh, compilation cache, batch prefetch, LoRA step, save errors). A script
written for any of those versions runs unchanged: the fields 5.15 added (``dataloader_in_order``,
``dataloader_multiprocessing_context``) and 5.23 added (``activation_checkpointing*``) are accepted whatever is
installed, and the ones 5.15 removed (``warmup_ratio``, ``logging_dir``) still work, with a ``FutureWarning``.
Deprecations warn as the installed transformers does (:mod:`torchlike.version`). ``__post_init__`` normalises values
the way transformers does (``output_dir=None`` -> ``"trainer_output"``, ``report_to="none"`` -> ``[]``, JSON strings
for dict fields, ``gradient_checkpointing`` resolved with ``activation_checkpointing``, ``warmup_ratio`` folded into
``warmup_steps``...) and rejects enumeration values torchlike cannot run, naming the field, the value and the
accepted values. Which fields the trainer honours, ignores (with a warning) or refuses
(with an error) is listed in ``torchlike.training_args_fields``; the trainer calls
``torchlike.field_support.check_unsupported(args)``.

Its length is transformers' ``TrainingArguments`` itself: about a hundred documented fields, kept in one dataclass so
that it matches transformers field for field.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .adapters.losses.settings import check_choice, enum_value
from .training_args_fields import TRAINING_ARGUMENTS_FIELD_SUPPORT
from .version import gradient_checkpointing_is_deprecated, warmup_ratio_and_logging_dir_are_removed

logger = logging.getLogger("torchlike")

# --- Accepted enumeration values ---------------------------------------------------------------------------------

#: ``lr_scheduler_type`` values torchlike runs: transformers' schedules that are a function of the step alone
#: (``get_scheduler`` gives each step's rate, see ``torchlike.optim``).
LR_SCHEDULERS: tuple[str, ...] = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts",
                                  "polynomial", "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                                  "warmup_stable_decay")
_METRIC_DRIVEN_LR_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")

#: ``optim`` values torchlike accepts, mapped to the optax optimizer that reproduces them. All the full-precision
#: torch AdamW variants (plain, fused, XLA, NPU, AnyPrecision with its default fp32 states, bitsandbytes' paged 32-bit)
#: compute the same update, which is ``optax.adamw``; ``"sgd"`` is ``torch.optim.SGD`` without momentum, which is
#: ``optax.sgd``.
OPTIMIZERS: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_torch_npu_fused": "adamw",
    "adamw_anyprecision": "adamw",
    "paged_adamw_32bit": "adamw",
    "sgd": "sgd",
}
_LOW_BIT_OPTIMIZERS = ("adamw_torch_4bit", "adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
_REMOVED_OPTIMIZERS = {"adamw_hf": "adamw_torch", "adamw_apex_fused": "adamw_torch"}

#: ``logging_strategy`` / ``eval_strategy`` values.
INTERVAL_STRATEGIES: tuple[str, ...] = ("no", "steps", "epoch")
#: ``save_strategy`` values: ``"best"`` saves after each evaluation that improves ``metric_for_best_model``.
SAVE_STRATEGIES: tuple[str, ...] = (*INTERVAL_STRATEGIES, "best")
#: ``on_save_error`` values: what a checkpoint save that cannot write its files does.
SAVE_ERROR_ACTIONS: tuple[str, ...] = ("raise", "warn")
#: ``hub_strategy`` values (pushes are of the Hugging Face-format model that ``save_model`` writes).
HUB_STRATEGIES: tuple[str, ...] = ("end", "every_save")
#: ``train_sampling_strategy`` values.
SAMPLING_STRATEGIES: tuple[str, ...] = ("random", "sequential")
#: ``report_to`` values; ``"all"`` means every one of ``REPORTERS`` that is installed.
REPORTERS: tuple[str, ...] = ("tensorboard", "wandb")
_REPORTER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}

#: Arguments older scripts still pass that transformers 5 no longer accepts, with what replaced them.
_REMOVED_ARGUMENTS: dict[str, str] = {
    "evaluation_strategy": "it was renamed `eval_strategy`",
    "no_cuda": "it was replaced by `use_cpu`",
    "per_gpu_train_batch_size": "it was replaced by `per_device_train_batch_size`",
    "per_gpu_eval_batch_size": "it was replaced by `per_device_eval_batch_size`",
    "overwrite_output_dir": "transformers 5 removed it; drop the argument",
}


def warn_from_config(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside the config classes (the user's ``SFTConfig(...)``):
    frames of this module, of dataclass-generated ``__init__`` code and of any ``TrainingArguments`` method are
    skipped, so subclasses in other modules need no registration.

    Args:
        message: the warning text.
        category: the warning class.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename in (__file__, "<string>")
                                 or isinstance(frame.f_locals.get("self"), TrainingArguments)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _parse_json_dict(name: str, value: object) -> Any:
    """Dict fields given as JSON text (from a command line) become dicts, as in transformers."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} looks like JSON but does not parse ({error}); got {value!r}. Pass a dict or "
                             f"valid JSON such as '{{\"key\": 1}}'.") from None
        return _convert_str_dict(loaded)
    return value


def _convert_str_dict(value: dict) -> dict:
    """transformers' conversion of string values inside a JSON dict: "true"/"false" -> bool, digits -> numbers."""
    for key, item in value.items():
        if isinstance(item, dict):
            value[key] = _convert_str_dict(item)
        elif isinstance(item, str):
            if item.lower() in ("true", "false"):
                value[key] = item.lower() == "true"
            elif item.isdigit():
                value[key] = int(item)
            elif item.replace(".", "", 1).isdigit():
                value[key] = float(item)
    return value


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _whole_steps(name: str, value: float) -> float | int:
    """transformers' rule for ``*_steps``: a float below 1 is a ratio of the total steps, above 1 it must be whole."""
    if value > 1:
        if value != int(value):
            raise ValueError(f"{name}={value!r}: a value above 1 is a number of steps and must be a whole number "
                             "(a value below 1 is a ratio of the total training steps).")
        return int(value)
    return value


def reject_removed_arguments(cls: type, removed: dict[str, str]) -> type:
    """Make ``cls(...)`` explain arguments that older scripts pass but the current API removed.

    Python's own message ("unexpected keyword argument") stays the exception type (``TypeError``), as with
    transformers and TRL, but says what replaced the argument.

    Args:
        cls: a dataclass. The names registered for its base classes are checked too (a dataclass subclass gets
            its own ``__init__``).
        removed: argument name -> what replaced it (a sentence fragment).

    Returns:
        ``cls``, whose ``__init__`` now checks for those names first.
    """
    init = cls.__init__
    removed = {**getattr(cls, "_removed_arguments", {}), **removed}
    cls._removed_arguments = removed

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, replacement in removed.items():
            if name in kwargs:
                raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {name!r}: "
                                f"{replacement}.")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@dataclass
class TrainingArguments:
    """The training configuration of ``transformers.TrainingArguments`` (5.12 to 5.24), run on JAX by torchlike's
    trainers.

    Every field has transformers' name and default (see the transformers documentation for each); a test holds them
    against the installed transformers. What torchlike does with each field is in
    ``torchlike.training_args_fields``: *honoured* fields mean what they mean in transformers, *ignored* ones
    warn when set, *refused* ones raise when set. The main honoured ones:

    Args:
        output_dir (`str`, *optional*): where checkpoints (``checkpoint-<step>``) and the model go;
            ``"trainer_output"`` when not given.
        per_device_train_batch_size (`int`, defaults to 8): examples per data-parallel shard; times
            ``data_parallel_size`` it is the global batch of one micro-step.
        gradient_accumulation_steps (`int`, defaults to 1): micro-batches per optimizer step; the loss is normalised
            by the number of loss tokens across all of them, as transformers does.
        learning_rate (`float`, defaults to 5e-5), weight_decay, adam_beta1, adam_beta2, adam_epsilon,
            max_grad_norm: the optax AdamW (``optim``) and clipping settings.
        lr_scheduler_type (`str`, defaults to ``"linear"``): one of ``LR_SCHEDULERS``.
        warmup_steps (`int` or `float`, defaults to 0): warmup steps, or a ratio of the total steps when below 1.
        optim (`str`, defaults to ``"adamw_torch_fused"``): a key of ``OPTIMIZERS``.
        bf16 (`bool`): compute in bfloat16 (parameters keep their dtype); runs on CPU too. ``fp16`` is refused by
            the trainers (no loss scaling): use ``bf16``.
        activation_checkpointing (`bool`): rematerialise each layer's activations in the backward pass.
            ``gradient_checkpointing`` is the same switch (transformers 5.23 renamed it and warns for the old name).
        logging_* / eval_* / save_* strategies: one of ``"no"``, ``"steps"``, ``"epoch"`` (``save_strategy`` also
            ``"best"``: a checkpoint after each evaluation that improves ``metric_for_best_model``).
        lr_scheduler_kwargs (`dict`, *optional*): the schedule's own keywords, as transformers' ``get_scheduler``
            takes them (``num_cycles``, ``min_lr`` / ``min_lr_rate``, ``power`` / ``lr_end``, ``timescale``,
            ``num_decay_steps`` / ``num_stable_steps`` / ``warmup_type`` / ``decay_type`` / ``min_lr_ratio``).
        load_best_model_at_end (`bool`), metric_for_best_model (`str`), greater_is_better (`bool`): track the best
            evaluation as transformers does (``state.best_metric``, ``state.best_model_checkpoint``, kept by
            ``save_total_limit``) and load that checkpoint's weights when training ends.
        report_to (`str` or `list[str]`, defaults to ``"none"``): ``"none"``, ``"all"`` or some of ``REPORTERS``;
            normalised to a list (``[]`` for none).
        use_cpu (`bool`): build the mesh from ``jax.devices("cpu")`` instead of the default backend.
        mesh_shape (`tuple[int, ...]`, *optional*): torchlike only. Sizes of the device-mesh axes named by
            ``mesh_axis_names``, e.g. ``(4, 2)`` for 4-way ``fsdp`` x 2-way ``tp`` (``"4,2"`` from a command line);
            their product must be the number of devices (of all processes). ``None`` puts every device on the first
            axis (``fsdp``).
        mesh_axis_names (`tuple[str, ...]`, defaults to ``("fsdp", "tp")``): torchlike only. Names of the mesh axes
            (``"fsdp,tp"`` from a command line; ``None`` means the default); batches are sharded over every axis
            except ``"tp"``.
        compilation_cache_dir (`str`, *optional*): torchlike only. Directory of JAX's persistent compilation cache
            (``torchlike.adapters.runtime.compilation.enable_compilation_cache``); ``None`` keeps torchlike's default
            cache.
        prefetch_batches (`int`, defaults to 2): torchlike only. Batches a background thread prepares and puts on
            the devices ahead of the train step; 0 prepares each batch in the training loop.
        lora_step (`str`, defaults to ``"auto"``): torchlike only. How a LoRA train step runs the adapted layers:
            ``"factored"`` as Qwix does, ``x @ W + s * (x @ A) @ B``; ``"merged"`` as one matmul on ``W + s * A @ B``
            formed once per step, the gradients of ``A`` and ``B`` taken from thin products written so that XLA
            transposes no activation (XLA:CPU materialises transposed activations for Qwix's three matmuls);
            ``"auto"`` merges on CPU meshes and factors elsewhere.
            Both give the same losses and gradients; LoRA dropout and QLoRA's quantised weights always factor.
        on_save_error (`str`, defaults to ``"raise"``): torchlike only. What a checkpoint save that cannot write its
            files (a full disk...) does: ``"raise"`` stops training with ``CheckpointSaveError``; ``"warn"`` logs that
            error as a warning and goes on training to the next save. Either way nothing of the failed save is left
            and the earlier checkpoints are intact.
        jit_checkpoint_grace_period (`float`, defaults to 30.0): torchlike only. With ``enable_jit_checkpoint``, the
            seconds the platform allows between its preemption notice (SIGTERM) and the kill: Kubernetes'
            ``terminationGracePeriodSeconds`` (30 by default), a Cloud TPU queued resource's or spot VM's shutdown
            time. The rest of the step in progress and the checkpoint must fit in it: training warns once when the
            steps and saves it measures would not, and the preemption checkpoint's log says how long it took after the
            notice. After a notice, the step's evaluation is skipped so the checkpoint comes first.
    """

    #: What torchlike does with each field (see :mod:`torchlike.field_support`).
    _FIELD_SUPPORT = TRAINING_ARGUMENTS_FIELD_SUPPORT

    # Dict-valued fields that may arrive as JSON text from a command line (transformers' ``_VALID_DICT_FIELDS``).
    _VALID_DICT_FIELDS = ("accelerator_config", "fsdp_config", "deepspeed", "activation_checkpointing_kwargs",
                          "gradient_checkpointing_kwargs", "lr_scheduler_kwargs")

    # --- transformers 5.12 to 5.24 fields, in transformers' order ---
    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | str | None = None
    warmup_steps: float = 0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim_target_modules: None | str | list[str] = None
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    tf32: bool | None = None
    # transformers 5.23: ``bool | None`` and a bare ``--activation_checkpointing`` means True, as in transformers.
    activation_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    # Aliases of the two above (transformers 5.12's names; the default was False, resolved to that in __post_init__).
    gradient_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, bool] | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    auto_find_batch_size: bool = False
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    log_level: str = "passive"
    log_level_replica: str = "warning"
    disable_tqdm: bool | None = None
    report_to: None | str | list[str] = "none"
    run_name: str | None = None
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None | Literal[False] = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    per_device_eval_batch_size: int = 8
    prediction_loss_only: bool = False
    eval_on_start: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    save_only_model: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_on_each_node: bool = False
    save_total_limit: int | None = None
    enable_jit_checkpoint: bool = False
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    full_determinism: bool = False
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    accelerator_config: dict | str | None = None
    parallelism_config: Any = None
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    fsdp: str | None = None
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: dict | str | None = None
    debug: str | list[str] = ""
    skip_memory_metrics: bool = True
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: str | None = None
    # Removed by transformers 5.15; still accepted (with a FutureWarning).
    warmup_ratio: float | None = None
    logging_dir: str | None = None
    local_rank: int = -1

    # --- torchlike fields ---
    # (``str`` in the annotations lets a command line pass "4,2"; the union order is what HfArgumentParser needs)
    mesh_shape: tuple[int, ...] | str | None = None
    mesh_axis_names: tuple[str, ...] | str | None = ("fsdp", "tp")
    compilation_cache_dir: str | None = None
    prefetch_batches: int = 2
    lora_step: str = "auto"
    on_save_error: str = "raise"
    jit_checkpoint_grace_period: float = 30.0

    def __post_init__(self) -> None:
        from .adapters.distributed.mesh import initialize_distributed

        # Scripts create their arguments first: start JAX's multi-process runtime before anything touches a device.
        initialize_distributed()
        # Defaults and normalisation, in transformers' order.
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(os.fspath(self.output_dir))
        for name in self._VALID_DICT_FIELDS:
            setattr(self, name, _parse_json_dict(name, getattr(self, name)))
        self._resolve_checkpointing_aliases()
        if self.disable_tqdm is None:
            self.disable_tqdm = logger.getEffectiveLevel() > logging.WARNING
        removed = ("transformers 5.15 removed it" if warmup_ratio_and_logging_dir_are_removed()
                   else "it is deprecated in transformers 5")
        if self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                raise ValueError(f"warmup_ratio={self.warmup_ratio!r} must be in [0, 1). Prefer warmup_steps, which "
                                 "takes a ratio when below 1 (e.g. warmup_steps=0.1).")
            warn_from_config(f"warmup_ratio: {removed}; using warmup_steps={self.warmup_ratio} (a value below 1 is a "
                             "ratio of the total steps). Pass warmup_steps instead.", FutureWarning)
            self.warmup_steps = self.warmup_ratio
        if self.logging_dir is not None:
            warn_from_config(f"logging_dir: {removed}; torchlike still writes the TensorBoard event files there. Set "
                             "$TENSORBOARD_LOGGING_DIR instead.", FutureWarning)
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if isinstance(self.debug, str):
            self.debug = self.debug.split()
        elif self.debug is None:
            self.debug = []

        # Enumerations.
        self.eval_strategy = check_choice("eval_strategy", self.eval_strategy, INTERVAL_STRATEGIES)
        self.logging_strategy = check_choice("logging_strategy", self.logging_strategy, INTERVAL_STRATEGIES)
        self.save_strategy = check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        self.hub_strategy = check_choice(
            "hub_strategy", self.hub_strategy, HUB_STRATEGIES,
            dict.fromkeys(("checkpoint", "all_checkpoints"),
                          "checkpoint-<step> folders are Orbax checkpoints (params, optimizer state, data position), "
                          "not Hugging Face models, so torchlike pushes only the model that save_model() writes."))
        self.lr_scheduler_type = check_choice(
            "lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS,
            dict.fromkeys(_METRIC_DRIVEN_LR_SCHEDULERS,
                          "it changes the learning rate from evaluation metrics during training, and torchlike's "
                          "compiled train step reads a learning rate fixed per step before training starts."))
        self.optim = check_choice("optim", self.optim, tuple(OPTIMIZERS), {
            **dict.fromkeys(_LOW_BIT_OPTIMIZERS, "low-bit optimizer states are not implemented; 'adamw_torch' gives "
                                                 "the full-precision update (optax.adamw) with fp32 states."),
            **{old: f"transformers 5 removed it; {new!r} computes the same update." for old, new in
               _REMOVED_OPTIMIZERS.items()},
        })
        self.train_sampling_strategy = check_choice(
            "train_sampling_strategy", self.train_sampling_strategy, SAMPLING_STRATEGIES,
            {"group_by_length": "torchlike pads batches to fixed shapes, so grouping by length saves nothing."})
        self.report_to = self._normalise_report_to(self.report_to)

        # Values derived from others, as transformers derives them.
        if not self.do_eval and self.eval_strategy != "no":
            self.do_eval = True
        if self.eval_strategy == "steps" and not self.eval_steps:
            if self.logging_steps > 0:
                self.eval_steps = self.logging_steps
            else:
                raise ValueError(f"eval_strategy='steps' needs eval_steps or logging_steps above 0; got "
                                 f"eval_steps={self.eval_steps!r}, logging_steps={self.logging_steps!r}.")
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        self._validate()

    def _resolve_checkpointing_aliases(self) -> None:
        """transformers 5.23's rule: ``gradient_checkpointing*`` count only when ``activation_checkpointing*`` is not
        set, and then mirror it (unset is ``False``), so either name reads the resolved value.

        Where the installed transformers deprecates the old names, giving one warns as transformers does; a TRL
        config's own default for it (``gradient_checkpointing=True``) does not count as given.
        """
        raw_defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            value = getattr(self, old)
            if getattr(self, new) is None and value is not None:
                if gradient_checkpointing_is_deprecated() and value != raw_defaults[old]:
                    warn_from_config(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.",
                                     FutureWarning)
                setattr(self, new, value)
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False

    def _normalise_report_to(self, value: object) -> list[str]:
        """``report_to`` as a list of integrations: ``"none"`` -> ``[]``, ``"all"`` -> the installed ones."""
        accepted = ("none", "all", *REPORTERS)
        values = [value] if value is None or isinstance(value, str) else list(value)
        values = ["none" if v is None else enum_value(v) for v in values]
        for v in values:
            check_choice("report_to", v, accepted, {
                "trackio": "torchlike reports to tensorboard and wandb only.",
                "mlflow": "torchlike reports to tensorboard and wandb only.",
                "comet_ml": "torchlike reports to tensorboard and wandb only.",
            })
        if len(values) > 1 and ("none" in values or "all" in values):
            raise ValueError(f"report_to={value!r}: 'none' and 'all' cannot be combined with other values. "
                             f"Accepted values: {', '.join(repr(v) for v in accepted)}, or a list of "
                             f"{', '.join(repr(v) for v in REPORTERS)}.")
        if values == ["none"]:
            return []
        if values == ["all"]:
            return [name for name in REPORTERS if any(map(_installed, _REPORTER_PACKAGES[name]))]
        for name in values:
            if not any(map(_installed, _REPORTER_PACKAGES[name])):
                raise ValueError(f"report_to={value!r} needs the {name} package, which is not installed. "
                                 f"Install it (pip install {name}) or drop {name!r} from report_to.")
        return list(dict.fromkeys(values))

    def _validate(self) -> None:
        if self.logging_strategy == "steps":
            if self.logging_steps <= 0:
                raise ValueError(f"logging_strategy='steps' needs logging_steps above 0; got {self.logging_steps!r}.")
            self.logging_steps = _whole_steps("logging_steps", self.logging_steps)
        if self.eval_strategy == "steps":
            self.eval_steps = _whole_steps("eval_steps", self.eval_steps)
        if self.save_strategy == "steps":
            if self.save_steps <= 0:
                raise ValueError(f"save_strategy='steps' needs save_steps above 0; got {self.save_steps!r}. Use "
                                 "save_strategy='no' to save only at the end.")
            self.save_steps = _whole_steps("save_steps", self.save_steps)
        self._validate_best_model()
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True were both set; choose at most one compute dtype.")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be >= 0: a number of steps, or a ratio of the "
                             "total steps when below 1.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        self._validate_mesh()
        if self.lora_step not in ("auto", "merged", "factored"):
            raise ValueError(f"lora_step={self.lora_step!r} must be 'auto', 'merged' or 'factored'.")
        self.on_save_error = check_choice("on_save_error", self.on_save_error, SAVE_ERROR_ACTIONS)
        grace = self.jit_checkpoint_grace_period
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise ValueError(f"jit_checkpoint_grace_period={grace!r} must be a number of seconds > 0: the time the "
                             "platform allows between its preemption notice and the kill (Kubernetes' "
                             "terminationGracePeriodSeconds, 30 by default).")
        if not isinstance(self.prefetch_batches, int) or self.prefetch_batches < 0:
            raise ValueError(f"prefetch_batches={self.prefetch_batches!r} must be an integer >= 0 (0 prepares each "
                             "batch in the training loop).")

    def _validate_best_model(self) -> None:
        """transformers' rule: the best checkpoint can only be loaded at the end if one is saved after each
        evaluation that may find it (``save_strategy="best"`` saves exactly then)."""
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        if self.eval_strategy != self.save_strategy:
            raise ValueError("load_best_model_at_end=True needs the save and eval strategies to match (or "
                             f"save_strategy='best'); got eval_strategy={self.eval_strategy!r} and "
                             f"save_strategy={self.save_strategy!r}.")
        if self.eval_strategy != "steps":
            return
        save, evaluate = self.save_steps, self.eval_steps
        if (save < 1) != (evaluate < 1):
            raise ValueError("load_best_model_at_end=True needs save_steps to be a multiple of eval_steps, which "
                             f"cannot be guaranteed when one is a ratio and the other a number of steps; got "
                             f"save_steps={save!r} and eval_steps={evaluate!r}.")
        if round(save * 1_000_000) % round(evaluate * 1_000_000) != 0:  # transformers' integer test, ratios too
            raise ValueError(f"load_best_model_at_end=True needs save_steps to be a round multiple of eval_steps, so "
                             f"that every checkpoint follows an evaluation; got save_steps={save!r} and "
                             f"eval_steps={evaluate!r}.")

    def _validate_mesh(self) -> None:
        if self.mesh_axis_names is None:
            self.mesh_axis_names = ("fsdp", "tp")
        if isinstance(self.mesh_axis_names, str):
            self.mesh_axis_names = tuple(self.mesh_axis_names.replace(",", " ").split())
        self.mesh_axis_names = tuple(self.mesh_axis_names)
        if not self.mesh_axis_names or len(set(self.mesh_axis_names)) != len(self.mesh_axis_names):
            raise ValueError(f"mesh_axis_names={self.mesh_axis_names!r} must be distinct names, e.g. "
                             "('fsdp', 'tp').")
        if self.mesh_shape is None:
            return
        if isinstance(self.mesh_shape, str):
            self.mesh_shape = tuple(int(part) for part in self.mesh_shape.replace(",", " ").split())
        shape = tuple(self.mesh_shape)
        if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in shape):
            raise ValueError(f"mesh_shape={self.mesh_shape!r} must hold positive integers, e.g. (4, 2).")
        if len(shape) != len(self.mesh_axis_names):
            raise ValueError(f"mesh_shape={shape!r} has {len(shape)} axes but mesh_axis_names="
                             f"{self.mesh_axis_names!r} has {len(self.mesh_axis_names)}; give one size per axis.")
        self.mesh_shape = shape

    # --- helpers the trainers use ---

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel shards: the product of ``mesh_shape`` over every axis but ``"tp"``.

        With ``mesh_shape=None`` every device (of all processes) is on the first axis, so it is
        ``jax.device_count()`` (``jax.devices("cpu")`` with ``use_cpu``).
        """
        if self.mesh_shape is None:
            import jax

            return len(jax.devices("cpu")) if self.use_cpu else jax.device_count()
        return math.prod(size for size, name in zip(self.mesh_shape, self.mesh_axis_names, strict=True)
                         if name != "tp")

    @property
    def train_batch_size(self) -> int:
        """Global examples per micro-step: ``per_device_train_batch_size * data_parallel_size``.

        transformers' property of the same name counts one process's batch; torchlike's single program spans every
        process, so this is the global batch (before gradient accumulation).
        """
        return self.per_device_train_batch_size * self.data_parallel_size

    @property
    def eval_batch_size(self) -> int:
        """Global examples per evaluation step: ``per_device_eval_batch_size * data_parallel_size``."""
        return self.per_device_eval_batch_size * self.data_parallel_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup length as transformers computes it.

        Args:
            num_training_steps: total optimizer steps of the run.

        Returns:
            ``int(warmup_steps)`` when ``warmup_steps >= 1``, else ``ceil(num_training_steps * warmup_steps)``.
        """
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, with ``hub_token`` hidden (transformers' ``to_dict`` hides it too).

        Returns:
            ``{field name: value}`` for every field.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if values.get("hub_token") is not None:
            values["hub_token"] = "<HUB_TOKEN>"
        return values

    def to_json_string(self) -> str:
        """``to_dict()`` as indented JSON (values JSON cannot hold are written with ``str``)."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def __repr__(self) -> str:
        body = "".join(f"{name}={value!r},\n" for name, value in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{body})"

    __str__ = __repr__


reject_removed_arguments(TrainingArguments, _REMOVED_ARGUMENTS)
