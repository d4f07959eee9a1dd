"""What torchlike does with each field ``trl.experimental.orpo.ORPOConfig`` adds to ``TrainingArguments``, and with
the ``TrainingArguments`` fields whose meaning ORPO changes.

``ORPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
rows that CPO shares are reused by ``torchlike.trl.experimental.cpo.cpo_fields``. A test holds it against the fields
of the real ``trl.experimental.orpo.ORPOConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored, refused
from ...trainer.dpo_fields import DPO_FIELD_SUPPORT

ORPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": refused("transformers' hook scales its noise by the padded width of TRL's concatenated "
                                   "chosen + rejected batch (the longest row of each batch); torchlike pads pair "
                                   "batches to one fixed width, so the noise would differ. Refused rather than "
                                   "approximated (SFTTrainer and Trainer honour it)."),
    # --- TrainingArguments fields whose meaning ORPO changes ---
    "per_device_train_batch_size": DPO_FIELD_SUPPORT["per_device_train_batch_size"],
    "gradient_accumulation_steps": DPO_FIELD_SUPPORT["gradient_accumulation_steps"],
    "remove_unused_columns": ignored("The prepared token ids reach the pair collator whatever its value; TRL's "
                                     "default collator needs False and sets it so itself, with a warning."),
    # --- model ---
    "model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when model is "
                                  "a string; with a model already loaded, TRL's ValueError."),
    "trust_remote_code": DPO_FIELD_SUPPORT["trust_remote_code"],
    "disable_dropout": DPO_FIELD_SUPPORT["disable_dropout"],
    "is_encoder_decoder": ignored("TRL reads it only when no model is given (model_init, which torchlike refuses); "
                                  "torchlike's model families are decoder-only."),
    # --- data ---
    "dataset_num_proc": DPO_FIELD_SUPPORT["dataset_num_proc"],
    "max_length": honoured("A response is cut so that prompt + response fit max_length (the prompt is never cut), "
                           "as TRL's tokenize_row; None means 512, with TRL's warning. Every batch is padded to the "
                           "longest prepared sequence (plus one column), so XLA compiles the step once."),
    "max_completion_length": ignored("TRL reads it only for encoder-decoder models; torchlike's model families are "
                                     "decoder-only."),
    "padding_value": honoured("The token id that pads input_ids (default: the tokenizer's pad token). Padding "
                              "positions are masked out of the loss; their logits enter TRL's logits/* metrics. TRL "
                              "first pads each half of a batch to its own longest row with the tokenizer's pad "
                              "token and uses padding_value past that, so with both set and different those "
                              "metrics can differ slightly."),
    # --- loss ---
    "beta": honoured("ORPO's lambda: the loss is the chosen NLL minus beta x mean log sigmoid(log odds ratio) "
                     "(torchlike.adapters.losses.orpo); rewards/* metrics are beta x mean log-probabilities."),
    # --- evaluation ---
    "generate_during_eval": refused("TRL samples completions of a random evaluation batch and logs them as a table "
                                    "to Weights & Biases or Comet; torchlike does not implement that table. Call "
                                    "model.generate on evaluation prompts yourself."),
}
