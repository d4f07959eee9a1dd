"""What torchlike does with each field TRL 1.0.0's ``trl.experimental.bco.BCOConfig`` adds to ``TrainingArguments``,
and with the ``TrainingArguments`` fields whose meaning BCO changes.

``BCOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
fields with the same meaning as in ``DPOConfig`` reuse its rows. ``tests/test_bco_trainer.py`` holds it against the
fields of TRL 1.0.0's ``BCOConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored, refused
from ...trainer.dpo_fields import DPO_FIELD_SUPPORT

BCO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": refused("TRL's hook sits on the embedding layer in every training-mode forward, so for a "
                                   "LoRA model without ref_model it also perturbs the reference pass, which torchlike "
                                   "runs once before training; torchlike refuses the field here (SFTTrainer and "
                                   "Trainer honour it)."),
    # --- TrainingArguments fields whose meaning BCO changes ---
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; as in TRL, the loss is the mean of the "
                                            "micro-batches' losses, and the running reward mean delta takes in each "
                                            "micro-batch's rewards before its loss reads it. torchlike computes those "
                                            "rewards in a forward pass without gradient before each step, so a step "
                                            "costs one more forward pass than TRL's."),
    "train_sampling_strategy": ignored("TRL 1.0.0's BCOTrainer always reads the training data in order (its "
                                       "_get_train_sampler is a SequentialSampler), and so does torchlike."),
    "remove_unused_columns": ignored("BCO examples reach the data collator as the prepared columns (token ids, label, "
                                     "reference log-probability and UDM weight); TRL's default collator sets it to "
                                     "False itself."),
    # --- model ---
    "model_init_kwargs": DPO_FIELD_SUPPORT["model_init_kwargs"],
    "disable_dropout": DPO_FIELD_SUPPORT["disable_dropout"],
    "is_encoder_decoder": ignored("Read by TRL only without a model (model_init); torchlike's models are decoder-only "
                                  "and a model is always given."),
    # --- data ---
    "dataset_num_proc": honoured("Processes for datasets.Dataset.map while unpairing paired data: as in TRL, the "
                                 "1000-pair blocks of paired data being unpaired restart at each process's shard."),
    "max_length": honoured("As TRL 1.0.0's BCO tokenisation: when prompt + completion (plus the BOS and EOS tokens "
                           "it adds) exceed it, the completion is cut (the prompt never is); None means 512, with "
                           "TRL's warning. Every batch is padded to the longest prepared sequence plus one column, so "
                           "XLA compiles the step once."),
    "max_completion_length": ignored("Read by TRL for encoder-decoder models only; torchlike's models are "
                                     "decoder-only."),
    "precompute_ref_log_probs": honoured("Whether a second, frozen model is kept (as TRL): with False (TRL's "
                                         "default), full fine-tuning without ref_model keeps a frozen copy of the "
                                         "starting weights as trainer.ref_model, so evaluate() can score data it has "
                                         "not seen after training has started; with True the starting weights score "
                                         "the data once, before training. Either way the reference "
                                         "log-probabilities are computed once before training and stored with each "
                                         "example (the values TRL computes in every step)."),
    "generate_during_eval": refused("TRL logs a table of policy and reference generations to Weights & Biases or "
                                    "Comet at each evaluation; torchlike logs no generation tables. Generate with "
                                    "model.generate after evaluate() instead."),
    # --- loss ---
    "beta": honoured("The temperature of the implied reward beta x log(pi / pi_ref); rewards/* metrics are beta x "
                     "log-ratios."),
    "prompt_sample_size": honoured("Prompts of each label drawn (with replacement, by NumPy's generator seeded with "
                                   "seed, as TRL's np.random.choice after transformers' set_seed) and embedded to fit "
                                   "the UDM density-ratio classifier; used only with embedding_func and "
                                   "embedding_tokenizer."),
    "min_density_ratio": honoured("Lower clamp of the UDM weight p / (1 - p) of each undesirable example."),
    "max_density_ratio": honoured("Upper clamp of the UDM weight p / (1 - p) of each undesirable example."),
}
