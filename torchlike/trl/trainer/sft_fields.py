"""What torchlike does with each field ``trl.SFTConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning SFT changes.

``SFTConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
the GRPO and DPO tables reuse its rows for the fields they share.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured, ignored

#: The router loss in the trainers that do not add it (TRL's DPO, GRPO, RLOO and KTO do, for MoE models).
SFT_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- trl.SFTConfig 1.16 ---
    "model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when model is"
                                  " a string (dtype as a string, a torch dtype or 'auto')."),
    "trust_remote_code": ignored("TRL passes it to from_pretrained, where it matters only for a repository with "
                                 "custom modelling code; such code is PyTorch, so torchlike refuses those "
                                 "repositories either way and loads its own architectures without it."),
    "router_aux_loss_coef": honoured("Weight of the Mixture-of-Experts load-balancing loss (transformers' "
                                     "load_balancing_loss_func) added to the loss of a model with a router (Qwen3 "
                                     "MoE); None takes the model config's; set on a dense model it is refused, as "
                                     "in TRL."),
    "chat_template_path": honoured("A .jinja/.j2 file whose text becomes the processing_class's chat template, or "
                                   "a tokenizer directory/id whose chat template and eos token are copied; a "
                                   "tokenizer with tokens the processing_class lacks is refused (TRL adds them and "
                                   "resizes the embeddings, which torchlike does not)."),
    "dataset_text_field": honoured("Column holding the text of language-modelling datasets."),
    "dataset_kwargs": honoured("{'skip_prepare_dataset': True} uses the dataset as given: input_ids, the loss on "
                               "labels != -100 (every token without labels), no truncation; other keys warn, as "
                               "TRL ignores them."),
    "dataset_num_proc": ignored("SFT examples are tokenised in one process, one at a time (streaming datasets too); "
                                "the result is the same as with several."),
    "eos_token": honoured("Token appended at the end of each example/turn (default: the tokenizer's eos_token)."),
    "max_length": honoured("Examples are truncated to max_length tokens (None: no truncation); every batch is "
                           "padded to the longest prepared example, one fixed shape so XLA compiles the step once."),
    "truncation_mode": honoured("'keep_start' keeps the first max_length tokens; the deprecated 'keep_end' keeps the"
                                " last ones (with TRL's FutureWarning)."),
    "shuffle_dataset": honoured("Shuffle the prepared training dataset once before training, seeded by seed."),
    "packing": honoured("Examples are packed into rows of max_length tokens (not truncated first, as in TRL); each "
                        "packed sequence gets position ids restarting at 0 and attention kept inside it, so the "
                        "loss equals the unpacked one; trainer.train_dataset shows TRL's packed columns (input_ids, "
                        "labels, seq_lengths). Generation and log-prob passes are never packed."),
    "packing_strategy": honoured("'bfd' (best fit decreasing, longer sequences truncated; TRL's default, which "
                                 "turns padding_free on), 'bfd_split' (longer sequences split into pieces) or "
                                 "'wrapped' (concatenated and cut every max_length tokens, sequences attending to "
                                 "each other unless padding_free), packed in groups of 1000 examples as TRL's "
                                 "pack_dataset does."),
    "padding_free": honoured("TRL's padding-free batches, kept as fixed-shape rows so XLA compiles once: each "
                             "sequence has its own position ids and attention, and its first token is not a target "
                             "(TRL sets that label to -100); without packing TRL's rule applies (max_length must be "
                             "None) and the loss equals padded training."),
    "pad_to_multiple_of": honoured("The fixed padded length of the batches (the longest prepared example) is "
                                   "rounded up to a multiple of it, as TRL's collator rounds each batch's length "
                                   "('auto' becomes None, as in TRL off Neuron)."),
    "eval_packing": honoured("Whether evaluation data is packed (None: as packing), with the packing_strategy of "
                             "training."),
    "completion_only_loss": honoured("Loss only on completion tokens (None: yes for prompt/completion datasets, no "
                                     "for language-modelling ones), with a loss mask distinct from padding."),
    "assistant_only_loss": honoured("Loss only on assistant turns of conversational data, from the chat template's "
                                    "{% generation %} markers."),
    "loss_type": honoured("'nll' (token-mean negative log-likelihood; 'chunked_nll' is its deprecated alias) or "
                          "'dft' (Dynamic Fine-Tuning: each token's NLL weighted by its detached probability, TRL's "
                          "formula); 'dft' with compute_loss_func is refused, as in TRL."),
    "activation_offloading": ignored("Activations stay on the device; gradient_checkpointing (on by default) is "
                                     "torchlike's way to cut activation memory."),
    "pad_token": honoured("Deprecated in TRL (FutureWarning): with the default data collator, sets "
                          "processing_class.pad_token, the padding id of the batches; it must be in the vocabulary."),
    # --- TrainingArguments fields whose meaning SFT changes ---
    "neftune_noise_alpha": honoured("NEFTune: uniform noise of magnitude alpha / sqrt(L * hidden_size) on the input "
                                    "embeddings in training steps only (L: the batch's length as TRL pads it, the "
                                    "flattened length with padding_free), as transformers' hook; evaluation and "
                                    "generation see none."),
    "remove_unused_columns": ignored("SFT examples reach the data collator as the prepared columns (input_ids, "
                                     "labels, seq_lengths), as with TRL's default True; False, which in TRL also "
                                     "passes the dataset's other columns to a custom data_collator, changes nothing "
                                     "(the default collator never reads them)."),
}
