"""What torchlike does with each field of ``TrainingArguments``: transformers' fields (5.12 to 5.24) and torchlike's
own.

``TrainingArguments._FIELD_SUPPORT`` is this table (see :mod:`torchlike.field_support`).
"""

from __future__ import annotations

from .field_support import FieldSupport, honoured, ignored, refused

_NO_TORCH_DDP = ("torchlike does not use torch DistributedDataParallel: gradients are reduced by XLA collectives "
                 "over the device mesh.")
_NO_DATALOADER = ("torchlike has no torch DataLoader: batches are prepared by its background prefetch thread (see "
                  "prefetch_batches).")
_USE_MESH = ("torchlike shards parameters and batches over its JAX device mesh instead; set mesh_shape / "
             "mesh_axis_names (parameters are sharded over the 'fsdp' axis by default).")
_XLA_COMPILES = "XLA always compiles the train step; there is no torch.compile to configure."
_NO_TRACKIO = "torchlike does not report to trackio (report_to accepts 'tensorboard' and 'wandb')."

TRAINING_ARGUMENTS_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- transformers.TrainingArguments 5.12 to 5.24 ---
    "output_dir": honoured("Checkpoints go to output_dir/checkpoint-<step> (torchlike.save) and save_model() writes "
                           "the Hugging Face-format model there; 'trainer_output' when not given."),
    "per_device_train_batch_size": honoured("Examples per data-parallel shard; times args.data_parallel_size "
                                            "(mesh axes other than 'tp', over all processes) it is the global "
                                            "micro-batch."),
    "num_train_epochs": honoured("Passes over the training data when max_steps is -1 (fractional epochs stop "
                                 "part-way, as in transformers)."),
    "max_steps": honoured("Total optimizer steps; overrides num_train_epochs when > 0."),
    "learning_rate": honoured("Peak learning rate of the optax schedule."),
    "lr_scheduler_type": honoured("Each step's learning rate is the one transformers' get_scheduler gives (computed "
                                  "once on the host, read from a table by the train step): linear, cosine, "
                                  "cosine_with_restarts, polynomial, constant, constant_with_warmup, inverse_sqrt, "
                                  "cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay. "
                                  "reduce_lr_on_plateau and greedy are rejected by the config: they change the rate "
                                  "from evaluation metrics, and the train step's rates are fixed before training."),
    "lr_scheduler_kwargs": honoured("Passed to transformers' get_scheduler as scheduler_specific_kwargs, which checks "
                                    "them: num_cycles (cosine, cosine_with_restarts), power / lr_end (polynomial), "
                                    "timescale (inverse_sqrt), min_lr / min_lr_rate (cosine_with_min_lr), "
                                    "warmup_lr_rate, num_stable_steps / num_decay_steps / warmup_type / decay_type / "
                                    "min_lr_ratio (warmup_stable_decay); constant and constant_with_warmup ignore "
                                    "them, as in transformers."),
    "warmup_steps": honoured("Linear warmup from 0: whole steps when >= 1, a ratio of the total steps (rounded up) "
                             "when below 1, as transformers' get_warmup_steps."),
    "optim": honoured("The torch AdamW variants map to optax.adamw (same update), 'sgd' to optax.sgd; others are "
                      "rejected by the config."),
    "optim_args": refused("Optimizer-specific options (AnyPrecision dtypes, SGD momentum, ...) are not implemented; "
                          "torchlike's optimizers take learning_rate, weight_decay, adam_beta1/2 and adam_epsilon."),
    "weight_decay": honoured("Decoupled weight decay of optax.adamw (L2 added to the gradient for sgd), applied as "
                             "transformers does: not to biases and norm weights."),
    "adam_beta1": honoured("b1 (first-moment decay) of optax.adamw."),
    "adam_beta2": honoured("b2 (second-moment decay) of optax.adamw."),
    "adam_epsilon": honoured("eps (denominator term) of optax.adamw."),
    "optim_target_modules": refused("GaLore/APOLLO optimizers are not implemented, so the optimizer would treat "
                                    "every module alike."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; the loss is normalised by the number "
                                            "of loss tokens across all of them, as transformers does."),
    "average_tokens_across_devices": refused("The train step is one SPMD program over the global batch, so the loss "
                                             "is always normalised by the tokens of all devices (the default True)."
                                             " A per-device normalisation would change the gradients."),
    "max_grad_norm": honoured("Global-norm clipping (optax.clip_by_global_norm) before the update; 0 or None "
                              "disables it."),
    "label_smoothing_factor": refused("Label smoothing is not implemented; the loss would be plain cross-entropy."),
    "bf16": honoured("Compute (activations, matmuls) in bfloat16 while parameters and optimizer state keep their "
                     "dtype, like torch autocast; runs on CPU too."),
    "fp16": refused("float16 training needs loss scaling, which torchlike does not implement; use bf16=True "
                    "(bfloat16 has float32's range, so it needs none, and it is the native TPU type)."),
    "bf16_full_eval": ignored("Evaluation computes in the training compute dtype (bfloat16 with bf16=True); the "
                              "parameters are not cast to bfloat16 for evaluation."),
    "fp16_full_eval": ignored("Evaluation computes in the training compute dtype (bfloat16 with bf16=True, else the "
                              "parameters' dtype); the parameters are not cast to float16 for evaluation."),
    "tf32": ignored("TF32 is a torch/CUDA matmul switch; XLA chooses matmul precision itself (set "
                    "jax_default_matmul_precision to control it)."),
    "activation_checkpointing": honoured("Rematerialisation (jax.checkpoint) of each decoder layer in the backward "
                                         "pass."),
    "activation_checkpointing_kwargs": ignored("torch checkpoint options (use_reentrant, every_n_layers, offload, "
                                               "...) have no JAX counterpart; torchlike rematerialises each decoder "
                                               "layer with jax.checkpoint's default policy."),
    "gradient_checkpointing": honoured("transformers 5.12's name for activation_checkpointing, used when that is not "
                                       "set (a FutureWarning where the installed transformers deprecates it); both "
                                       "then hold the same value."),
    "gradient_checkpointing_kwargs": honoured("transformers 5.12's name for activation_checkpointing_kwargs, copied "
                                              "there when that is not set (a FutureWarning where the installed "
                                              "transformers deprecates it); that field's row applies."),
    "torch_compile": ignored(_XLA_COMPILES),
    "torch_compile_backend": ignored(_XLA_COMPILES),
    "torch_compile_mode": ignored(_XLA_COMPILES),
    "use_liger_kernel": ignored("Liger kernels are Triton code for torch models. What Liger's fused linear "
                                "cross-entropy saves, torchlike always does: the loss computes logits a block of "
                                "positions at a time under rematerialisation, so no [batch, seq, vocab] float32 "
                                "copy is held (the loss is the same)."),
    "liger_kernel_config": ignored("Liger kernels are Triton code for torch models; XLA fuses the JAX model itself."),
    "use_cache": ignored("The training forward pass never builds a KV cache in torchlike."),
    "neftune_noise_alpha": honoured("NEFTune: uniform noise of magnitude alpha / sqrt(L * hidden_size) on a causal "
                                    "LM's input embeddings in training steps only (L: the longest row's real tokens, "
                                    "the width a pad-to-longest collator gives), as transformers' hook; evaluation "
                                    "and generation see none. Refused for a plain NNX module."),
    "torch_empty_cache_steps": ignored("JAX manages device memory itself; there is no torch allocator cache to "
                                       "empty."),
    "auto_find_batch_size": refused("torchlike does not retry with a smaller batch after running out of memory; "
                                    "set per_device_train_batch_size (and gradient_accumulation_steps) yourself."),
    "logging_strategy": honoured("When to log loss, learning rate and grad norm to log_history, the progress bar "
                                 "and report_to: 'no', 'steps' or 'epoch'."),
    "logging_steps": honoured("Optimizer steps between logs (a ratio of the total steps when below 1); the logged "
                              "loss is the mean since the last log."),
    "logging_first_step": honoured("Also log after the first optimizer step."),
    "log_on_each_node": ignored("torchlike logs (progress bar, log_history reporting) from process 0 only, as with "
                                "log_on_each_node=False."),
    "logging_nan_inf_filter": honoured("A nan/inf step loss is replaced, in the logged loss and train_loss, by "
                                       "transformers' value: the sum of the logging window's earlier losses "
                                       "divided by one plus their count (the update itself is not skipped; the "
                                       "unit is the optimizer step, where transformers filters micro-batches)."),
    "include_num_input_tokens_seen": ignored("torchlike does not log num_input_tokens_seen yet."),
    "log_level": ignored("torchlike logs through Python's 'torchlike' logger; set its level with "
                         "logging.getLogger('torchlike').setLevel(...)."),
    "log_level_replica": ignored("torchlike logs from process 0 only; other processes stay quiet."),
    "disable_tqdm": honoured("Hides the tqdm progress bar (it shows loss and learning rate)."),
    "report_to": honoured("Loggers for log_history entries: 'tensorboard', 'wandb', 'all' (those installed) or "
                          "'none'; others are rejected by the config."),
    "run_name": honoured("Run name given to wandb and written with the TensorBoard logs."),
    "project": ignored(_NO_TRACKIO),
    "trackio_space_id": ignored(_NO_TRACKIO),
    "trackio_bucket_id": ignored(_NO_TRACKIO),
    "trackio_static_space_id": ignored(_NO_TRACKIO),
    "eval_strategy": honoured("When evaluate() runs during training: 'no', 'steps' or 'epoch'."),
    "eval_steps": honoured("Optimizer steps between evaluations (defaults to logging_steps, a ratio when below 1)."),
    "eval_delay": honoured("No evaluation before this many steps (or epochs with eval_strategy='epoch'), as "
                           "transformers' DefaultFlowCallback decides."),
    "per_device_eval_batch_size": honoured("Examples per data-parallel shard in evaluation; the last partial batch "
                                           "is padded and masked."),
    "prediction_loss_only": honoured("True: evaluate() computes only the loss and does not call compute_metrics, "
                                     "as in transformers."),
    "eval_on_start": honoured("Run one evaluation before the first training step."),
    "eval_do_concat_batches": honoured("False: compute_metrics receives lists of per-batch arrays instead of arrays "
                                       "concatenated over the batches (padded with -100)."),
    "eval_use_gather_object": ignored("Evaluation outputs are arrays, which JAX gathers across devices and "
                                      "processes; there are no Python objects to gather."),
    "eval_accumulation_steps": ignored("Predictions move to the host after every evaluation batch, so the devices "
                                       "never hold more than one batch of logits; compute_metrics receives the same "
                                       "arrays for any value."),
    "include_for_metrics": honoured("'inputs' adds the input ids and 'loss' each example's batch loss to the "
                                    "EvalPrediction compute_metrics receives."),
    "batch_eval_metrics": honoured("compute_metrics is called on every evaluation batch (torch tensors) with "
                                   "compute_result=True on the last, whose result evaluate() reports."),
    "save_only_model": honoured("Checkpoints hold only the model (or LoRA) parameters, without optimizer state, "
                                "RNG and data position, so they cannot be resumed from."),
    "save_strategy": honoured("When to write output_dir/checkpoint-<step>: 'no', 'steps', 'epoch' or 'best' (after "
                              "each evaluation that improves metric_for_best_model, as transformers decides)."),
    "save_steps": honoured("Optimizer steps between checkpoints (a ratio of the total steps when below 1)."),
    "save_on_each_node": refused("Orbax writes one checkpoint collectively from all processes, so output_dir must "
                                 "be storage that every host can reach; per-node copies are not written."),
    "save_total_limit": honoured("Keep at most this many checkpoint-<step> folders, deleting the oldest but never "
                                 "the newest nor state.best_model_checkpoint; with 1, training ends with only the "
                                 "best one kept, as in transformers (folders are ordered by step, where transformers "
                                 "orders them by modification time)."),
    "enable_jit_checkpoint": honoured("On SIGTERM (or JAX's preemption sync point), every process writes the "
                                      "checkpoint of the step in progress once it ends (agreed across processes) and "
                                      "training stops, so the job exits normally; resume_from_checkpoint=True "
                                      "continues from it. A second SIGTERM changes nothing; saves are atomic."),
    "push_to_hub": honoured("Push the Hugging Face-format model (save_model's output) to hub_model_id with "
                            "huggingface_hub: from save_model() (commit 'Model save', as transformers) and, with "
                            "hub_strategy='every_save', at each checkpoint save."),
    "hub_token": honoured("Token for the Hub pushes."),
    "hub_private_repo": honoured("Create the Hub repository as private."),
    "hub_model_id": honoured("Hub repository to push to (defaults to the name of output_dir)."),
    "hub_strategy": honoured("'every_save': push the model at each checkpoint save; 'end': not then. Either way "
                             "save_model() pushes when push_to_hub is set, as in transformers, which is the push at "
                             "the end of a script. Checkpoint pushes are rejected by the config (checkpoints are "
                             "Orbax, not Hugging Face format)."),
    "hub_always_push": ignored("torchlike pushes synchronously, so a push is never skipped while an earlier one "
                               "runs."),
    "hub_revision": refused("Pushing to a branch other than the repository's default is not implemented; the "
                            "model would land on the default branch."),
    "load_best_model_at_end": honoured("When training ends, the model takes the weights stored in "
                                       "state.best_model_checkpoint (the optimizer state is left as it is, as in "
                                       "transformers); needs matching eval and save strategies, or "
                                       "save_strategy='best'."),
    "metric_for_best_model": honoured("The evaluation metric (eval_ prefixed when it is not) each evaluation during "
                                      "training compares with state.best_metric, as transformers' "
                                      "_determine_best_metric; a new best sets best_metric, best_global_step and "
                                      "best_model_checkpoint. 'loss' with load_best_model_at_end. "
                                      "EarlyStoppingCallback reads it."),
    "greater_is_better": honoured("Whether a larger metric_for_best_model is better; by default True unless the "
                                  "metric's name ends with 'loss', as in transformers."),
    "ignore_data_skip": refused("Resuming restores the exact data position saved in the checkpoint; starting the "
                                "epoch's data over is not implemented."),
    "restore_callback_states_from_checkpoint": honoured("Checkpoints hold each ExportableState callback's state (and "
                                                        "the control's) in trainer_state.json's stateful_callbacks, "
                                                        "as transformers writes them; with True, resuming rebuilds "
                                                        "those callbacks from it (e.g. EarlyStoppingCallback's "
                                                        "patience counter)."),
    "full_determinism": ignored("XLA runs the same program in the same order for a given seed; on GPUs add "
                                "--xla_gpu_deterministic_ops=true to XLA_FLAGS for bitwise determinism."),
    "seed": honoured("Seeds the LoRA or prompt-learning weights a trainer creates from peft_config (TRL seeds "
                     "before creating the adapter), LoRA dropout, GRPO's sampling, SFT's shuffle_dataset and, without "
                     "data_seed, the training data order."),
    "data_seed": honoured("Seeds the training data order (train_sampling_strategy='random') in place of seed, as "
                          "transformers' sampler does."),
    "use_cpu": honoured("Builds the device mesh from jax.devices('cpu') instead of the default backend."),
    "accelerator_config": ignored("torchlike does not use Accelerate: batches are sharded over the mesh's data axes"
                                  " (split_batches, dispatch_batches, even_batches... have no effect)."),
    "parallelism_config": ignored(_USE_MESH),
    "dataloader_drop_last": honoured("Drop the last partial training batch of each epoch (by default it is padded "
                                     "and masked, without a new compilation)."),
    "dataloader_num_workers": ignored(_NO_DATALOADER),
    "dataloader_pin_memory": ignored(_NO_DATALOADER),
    "dataloader_persistent_workers": ignored(_NO_DATALOADER),
    "dataloader_prefetch_factor": ignored(_NO_DATALOADER),
    "dataloader_multiprocessing_context": ignored(_NO_DATALOADER),
    "dataloader_in_order": ignored(_NO_DATALOADER + " Batches always arrive in order."),
    "remove_unused_columns": honoured("Each example keeps only the columns the loss reads before the data "
                                      "collator, as transformers' RemoveColumnsCollator: input_ids, attention_mask "
                                      "and loss_mask for a torchlike model's own loss; with compute_loss_func the "
                                      "model's inputs (a plain NNX module: its __call__ parameters) and label_names."
                                      " A JAX-native loss_fn may read any column, so it gets them all."),
    "label_names": honoured("Batch columns that hold the labels (default ['labels']): with compute_loss_func they are "
                            "left out of the model's inputs and passed as its labels (one array, or a tuple for "
                            "several), the first counted for num_items_in_batch; remove_unused_columns keeps them. "
                            "transformers hands compute_loss_func only a 'labels' column, which is the default."),
    "train_sampling_strategy": honoured("'random' (default): reshuffle every epoch, seeded by data_seed or seed, "
                                        "like transformers' RandomSampler; 'sequential': dataset order. "
                                        "'group_by_length' is rejected by the config."),
    "length_column_name": ignored("Only read by train_sampling_strategy='group_by_length', which torchlike does not"
                                  " support."),
    "ddp_find_unused_parameters": ignored(_NO_TORCH_DDP),
    "ddp_bucket_cap_mb": ignored(_NO_TORCH_DDP),
    "ddp_broadcast_buffers": ignored(_NO_TORCH_DDP),
    "ddp_static_graph": ignored(_NO_TORCH_DDP),
    "ddp_backend": ignored(_NO_TORCH_DDP + " Multi-process runs use jax.distributed."),
    "ddp_timeout": ignored("Multi-process runs use jax.distributed, which has its own initialisation timeout."),
    "fsdp": ignored(_USE_MESH),
    "fsdp_config": ignored(_USE_MESH),
    "deepspeed": ignored(_USE_MESH),
    "debug": ignored("transformers' debug options (underflow_overflow, tpu_metrics_debug) are torch tools; use "
                     "jax.config.update('jax_debug_nans', True) instead."),
    "skip_memory_metrics": ignored("torchlike does not add memory metrics to the logs."),
    "do_train": honoured("Kept for your script, as in transformers (whose Trainer does not read it either)."),
    "do_eval": honoured("Kept for your script, as in transformers; set to True when eval_strategy is not 'no'."),
    "do_predict": honoured("Kept for your script, as in transformers (whose Trainer does not read it either)."),
    "resume_from_checkpoint": honoured("Kept for your script, as in transformers: pass it to "
                                       "trainer.train(resume_from_checkpoint=...), which takes True (the latest "
                                       "checkpoint in output_dir) or a path and continues exactly."),
    "warmup_ratio": honoured("Deprecated in transformers 5 and removed in 5.15: copied into warmup_steps (a ratio) "
                             "with a FutureWarning."),
    "logging_dir": honoured("Where report_to='tensorboard' writes its event files (default: "
                            "$TENSORBOARD_LOGGING_DIR, else output_dir/runs/<time>_<host>), with a FutureWarning. "
                            "transformers 5 deprecates it, its TensorBoardCallback no longer reads it and 5.15 "
                            "removed it; torchlike still does."),
    "local_rank": ignored("Set by torch launchers; torchlike reads the process index from jax.distributed."),
    # --- torchlike ---
    "mesh_shape": honoured("torchlike: sizes of the device-mesh axes (e.g. (4, 2) for fsdp x tp); None puts every "
                           "device on 'fsdp'."),
    "mesh_axis_names": honoured("torchlike: names of the mesh axes, ('fsdp', 'tp') by default; batches are sharded "
                                "over every axis but 'tp'."),
    "compilation_cache_dir": honoured("torchlike: directory of JAX's persistent compilation cache (None keeps "
                                      "torchlike's default)."),
    "prefetch_batches": honoured("torchlike: batches prepared and put on the devices ahead of the train step by a "
                                 "background thread (0: prepared in the loop)."),
    "lora_step": honoured("torchlike: how a LoRA train step runs the adapted layers: 'factored' (Qwix's x@W + "
                          "s*(x@A)@B), 'merged' (one matmul on W + s*A@B formed each step, factor gradients from "
                          "thin products) or 'auto' (merged on CPU meshes); same losses and gradients."),
    "jit_checkpoint_grace_period": honoured("torchlike: with enable_jit_checkpoint, the seconds between the "
                                            "platform's preemption notice and its kill (terminationGracePeriodSeconds);"
                                            " training warns once when a step and a save would not fit in it, a "
                                            "notice skips that step's evaluation, and the preemption checkpoint's log "
                                            "says how long it took."),
    "on_save_error": honoured("torchlike: what a checkpoint save that cannot write its files (a full disk) does: "
                              "'raise' stops training with CheckpointSaveError, 'warn' logs it and trains on to the "
                              "next save; nothing of the failed save is kept and earlier checkpoints stay intact."),
}
