"""What torchlike does with each field of ``trl.experimental.gmpo.GMPOConfig``: ``GRPOConfig``'s rows, except the
fields GMPO gives another meaning and the loss fields TRL's GMPO loss does not read. A test holds the table against the
fields of the real class."""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored

_NOT_READ = ("TRL's GMPOTrainer replaces GRPO's loss with the geometric-mean one, which does not read this field "
             "(TRL ignores it as well, so the trained weights are the same).")

GMPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "epsilon": honoured("Lower clip of the per-token log-ratio, in log space: the ratio's lower bound is "
                        "exp(-epsilon) (GMPO's default 0.4), applied the PPO way for the advantage's sign before the "
                        "geometric mean, as TRL's GMPO."),
    "epsilon_high": honoured("Upper clip of the per-token log-ratio, in log space (None: epsilon): the ratio's upper "
                             "bound is exp(epsilon_high)."),
    "beta": honoured("KL coefficient: beta != 0 keeps a frozen reference model (the base with LoRA off for PEFT) and "
                     "adds beta x the sequence's mean k3 KL to each sequence's loss, as TRL's GMPO."),
    "top_entropy_quantile": honoured("Below 1, the geometric mean counts only the completion's highest-entropy "
                                     "tokens (the top quantile of each batch), as TRL's GMPO."),
    **dict.fromkeys(("loss_type", "importance_sampling_level", "delta", "off_policy_mask_threshold",
                     "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                     "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef", "use_adaptive_entropy",
                     "entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                     "router_aux_loss_coef", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                     "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"), ignored(_NOT_READ)),
    "max_staleness": honoured("torchlike (TRL's AsyncGRPOConfig name): 0 samples each generation batch before it "
                              "trains; >= 1 samples the next one while the current one trains. The sampler "
                              "correction GRPO applies to those batches is not in GMPO's loss (TRL's GMPO loss reads "
                              "no importance-sampling ratio)."),
}
