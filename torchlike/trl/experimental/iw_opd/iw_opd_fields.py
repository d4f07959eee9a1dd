"""What torchlike does with each field ``trl.experimental.iw_opd.IWOPDConfig`` adds to ``TrainingArguments``, and with
the ``TrainingArguments`` fields whose meaning IW-OPD changes. A test holds the table against the fields of the real
class."""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored, refused
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT
from ..gkd.gkd_fields import GKD_FIELD_SUPPORT

_VLLM = ("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
         "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
         "vllm_max_model_length", "vllm_model_impl", "vllm_structured_outputs_regex", "vllm_enable_sleep_mode")

IW_OPD_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: GRPO_FIELD_SUPPORT.get(name, GRPO_FIELD_SUPPORT["vllm_mode"]) for name in _VLLM},
    "vllm_sync_frequency": ignored("With use_vllm=True and vllm_mode='server' torchlike loads the student's LoRA "
                                   "adapter into the server before every generation round that follows an optimizer "
                                   "step (vllm_sync_frequency=1); otherwise its own JAX engine samples the current "
                                   "weights."),
    "neftune_noise_alpha": GKD_FIELD_SUPPORT["neftune_noise_alpha"],
    "model_init_kwargs": GKD_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": GKD_FIELD_SUPPORT["trust_remote_code"],
    "teacher_model_name_or_path": GKD_FIELD_SUPPORT["teacher_model_name_or_path"],
    "teacher_model_init_kwargs": GKD_FIELD_SUPPORT["teacher_model_init_kwargs"],
    "teacher_model_revision": honoured("The teacher's hub revision when it is loaded from a path or hub id (its "
                                       "teacher_model_init_kwargs' revision wins)."),
    "disable_dropout": GRPO_FIELD_SUPPORT["disable_dropout"],
    # --- TrainingArguments fields whose meaning IW-OPD changes ---
    "per_device_train_batch_size": honoured("Sequences per data-parallel shard in a micro-batch; times "
                                            "gradient_accumulation_steps, the sequences of one optimizer step, drawn "
                                            "as generation_batch_size prompts x num_generations."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step, each drawing whether it is trained on "
                                            "the student's completions (lmbda) as TRL's buffer does."),
    "remove_unused_columns": ignored("TRL's IWOPDTrainer sets it to False: its collator reads the messages column."),
    # --- data ---
    "max_length": honoured("Prompt + completion tokens: the dataset's completion is cut to fit after the prompt."),
    "max_prompt_length": honoured("The prompt's own budget (None: max_length - max_completion_length), truncated on "
                                  "the tokenizer's truncation_side, as TRL's collator does."),
    "max_completion_length": honoured("The most tokens sampled per completion."),
    "num_generations": honoured("Each prompt's row appears num_generations times in a row in an optimizer step's "
                                "sequences (TRL's RepeatSampler), sampled once each."),
    "generation_batch_size": honoured("Unique prompts per optimizer step (default per_device_train_batch_size x "
                                      "gradient_accumulation_steps / num_generations); an epoch is its whole batches."),
    "temperature": honoured("Sampling temperature; both models' logits are divided by it in the loss."),
    "top_p": honoured("Nucleus sampling of the student's completions."),
    "top_k": honoured("Top-k sampling of the student's completions (0: off)."),
    # --- loss ---
    "lmbda": honoured("Each micro-batch is the student's own completions of its prompts with this probability "
                      "(Python's random, seeded by seed, as TRL draws it), else the dataset's completions."),
    "beta": honoured("The generalized JSD's interpolation: 0 forward KL, 1 reverse KL, between them the JSD."),
    "distillation_objective": honoured("'iw_opd': the sampled-token importance-weighted objective "
                                       "(torchlike.adapters.losses.iw_opd.iw_opd_terms); 'jsd': the generalized JSD on "
                                       "loss_top_k supports, as TRL computes them."),
    "iw_opd_gamma": honoured("The weights' amplification: w_t = 1 + gamma (1 - |A|_<t / |A|_total)."),
    "iw_opd_epsilon": honoured("The floor of each row's total |A| when normalising the weights."),
    "reverse_kl_top_1_mode": honoured("The reverse term's top-1 token with beta > 0 and loss_top_k == 1: the sampled "
                                      "token, or the student's most likely one ('argmax')."),
    "loss_top_k": honoured("The divergence's support: the teacher's top-k (forward KL), the student's (reverse KL) or "
                           "their union (JSD), renormalised or with a tail bucket; 0: the whole vocabulary; 1 with "
                           "beta > 0: the teacher's top-1 and the reverse top-1 token, as TRL."),
    "loss_add_tail": honoured("A bucket with the probability mass outside the support is added to both "
                              "distributions."),
    "use_teacher_server": refused("It reads teacher log-probabilities from a vLLM server; torchlike runs the teacher "
                                  "beside the student in the same step. Pass teacher_model."),
    "teacher_model_server_url": ignored("Only read with use_teacher_server, which torchlike refuses."),
    "log_completions": ignored("TRL prints and logs a sample of on-policy completions; torchlike's IW-OPD does not "
                               "yet."),
    "log_completions_steps": ignored("Only read with log_completions."),
    "num_completions_to_print": ignored("Only read with log_completions."),
}
