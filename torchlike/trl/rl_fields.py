"""The field tables of ``GRPOConfig`` and ``DPOConfig``: what torchlike does with each field TRL 1.16 adds for them.

``GRPO_FIELD_SUPPORT`` and ``DPO_FIELD_SUPPORT`` use the statuses of ``torchlike.trl.fields`` (honoured / ignored /
refused). Each config class names its table (``_FIELD_SUPPORT``) and ``check_unsupported`` lays it over
``FIELD_SUPPORT``, so every config-specific field, and every ``TrainingArguments`` field whose meaning the algorithm
changes, is decided here. Fields with the same meaning as in ``SFTConfig`` reuse its rows. A test holds the tables
against the fields of the real ``trl.GRPOConfig`` and ``trl.DPOConfig``.
"""

from __future__ import annotations

from torchlike.trl.fields import FIELD_SUPPORT, FieldSupport, _honoured, _ignored, _refused

_NO_VLLM = ("vLLM is a CUDA/PyTorch engine torchlike does not use: completions come from torchlike's JAX sampler on "
            "the training mesh (like vllm_mode='colocate') with the same sampling settings.")
_ONLY_WITH_VLLM = "Only read with use_vllm=True; torchlike generates with its own JAX sampler."
_NO_SAMPLER_MISMATCH = ("Corrects the gap between vLLM's and the trainer's log-probabilities; torchlike samples and "
                        "scores with the same JAX model, so there is no gap to correct.")
_NO_TORCH_GENERATION = "A transformers (PyTorch) generation engine; torchlike generates with its own JAX sampler."
_NO_REF_SYNC = ("Updating the reference model from the policy during training (TR-DPO) is not implemented; the "
                "reference would stay the initial model.")
_ONLY_WITH_REF_SYNC = "Only read with sync_ref_model=True, which torchlike does not support yet."
_NO_ADAPTIVE_ENTROPY = "Only read with use_adaptive_entropy=True, which torchlike does not support yet."
_NO_DROPOUT = ("Always in effect when True: torchlike's model families have no dropout layers, and LoRA dropout is "
               "switched off, so the log-probabilities are deterministic.")
_SAMPLING = "applied at every decoding step by torchlike's sampler, as transformers' generate does."
_PAD_MULTIPLE = ("Padded lengths are rounded up to a multiple of it ('auto' becomes None, as in TRL off Neuron; "
                 "torchlike already pads to a few fixed shapes).")

GRPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- TrainingArguments fields whose meaning GRPO changes ---
    "per_device_train_batch_size": _honoured("Completions (not prompts) per data-parallel shard, as in TRL; times "
                                             "args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": _honoured("Micro-batches per optimizer step. As in TRL, the grpo, bnpo, dr_grpo, "
                                             "sapo and luspo losses are divided by it, and dapo, cispo and vespo "
                                             "divide their token sum by the generation batch's loss tokens scaled to "
                                             "one accumulation window."),
    "remove_unused_columns": _honoured("False (GRPO's default): every dataset column except prompt reaches the reward "
                                       "functions as a keyword list; True keeps only prompt."),
    "data_seed": _ignored("TRL's GRPO sampler shuffles the prompts with seed and never reads data_seed; torchlike "
                          "does the same."),
    # --- model ---
    "model_init_kwargs": FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": FIELD_SUPPORT["router_aux_loss_coef"],
    "disable_dropout": _honoured(_NO_DROPOUT),
    "cast_lm_head_to_fp32": _refused("Casting only the LM head to float32 is not implemented; with bf16=False the whole"
                                     " model computes in float32."),
    # --- data ---
    "num_generations": _honoured("Completions sampled per prompt (at least 2); advantages are taken within each group "
                                 "of num_generations."),
    "num_generations_eval": _honoured("Completions per prompt in evaluation (None: num_generations)."),
    "max_completion_length": _honoured("Generation stops after this many tokens; with the prompt length it sizes the "
                                       "KV cache, and it is the dr_grpo loss's constant."),
    "ds3_gather_for_generation": _ignored("A DeepSpeed ZeRO-3 setting; torchlike's parameters are sharded by JAX over "
                                          "the mesh and the sampler reads them where they are."),
    "shuffle_dataset": _honoured("Shuffle the prompts every epoch, seeded by seed (not data_seed), as TRL's sampler "
                                 "does; False keeps dataset order."),
    "pad_to_multiple_of": _honoured(_PAD_MULTIPLE),
    # --- generation ---
    "generation_batch_size": _honoured("Completions generated at once (default per_device_train_batch_size x "
                                       "data-parallel shards x steps_per_generation); must be divisible by "
                                       "num_generations."),
    "steps_per_generation": _honoured("Micro-steps each generation batch feeds (default gradient_accumulation_steps); "
                                      "the old-policy log-probabilities are stored when the policy can change before "
                                      "a batch is used (more steps than one accumulation window, or "
                                      "num_iterations > 1)."),
    "temperature": _honoured("Sampling temperature; the training log-probabilities are those of softmax(logits / "
                             "temperature), as in TRL."),
    "top_p": _honoured("Nucleus sampling threshold, " + _SAMPLING),
    "top_k": _honoured("Top-k filtering (0 disables it), " + _SAMPLING),
    "min_p": _honoured("Minimum probability relative to the most likely token, " + _SAMPLING),
    "repetition_penalty": _honoured("Penalty on tokens already in the prompt or completion, " + _SAMPLING),
    "generation_kwargs": _honoured("Further sampling settings for torchlike's sampler (GenerationConfig names; keys it "
                                   "does not support raise); they override the fields above, as in TRL."),
    "chat_template_kwargs": _honoured("Keyword arguments for apply_chat_template on conversational prompts (e.g. "
                                      "enable_thinking)."),
    "cache_implementation": _ignored("torchlike's sampler always uses its own preallocated KV cache, sized from the "
                                     "prompt and completion lengths."),
    # --- vLLM ---
    "use_vllm": _ignored(_NO_VLLM),
    "vllm_mode": _ignored(_ONLY_WITH_VLLM),
    "vllm_model_impl": _ignored(_ONLY_WITH_VLLM),
    "vllm_enable_sleep_mode": _ignored(_ONLY_WITH_VLLM),
    "vllm_structured_outputs_regex": _refused("Regex-constrained generation is not implemented in torchlike's sampler;"
                                              " completions would not follow the pattern."),
    "vllm_server_base_url": _ignored(_ONLY_WITH_VLLM),
    "vllm_server_host": _ignored(_ONLY_WITH_VLLM),
    "vllm_server_port": _ignored(_ONLY_WITH_VLLM),
    "vllm_server_timeout": _ignored(_ONLY_WITH_VLLM),
    "vllm_group_port": _ignored(_ONLY_WITH_VLLM),
    "vllm_gpu_memory_utilization": _ignored(_ONLY_WITH_VLLM),
    "vllm_max_model_length": _ignored(_ONLY_WITH_VLLM),
    "vllm_tensor_parallel_size": _ignored(_ONLY_WITH_VLLM + " Use mesh_shape to shard the model."),
    "vllm_importance_sampling_correction": _ignored(_NO_SAMPLER_MISMATCH),
    "vllm_importance_sampling_mode": _ignored(_NO_SAMPLER_MISMATCH),
    "vllm_importance_sampling_clip_max": _ignored(_NO_SAMPLER_MISMATCH),
    "vllm_importance_sampling_clip_min": _ignored(_NO_SAMPLER_MISMATCH),
    "vllm_importance_sampling_cap": _ignored(_NO_SAMPLER_MISMATCH + " (Deprecated in TRL for "
                                                                    "vllm_importance_sampling_clip_max.)"),
    # --- algorithm ---
    "beta": _honoured("KL coefficient: beta != 0 keeps a frozen reference model (the base model with LoRA off for "
                      "PEFT) and adds beta x the k3 KL estimate per token."),
    "num_iterations": _honoured("Optimizer passes over each generation batch (mu); later passes clip the ratio "
                                "against the stored old-policy log-probabilities."),
    "epsilon": _honoured("Lower clip of the importance ratio, 1 - epsilon."),
    "delta": _honoured("Upper bound on the unclipped ratio (two-sided clipping, INTELLECT-2); None disables it."),
    "epsilon_high": _honoured("Upper clip of the ratio, 1 + epsilon_high (None: epsilon); for cispo the cap on the "
                              "ratio itself."),
    "sapo_temperature_neg": _honoured("Gate temperature of loss_type='sapo' for negative advantages."),
    "sapo_temperature_pos": _honoured("Gate temperature of loss_type='sapo' for positive advantages."),
    "vespo_k_pos": _honoured("Gamma-weight exponent of loss_type='vespo' for non-negative advantages."),
    "vespo_lambda_pos": _honoured("Gamma-weight rate of loss_type='vespo' for non-negative advantages."),
    "vespo_k_neg": _honoured("Gamma-weight exponent of loss_type='vespo' for negative advantages."),
    "vespo_lambda_neg": _honoured("Gamma-weight rate of loss_type='vespo' for negative advantages."),
    "importance_sampling_level": _honoured("'token': one ratio per token; 'sequence': one per sequence, the masked "
                                           "mean log-ratio (GSPO)."),
    "reward_weights": _honoured("Weight of each reward function in the NaN-skipping sum of rewards (default 1.0 "
                                "each); None rewards are left out."),
    "multi_objective_aggregation": _honoured("'sum_then_normalize': weighted sum, then group advantages; "
                                             "'normalize_then_sum': normalise each reward in its group, then sum "
                                             "(GDPO)."),
    "scale_rewards": _honoured("'group', 'batch' or 'none' (True/False as in TRL): the standard deviation the "
                               "group-centred rewards are divided by (plus 1e-4)."),
    "loss_type": _honoured("All of TRL's: grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo, computed as TRL 1.16 "
                           "does (torchlike.adapters.rl_math.grpo_loss)."),
    "mask_truncated_completions": _honoured("Completions cut at max_completion_length without an EOS are left out of "
                                            "the loss."),
    "sync_ref_model": _refused(_NO_REF_SYNC),
    "ref_model_mixup_alpha": _ignored(_ONLY_WITH_REF_SYNC),
    "ref_model_sync_steps": _ignored(_ONLY_WITH_REF_SYNC),
    "top_entropy_quantile": _refused("Restricting the loss to high-entropy tokens is not implemented; every completion "
                                     "token would count."),
    "entropy_coef": _refused("The entropy bonus is not implemented; the loss would have none."),
    "use_adaptive_entropy": _refused("Adaptive entropy control is not implemented; the loss would have no entropy "
                                     "bonus."),
    "entropy_coef_min": _ignored(_NO_ADAPTIVE_ENTROPY),
    "entropy_coef_max": _ignored(_NO_ADAPTIVE_ENTROPY),
    "entropy_coef_delta": _ignored(_NO_ADAPTIVE_ENTROPY),
    "entropy_target": _ignored(_NO_ADAPTIVE_ENTROPY),
    "max_tool_calling_iterations": _ignored("Only read when the trainer is given tools, which torchlike's GRPOTrainer "
                                            "does not take."),
    "off_policy_mask_threshold": _honoured("Sequences with a negative advantage whose mean log(pi_old / pi) exceeds it "
                                           "are dropped from the loss (DeepSeek-V3.2)."),
    "use_bias_correction_kl": _honoured("Multiply the per-token KL by the importance ratio (True, the default, as in "
                                        "TRL)."),
    # --- logging ---
    "log_completions": _honoured("Print the prompts, completions, rewards and advantages of every generation batch "
                                 "(num_completions_to_print rows); there is no wandb completions table."),
    "log_multimodal": _ignored("torchlike's GRPO is text-only; there is no image content to log."),
    "num_completions_to_print": _honoured("How many of the logged completions are printed (None: all)."),
    "log_unique_prompts": _ignored("torchlike logs one row per completion; showing each prompt once is not "
                                   "implemented."),
    "log_completions_hub_repo": _ignored("Completions are not uploaded to a Hub dataset; they are in the logs (see "
                                         "log_completions)."),
    # --- transformers generation engines ---
    "use_transformers_continuous_batching": _ignored(_NO_TORCH_GENERATION),
    "transformers_continuous_batching_config": _ignored(_NO_TORCH_GENERATION),
    "use_transformers_paged": _ignored(_NO_TORCH_GENERATION),
    # --- removed from TRL, kept by torchlike ---
    "max_prompt_length": _honoured("Removed in TRL 0.28 but still accepted (with a FutureWarning): a prompt longer "
                                   "than this keeps its last max_prompt_length tokens, as TRL used to do."),
}

DPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- TrainingArguments fields whose meaning DPO changes ---
    "per_device_train_batch_size": _honoured("Preference pairs per data-parallel shard (each a chosen and a rejected "
                                             "sequence); times args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": _honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                             "micro-batches' losses (each a mean over its pairs)."),
    "remove_unused_columns": _ignored("DPO examples reach the data collator as the prepared columns (token ids and "
                                      "reference log-probabilities), as with TRL's default True; False, which in TRL "
                                      "also passes the dataset's other columns to a custom data_collator, changes "
                                      "nothing (the default collator never reads them)."),
    # --- model ---
    "model_init_kwargs": FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": FIELD_SUPPORT["router_aux_loss_coef"],
    "disable_dropout": _honoured(_NO_DROPOUT),
    # --- data ---
    "dataset_num_proc": _honoured("Processes for datasets.Dataset.map while tokenising the preference pairs."),
    "max_length": _honoured("Prompt + completion sequences longer than this are truncated (None: no truncation); "
                            "with keep_start, pairs whose prompt alone fills it are dropped with a warning. Every "
                            "batch is padded to the longest prepared sequence, so XLA compiles the step once."),
    "truncation_mode": _honoured("'keep_start' keeps the first max_length tokens; the deprecated 'keep_end' keeps the "
                                 "last ones (with TRL's FutureWarning)."),
    "padding_free": _ignored("TRL 1.16 itself warns and pads instead; torchlike pads to fixed shapes so XLA compiles "
                             "once."),
    "pad_to_multiple_of": _honoured(_PAD_MULTIPLE),
    "precompute_ref_log_probs": _ignored("torchlike always computes the reference log-probabilities once, before "
                                         "training, and stores them with each example; the reference is frozen and "
                                         "has no dropout, so these are the values TRL computes in each step."),
    "precompute_ref_batch_size": _ignored("The reference pass before training runs in batches of "
                                          "per_device_train_batch_size (per_device_eval_batch_size for evaluation "
                                          "data)."),
    # --- loss ---
    "loss_type": _honoured("All of TRL's 15 loss types, alone or combined, computed as TRL 1.16 does "
                           "(torchlike.adapters.rl_math.dpo_loss). aot and aot_unpaired sort within a batch, so "
                           "the rows padding a partial last batch enter the sort (a warning suggests "
                           "dataloader_drop_last)."),
    "loss_weights": _honoured("Weight of each loss type when several are combined (default 1.0 each)."),
    "ld_alpha": _honoured("LD-DPO: log-probabilities of the tokens past the shorter response of a pair are weighted "
                          "by ld_alpha."),
    "f_divergence_type": _honoured("The f-divergence of f-DPO: reverse_kl (standard DPO), forward_kl, js_divergence or "
                                   "alpha_divergence."),
    "f_alpha_divergence_coef": _honoured("alpha of f_divergence_type='alpha_divergence'."),
    "label_smoothing": _honoured("eps of the robust, exo_pair, aot and aot_unpaired losses (TRL 1.16's sigmoid loss "
                                 "does not read it)."),
    "beta": _honoured("The DPO temperature beta (tau for ipo); rewards/* metrics are beta x log-ratios."),
    "use_weighting": _refused("WPO weighting needs each token's sum of squared probabilities, which torchlike does not "
                              "compute yet; the pairs would be weighted equally."),
    "discopop_tau": _honoured("Temperature of loss_type='discopop'."),
    "activation_offloading": FIELD_SUPPORT["activation_offloading"],
    "sync_ref_model": _refused(_NO_REF_SYNC),
    "ref_model_mixup_alpha": _ignored(_ONLY_WITH_REF_SYNC),
    "ref_model_sync_steps": _ignored(_ONLY_WITH_REF_SYNC),
    # --- deprecated ---
    "pad_token": FIELD_SUPPORT["pad_token"],
}
