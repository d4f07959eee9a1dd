"""What torchlike does with each field ``trl.SFTConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning SFT changes.

``SFTConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
the GRPO and DPO tables reuse its rows for the fields they share.
"""

from __future__ import annotations

from ..field_support import FieldSupport, honoured, ignored, refused

SFT_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- trl.SFTConfig 1.16 ---
    "model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when model is"
                                  " a string (dtype as a string, a torch dtype or 'auto')."),
    "trust_remote_code": refused("Hub modelling code is PyTorch and cannot run on torchlike's JAX models (which are "
                                 "built from torchlike's own model families)."),
    "router_aux_loss_coef": refused("torchlike's model families are dense; there is no Mixture-of-Experts router "
                                    "loss to weight."),
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
    "packing": refused("Packing several examples into one max_length sequence is not supported yet."),
    "packing_strategy": ignored("Only used with packing=True, which torchlike does not support yet."),
    "padding_free": refused("Padding-free batches (all examples flattened into one sequence) are not supported: "
                            "torchlike pads to fixed shapes so XLA compiles once."),
    "pad_to_multiple_of": honoured("The fixed padded length of the batches (the longest prepared example) is "
                                   "rounded up to a multiple of it, as TRL's collator rounds each batch's length "
                                   "('auto' becomes None, as in TRL off Neuron)."),
    "eval_packing": honoured("None (same as packing) or False: evaluation data is not packed; True is rejected by "
                             "the config."),
    "completion_only_loss": honoured("Loss only on completion tokens (None: yes for prompt/completion datasets, no "
                                     "for language-modelling ones), with a loss mask distinct from padding."),
    "assistant_only_loss": honoured("Loss only on assistant turns of conversational data, from the chat template's "
                                    "{% generation %} markers."),
    "loss_type": honoured("'nll' (token-mean negative log-likelihood; 'chunked_nll' is its deprecated alias); "
                          "'dft' is rejected by the config."),
    "activation_offloading": ignored("Activations stay on the device; gradient_checkpointing (on by default) is "
                                     "torchlike's way to cut activation memory."),
    "pad_token": honoured("Deprecated in TRL (FutureWarning): with the default data collator, sets "
                          "processing_class.pad_token, the padding id of the batches; it must be in the vocabulary."),
    # --- TrainingArguments fields whose meaning SFT changes ---
    "remove_unused_columns": ignored("SFT examples reach the data collator as the prepared columns (input_ids, "
                                     "loss_mask, seq_len), as with TRL's default True; False, which in TRL also "
                                     "passes the dataset's other columns to a custom data_collator, changes nothing "
                                     "(the default collator never reads them)."),
}
