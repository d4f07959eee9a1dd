"""What torchlike does with each field ``trl.KTOConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning KTO changes.

``KTOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
fields with the same meaning as in ``DPOConfig`` reuse its rows. A test holds it against the fields of the real
``trl.KTOConfig``.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured, ignored, refused
from .dpo_fields import DPO_FIELD_SUPPORT

KTO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": refused("TRL's hook sits on the embedding layer in every training-mode forward, so it also "
                                   "perturbs KTO's KL-estimate pass and, for a LoRA model without ref_model, the "
                                   "reference pass; torchlike adds NEFTune noise to the train step's inputs only, so "
                                   "it refuses the field here (SFTTrainer and Trainer honour it)."),
    # --- TrainingArguments fields whose meaning KTO changes ---
    "per_device_train_batch_size": honoured("Examples per data-parallel shard; times args.data_parallel_size it is "
                                            "the global micro-batch. It is also the size of the dataset chunks within "
                                            "which completions are rotated to build the KL completions (evaluation "
                                            "data too, as in TRL); loss_type='kto' needs it above 1."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                            "micro-batches' losses, and each micro-batch estimates its own KL term."),
    "train_sampling_strategy": honoured("Defaults to 'sequential', as in TRL's KTOConfig: each batch is a chunk of "
                                        "the dataset in order, so its KL completions are its own examples' "
                                        "completions. loss_type='kto' refuses 'random' (with TRL's message); "
                                        "apo_zero_unpaired accepts it."),
    "remove_unused_columns": ignored("KTO examples reach the data collator as the prepared columns (token ids, label "
                                     "and reference log-probabilities), as with TRL's default True; False, which in "
                                     "TRL also passes the dataset's other columns to a custom data_collator, changes "
                                     "nothing (the default collator never reads them)."),
    # --- model ---
    "model_init_kwargs": DPO_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": DPO_FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": DPO_FIELD_SUPPORT["router_aux_loss_coef"],
    "disable_dropout": DPO_FIELD_SUPPORT["disable_dropout"],
    # --- data ---
    "dataset_num_proc": honoured("Processes for datasets.Dataset.map while tokenising. As in TRL, the dataset is "
                                 "then processed in contiguous shards, one per process, and the KL chunks (and the "
                                 "1000-pair blocks of paired data being unpaired) restart at each shard."),
    "max_length": honoured("Prompt + completion sequences (and the KL sequences) keep their first max_length tokens "
                           "(None: no truncation); examples whose prompt alone fills it are dropped, with a warning, "
                           "before the KL completions are built. Every batch is padded to the longest prepared "
                           "sequence, so XLA compiles the step once."),
    "pad_to_multiple_of": DPO_FIELD_SUPPORT["pad_to_multiple_of"],
    "precompute_ref_log_probs": DPO_FIELD_SUPPORT["precompute_ref_log_probs"],
    "precompute_ref_batch_size": DPO_FIELD_SUPPORT["precompute_ref_batch_size"],
    # --- loss ---
    "loss_type": honoured("Both of TRL's loss types, 'kto' (with the KL estimate from the mismatched completions) and "
                          "'apo_zero_unpaired', computed as TRL 1.16 does (torchlike.adapters.losses.kto.kto_loss)."),
    "beta": honoured("The temperature of the implied reward beta x log(pi / pi_ref); rewards/* metrics are beta x "
                     "log-ratios."),
    "desirable_weight": honoured("Weight of the losses of desirable examples (label True); TRL's warning when "
                                 "neither weight suits the dataset's balance is given too."),
    "undesirable_weight": honoured("Weight of the losses of undesirable examples (label False)."),
    "activation_offloading": DPO_FIELD_SUPPORT["activation_offloading"],
    "sync_ref_model": honoured("Every ref_model_sync_steps optimizer steps the reference (ref_model, else a copy of "
                               "the initial model) becomes ref_model_mixup_alpha x policy + (1 - "
                               "ref_model_mixup_alpha) x reference (TRL's SyncRefModelCallback, TR-DPO); the "
                               "reference log-probabilities are then computed for each batch from the current "
                               "reference. As in TRL, refused with a LoRA adapter and with "
                               "precompute_ref_log_probs=True."),
    "ref_model_mixup_alpha": DPO_FIELD_SUPPORT["ref_model_mixup_alpha"],
    "ref_model_sync_steps": DPO_FIELD_SUPPORT["ref_model_sync_steps"],
}
