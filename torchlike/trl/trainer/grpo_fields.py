"""What torchlike does with each field ``trl.GRPOConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning GRPO changes.

``GRPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see
:mod:`torchlike.field_support`); fields with the same meaning as in ``SFTConfig`` reuse its rows. A test holds it
against the fields of the real ``trl.GRPOConfig``.
"""

from __future__ import annotations

from ...adapters.rollout.sampling_settings import SamplingSettings
from ...field_support import FieldSupport, honoured, ignored, refused
from .sft_fields import SFT_FIELD_SUPPORT

_USE_VLLM = ("False (TRL's default): completions come from torchlike's JAX rollout engine (rollout_engine; 'paged' has "
             "vLLM's paged KV cache, continuous batching and shared prompts) on the training mesh. True with "
             "vllm_mode='server': from a vLLM server's OpenAI API (rollout_engine='vllm_server', "
             "torchlike.adapters.rollout.vllm_server), the policy's LoRA adapter loaded into the server after each "
             "optimizer step (full fine-tuning is refused: vLLM's API takes no whole weights). True with "
             "vllm_mode='colocate': a warning, and torchlike's own JAX engine samples on the training mesh as colocate "
             "does (vLLM is a CUDA/PyTorch engine that cannot share a JAX process; on a TPU host the Tunix vLLM "
             "sampler path is not wired yet).")
_VLLM_MODE = ("'server' (with use_vllm=True): sample through a vLLM server (see use_vllm); 'colocate': torchlike's "
              "own JAX engine on the training mesh, with a warning when use_vllm=True.")
_SERVER_ADDRESS = ("With use_vllm=True and vllm_mode='server': the vLLM server's address, vllm_server_base_url or else "
                   "http://{vllm_server_host}:{vllm_server_port}; the server must read the adapter folders torchlike "
                   "writes (rollout_vllm_adapter_dir, a temporary folder by default) at the same path.")
_ONLY_WITH_VLLM = ("Only read by TRL's own vLLM engine; torchlike's server mode talks to a vLLM server through its "
                   "OpenAI API and syncs LoRA adapters as files, and otherwise generates with its own JAX rollout "
                   "engine (rollout_* fields).")
_SAMPLER_CORRECTION = ("With max_staleness >= 1 the engine's log-probs come from the weights before the last "
                       "optimizer steps, and TRL's vLLM importance-sampling correction reweights the per-token loss; "
                       "with max_staleness=0 sampler and trainer share the weights and nothing is corrected.")
_NO_TORCH_GENERATION = "A transformers (PyTorch) generation engine; torchlike generates with its own JAX sampler."
_REF_SYNC = ("Every ref_model_sync_steps optimizer steps the reference becomes ref_model_mixup_alpha x policy + (1 - "
             "ref_model_mixup_alpha) x reference (TRL's SyncRefModelCallback, TR-DPO; "
             "torchlike.adapters.training.reference_sync). As in TRL, refused with a LoRA adapter (the reference is "
             "the adapter switched off)")
_ADAPTIVE_ENTROPY = "With use_adaptive_entropy (torchlike.trl.online.entropy_control), "
_NO_DROPOUT = ("Always in effect when True: torchlike's model families have no dropout layers, and LoRA dropout is "
               "switched off, so the log-probabilities are deterministic.")
_SAMPLING = "applied at every decoding step by torchlike's sampler, as transformers' generate does."
_PAD_MULTIPLE = ("Padded lengths are rounded up to a multiple of it ('auto' becomes None, as in TRL off Neuron; "
                 "torchlike already pads to a few fixed shapes).")

GRPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": refused("TRL's hook sits on the embedding layer the policy shares with generation and "
                                   "the reference pass, so it perturbs those too; torchlike adds NEFTune noise in "
                                   "train steps only, so it refuses the field here (SFTTrainer and Trainer "
                                   "honour it)."),
    # --- TrainingArguments fields whose meaning GRPO changes ---
    "per_device_train_batch_size": honoured("Completions (not prompts) per data-parallel shard, as in TRL; times "
                                            "args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step. As in TRL, the grpo, bnpo, dr_grpo, "
                                            "sapo and luspo losses are divided by it, and dapo, cispo and vespo "
                                            "divide their token sum by the generation batch's loss tokens scaled to "
                                            "one accumulation window."),
    "remove_unused_columns": honoured("False (GRPO's default): every dataset column except prompt reaches the reward "
                                      "functions as a keyword list (and an environment's reset); True keeps only "
                                      "prompt, dropping the environment column that routes rows too, as in TRL."),
    "data_seed": ignored("TRL's GRPO sampler shuffles the prompts with seed and never reads data_seed; torchlike "
                         "does the same."),
    # --- model ---
    "model_init_kwargs": SFT_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": SFT_FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": SFT_FIELD_SUPPORT["router_aux_loss_coef"],
    "disable_dropout": honoured(_NO_DROPOUT),
    "cast_lm_head_to_fp32": honoured("With bf16 the decoder computes in bfloat16 and the output head multiplies its "
                                     "float32 hidden states by the float32 head weights (training, old-policy and "
                                     "reference log-probabilities), as TRL's fp32 head outside autocast; with "
                                     "bf16=False everything is float32 already. (TRL refuses it with LoRA on lm_head, "
                                     "which torchlike's LoRA cannot target.)"),
    # --- data ---
    "num_generations": honoured("Completions sampled per prompt (at least 2); advantages are taken within each group "
                                "of num_generations."),
    "num_generations_eval": honoured("Completions per prompt in evaluation (None: num_generations)."),
    "max_completion_length": honoured("Generation stops after this many tokens; with the prompt length it sizes the "
                                      "KV cache, and it is the dr_grpo loss's constant."),
    "ds3_gather_for_generation": ignored("A DeepSpeed ZeRO-3 setting; torchlike's parameters are sharded by JAX over "
                                         "the mesh and the sampler reads them where they are."),
    "shuffle_dataset": honoured("Shuffle the prompts every epoch, seeded by seed (not data_seed), as TRL's sampler "
                                "does; False keeps dataset order."),
    "pad_to_multiple_of": honoured(_PAD_MULTIPLE),
    # --- generation ---
    "generation_batch_size": honoured("Completions generated at once (default per_device_train_batch_size x "
                                      "data-parallel shards x steps_per_generation); must be divisible by "
                                      "num_generations."),
    "steps_per_generation": honoured("Micro-steps each generation batch feeds (default gradient_accumulation_steps); "
                                     "the old-policy log-probabilities are stored when the policy can change before "
                                     "a batch is used (more steps than one accumulation window, or "
                                     "num_iterations > 1)."),
    "temperature": honoured("Sampling temperature; the training log-probabilities are those of softmax(logits / "
                            "temperature), as in TRL."),
    "top_p": honoured("Nucleus sampling threshold, " + _SAMPLING),
    "top_k": honoured("Top-k filtering (0 disables it), " + _SAMPLING),
    "min_p": honoured("Minimum probability relative to the most likely token, " + _SAMPLING),
    "repetition_penalty": honoured("Penalty on tokens already in the prompt or completion, " + _SAMPLING),
    "generation_kwargs": honoured("Further sampling settings for torchlike's sampler, by GenerationConfig name ("
                                  + ", ".join(SamplingSettings.names()) + "; other keys raise); they override the "
                                  "fields above, as in TRL."),
    "chat_template_kwargs": honoured("Keyword arguments for apply_chat_template on conversational prompts (e.g. "
                                     "enable_thinking)."),
    "cache_implementation": ignored("torchlike's sampler always uses its own preallocated KV cache, sized from the "
                                    "prompt and completion lengths."),
    # --- vLLM ---
    "use_vllm": honoured(_USE_VLLM),
    "vllm_mode": honoured(_VLLM_MODE),
    "vllm_model_impl": ignored(_ONLY_WITH_VLLM),
    "vllm_enable_sleep_mode": ignored(_ONLY_WITH_VLLM),
    "vllm_structured_outputs_regex": refused("Regex-constrained generation is not implemented in torchlike's sampler;"
                                             " completions would not follow the pattern."),
    "vllm_server_base_url": honoured(_SERVER_ADDRESS),
    "vllm_server_host": honoured(_SERVER_ADDRESS),
    "vllm_server_port": honoured(_SERVER_ADDRESS),
    "vllm_server_timeout": honoured("With use_vllm=True and vllm_mode='server': seconds to wait for the server's "
                                    "/health when the engine is built (an unreachable server is an error naming its "
                                    "URL), and for each request."),
    "vllm_group_port": ignored(_ONLY_WITH_VLLM),
    "vllm_gpu_memory_utilization": ignored(_ONLY_WITH_VLLM + " Its KV cache is sized in tokens by "
                                                            "rollout_kv_cache_tokens."),
    "vllm_max_model_length": ignored(_ONLY_WITH_VLLM + " Its page tables hold the longest prompt plus "
                                                      "max_completion_length."),
    "vllm_tensor_parallel_size": ignored(_ONLY_WITH_VLLM + " Use mesh_shape to shard the model."),
    "vllm_importance_sampling_correction": honoured(_SAMPLER_CORRECTION + " True (TRL's default) applies it."),
    "vllm_importance_sampling_mode": honoured(_SAMPLER_CORRECTION + " token_/sequence_ x truncate/mask, TRL's "
                                              "formulas (losses.grpo.sampler_importance_ratio)."),
    "vllm_importance_sampling_clip_max": honoured(_SAMPLER_CORRECTION + " The upper bound."),
    "vllm_importance_sampling_clip_min": honoured(_SAMPLER_CORRECTION + " The lower bound (None: open)."),
    "vllm_importance_sampling_cap": honoured("Deprecated in TRL (FutureWarning, as TRL): copied into "
                                             "vllm_importance_sampling_clip_max."),
    # --- algorithm ---
    "beta": honoured("KL coefficient: beta != 0 keeps a frozen reference model (the base model with LoRA off for "
                     "PEFT) and adds beta x the k3 KL estimate per token."),
    "num_iterations": honoured("Optimizer passes over each generation batch (mu); later passes clip the ratio "
                               "against the stored old-policy log-probabilities."),
    "epsilon": honoured("Lower clip of the importance ratio, 1 - epsilon."),
    "delta": honoured("Upper bound on the unclipped ratio (two-sided clipping, INTELLECT-2); None disables it."),
    "epsilon_high": honoured("Upper clip of the ratio, 1 + epsilon_high (None: epsilon); for cispo the cap on the "
                             "ratio itself."),
    "sapo_temperature_neg": honoured("Gate temperature of loss_type='sapo' for negative advantages."),
    "sapo_temperature_pos": honoured("Gate temperature of loss_type='sapo' for positive advantages."),
    "vespo_k_pos": honoured("Gamma-weight exponent of loss_type='vespo' for non-negative advantages."),
    "vespo_lambda_pos": honoured("Gamma-weight rate of loss_type='vespo' for non-negative advantages."),
    "vespo_k_neg": honoured("Gamma-weight exponent of loss_type='vespo' for negative advantages."),
    "vespo_lambda_neg": honoured("Gamma-weight rate of loss_type='vespo' for negative advantages."),
    "importance_sampling_level": honoured("'token': one ratio per token; 'sequence': one per sequence, the masked "
                                          "mean log-ratio (GSPO)."),
    "reward_weights": honoured("Weight of each reward function in the NaN-skipping sum of rewards (default 1.0 "
                               "each); None rewards are left out. An environment's get_reward comes after them with "
                               "weight 1, as in TRL."),
    "multi_objective_aggregation": honoured("'sum_then_normalize': weighted sum, then group advantages; "
                                            "'normalize_then_sum': normalise each reward in its group, then sum "
                                            "(GDPO)."),
    "scale_rewards": honoured("'group', 'batch' or 'none' (True/False as in TRL): the standard deviation the "
                              "group-centred rewards are divided by (plus 1e-4)."),
    "loss_type": honoured("All of TRL's: grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo, computed as TRL 1.16 "
                          "does (torchlike.adapters.losses.grpo.grpo_loss)."),
    "mask_truncated_completions": honoured("Completions cut at max_completion_length without an EOS are left out of "
                                           "the loss."),
    "sync_ref_model": honoured(_REF_SYNC + " and with beta=0 (no reference)."),
    "ref_model_mixup_alpha": honoured("The policy's share in each reference update (sync_ref_model)."),
    "ref_model_sync_steps": honoured("Optimizer steps between reference updates (sync_ref_model)."),
    "top_entropy_quantile": honoured("Below 1.0 the policy loss counts only the completion tokens whose entropy "
                                     "reaches the batch's (1 - top_entropy_quantile) quantile, as TRL's "
                                     "get_high_entropy_mask (torchlike.adapters.losses.grpo.high_entropy_mask)."),
    "entropy_coef": honoured("The loss subtracts entropy_coef x the mean completion-token entropy (over the "
                             "top_entropy_quantile tokens), divided by the accumulation steps for every loss type, as "
                             "TRL; logs policy_loss and entropy_coef. With use_adaptive_entropy, the initial "
                             "coefficient."),
    "use_adaptive_entropy": honoured("TRL's adaptive entropy control (Skywork-OR1, "
                                     "torchlike.trl.online.entropy_control): each optimizer step applies "
                                     "entropy_coef when the entropy measured by the step before (the token mean "
                                     "over all its micro-batches; none before the first) is at or below "
                                     "entropy_target, else 0; after the step entropy_coef moves by "
                                     "entropy_coef_delta, up when that step's entropy is at or below the target, down "
                                     "otherwise. The coefficient is an input of the compiled step (no recompilation); "
                                     "logs entropy_coef each step and keeps the state in each checkpoint's "
                                     "entropy_ctrl_state.json, restored on resume, as TRL."),
    "entropy_coef_min": honoured(_ADAPTIVE_ENTROPY + "the lowest entropy_coef the controller goes to."),
    "entropy_coef_max": honoured(_ADAPTIVE_ENTROPY + "the highest entropy_coef the controller goes to."),
    "entropy_coef_delta": honoured(_ADAPTIVE_ENTROPY + "how far entropy_coef moves after each optimizer step."),
    "entropy_target": honoured(_ADAPTIVE_ENTROPY + "the entropy (nats, over the entropy bonus's tokens) at or below "
                               "which entropy_coef is applied and raised; above it, lowered."),
    "max_tool_calling_iterations": honoured("With tools: the most rounds of tool calls and continued generation per "
                                            "completion (None: until the model stops calling tools or "
                                            "max_completion_length is reached), as TRL's tool-calling loop."),
    "off_policy_mask_threshold": honoured("Sequences with a negative advantage whose mean log(pi_old / pi) exceeds it "
                                          "are dropped from the loss (DeepSeek-V3.2)."),
    "use_bias_correction_kl": honoured("Multiply the per-token KL by the importance ratio (True, the default, as in "
                                       "TRL)."),
    # --- logging ---
    "log_completions": honoured("Print the prompts, completions, rewards and advantages of every generation batch "
                                "(num_completions_to_print rows); there is no wandb completions table."),
    "log_multimodal": ignored("torchlike's GRPO is text-only; there is no image content to log."),
    "num_completions_to_print": honoured("How many of the logged completions are printed (None: all)."),
    "log_unique_prompts": ignored("torchlike logs one row per completion; showing each prompt once is not "
                                  "implemented."),
    "log_completions_hub_repo": ignored("Completions are not uploaded to a Hub dataset; they are in the logs (see "
                                        "log_completions)."),
    # --- transformers generation engines ---
    "use_transformers_continuous_batching": ignored(_NO_TORCH_GENERATION),
    "transformers_continuous_batching_config": ignored(_NO_TORCH_GENERATION),
    "use_transformers_paged": ignored(_NO_TORCH_GENERATION),
    # --- removed from TRL, kept by torchlike ---
    "rollout_engine": honoured("torchlike: None (the default) is the backend's fastest engine "
                               "(torchlike.adapters.rollout.default_engine: 'paged' on the CPU, 'static' on a GPU or "
                               "TPU until measured there); 'static' (the fewest compiled programs) samples with "
                               "one left-padded batch decoded to its longest row in one program; 'paged' with the "
                               "paged, continuously batched engine (torchlike.adapters.rollout: pages freed as "
                               "completions end, one prefill per prompt group, a fraction of the KV memory; faster "
                               "when completion lengths are long-tailed); 'vllm_server' through a vLLM server (what "
                               "use_vllm=True, vllm_mode='server' picks); or an engine registered with "
                               "torchlike.register_rollout_engine(name, builder)."),
    "rollout_max_num_seqs": honoured("torchlike: completions decoded together (vLLM's max_num_seqs); the others "
                                     "wait and take the slots of completions that end."),
    "rollout_page_size": honoured("torchlike: tokens per KV-cache page (vLLM's block_size)."),
    "rollout_max_num_batched_tokens": honoured("torchlike: the most prompt tokens the paged engine prefills between "
                                               "two decode calls (vLLM's max_num_batched_tokens); longer prompts are "
                                               "prefilled in chunks while the running completions keep decoding."),
    "rollout_attention": honoured("torchlike: how the paged engine's decode reads its KV pages: 'gather' (a dense "
                                  "view, the CPU's way), 'pallas_gpu' / 'pallas_tpu' (JAX's paged-attention kernels, "
                                  "pages read in place; the GPU's / TPU's default for Qwen2, Qwen3, Qwen3-MoE, "
                                  "Llama 3, Gemma 2/3/4 and the native decoder's families); None: the backend's "
                                  "own."),
    "rollout_gpu_memory_utilization": honoured("torchlike (vLLM's gpu_memory_utilization): with "
                                               "rollout_kv_cache_tokens=None the paged engine's KV pool takes what "
                                               "this share of the device's memory leaves; completions beyond it are "
                                               "preempted and recomputed (same tokens). None: every slot's longest "
                                               "completion."),
    "rollout_async_scheduling": honoured("torchlike (vLLM's async_scheduling): the paged engine dispatches each "
                                         "decode call before reading the previous one's tokens while its batch is "
                                         "unchanged (same tokens); None: the backend's default (on for a GPU or "
                                         "TPU, off on the CPU)."),
    "max_staleness": honoured("torchlike (TRL's AsyncGRPOConfig name): 0 samples each generation batch before it "
                              "trains; >= 1 samples the next one while the current one trains (the optimizer "
                              "steps of one generation batch must not exceed it), with the sampler correction. On "
                              "the paged engine the batches go to one stream (in-flight batching: a batch's freed "
                              "slots take the next one's completions; each optimizer step's weights are applied "
                              "between two decode calls, every token tagged with its step, logged as TRL's "
                              "sample/staleness_mean and _max); the static engine samples ahead with a second "
                              "engine in a background thread."),
    "rollout_vllm_adapter_dir": honoured("torchlike: with use_vllm=True and vllm_mode='server', the folder each "
                                         "optimizer step's LoRA adapter is written under for the vLLM server to load "
                                         "(the server must read the same path); None: a temporary folder."),
    "rollout_kv_cache_tokens": honoured("torchlike: the KV cache's size in tokens (or rollout_gpu_memory_utilization "
                                        "sizes it); None holds every slot's longest completion. Completions are "
                                        "admitted as pages are free and preempted (recomputed later, same tokens) "
                                        "when they run out."),
    "max_prompt_length": honoured("Removed in TRL 0.28 but still accepted (with a FutureWarning): a prompt longer "
                                  "than this keeps its last max_prompt_length tokens, as TRL used to do."),
}
