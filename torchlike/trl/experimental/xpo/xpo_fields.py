"""What torchlike does with each field ``trl.experimental.xpo.XPOConfig`` (TRL 1.0.0) adds to ``OnlineDPOConfig``, and
with the ``OnlineDPOConfig`` fields whose meaning XPO changes.

``XPOConfig._FIELD_SUPPORT`` is this table, laid over online DPO's (see :mod:`torchlike.field_support`).
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored
from ..online_dpo.online_dpo_fields import ONLINE_DPO_FIELD_SUPPORT

XPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **ONLINE_DPO_FIELD_SUPPORT,
    "per_device_train_batch_size": honoured("Prompts per data-parallel shard and micro-batch, as in TRL: each gets "
                                            "one completion from the policy and one from the reference, so a "
                                            "micro-batch trains on twice as many completions. An epoch's last "
                                            "partial batch (and a partial accumulation window) is dropped, where "
                                            "TRL trains on it."),
    "alpha": honoured("Weight of XPO's exploration term: alpha times the policy's summed log-probability of the "
                      "reference's completion, added to each pair's DPO loss. A list gives the alpha of each epoch "
                      "(the last one after it), as TRL documents it; TRL 1.0.0 indexes the list with the fractional "
                      "state.epoch, torchlike uses the epoch's index."),
    "max_length": ignored("TRL 1.0.0's XPOTrainer scores prompt and completion whole: its training_step never cuts "
                          "prompts to max_length (OnlineDPOTrainer's _forward does, XPO does not call it)."),
    "reward_weights": ignored("XPO takes a single reward function or model (TRL 1.0.0's XPOTrainer refuses more) and "
                              "uses its score unweighted."),
    "missing_eos_penalty": honoured("Subtracted from the reward of every completion (the policy's and the "
                                    "reference's) without an end token before they are compared; with a judge it "
                                    "has no effect, as in TRL 1.0.0."),
    "reward_model_path": honoured("As in TRL, the trainer does not read it (it takes reward_funcs or judge); the "
                                  "`torchlike xpo` command loads it as its reward model, as TRL's example script."),
    "judge": ignored("The name of a judge for TRL's example script; the trainer takes a judge object (judge=), and "
                     "the torchlike commands refuse TRL's judge names (each needs a remote service or llm-blender's "
                     "PairRM)."),
    "use_transformers_paged": ignored("transformers' paged generation; torchlike samples with its own JAX rollout "
                                      "engine."),
}
