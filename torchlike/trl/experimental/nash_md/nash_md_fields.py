"""What torchlike does with each field ``trl.experimental.nash_md.NashMDConfig`` (TRL 1.0.0) adds to
``OnlineDPOConfig``, and with the ``OnlineDPOConfig`` fields whose meaning Nash-MD changes.

``NashMDConfig._FIELD_SUPPORT`` is this table, laid over online DPO's (see :mod:`torchlike.field_support`).
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored
from ..online_dpo.online_dpo_fields import ONLINE_DPO_FIELD_SUPPORT
from ..xpo.xpo_fields import XPO_FIELD_SUPPORT

NASH_MD_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **ONLINE_DPO_FIELD_SUPPORT,
    "per_device_train_batch_size": honoured("Prompts per data-parallel shard and micro-batch, as in TRL: each gets "
                                            "one completion from the policy, which the loss trains on, and one from "
                                            "the policy/reference geometric mixture, which it is judged against. "
                                            "An epoch's last partial batch (and a partial accumulation window) is "
                                            "dropped, where TRL trains on it."),
    "mixture_coef": honoured("The reference's weight c in the geometric mixture the second completion of each "
                             "prompt is sampled from (per-token log_softmax(c * reference + (1 - c) * policy), with "
                             "the static rollout engine). A list gives the coefficient of each epoch (the last one "
                             "after it), as TRL documents it; TRL 1.0.0 indexes the list with the fractional "
                             "state.epoch, torchlike uses the epoch's index."),
    "beta": honoured("Weight of the KL term of Nash-MD's loss (beta times the policy's summed log-probability "
                     "weighted by the detached log-ratio to the reference). A list gives the beta of each epoch (the "
                     "last one after it), indexed by the epoch's index as for mixture_coef."),
    "loss_type": ignored("Nash-MD's loss is its REINFORCE score and KL terms whatever loss_type says (TRL 1.0.0's "
                         "NashMDTrainer never reads it); a value other than 'sigmoid' or 'ipo' is still refused at "
                         "construction, as by OnlineDPOTrainer."),
    "max_length": ignored("TRL 1.0.0's NashMDTrainer scores prompt and completion whole: its training_step never "
                          "cuts prompts to max_length."),
    "reward_weights": ignored("Nash-MD takes a single reward function or model (TRL 1.0.0's NashMDTrainer refuses "
                              "more) and uses its score unweighted."),
    "missing_eos_penalty": honoured("Subtracted from the reward of every completion (the policy's and the "
                                    "mixture's) without an end token before the probability that the policy's wins "
                                    "is taken; with a judge it has no effect, as in TRL 1.0.0."),
    "reward_model_path": honoured("As in TRL, the trainer does not read it (it takes reward_funcs or judge); the "
                                  "`torchlike nash_md` command loads it as its reward model, as TRL's example script."),
    "judge": XPO_FIELD_SUPPORT["judge"],
    "use_transformers_paged": XPO_FIELD_SUPPORT["use_transformers_paged"],
}
