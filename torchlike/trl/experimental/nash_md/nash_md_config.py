"""``NashMDConfig``: TRL 1.0.0's ``trl.experimental.nash_md.NashMDConfig``, on torchlike's ``OnlineDPOConfig``.

It adds TRL 1.0.0's ``mixture_coef`` (the reference's weight in the geometric mixture the second completions are
sampled from) and the two ``OnlineDPOConfig`` fields TRL 1.0.0 had and 1.16 dropped (``judge``,
``use_transformers_paged``). What the trainer does with each field is in
``torchlike.trl.experimental.nash_md.nash_md_fields.NASH_MD_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..online_dpo.online_dpo_config import OnlineDPOConfig
from .nash_md_fields import NASH_MD_FIELD_SUPPORT


@dataclass
class NashMDConfig(OnlineDPOConfig):
    """Configuration of ``torchlike.trl.experimental.nash_md.NashMDTrainer``, with TRL 1.0.0 ``NashMDConfig``'s fields
    and defaults. All ``OnlineDPOConfig`` fields apply.

    Args:
        mixture_coef (`float` or `list[float]`, defaults to `0.5`): the reference's weight ``c`` in the mixture whose
            per-token logits are ``c * reference + (1 - c) * policy``; a list gives one value per epoch, the last for
            the epochs after it. A one-element list becomes its value.
        judge (`str`, *optional*): a judge's name for TRL 1.0.0's example script (the trainer takes ``judge``).
        use_transformers_paged (`bool`, defaults to `False`): transformers' paged generation (ignored).
    """

    _FIELD_SUPPORT = NASH_MD_FIELD_SUPPORT

    judge: str | None = None
    use_transformers_paged: bool = False
    mixture_coef: list[float] = field(default_factory=lambda: [0.5])  # TRL's type (for the parser); one value: a float

    def __post_init__(self) -> None:
        super().__post_init__()
        if hasattr(self.mixture_coef, "__len__") and len(self.mixture_coef) == 1:
            self.mixture_coef = self.mixture_coef[0]
