"""Training losses, one module per trainer family: per-token log-probs (:mod:`.logprobs`), GRPO, RLOO, DPO, KTO,
reward modelling, distillation, the MoE router loss, ORPO and CPO, each with its settings record, its pure math and its
step loss."""
