"""What torchlike does with each field ``trl.experimental.gold.GOLDConfig`` adds to ``SFTConfig``, and with the
``SFTConfig`` fields whose meaning GOLD changes.

``GOLDConfig._FIELD_SUPPORT`` is this table, laid over ``SFTConfig``'s (see :mod:`torchlike.field_support`). TRL's
``GOLDTrainer`` tokenises the rows itself (``_prepare_dataset_with_original_text``: the prompt and completion texts
kept beside the ids, the completion's last ``max_length`` tokens) and batches them with ``DataCollatorForChatML``, so
most of SFT's data-preparation fields do nothing there; they are ignored here too. A test holds the table against the
fields of the real ``trl.experimental.gold.GOLDConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored, refused
from ...trainer.sft_fields import SFT_FIELD_SUPPORT
from ..gkd.gkd_fields import GKD_FIELD_SUPPORT
from ..iw_opd.iw_opd_fields import IW_OPD_FIELD_SUPPORT

_OWN_TOKENISATION = ("TRL's GOLDTrainer tokenises the rows itself and batches them with DataCollatorForChatML, which "
                     "never reads it; torchlike builds the same batches.")
_VLLM = ("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
         "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
         "vllm_max_model_length", "vllm_model_impl", "vllm_structured_outputs_regex", "vllm_sync_frequency",
         "vllm_enable_sleep_mode")
_ULD = "Read only with use_uld_loss=True: "

GOLD_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: IW_OPD_FIELD_SUPPORT[name] for name in _VLLM},
    **{name: ignored(_OWN_TOKENISATION) for name in (
        "eos_token", "truncation_mode", "packing_strategy", "eval_packing", "completion_only_loss",
        "assistant_only_loss", "pad_to_multiple_of", "shuffle_dataset")},
    **{name: SFT_FIELD_SUPPORT[name] for name in ("model_init_kwargs", "trust_remote_code", "chat_template_path",
                                                 "activation_offloading", "dataset_num_proc")},
    "dataset_text_field": honoured("A row without messages or prompt/completion is this column's text, all of "
                                   "it completion (so no prompt token: TRL's collator refuses it, as torchlike does)."),
    "dataset_kwargs": honoured("skip_prepare_dataset=True hands the raw messages rows to DataCollatorForChatML, which "
                               "tokenises them itself, as TRL's; no other key is read."),
    "packing": refused("TRL's GOLD refuses packing with cross-tokenizer ULD and its DataCollatorForChatML cannot find "
                       "the prompt of a packed row; GOLD's batches are whole conversations, left-padded."),
    "padding_free": refused("TRL's SFTTrainer refuses padding-free batches with GOLD's own data collator; GOLD's "
                            "batches are left-padded rows."),
    "loss_type": ignored("GOLDTrainer's loss is the generalized JSD or ULD (its compute_loss replaces SFT's)."),
    "pad_token": GKD_FIELD_SUPPORT["pad_token"],
    "router_aux_loss_coef": ignored("GOLD's loss is the divergence alone: TRL's GOLDTrainer.compute_loss never adds "
                                    "the router load-balancing loss."),
    "neftune_noise_alpha": GKD_FIELD_SUPPORT["neftune_noise_alpha"],
    "remove_unused_columns": ignored("TRL's GOLDTrainer keeps the columns its collator reads (original texts, byte "
                                     "offsets); torchlike reads them either way."),
    "max_length": honoured("Each row keeps its last max_length tokens (the prompt's oldest go first; the kept texts "
                           "are decoded again, as TRL's); a row left without prompt tokens is refused with TRL's "
                           "message. The on-policy prompts keep their last max_length - max_completion_length "
                           "tokens."),
    "per_device_train_batch_size": IW_OPD_FIELD_SUPPORT["per_device_train_batch_size"],
    "gradient_accumulation_steps": IW_OPD_FIELD_SUPPORT["gradient_accumulation_steps"],
    # --- trl.experimental.gold.GOLDConfig 1.16 ---
    "temperature": honoured("Sampling temperature of the student's completions; both models' logits are divided by "
                            "it in the generalized JSD (not in ULD, which has its own temperatures)."),
    "top_p": IW_OPD_FIELD_SUPPORT["top_p"],
    "top_k": IW_OPD_FIELD_SUPPORT["top_k"],
    "lmbda": IW_OPD_FIELD_SUPPORT["lmbda"],
    "beta": honoured("The generalized JSD's interpolation (0 forward KL, 1 reverse KL), over the whole vocabulary; "
                     "with the hybrid ULD loss, that of the JSD on the shared tokens."),
    "max_completion_length": honoured("The most tokens sampled per completion; completions stop at their first EOS, "
                                      "which is trained on, as in TRL."),
    "teacher_model_name_or_path": GKD_FIELD_SUPPORT["teacher_model_name_or_path"],
    "teacher_model_init_kwargs": GKD_FIELD_SUPPORT["teacher_model_init_kwargs"],
    "teacher_model_revision": IW_OPD_FIELD_SUPPORT["teacher_model_revision"],
    "teacher_tokenizer_name_or_path": honoured(_ULD + "the teacher's tokenizer (default: the teacher's path), loaded "
                                               "with transformers' AutoTokenizer."),
    "disable_dropout": GKD_FIELD_SUPPORT["disable_dropout"],
    "seq_kd": ignored("TRL's GOLDTrainer stores it and never reads it: no teacher completions are sampled."),
    "num_generations": IW_OPD_FIELD_SUPPORT["num_generations"],
    "generation_batch_size": IW_OPD_FIELD_SUPPORT["generation_batch_size"],
    "use_uld_loss": honoured("Universal Logit Distillation across tokenizers: the teacher reads the prompt and "
                             "completion texts through its own tokenizer, and the two answers' distributions are "
                             "aligned and compared (torchlike.adapters.losses.uld)."),
    "use_extended_uld": honoured(_ULD + "the two tokenizations are aligned on their byte offsets and split tokens' "
                                 "probabilities merged; False: positional alignment of the first min(n, m) tokens."),
    "uld_token_merge_strategy": honoured(_ULD + "'observed' (the first position's distribution times the later "
                                         "tokens' probabilities) or 'bayesian' (the last position's, shifted one "
                                         "position earlier, times the earlier tokens')."),
    "uld_use_hybrid_loss": honoured(_ULD + "the JSD on the tokens both vocabularies spell the same, the sorted L1 on "
                                    "the rest; matched_loss and unmatched_loss are logged."),
    "uld_hybrid_matched_weight": honoured(_ULD + "the shared tokens' weight (None: their share of the teacher's "
                                          "vocabulary)."),
    "uld_hybrid_unmatched_weight": honoured(_ULD + "the other tokens' weight (None: 1 - the matched weight)."),
    "uld_crossentropy_weight": honoured(_ULD + "weight of the student's cross-entropy on its labels."),
    "uld_distillation_weight": honoured(_ULD + "weight of the distillation term."),
    "uld_student_temperature": honoured(_ULD + "the student's softmax temperature."),
    "uld_teacher_temperature": honoured(_ULD + "the teacher's softmax temperature."),
    "uld_skip_student_eos": honoured(_ULD + "the student's answer drops its last token."),
    "uld_skip_teacher_eos": honoured(_ULD + "the teacher's answer drops its last token."),
    "log_completions": ignored("TRL prints a rich table of on-policy completions and logs it to Weights & Biases; "
                               "torchlike's GOLD does not yet."),
    "log_completions_steps": ignored("Only read with log_completions."),
    "num_completions_to_print": ignored("Only read with log_completions."),
    "wandb_log_unique_prompts": ignored("Only read with log_completions (the Weights & Biases table)."),
    "callbacks": ignored("TRL's GOLDTrainer never reads it; pass callback objects to the trainer's callbacks."),
}
