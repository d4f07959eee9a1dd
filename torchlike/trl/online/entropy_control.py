"""TRL's adaptive entropy control (``GRPOConfig.use_adaptive_entropy``, Skywork-OR1): the coefficient of GRPO's entropy
bonus, moved after every optimizer step towards keeping the completions' entropy at ``entropy_target``, and the file a
checkpoint keeps it in.

As ``trl.GRPOTrainer``: the coefficient an optimizer step applies is ``entropy_coef`` when the entropy measured at the
end of the previous step is at or below ``entropy_target``, else 0 (nothing is measured before the first step, so it
applies 0); after the step, the step's entropy (summed over the entropy bonus's tokens of all its micro-batches,
divided by their count) moves ``entropy_coef`` by ``entropy_coef_delta``, up when at or below the target and down
otherwise, within ``[entropy_coef_min, entropy_coef_max]``. The state is TRL's ``entropy_ctrl_state.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..trainer.grpo_config import GRPOConfig

__all__ = ["STATE_FILE", "AdaptiveEntropyControl"]

#: The controller's file in a ``checkpoint-<step>`` folder (TRL's name and keys).
STATE_FILE = "entropy_ctrl_state.json"


@dataclasses.dataclass
class AdaptiveEntropyControl:
    """The adaptive entropy controller's settings (``GRPOConfig`` fields) and state.

    Args:
        target: ``entropy_target``, in nats.
        delta: ``entropy_coef_delta``.
        minimum: ``entropy_coef_min``.
        maximum: ``entropy_coef_max``.
        coefficient: the current ``entropy_coef`` (initially the config's).
        last_world_entropy: the entropy measured by the last optimizer step (``inf`` before the first).
    """

    target: float
    delta: float
    minimum: float
    maximum: float
    coefficient: float
    last_world_entropy: float = math.inf

    @classmethod
    def from_config(cls, args: GRPOConfig) -> AdaptiveEntropyControl:
        """The controller of ``args`` before training (``args.use_adaptive_entropy`` is not checked here)."""
        return cls(target=args.entropy_target, delta=args.entropy_coef_delta, minimum=args.entropy_coef_min,
                   maximum=args.entropy_coef_max, coefficient=args.entropy_coef)

    @property
    def applied_coefficient(self) -> float:
        """The coefficient the next optimizer step (and an evaluation) applies: ``coefficient`` when the last measured
        entropy is at or below ``target``, else 0."""
        return self.coefficient if self.last_world_entropy <= self.target else 0.0

    def update(self, entropy_sum: float, token_count: float) -> None:
        """Takes one optimizer step's measurement: ``entropy = entropy_sum / max(token_count, 1)`` over the tokens of
        its micro-batches (every process's); ``coefficient`` becomes ``min(coefficient + delta, maximum)`` when
        ``entropy <= target``, else ``max(coefficient - delta, minimum)``."""
        entropy = entropy_sum / max(token_count, 1.0)
        if entropy <= self.target:
            self.coefficient = min(self.coefficient + self.delta, self.maximum)
        else:
            self.coefficient = max(self.coefficient - self.delta, self.minimum)
        self.last_world_entropy = entropy

    def save(self, folder: str | Path) -> None:
        """Writes :data:`STATE_FILE` into a checkpoint folder: ``{"entropy_coef", "last_world_entropy"}``."""
        with open(Path(folder) / STATE_FILE, "w") as file:
            json.dump({"entropy_coef": self.coefficient, "last_world_entropy": self.last_world_entropy}, file)

    def load(self, folder: str | Path) -> None:
        """Takes the state of a checkpoint folder's :data:`STATE_FILE`; a folder without one (saved without adaptive
        control) leaves the state as it is, as in TRL."""
        path = Path(folder) / STATE_FILE
        if path.exists():
            state = json.loads(path.read_text())
            self.coefficient = state["entropy_coef"]
            self.last_world_entropy = state["last_world_entropy"]
