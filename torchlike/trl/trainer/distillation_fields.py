"""What torchlike does with each field ``trl.DistillationConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning distillation changes.

``DistillationConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see
:mod:`torchlike.field_support`); the generation and vLLM fields, which mean what they mean in ``GRPOConfig``, reuse
its rows. A test holds the table against the fields of the real ``trl.DistillationConfig``.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured, ignored, refused
from .grpo_fields import GRPO_FIELD_SUPPORT
from .sft_fields import SFT_FIELD_SUPPORT

#: The fields of ``trl.DistillationConfig`` that mean what they mean in ``trl.GRPOConfig``.
_AS_IN_GRPO = ("ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of", "top_p", "top_k", "min_p",
               "repetition_penalty", "generation_kwargs", "chat_template_kwargs", "cache_implementation", "use_vllm",
               "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
               "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
               "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
               "num_completions_to_print")

DISTILLATION_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: GRPO_FIELD_SUPPORT[name] for name in _AS_IN_GRPO},
    "neftune_noise_alpha": refused("TRL's hook sits on the student's embedding layer, which also samples the "
                                   "on-policy completions, so it perturbs generation too; torchlike adds NEFTune "
                                   "noise in train steps only (where it would also reach the teacher's forward "
                                   "pass), so it refuses the field here (SFTTrainer and Trainer honour it)."),
    # --- TrainingArguments fields whose meaning distillation changes ---
    "per_device_train_batch_size": honoured("Prompts (one completion each) per data-parallel shard; times "
                                            "args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step. As in TRL, one generation batch of "
                                            "per_device_train_batch_size x data-parallel shards x "
                                            "gradient_accumulation_steps prompts is sampled per optimizer step and "
                                            "split into the micro-batches, and the loss is the divergence summed "
                                            "over all its completion tokens divided by their number."),
    "data_seed": ignored("TRL's distillation sampler shuffles the prompts with seed and never reads data_seed; "
                         "torchlike does the same."),
    "remove_unused_columns": ignored("Only the prompt column is read (as in TRL, which keeps or drops the other "
                                     "columns and never reads them), so the setting changes nothing."),
    # --- model and teacher ---
    "model_init_kwargs": SFT_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": SFT_FIELD_SUPPORT["trust_remote_code"],
    "teacher_model_name_or_path": honoured("The teacher loaded with torchlike.AutoModelForCausalLM.from_pretrained "
                                           "when the trainer gets no teacher_model (TRL's distillation script passes "
                                           "it as teacher_model; torchlike's trainer also reads it itself)."),
    "teacher_model_revision": honoured("The hub revision of a teacher given as a string, unless "
                                       "teacher_model_init_kwargs sets revision."),
    "teacher_model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when "
                                          "the teacher is a string (without dtype, the checkpoint's dtype, as TRL); "
                                          "with an already loaded teacher_model they are refused, as in TRL."),
    "disable_dropout": honoured("True switches LoRA dropout off in the student's train steps; torchlike's model "
                                "families have no other dropout layers, and the teacher never applies dropout."),
    # --- data and generation ---
    "max_completion_length": honoured("Each on-policy completion stops after this many tokens (or at its first EOS, "
                                      "which is trained on, as in TRL); with the prompt length it sizes the KV cache. "
                                      "Completions are padded to it, so the step compiles once."),
    "temperature": honoured("Sampling temperature of the on-policy completions, and the temperature of both the "
                            "student's and the teacher's softmax in the divergence (logits / temperature), as in TRL "
                            "(a temperature in generation_kwargs changes the sampling only)."),
    # --- loss ---
    "beta": honoured("TRL's generalized Jensen-Shannon divergence per completion token: 0 is KL(teacher || student), "
                     "1 is KL(student || teacher), in between beta KL(teacher || m) + (1 - beta) KL(student || m) "
                     "with m = (1 - beta) student + beta teacher (torchlike.adapters.losses.distillation)."),
    "max_tool_calling_iterations": honoured("With tools: the most rounds of tool calls and continued generation per "
                                            "completion (None: until no call is made or max_completion_length is "
                                            "reached), as TRL's _tool_call_loop."),
    # --- logging ---
    "log_completions": honoured("Print the prompts and completions of the latest generation batch at each training "
                                "log (num_completions_to_print rows) and write them to "
                                "output_dir/completions/completions_<step>.parquet, as TRL; there is no wandb or "
                                "trackio table."),
    "log_unique_prompts": ignored("Only shapes the wandb/trackio completions table, which torchlike does not log."),
}
