"""Training losses, one module per trainer family: per-token log-probs (:mod:`.logprobs`), the reward-to-advantage
pieces GRPO and RLOO share (:mod:`.advantages`), GRPO, RLOO, DPO, KTO, reward modelling, distillation (and GKD), the MoE
router loss, ORPO, CPO and their shared pair scores. Each family module holds its frozen settings record built from
the trainer config by field name (:class:`.settings.LossSettings`), its pure math and its step loss."""
