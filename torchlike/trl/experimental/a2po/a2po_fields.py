"""What torchlike does with each field ``trl.experimental.a2po.A2POConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning A*-PO changes. A test holds the table against the fields of the real class.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT
from ...trainer.sft_fields import SFT_FIELD_SUPPORT

A2PO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": GRPO_FIELD_SUPPORT["neftune_noise_alpha"],
    # --- TrainingArguments fields whose meaning A*-PO changes ---
    "per_device_train_batch_size": honoured("Prompts per data-parallel shard in a micro-batch, each with one policy "
                                            "completion; stage 1 samples num_value_samples reference completions for "
                                            "this many prompts at a time."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step, each sampled with the weights of the "
                                            "steps before it; the loss is the mean of the micro-batches' losses."),
    "remove_unused_columns": honoured("False (TRL's default here): every dataset column but prompt and completion "
                                      "reaches the reward functions as a keyword argument; True keeps only prompt."),
    # --- model ---
    "model_init_kwargs": SFT_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": SFT_FIELD_SUPPORT["trust_remote_code"],
    # --- generation ---
    "max_prompt_length": honoured("Prompts (rendered with the chat template when conversational, tokenised without "
                                  "special tokens) are truncated to it on the tokenizer's truncation_side, as TRL's "
                                  "tokenizer call does (None: not truncated)."),
    "max_completion_length": honoured("The most tokens sampled per completion in both stages; it sizes the KV "
                                      "cache."),
    "temperature": honoured("Sampling temperature of both stages (the log-probabilities of the loss are "
                            "untempered, as in TRL)."),
    "top_p": honoured("Nucleus sampling in both stages."),
    "top_k": honoured("Top-k sampling in both stages (None: off)."),
    # --- stage 1 ---
    "num_value_samples": honoured("Reference completions per prompt (train and eval prompts) before training."),
    "beta1": honoured("V*(x) = beta1 * log(mean_i exp(r_i / beta1)) over the prompt's reference completions."),
    "filter_all_incorrect": honoured("Training prompts whose reference completions all scored 0 are dropped before "
                                     "training (eval prompts are kept)."),
    # --- stage 2 ---
    "beta2": honoured("The implicit reward beta2 * log(pi / pi_ref) regressed onto r - V*."),
    "reward_weights": honoured("Weights of the reward functions in the scalar reward (default 1.0 each)."),
}
