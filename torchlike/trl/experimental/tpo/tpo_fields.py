"""What torchlike does with each field ``trl.experimental.tpo.TPOConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning TPO changes.

``TPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
fields with the same meaning as in ``DPOConfig`` reuse its rows. A test holds it against the fields of the real
``trl.experimental.tpo.TPOConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured
from ...trainer.dpo_fields import DPO_FIELD_SUPPORT

TPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": DPO_FIELD_SUPPORT["neftune_noise_alpha"],
    # --- TrainingArguments fields whose meaning TPO changes ---
    "per_device_train_batch_size": honoured("Triples per data-parallel shard (each a chosen, a rejected and a gold "
                                            "sequence); times args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                            "micro-batches' losses (each a mean over its triples plus the gold "
                                            "responses' token-mean NLL)."),
    "remove_unused_columns": honoured("The prepared columns (prompt_ids, chosen_ids, rejected_ids, reference_ids) "
                                      "reach the data collator, as with TRL's default True; False, which in TRL also "
                                      "passes the dataset's other columns to a custom data_collator, changes nothing "
                                      "for the default collator, which never reads them."),
    # --- model ---
    "model_init_kwargs": DPO_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": DPO_FIELD_SUPPORT["trust_remote_code"],
    "disable_dropout": DPO_FIELD_SUPPORT["disable_dropout"],
    # --- data ---
    "dataset_num_proc": honoured("Processes for datasets.Dataset.map while tokenising the triples."),
    "max_length": honoured("Each prompt + response sequence longer than this is truncated (None: no truncation); no "
                           "example is dropped, as in TRL. Every batch is padded to the longest prepared sequence, so "
                           "XLA compiles the step once."),
    "truncation_mode": honoured("'keep_start' keeps the first max_length tokens, 'keep_end' the last ones."),
    "pad_to_multiple_of": honoured("The padded length is rounded up to a multiple of it."),
    # --- loss ---
    "loss_type": honoured("sigmoid, hinge, ipo and tpo-l, computed as TRL 1.16 does (torchlike.adapters.losses.tpo); "
                          "ipo and tpo-l average the completion log-probabilities, the others sum them."),
    "beta": honoured("The temperature beta of the preference term (tau for ipo); rewards/* metrics are beta x the "
                     "policy's log-probabilities."),
    "label_smoothing": honoured("eps of the sigmoid and tpo-l losses; hinge and ipo ignore it, with TRL's warning."),
    "tpo_alpha": honoured("Weight of the gold (reference) responses' token-mean NLL; 0 leaves their rows out of the "
                          "batch and the forward pass, as TRL's collator does."),
    "tpo_l_gamma": honoured("tpo-l's target reward margin: the sigmoid reads the log-probability difference minus "
                            "tpo_l_gamma / beta."),
}
