"""``XPOConfig``: TRL 1.0.0's ``trl.experimental.xpo.XPOConfig``, on torchlike's ``OnlineDPOConfig``.

It adds TRL 1.0.0's ``alpha`` (the weight of XPO's exploration term) and the two ``OnlineDPOConfig`` fields TRL 1.0.0
had and 1.16 dropped (``judge``, ``use_transformers_paged``). What the trainer does with each field is in
``torchlike.trl.experimental.xpo.xpo_fields.XPO_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..online_dpo.online_dpo_config import OnlineDPOConfig
from .xpo_fields import XPO_FIELD_SUPPORT


@dataclass
class XPOConfig(OnlineDPOConfig):
    """Configuration of ``torchlike.trl.experimental.xpo.XPOTrainer``, with TRL 1.0.0 ``XPOConfig``'s fields and
    defaults. All ``OnlineDPOConfig`` fields apply.

    Args:
        alpha (`float` or `list[float]`, defaults to `1e-5`): weight of the XPO term (``alpha`` times the policy's
            summed log-probability of the reference's completion); a list gives one value per epoch, the last for the
            epochs after it. A one-element list becomes its value.
        judge (`str`, *optional*): a judge's name for TRL 1.0.0's example script (the trainer takes ``judge``).
        use_transformers_paged (`bool`, defaults to `False`): transformers' paged generation (ignored).
    """

    _FIELD_SUPPORT = XPO_FIELD_SUPPORT

    judge: str | None = None
    use_transformers_paged: bool = False
    alpha: list[float] = field(default_factory=lambda: [1e-5])  # TRL's type (for the parser); one value: a float

    def __post_init__(self) -> None:
        super().__post_init__()
        if hasattr(self.alpha, "__len__") and len(self.alpha) == 1:
            self.alpha = self.alpha[0]
