"""What torchlike does with each field ``trl.experimental.sdft.SDFTConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning SDFT changes; the sampling and vLLM fields are ``GRPOConfig``'s rows. A test
holds the table against the fields of the real class."""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, refused
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT

_FROM_GRPO = ("neftune_noise_alpha", "model_init_kwargs", "trust_remote_code", "disable_dropout",
              "num_generations_eval", "ds3_gather_for_generation", "shuffle_dataset", "generation_batch_size",
              "steps_per_generation", "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
              "repetition_penalty", "cache_implementation", "use_vllm", "vllm_mode", "vllm_model_impl",
              "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
              "vllm_group_port", "vllm_server_timeout", "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization",
              "vllm_max_model_length")

SDFT_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: GRPO_FIELD_SUPPORT[name] for name in _FROM_GRPO},
    # --- TrainingArguments fields whose meaning SDFT changes ---
    "per_device_train_batch_size": honoured("Completions (not prompts) per data-parallel shard in a micro-batch, as "
                                            "in TRL; num_generations completions of each prompt."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; the loss is the mean of the "
                                            "micro-batches' losses, as TRL divides each by the accumulation steps."),
    "remove_unused_columns": honoured("False (TRL's default here): privileged_context reaches the teacher prompt; "
                                      "True keeps only prompt and privileged_context, the columns SDFT reads."),
    # --- data and sampling ---
    "max_prompt_length": honoured("Prompts (and teacher prompts) keep their last max_prompt_length tokens, as TRL "
                                  "truncates them (None: not truncated)."),
    "num_generations": honoured("Completions sampled per prompt, generated together (a prompt's rows are "
                                "consecutive, as TRL's RepeatSampler lays them out)."),
    "max_completion_length": honoured("The most tokens sampled per completion; it sizes the KV cache."),
    "temperature": honoured("Sampling temperature; both models' logits are divided by it in the loss, as TRL does."),
    "num_iterations": honoured("Passes over each generation batch; with more than one (or steps_per_generation not "
                               "dividing the accumulation), the rollout's log-probabilities are kept for the "
                               "importance weights, as TRL computes them."),
    "use_teacher_server": refused("It scores the teacher on a vLLM generation server; torchlike scores the teacher "
                                  "with a local forward pass in the same step (teacher_model_kind='live' is the "
                                  "current student)."),
    # --- teacher ---
    "teacher_model_kind": honoured("'base': a frozen copy of the initial student (with a LoRA adapter, the student "
                                   "with its adapter off); 'live': the current student, without gradient; 'ema': a "
                                   "copy of the student moved towards it by teacher_update_rate every "
                                   "teacher_sync_steps optimizer steps (with a LoRA adapter, only the adapter "
                                   "moves, as TRL's teacher adapter)."),
    "teacher_update_rate": honoured("EMA rate of the 'ema' teacher (1.0: a copy of the student at each sync)."),
    "teacher_sync_steps": honoured("Optimizer steps between the 'ema' teacher's updates."),
    "generate_from_teacher": honoured("Completions are sampled (by the student) after the teacher prompt instead of "
                                      "the student prompt; no importance weights are applied then, as in TRL."),
    "teacher_prompt_template": honoured("The teacher prompt: template.format(prompt=..., privileged_context=...); "
                                        "for a conversation, the last user turn's text is formatted and replaces it."),
    # --- loss ---
    "distillation_alpha": honoured("The divergence's interpolation: 0 is KL(teacher || student), 1 KL(student || "
                                   "teacher), between them the KLs to the mixture, interpolated "
                                   "(torchlike.adapters.losses.self_distillation.divergence)."),
    "distillation_mode": honoured("'topk_logits' (the student's top distillation_topk tokens), 'full_logits' (the "
                                  "whole vocabulary) or 'sampled_token' (reverse KL on the sampled token), as TRL."),
    "distillation_topk": honoured("Tokens of the student's top-k support in 'topk_logits'."),
    "distillation_is_clip": honoured("The importance ratio exp(log s - log s_rollout) weighting each token's loss is "
                                     "clipped at it (None: no weighting); applied when the rollout's "
                                     "log-probabilities are kept (see num_iterations)."),
    "distillation_add_tail": honoured("'topk_logits' adds a bucket with the mass outside the top k instead of "
                                      "renormalising the top k."),
    "num_loss_tokens_to_skip": honoured("The first completion tokens left out of the loss."),
}
