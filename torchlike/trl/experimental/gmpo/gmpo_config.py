"""``GMPOConfig``: TRL 1.16's ``trl.experimental.gmpo.GMPOConfig``: ``GRPOConfig`` with GMPO's clipping range.

Every field is ``GRPOConfig``'s; ``epsilon`` and ``epsilon_high`` bound the per-token *log*-ratio (the ratio's range is
``(exp(-epsilon), exp(epsilon_high))``) and ``epsilon`` defaults to GMPO's 0.4. What the trainer does with each field
is in ``torchlike.trl.experimental.gmpo.gmpo_fields.GMPO_FIELD_SUPPORT`` (over GRPO's table).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...trainer.grpo_config import GRPOConfig
from .gmpo_fields import GMPO_FIELD_SUPPORT


@dataclass
class GMPOConfig(GRPOConfig):
    """Configuration of ``torchlike.trl.experimental.gmpo.GMPOTrainer``, with TRL 1.16 ``GMPOConfig``'s fields and
    defaults: ``GRPOConfig``'s (see its documentation), and

    Args:
        epsilon (`float`, defaults to 0.4): the lower bound of the per-token importance ratio is ``exp(-epsilon)``.
        epsilon_high (`float`, *optional*): its upper bound is ``exp(epsilon_high)`` (``None``: ``epsilon``).
    """

    _FIELD_SUPPORT = GMPO_FIELD_SUPPORT

    epsilon: float = 0.4
