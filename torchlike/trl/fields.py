"""The field table: for every field of ``TrainingArguments`` and ``SFTConfig``, whether torchlike honours it.

``FIELD_SUPPORT`` maps each field name to a ``FieldSupport``:

- ``"honoured"``: the trainer does what transformers/TRL do with the field (the reason says how).
- ``"ignored"``: the field has no effect in torchlike; setting it to anything but its default warns once, with the
  reason (it only concerns torch, CUDA, Accelerate or a tool torchlike does not use, and ignoring it does not change
  the trained weights).
- ``"refused"``: only the default is supported; any other value raises ``ValueError`` with the reason, because
  ignoring it would change the results the user expects.

``check_unsupported(args)`` applies the table to a config; trainers call it when they start. A config class may name
its own rows in a ``_FIELD_SUPPORT`` class attribute (``GRPOConfig``, ``DPOConfig``: see ``torchlike.trl.rl_fields``),
which are laid over this table. A test holds the table against the fields of the real ``trl.SFTConfig`` and
``transformers.TrainingArguments``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["honoured", "ignored", "refused"]


@dataclass(frozen=True)
class FieldSupport:
    """What torchlike does with one configuration field.

    Args:
        status: ``"honoured"``, ``"ignored"`` (warn when set) or ``"refused"`` (error when set).
        reason: for honoured fields, how torchlike implements it; otherwise why it is ignored or refused and what
            to use instead.
    """

    status: Status
    reason: str


def _honoured(reason: str) -> FieldSupport:
    return FieldSupport("honoured", reason)


def _ignored(reason: str) -> FieldSupport:
    return FieldSupport("ignored", reason)


def _refused(reason: str) -> FieldSupport:
    return FieldSupport("refused", reason)


_NO_TORCH_DDP = ("torchlike does not use torch DistributedDataParallel: gradients are reduced by XLA collectives "
                 "over the device mesh.")
_NO_DATALOADER = ("torchlike has no torch DataLoader: batches are prepared by its background prefetch thread (see "
                  "prefetch_batches).")
_USE_MESH = ("torchlike shards parameters and batches over its JAX device mesh instead; set mesh_shape / "
             "mesh_axis_names (parameters are sharded over the 'fsdp' axis by default).")
_XLA_COMPILES = "XLA always compiles the train step; there is no torch.compile to configure."
_NO_TRACKIO = "torchlike does not report to trackio (report_to accepts 'tensorboard' and 'wandb')."
_NO_BEST_MODEL = ("torchlike does not track the best checkpoint by an eval metric (no load_best_model_at_end, no "
                  "save_strategy='best'), so checkpoint rotation and the final model would not be what you expect.")
_ONLY_FOR_METRICS = ("Only changes what compute_metrics receives; torchlike's trainers do not take compute_metrics yet "
                     "(evaluate() reports the loss), so it has no effect.")

FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- transformers.TrainingArguments 5.12.1 ---
    "output_dir": _honoured("Checkpoints go to output_dir/checkpoint-<step> (torchlike.save) and save_model() writes "
                            "the Hugging Face-format model there; 'trainer_output' when not given."),
    "per_device_train_batch_size": _honoured("Examples per data-parallel shard; times args.data_parallel_size "
                                             "(mesh axes other than 'tp', over all processes) it is the global "
                                             "micro-batch."),
    "num_train_epochs": _honoured("Passes over the training data when max_steps is -1 (fractional epochs stop "
                                  "part-way, as in transformers)."),
    "max_steps": _honoured("Total optimizer steps; overrides num_train_epochs when > 0."),
    "learning_rate": _honoured("Peak learning rate of the optax schedule."),
    "lr_scheduler_type": _honoured("optax schedule with transformers' shape: linear, cosine (half cycle to 0), "
                                   "constant (no warmup, as transformers) or constant_with_warmup; others are "
                                   "rejected by the config."),
    "lr_scheduler_kwargs": _refused("torchlike's schedules take no extra parameters yet (cosine is transformers' "
                                    "default half cycle)."),
    "warmup_steps": _honoured("Linear warmup from 0: whole steps when >= 1, a ratio of the total steps (rounded up) "
                              "when below 1, as transformers' get_warmup_steps."),
    "optim": _honoured("The torch AdamW variants map to optax.adamw (same update), 'sgd' to optax.sgd; others are "
                       "rejected by the config."),
    "optim_args": _refused("Optimizer-specific options (AnyPrecision dtypes, SGD momentum, ...) are not implemented; "
                           "torchlike's optimizers take learning_rate, weight_decay, adam_beta1/2 and adam_epsilon."),
    "weight_decay": _honoured("Decoupled weight decay of optax.adamw (L2 added to the gradient for sgd), applied as "
                              "transformers does: not to biases and norm weights."),
    "adam_beta1": _honoured("b1 (first-moment decay) of optax.adamw."),
    "adam_beta2": _honoured("b2 (second-moment decay) of optax.adamw."),
    "adam_epsilon": _honoured("eps (denominator term) of optax.adamw."),
    "optim_target_modules": _refused("GaLore/APOLLO optimizers are not implemented, so the optimizer would treat "
                                     "every module alike."),
    "gradient_accumulation_steps": _honoured("Micro-batches per optimizer step; the loss is normalised by the number "
                                             "of loss tokens across all of them, as transformers does."),
    "average_tokens_across_devices": _refused("The train step is one SPMD program over the global batch, so the loss "
                                              "is always normalised by the tokens of all devices (the default True)."
                                              " A per-device normalisation would change the gradients."),
    "max_grad_norm": _honoured("Global-norm clipping (optax.clip_by_global_norm) before the update; 0 or None "
                               "disables it."),
    "label_smoothing_factor": _refused("Label smoothing is not implemented; the loss would be plain cross-entropy."),
    "bf16": _honoured("Compute (activations, matmuls) in bfloat16 while parameters and optimizer state keep their "
                      "dtype, like torch autocast; runs on CPU too."),
    "fp16": _refused("float16 training needs loss scaling, which torchlike does not implement; use bf16=True "
                     "(bfloat16 has float32's range, so it needs none, and it is the native TPU type)."),
    "bf16_full_eval": _ignored("Evaluation computes in the training compute dtype (bfloat16 with bf16=True); the "
                               "parameters are not cast to bfloat16 for evaluation."),
    "fp16_full_eval": _ignored("Evaluation computes in the training compute dtype (bfloat16 with bf16=True, else the "
                               "parameters' dtype); the parameters are not cast to float16 for evaluation."),
    "tf32": _ignored("TF32 is a torch/CUDA matmul switch; XLA chooses matmul precision itself (set "
                     "jax_default_matmul_precision to control it)."),
    "gradient_checkpointing": _honoured("Rematerialisation (jax.checkpoint) of each decoder layer in the backward "
                                        "pass."),
    "gradient_checkpointing_kwargs": _ignored("torch checkpoint options (use_reentrant, ...) have no JAX counterpart;"
                                              " torchlike rematerialises each decoder layer with jax.checkpoint's "
                                              "default policy."),
    "torch_compile": _ignored(_XLA_COMPILES),
    "torch_compile_backend": _ignored(_XLA_COMPILES),
    "torch_compile_mode": _ignored(_XLA_COMPILES),
    "use_liger_kernel": _ignored("Liger kernels are Triton code for torch models; XLA fuses the JAX model itself "
                                 "(the loss is the same)."),
    "liger_kernel_config": _ignored("Liger kernels are Triton code for torch models; XLA fuses the JAX model itself."),
    "use_cache": _ignored("The training forward pass never builds a KV cache in torchlike."),
    "neftune_noise_alpha": _refused("NEFTune embedding noise is not implemented; training would run without it."),
    "torch_empty_cache_steps": _ignored("JAX manages device memory itself; there is no torch allocator cache to "
                                        "empty."),
    "auto_find_batch_size": _refused("torchlike does not retry with a smaller batch after running out of memory; "
                                     "set per_device_train_batch_size (and gradient_accumulation_steps) yourself."),
    "logging_strategy": _honoured("When to log loss, learning rate and grad norm to log_history, the progress bar "
                                  "and report_to: 'no', 'steps' or 'epoch'."),
    "logging_steps": _honoured("Optimizer steps between logs (a ratio of the total steps when below 1); the logged "
                               "loss is the mean since the last log."),
    "logging_first_step": _honoured("Also log after the first optimizer step."),
    "log_on_each_node": _ignored("torchlike logs (progress bar, log_history reporting) from process 0 only, as with "
                                 "log_on_each_node=False."),
    "logging_nan_inf_filter": _honoured("A nan/inf step loss is replaced, in the logged loss and train_loss, by "
                                        "transformers' value: the sum of the logging window's earlier losses "
                                        "divided by one plus their count (the update itself is not skipped; the "
                                        "unit is the optimizer step, where transformers filters micro-batches)."),
    "include_num_input_tokens_seen": _ignored("torchlike does not log num_input_tokens_seen yet."),
    "log_level": _ignored("torchlike logs through Python's 'torchlike' logger; set its level with "
                          "logging.getLogger('torchlike').setLevel(...)."),
    "log_level_replica": _ignored("torchlike logs from process 0 only; other processes stay quiet."),
    "disable_tqdm": _honoured("Hides the tqdm progress bar (it shows loss and learning rate)."),
    "report_to": _honoured("Loggers for log_history entries: 'tensorboard', 'wandb', 'all' (those installed) or "
                           "'none'; others are rejected by the config."),
    "run_name": _honoured("Run name given to wandb and written with the TensorBoard logs."),
    "project": _ignored(_NO_TRACKIO),
    "trackio_space_id": _ignored(_NO_TRACKIO),
    "trackio_bucket_id": _ignored(_NO_TRACKIO),
    "trackio_static_space_id": _ignored(_NO_TRACKIO),
    "eval_strategy": _honoured("When evaluate() runs during training: 'no', 'steps' or 'epoch'."),
    "eval_steps": _honoured("Optimizer steps between evaluations (defaults to logging_steps, a ratio when below 1)."),
    "eval_delay": _honoured("No evaluation before this many steps (or epochs with eval_strategy='epoch'), as "
                            "transformers' DefaultFlowCallback decides."),
    "per_device_eval_batch_size": _honoured("Examples per data-parallel shard in evaluation; the last partial batch "
                                            "is padded and masked."),
    "prediction_loss_only": _ignored("evaluate() only ever computes the loss (torchlike's trainers do not take "
                                     "compute_metrics yet), which is what prediction_loss_only=True asks for."),
    "eval_on_start": _honoured("Run one evaluation before the first training step."),
    "eval_do_concat_batches": _ignored(_ONLY_FOR_METRICS),
    "eval_use_gather_object": _ignored("Evaluation gathers no predictions, only each batch's loss sum and item count, "
                                       "which JAX reduces across devices and processes."),
    "eval_accumulation_steps": _ignored("Evaluation keeps no predictions on the devices, only each batch's loss sum "
                                        "and item count (scalars), so there is nothing to move to the host early."),
    "include_for_metrics": _ignored(_ONLY_FOR_METRICS),
    "batch_eval_metrics": _ignored(_ONLY_FOR_METRICS),
    "save_only_model": _honoured("Checkpoints hold only the model (or LoRA) parameters, without optimizer state, "
                                 "RNG and data position, so they cannot be resumed from."),
    "save_strategy": _honoured("When to write output_dir/checkpoint-<step>: 'no', 'steps' or 'epoch'."),
    "save_steps": _honoured("Optimizer steps between checkpoints (a ratio of the total steps when below 1)."),
    "save_on_each_node": _refused("Orbax writes one checkpoint collectively from all processes, so output_dir must "
                                  "be storage that every host can reach; per-node copies are not written."),
    "save_total_limit": _honoured("Keep at most this many checkpoint-<step> folders, deleting the oldest."),
    "enable_jit_checkpoint": _ignored("torchlike does not checkpoint on SIGTERM; use save_strategy/save_steps."),
    "push_to_hub": _honoured("Push the Hugging Face-format model (save_model's output) to hub_model_id with "
                             "huggingface_hub: from save_model() (commit 'Model save', as transformers) and, with "
                             "hub_strategy='every_save', at each checkpoint save."),
    "hub_token": _honoured("Token for the Hub pushes."),
    "hub_private_repo": _honoured("Create the Hub repository as private."),
    "hub_model_id": _honoured("Hub repository to push to (defaults to the name of output_dir)."),
    "hub_strategy": _honoured("'every_save': push the model at each checkpoint save; 'end': not then. Either way "
                              "save_model() pushes when push_to_hub is set, as in transformers, which is the push at "
                              "the end of a script. Checkpoint pushes are rejected by the config (checkpoints are "
                              "Orbax, not Hugging Face format)."),
    "hub_always_push": _ignored("torchlike pushes synchronously, so a push is never skipped while an earlier one "
                                "runs."),
    "hub_revision": _refused("Pushing to a branch other than the repository's default is not implemented; the "
                             "model would land on the default branch."),
    "load_best_model_at_end": _refused(_NO_BEST_MODEL),
    "metric_for_best_model": _refused(_NO_BEST_MODEL),
    "greater_is_better": _refused(_NO_BEST_MODEL),
    "ignore_data_skip": _refused("Resuming restores the exact data position saved in the checkpoint; starting the "
                                 "epoch's data over is not implemented."),
    "restore_callback_states_from_checkpoint": _ignored("torchlike checkpoints do not hold callback states; "
                                                        "callbacks start fresh on resume."),
    "full_determinism": _ignored("XLA runs the same program in the same order for a given seed; on GPUs add "
                                 "--xla_gpu_deterministic_ops=true to XLA_FLAGS for bitwise determinism."),
    "seed": _honoured("Seeds the LoRA weights a trainer creates from peft_config (TRL seeds before creating the "
                      "adapter), LoRA dropout, GRPO's sampling, SFT's shuffle_dataset and, without data_seed, the "
                      "training data order."),
    "data_seed": _honoured("Seeds the training data order (train_sampling_strategy='random') in place of seed, as "
                           "transformers' sampler does."),
    "use_cpu": _honoured("Builds the device mesh from jax.devices('cpu') instead of the default backend."),
    "accelerator_config": _ignored("torchlike does not use Accelerate: batches are sharded over the mesh's data axes"
                                   " (split_batches, dispatch_batches, even_batches... have no effect)."),
    "parallelism_config": _ignored(_USE_MESH),
    "dataloader_drop_last": _honoured("Drop the last partial training batch of each epoch (by default it is padded "
                                      "and masked, without a new compilation)."),
    "dataloader_num_workers": _ignored(_NO_DATALOADER),
    "dataloader_pin_memory": _ignored(_NO_DATALOADER),
    "dataloader_persistent_workers": _ignored(_NO_DATALOADER),
    "dataloader_prefetch_factor": _ignored(_NO_DATALOADER),
    "remove_unused_columns": _honoured("Each example keeps only the columns the loss reads before the data "
                                       "collator, as transformers' RemoveColumnsCollator: input_ids, attention_mask "
                                       "and loss_mask for a torchlike model's own loss; with compute_loss_func the "
                                       "model's inputs (a plain NNX module: its __call__ parameters) and label_names."
                                       " A JAX-native loss_fn may read any column, so it gets them all."),
    "label_names": _honoured("Batch columns that hold the labels (default ['labels']): with compute_loss_func they are "
                             "left out of the model's inputs and passed as its labels (one array, or a tuple for "
                             "several), the first counted for num_items_in_batch; remove_unused_columns keeps them. "
                             "transformers hands compute_loss_func only a 'labels' column, which is the default."),
    "train_sampling_strategy": _honoured("'random' (default): reshuffle every epoch, seeded by data_seed or seed, "
                                         "like transformers' RandomSampler; 'sequential': dataset order. "
                                         "'group_by_length' is rejected by the config."),
    "length_column_name": _ignored("Only read by train_sampling_strategy='group_by_length', which torchlike does not"
                                   " support."),
    "ddp_find_unused_parameters": _ignored(_NO_TORCH_DDP),
    "ddp_bucket_cap_mb": _ignored(_NO_TORCH_DDP),
    "ddp_broadcast_buffers": _ignored(_NO_TORCH_DDP),
    "ddp_static_graph": _ignored(_NO_TORCH_DDP),
    "ddp_backend": _ignored(_NO_TORCH_DDP + " Multi-process runs use jax.distributed."),
    "ddp_timeout": _ignored("Multi-process runs use jax.distributed, which has its own initialisation timeout."),
    "fsdp": _ignored(_USE_MESH),
    "fsdp_config": _ignored(_USE_MESH),
    "deepspeed": _ignored(_USE_MESH),
    "debug": _ignored("transformers' debug options (underflow_overflow, tpu_metrics_debug) are torch tools; use "
                      "jax.config.update('jax_debug_nans', True) instead."),
    "skip_memory_metrics": _ignored("torchlike does not add memory metrics to the logs."),
    "do_train": _honoured("Kept for your script, as in transformers (whose Trainer does not read it either)."),
    "do_eval": _honoured("Kept for your script, as in transformers; set to True when eval_strategy is not 'no'."),
    "do_predict": _honoured("Kept for your script, as in transformers (whose Trainer does not read it either)."),
    "resume_from_checkpoint": _honoured("Kept for your script, as in transformers: pass it to "
                                        "trainer.train(resume_from_checkpoint=...), which takes True (the latest "
                                        "checkpoint in output_dir) or a path and continues exactly."),
    "warmup_ratio": _honoured("Deprecated in transformers 5: copied into warmup_steps (a ratio) with a "
                              "FutureWarning."),
    "logging_dir": _honoured("Where report_to='tensorboard' writes its event files (default: "
                             "$TENSORBOARD_LOGGING_DIR, else output_dir/runs/<time>_<host>). transformers 5 deprecates "
                             "it and its TensorBoardCallback no longer reads it; torchlike still does."),
    "local_rank": _ignored("Set by torch launchers; torchlike reads the process index from jax.distributed."),
    # --- torchlike ---
    "mesh_shape": _honoured("torchlike: sizes of the device-mesh axes (e.g. (4, 2) for fsdp x tp); None puts every "
                            "device on 'fsdp'."),
    "mesh_axis_names": _honoured("torchlike: names of the mesh axes, ('fsdp', 'tp') by default; batches are sharded "
                                 "over every axis but 'tp'."),
    "compilation_cache_dir": _honoured("torchlike: directory of JAX's persistent compilation cache (None keeps "
                                       "torchlike's default)."),
    "prefetch_batches": _honoured("torchlike: batches prepared and put on the devices ahead of the train step by a "
                                  "background thread (0: prepared in the loop)."),
    "lora_step": _honoured("torchlike: how a LoRA train step runs the adapted layers: 'factored' (Qwix's x@W + "
                           "s*(x@A)@B), 'merged' (one matmul on W + s*A@B formed each step, factor gradients from "
                           "thin products) or 'auto' (merged on CPU meshes); same losses and gradients."),
    # --- trl.SFTConfig 1.16 ---
    "model_init_kwargs": _honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when model is"
                                   " a string (dtype as a string, a torch dtype or 'auto')."),
    "trust_remote_code": _refused("Hub modelling code is PyTorch and cannot run on torchlike's JAX models (which are "
                                  "built from torchlike's own model families)."),
    "router_aux_loss_coef": _refused("torchlike's model families are dense; there is no Mixture-of-Experts router "
                                     "loss to weight."),
    "chat_template_path": _honoured("A .jinja/.j2 file whose text becomes the processing_class's chat template, or "
                                    "a tokenizer directory/id whose chat template and eos token are copied; a "
                                    "tokenizer with tokens the processing_class lacks is refused (TRL adds them and "
                                    "resizes the embeddings, which torchlike does not)."),
    "dataset_text_field": _honoured("Column holding the text of language-modelling datasets."),
    "dataset_kwargs": _honoured("{'skip_prepare_dataset': True} uses the dataset as given: input_ids, the loss on "
                                "labels != -100 (every token without labels), no truncation; other keys warn, as "
                                "TRL ignores them."),
    "dataset_num_proc": _ignored("SFT examples are tokenised in one process, one at a time (streaming datasets too); "
                                "the result is the same as with several."),
    "eos_token": _honoured("Token appended at the end of each example/turn (default: the tokenizer's eos_token)."),
    "max_length": _honoured("Examples are truncated to max_length tokens and batches padded to it (None: no "
                            "truncation, padding to a small set of length buckets)."),
    "truncation_mode": _honoured("'keep_start' keeps the first max_length tokens; the deprecated 'keep_end' keeps the"
                                 " last ones (with TRL's FutureWarning)."),
    "shuffle_dataset": _honoured("Shuffle the prepared training dataset once before training, seeded by seed."),
    "packing": _refused("Packing several examples into one max_length sequence is not supported yet."),
    "packing_strategy": _ignored("Only used with packing=True, which torchlike does not support yet."),
    "padding_free": _refused("Padding-free batches (all examples flattened into one sequence) are not supported: "
                             "torchlike pads to fixed shapes so XLA compiles once."),
    "pad_to_multiple_of": _honoured("The fixed padded length of the batches (max_length, or the longest example) is "
                                    "rounded up to a multiple of it, as TRL's collator rounds each batch's length "
                                    "('auto' becomes None, as in TRL off Neuron)."),
    "eval_packing": _honoured("None (same as packing) or False: evaluation data is not packed; True is rejected by "
                              "the config."),
    "completion_only_loss": _honoured("Loss only on completion tokens (None: yes for prompt/completion datasets, no "
                                      "for language-modelling ones), with a loss mask distinct from padding."),
    "assistant_only_loss": _honoured("Loss only on assistant turns of conversational data, from the chat template's "
                                     "{% generation %} markers."),
    "loss_type": _honoured("'nll' (token-mean negative log-likelihood; 'chunked_nll' is its deprecated alias); "
                           "'dft' is rejected by the config."),
    "activation_offloading": _ignored("Activations stay on the device; gradient_checkpointing (on by default) is "
                                      "torchlike's way to cut activation memory."),
    "pad_token": _honoured("Deprecated in TRL (FutureWarning): with the default data collator, sets "
                           "processing_class.pad_token, the padding id of the batches; it must be in the vocabulary."),
}

#: ``SFTConfig``'s own rows, laid over ``FIELD_SUPPORT`` for it (``SFTConfig._FIELD_SUPPORT``).
SFT_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "remove_unused_columns": _ignored("SFT examples reach the data collator as the prepared columns (input_ids, "
                                      "loss_mask, seq_len), as with TRL's default True; False, which in TRL also "
                                      "passes the dataset's other columns to a custom data_collator, changes nothing "
                                      "(the default collator never reads them)."),
}


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple, str)) and len(value) == 0)


def _differs(value: Any, default: Any) -> bool:
    """Whether a field's value counts as set: unequal to its default (an empty dict/list/string equals None)."""
    if _is_empty(value) and _is_empty(default):
        return False
    try:
        return bool(value != default)
    except Exception:  # values whose comparison is not a plain bool (arrays, odd objects) count as set
        return True


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """Field values of a default-constructed ``cls``, i.e. defaults after ``__post_init__``'s normalisation."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instance = cls()
        return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
    except (TypeError, ValueError):
        values = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
        return values


def _shown(name: str, value: Any) -> str:
    return "'<hidden>'" if name == "hub_token" else repr(value)


def field_table(config_class: type) -> dict[str, FieldSupport]:
    """The rows that apply to a config class: ``FIELD_SUPPORT`` with the class's own ``_FIELD_SUPPORT`` laid over it.

    Args:
        config_class: ``TrainingArguments`` or a subclass.

    Returns:
        Field name -> ``FieldSupport``.
    """
    return {**FIELD_SUPPORT, **getattr(config_class, "_FIELD_SUPPORT", {})}


def check_unsupported(args: Any) -> None:
    """Warn about ignored fields and reject refused fields that ``args`` sets to a non-default value.

    Each ignored field gets one ``UserWarning`` naming the field, its value and the reason; all refused fields are
    reported together in one ``ValueError``. Fields left at their defaults are silent.

    Args:
        args: a ``torchlike.TrainingArguments`` or subclass (``SFTConfig``...).

    Raises:
        ValueError: a refused field is set; the message names each one with its value, the reason and the fix.
    """
    defaults = _defaults(type(args))
    table = field_table(type(args))
    refused = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        default = defaults.get(f.name)
        if not _differs(value, default):
            continue
        support = table.get(f.name)
        if support is None:
            warnings.warn(f"{f.name}={_shown(f.name, value)} is not in torchlike's field table "
                          "(torchlike.trl.fields.FIELD_SUPPORT), so nothing reads it; please report this.",
                          UserWarning, stacklevel=2)
        elif support.status == "ignored":
            warnings.warn(f"{f.name}={_shown(f.name, value)} is ignored: {support.reason}", UserWarning, stacklevel=2)
        elif support.status == "refused":
            refused.append(f"{f.name}={_shown(f.name, value)}: {support.reason} Remove it or set "
                           f"{f.name}={default!r} (the default).")
    if refused:
        raise ValueError(f"{type(args).__name__} sets {len(refused)} argument(s) torchlike does not support:\n  - "
                         + "\n  - ".join(refused))


def fields_with_status(status: Status) -> list[str]:
    """Names of the fields with a given status, in table order.

    Args:
        status: ``"honoured"``, ``"ignored"`` or ``"refused"``.

    Returns:
        The field names.
    """
    return [name for name, support in FIELD_SUPPORT.items() if support.status == status]


def unsupported_fields_markdown() -> str:
    """The "not honoured" tables of MIGRATION.md: every ignored or refused field of ``TrainingArguments``,
    ``SFTConfig``, ``GRPOConfig`` and ``DPOConfig`` with its reason (a test keeps MIGRATION.md equal to it).

    Returns:
        Markdown: one table per config class, rows sorted by status then name.
    """
    from torchlike.training_args import TrainingArguments
    from torchlike.trl.dpo_config import DPOConfig
    from torchlike.trl.grpo_config import GRPOConfig
    from torchlike.trl.sft_config import SFTConfig

    sections, shown = [], set()
    for config_class in (TrainingArguments, SFTConfig, GRPOConfig, DPOConfig):
        names = {field.name for field in dataclasses.fields(config_class)}
        table = field_table(config_class)
        rows = sorted((support.status, name, support.reason) for name, support in table.items()
                      if name in names and support.status != "honoured"
                      and (name, support) not in shown)
        shown.update((name, table[name]) for _, name, _ in rows)
        if not rows:
            continue
        lines = [f"### {config_class.__name__}", "", "| field | status | why |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {status} | {reason.replace('|', '/')} |" for status, name, reason in rows]
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"
