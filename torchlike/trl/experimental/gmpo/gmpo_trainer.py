"""``GMPOTrainer``: TRL 1.16's Geometric-Mean Policy Optimization trainer (``trl.experimental.gmpo``), and
:class:`GMPO`, the algorithm it trains with on torchlike's policy-gradient loop.

GMPO (https://huggingface.co/papers/2507.20673) is GRPO with another loss: the sequence's weight is the geometric mean
of its token ratios, each clipped in log space (``adapters.losses.gmpo.gmpo_step_loss``). Sampling, rewards,
group-relative advantages, old and reference log-probabilities are GRPO's (:class:`~torchlike.trl.trainer.grpo_trainer.
GRPO`); each micro-batch's loss is a mean over its sequences, which gradient accumulation averages, as TRL divides it
by the accumulation steps whatever ``loss_type`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ....adapters.losses import gmpo as gmpo_losses
from ....adapters.losses import grpo as grpo_losses
from ...trainer.grpo_trainer import GRPO, GRPOTrainer
from ...trainer.policy_gradient_trainer import LogProbs
from .gmpo_config import GMPOConfig

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from ....adapters.families.base import Family
    from ...online.entropy_control import AdaptiveEntropyControl

__all__ = ["GMPO", "GMPOTrainer"]


class GMPO(GRPO):
    """TRL 1.16's GMPO on the policy-gradient loop: GRPO's rollout and advantages, GMPO's step loss."""

    args: GMPOConfig

    def entropy_control(self) -> AdaptiveEntropyControl | None:
        """None: GMPO's loss has no entropy bonus, adaptive or fixed (TRL's GMPO loss reads neither)."""
        return None

    def step_columns(self, batch: dict[str, np.ndarray], log_probs: LogProbs) -> None:
        """GRPO's columns (old and reference log-probs by TRL's rule), each micro-batch weighing 1: its loss is a
        mean over its sequences."""
        super().step_columns(batch, log_probs)
        batch["step_weight"] = np.ones(len(batch["completion_mask"]), np.float32)

    def step_loss(self, family: Family, temperature: float, decoder_dtype: DTypeLike | None,
                  router_aux_loss_coef: float) -> Callable:
        """TRL's GMPO loss (:func:`adapters.losses.gmpo.gmpo_step_loss`); no router loss (TRL's GMPO adds none)."""
        settings = grpo_losses.GRPOLossSettings.from_config(self.args, temperature=temperature,
                                                            compute_dtype=decoder_dtype, router_aux_loss_coef=0.0)
        return gmpo_losses.gmpo_step_loss(family, settings)


class GMPOTrainer(GRPOTrainer):
    """``trl.experimental.gmpo.GMPOTrainer``: ``GRPOTrainer`` (every argument of its constructor) training with the
    :class:`GMPO` loss; the default ``args`` is ``GMPOConfig("<model>-GMPO")``.

    Example:

    ```python
    >>> from torchlike.trl.experimental.gmpo import GMPOConfig, GMPOTrainer
    >>> def short(completions, **kwargs):
    ...     return [-len(text) / 100 for text in completions]
    >>> trainer = GMPOTrainer("path/to/qwen2", reward_funcs=short, train_dataset=[{"prompt": "Hi"}] * 64,
    ...                       args=GMPOConfig("out", max_completion_length=32))
    >>> trainer.train()
    ```
    """

    algorithm_class = GMPO
    _config_class = GMPOConfig
    _output_suffix = "GMPO"
    _tag_names = ["trl", "gmpo"]
