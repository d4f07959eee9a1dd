"""What torchlike does with each field ``trl.experimental.gkd.GKDConfig`` adds to ``SFTConfig``, and with the
``SFTConfig`` fields whose meaning GKD changes.

``GKDConfig._FIELD_SUPPORT`` is this table, laid over ``SFTConfig``'s (see :mod:`torchlike.field_support`). TRL's
``GKDTrainer`` sets ``dataset_kwargs["skip_prepare_dataset"] = True`` and batches the raw ``messages`` rows with its
``DataCollatorForChatML``, so SFT's data-preparation fields do nothing there; they are ignored here too. A test holds
the table against the fields of the real ``trl.experimental.gkd.GKDConfig``.
"""

from __future__ import annotations

from torchlike.field_support import FieldSupport, honoured, ignored, refused
from torchlike.trl.trainer.distillation_fields import DISTILLATION_FIELD_SUPPORT
from torchlike.trl.trainer.sft_fields import SFT_FIELD_SUPPORT

_SKIPPED_PREPARATION = ("TRL's GKDTrainer skips SFT's dataset preparation (it forces dataset_kwargs "
                        "skip_prepare_dataset) and batches with DataCollatorForChatML, which never reads it; "
                        "torchlike builds the same batches.")

GKD_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: ignored(_SKIPPED_PREPARATION) for name in (
        "dataset_text_field", "dataset_num_proc", "eos_token", "truncation_mode", "shuffle_dataset",
        "packing_strategy", "eval_packing", "completion_only_loss", "assistant_only_loss", "pad_to_multiple_of")},
    **{name: SFT_FIELD_SUPPORT[name] for name in ("model_init_kwargs", "trust_remote_code", "chat_template_path",
                                                 "activation_offloading")},
    "router_aux_loss_coef": ignored("GKD's loss is the generalized JSD alone: TRL's GKDTrainer.compute_loss never "
                                    "adds the router load-balancing loss (TRL only refuses a coefficient for a dense "
                                    "model, where torchlike warns instead)."),
    "dataset_kwargs": ignored("TRL's GKDTrainer sets skip_prepare_dataset=True whatever is given and reads no other "
                              "key; the messages rows are batched as TRL's DataCollatorForChatML batches them."),
    "packing": refused("With TRL's default packing_strategy ('bfd') packing turns padding-free batches on, which "
                       "TRL's SFTTrainer refuses with GKD's own data collator; with 'wrapped' the preparation that "
                       "packs is skipped. GKD's batches are whole conversations, left-padded."),
    "padding_free": refused("TRL's SFTTrainer refuses padding-free batches with GKD's own data collator; GKD's "
                            "batches are left-padded rows."),
    "loss_type": ignored("GKDTrainer's loss is always the generalized JSD (its compute_loss replaces SFT's)."),
    "pad_token": ignored("TRL's DataCollatorForChatML, built before SFTTrainer reads pad_token, pads with "
                         "processing_class.pad_token_id and refuses a tokenizer without one; so does torchlike."),
    "remove_unused_columns": ignored("TRL's GKDTrainer sets it to False (the collator reads the messages column); "
                                     "torchlike reads the messages column either way."),
    "neftune_noise_alpha": DISTILLATION_FIELD_SUPPORT["neftune_noise_alpha"],
    "max_length": honoured("Each conversation keeps its last max_length tokens (the prompt's oldest tokens go "
                           "first), as TRL's DataCollatorForChatML; a row left without prompt tokens is refused with "
                           "TRL's message. Batches are padded to the longest kept row, so the step compiles once."),
    "per_device_train_batch_size": honoured("Conversations per data-parallel shard and micro-batch; the on-policy "
                                            "decision (lmbda) and the generations are per micro-batch, as TRL's "
                                            "training_step."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL the loss is divided by the "
                                            "number of labelled tokens in the window's dataset batches (transformers' "
                                            "num_items_in_batch, counted before on-policy completions replace "
                                            "them)."),
    # --- trl.experimental.gkd.GKDConfig 1.16 ---
    "temperature": honoured("Sampling temperature of the student's on-policy and the teacher's seq_kd completions "
                            "(top_k 0, top_p 1, as TRL's generation config); as in TRL the loss compares the "
                            "untempered distributions."),
    "lmbda": honoured("Each micro-batch is replaced by the student's completions of its prompts when "
                      "random.random() <= lmbda, drawn as TRL draws it (Python's random, seeded with seed, one draw "
                      "per micro-batch; a resumed run skips the draws of the steps done)."),
    "beta": honoured("TRL's generalized Jensen-Shannon divergence per labelled token: 0 is KL(teacher || student), "
                     "1 is KL(student || teacher), in between beta KL(teacher || m) + (1 - beta) KL(student || m) "
                     "with m = (1 - beta) student + beta teacher (torchlike.adapters.losses.distillation)."),
    "max_new_tokens": honoured("The most tokens per on-policy or seq_kd completion; completions stop at their first "
                               "EOS, which is trained on, as in TRL."),
    "teacher_model_name_or_path": DISTILLATION_FIELD_SUPPORT["teacher_model_name_or_path"],
    "teacher_model_init_kwargs": DISTILLATION_FIELD_SUPPORT["teacher_model_init_kwargs"],
    "disable_dropout": DISTILLATION_FIELD_SUPPORT["disable_dropout"],
    "seq_kd": honoured("A micro-batch that is not on-policy trains on the teacher's sampled completions of its "
                       "prompts in place of the dataset's (sequence-level KD), as TRL's training_step."),
}
