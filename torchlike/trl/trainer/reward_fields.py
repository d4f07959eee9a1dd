"""What torchlike does with each field ``trl.RewardConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning reward modelling changes.

``RewardConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
fields with the same meaning as in ``SFTConfig`` or ``DPOConfig`` reuse their rows. A test holds it against the fields
of the real ``trl.RewardConfig``.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured, ignored
from .dpo_fields import DPO_FIELD_SUPPORT
from .sft_fields import SFT_FIELD_SUPPORT

REWARD_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- TrainingArguments fields whose meaning reward modelling changes ---
    "per_device_train_batch_size": honoured("Preference pairs per data-parallel shard (each a chosen and a rejected "
                                            "sequence, scored in one forward pass); times args.data_parallel_size "
                                            "it is the global micro-batch."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                            "micro-batches' losses (each a mean over its pairs)."),
    "remove_unused_columns": ignored("Reward examples reach the data collator as TRL's signature columns (chosen_ids, "
                                     "rejected_ids and margin), as with TRL's default True; False, which in TRL also "
                                     "passes the dataset's other columns to a custom data_collator, changes nothing "
                                     "(the default collator never reads them)."),
    "neftune_noise_alpha": honoured("NEFTune: uniform noise of magnitude alpha / sqrt(L * hidden_size) on the reward "
                                    "model's input embeddings in training steps only (L: the longest chosen or "
                                    "rejected sequence of the micro-batch, the width TRL's collator pads the stacked "
                                    "pairs to), as transformers' hook; evaluation sees none."),
    # --- model ---
    "model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForSequenceClassification.from_pretrained "
                                  "when model is a string (num_labels is always 1, as in TRL; dtype defaults to "
                                  "float32)."),
    "trust_remote_code": SFT_FIELD_SUPPORT["trust_remote_code"],
    "chat_template_path": SFT_FIELD_SUPPORT["chat_template_path"],
    "disable_dropout": honoured("Always in effect when True: torchlike's model families have no dropout layers, and "
                                "LoRA dropout is switched off in the train step, so the scores are deterministic."),
    # --- data ---
    "dataset_num_proc": honoured("Processes for datasets.Dataset.map while tokenising the preference pairs (a "
                                 "datasets.Dataset; other inputs are tokenised in one process, with the same result)."),
    "eos_token": honoured("Set as the processing_class's eos token (and the model config's eos_token_id), so it is "
                          "the token appended to standard chosen and rejected texts that do not end with it."),
    "max_length": honoured("Pairs whose chosen or rejected sequence has more than max_length tokens are dropped, as in "
                           "TRL (with a warning counting them); None keeps every pair. Every batch is padded to the "
                           "longest kept sequence, so XLA compiles the step once."),
    "pad_to_multiple_of": DPO_FIELD_SUPPORT["pad_to_multiple_of"],
    # --- training ---
    "center_rewards_coefficient": honoured("Adds c x mean((r_chosen + r_rejected)^2) to the loss, pulling rewards "
                                           "towards zero (torchlike.adapters.losses.reward.bradley_terry_loss)."),
    "activation_offloading": SFT_FIELD_SUPPORT["activation_offloading"],
    # --- deprecated ---
    "pad_token": honoured("Deprecated in TRL (FutureWarning): set as the processing_class's pad token, whose id the "
                          "model config's pad_token_id takes; the score is read at each sequence's last token that is "
                          "not it. It must be in the vocabulary."),
}
