"""What torchlike does with each field ``trl.experimental.cpo.CPOConfig`` adds to ``TrainingArguments``, and with
the ``TrainingArguments`` fields whose meaning CPO changes.

``CPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
the rows CPO shares with ORPO are ORPO's. A test holds it against the fields of the real
``trl.experimental.cpo.CPOConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured
from ..orpo.orpo_fields import ORPO_FIELD_SUPPORT

_SHARED_WITH_ORPO = ("neftune_noise_alpha", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "remove_unused_columns", "model_init_kwargs", "trust_remote_code", "disable_dropout",
                     "is_encoder_decoder", "dataset_num_proc", "max_length", "max_completion_length",
                     "generate_during_eval")

CPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    **{name: ORPO_FIELD_SUPPORT[name] for name in _SHARED_WITH_ORPO},
    # --- loss ---
    "loss_type": honoured("sigmoid, hinge, ipo and simpo, computed as TRL 1.16 does (torchlike.adapters.losses.cpo); "
                          "'alphapo' becomes simpo with cpo_alpha=0, as TRL's __post_init__ does; ipo and simpo "
                          "average the completion log-probabilities, the others sum them."),
    "beta": honoured("The temperature beta of the sigmoid, hinge and simpo losses (tau for ipo); rewards/* metrics "
                     "are beta x the (transformed) log-probabilities."),
    "label_smoothing": honoured("eps of the sigmoid and simpo losses; hinge and ipo ignore it, with TRL's warning."),
    "cpo_alpha": honoured("Weight of the behaviour-cloning term, the chosen responses' token-mean NLL (0: not "
                          "computed, nll_loss logs 0)."),
    "simpo_gamma": honoured("SimPO's target margin: loss_type='simpo' subtracts simpo_gamma / beta from the "
                            "log-probability difference."),
    "alpha": honoured("AlphaPO: with alpha != 0 the rewards of every loss type are (1 - p^-alpha) / alpha, p the "
                      "policy's probability of the response."),
}
