"""torchlike.trl.rewards: TRL 1.16's built-in GRPO reward functions (``from trl.rewards import ...``).

Every function follows the GRPO calling convention (keyword arguments, ``**kwargs`` for the columns it does not use)
and imports without optional packages; the math rewards need ``math_verify`` only when called.
"""

from torchlike.trl.rewards.accuracy_rewards import accuracy_reward, get_cosine_scaled_reward, reasoning_accuracy_reward
from torchlike.trl.rewards.format_rewards import think_format_reward
from torchlike.trl.rewards.other_rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
