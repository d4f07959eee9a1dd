"""What torchlike does with each field ``trl.DPOConfig`` adds to ``TrainingArguments``, and with the
``TrainingArguments`` fields whose meaning DPO changes.

``DPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see
:mod:`torchlike.field_support`); fields with the same meaning as in ``SFTConfig`` or ``GRPOConfig`` reuse their
rows. A test holds it against the fields of the real ``trl.DPOConfig``.
"""

from __future__ import annotations

from ...field_support import FieldSupport, honoured, ignored, refused
from .grpo_fields import GRPO_FIELD_SUPPORT
from .sft_fields import SFT_FIELD_SUPPORT

DPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": refused("TRL's hook sits on the embedding layer the policy shares with generation and "
                                   "the reference pass, so it perturbs those too; torchlike adds NEFTune noise in "
                                   "train steps only, so it refuses the field here (SFTTrainer and Trainer "
                                   "honour it)."),
    # --- TrainingArguments fields whose meaning DPO changes ---
    "per_device_train_batch_size": honoured("Preference pairs per data-parallel shard (each a chosen and a rejected "
                                            "sequence); times args.data_parallel_size it is the global micro-batch."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                            "micro-batches' losses (each a mean over its pairs)."),
    "remove_unused_columns": ignored("DPO examples reach the data collator as the prepared columns (token ids and "
                                     "reference log-probabilities), as with TRL's default True; False, which in TRL "
                                     "also passes the dataset's other columns to a custom data_collator, changes "
                                     "nothing (the default collator never reads them)."),
    # --- model ---
    "model_init_kwargs": SFT_FIELD_SUPPORT["model_init_kwargs"],
    "trust_remote_code": SFT_FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": SFT_FIELD_SUPPORT["router_aux_loss_coef"],
    "disable_dropout": GRPO_FIELD_SUPPORT["disable_dropout"],
    # --- data ---
    "dataset_num_proc": honoured("Processes for datasets.Dataset.map while tokenising the preference pairs."),
    "max_length": honoured("Prompt + completion sequences longer than this are truncated (None: no truncation); "
                           "with keep_start, pairs whose prompt alone fills it are dropped with a warning. Every "
                           "batch is padded to the longest prepared sequence, so XLA compiles the step once."),
    "truncation_mode": honoured("'keep_start' keeps the first max_length tokens; the deprecated 'keep_end' keeps the "
                                "last ones (with TRL's FutureWarning)."),
    "padding_free": ignored("TRL 1.16 itself warns and pads instead; torchlike pads to fixed shapes so XLA compiles "
                            "once."),
    "pad_to_multiple_of": GRPO_FIELD_SUPPORT["pad_to_multiple_of"],
    "precompute_ref_log_probs": honoured("Whether a second, frozen model is kept (as TRL): with False (TRL's "
                                         "default), full fine-tuning without ref_model keeps a frozen copy of the "
                                         "starting weights as trainer.ref_model, so evaluate() can score data it has "
                                         "not seen after training has started; with True the starting weights score "
                                         "the data once, before training, and new data after that raises TRL's "
                                         "error. Either way the reference log-probabilities are computed once before "
                                         "training and stored with each example (for each batch with "
                                         "sync_ref_model): the reference is frozen and has no dropout, so these are "
                                         "the values TRL computes in each step. As in TRL, True is refused with an "
                                         "IterableDataset and with sync_ref_model."),
    "precompute_ref_batch_size": ignored("The reference pass before training runs in batches of "
                                         "per_device_train_batch_size (per_device_eval_batch_size for evaluation "
                                         "data)."),
    # --- loss ---
    "loss_type": honoured("All of TRL's 15 loss types, alone or combined, computed as TRL 1.16 does "
                          "(torchlike.adapters.losses.dpo.dpo_loss). aot and aot_unpaired sort within a batch, so "
                          "the rows padding a partial last batch enter the sort (a warning suggests "
                          "dataloader_drop_last)."),
    "loss_weights": honoured("Weight of each loss type when several are combined (default 1.0 each)."),
    "ld_alpha": honoured("LD-DPO: log-probabilities of the tokens past the shorter response of a pair are weighted "
                         "by ld_alpha."),
    "f_divergence_type": honoured("The f-divergence of f-DPO: reverse_kl (standard DPO), forward_kl, js_divergence or "
                                  "alpha_divergence."),
    "f_alpha_divergence_coef": honoured("alpha of f_divergence_type='alpha_divergence'."),
    "label_smoothing": honoured("eps of the robust, exo_pair, aot and aot_unpaired losses (TRL 1.16's sigmoid loss "
                                "does not read it)."),
    "beta": honoured("The DPO temperature beta (tau for ipo); rewards/* metrics are beta x log-ratios."),
    "use_weighting": honoured("WPO: each pair's loss is multiplied by w_chosen x w_rejected, w = exp(mean over the "
                              "completion tokens of log p - log sum_v p_v^2), without gradient, as TRL "
                              "(torchlike.adapters.losses.dpo.wpo_weights); refused with aot and aot_unpaired, "
                              "as in TRL."),
    "discopop_tau": honoured("Temperature of loss_type='discopop'."),
    "activation_offloading": SFT_FIELD_SUPPORT["activation_offloading"],
    "sync_ref_model": honoured("Every ref_model_sync_steps optimizer steps the reference (ref_model, else a copy of "
                               "the initial model) becomes ref_model_mixup_alpha x policy + (1 - "
                               "ref_model_mixup_alpha) x reference (TRL's SyncRefModelCallback, TR-DPO); the "
                               "reference log-probabilities are then computed for each batch from the current "
                               "reference. As in TRL, refused with a LoRA adapter and with "
                               "precompute_ref_log_probs=True."),
    "ref_model_mixup_alpha": GRPO_FIELD_SUPPORT["ref_model_mixup_alpha"],
    "ref_model_sync_steps": GRPO_FIELD_SUPPORT["ref_model_sync_steps"],
    # --- deprecated ---
    "pad_token": SFT_FIELD_SUPPORT["pad_token"],
}
