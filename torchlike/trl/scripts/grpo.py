"""``torchlike grpo``: GRPO from the command line, TRL's ``trl/scripts/grpo.py`` on torchlike.

Reward functions are named with ``--reward_funcs``: TRL's registry names (``accuracy_reward``,
``reasoning_accuracy_reward``, ``think_format_reward``, ``get_soft_overlong_punishment``) or a dotted import path
(``my_lib.rewards.custom_reward``, importable from the working directory).

Example:
    ```bash
    torchlike grpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward think_format_reward --output_dir Qwen2-0.5B-GRPO
    ```
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.grpo_config import GRPOConfig


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """``ScriptArguments`` plus the rewards (TRL's ``GRPOScriptArguments``).

    Args:
        reward_model_name_or_path: a reward model id or path (refused by torchlike's ``GRPOTrainer``, which takes
            reward functions only).
        reward_funcs: registry names or dotted import paths of reward functions.
    """

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reward model id or path (not supported by torchlike: use --reward_funcs)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions to use: `accuracy_reward`, `reasoning_accuracy_reward`, "
                          "`think_format_reward`, `get_soft_overlong_punishment` (max_completion_len=1280, "
                          "soft_punish_cache=256), or any dotted import path (e.g. 'my_lib.rewards.custom_reward')."},
    )


def reward_registry() -> dict[str, Callable]:
    """TRL's named reward functions, with the settings TRL's script uses."""
    from torchlike.trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }


def load_reward_funcs(script_args: GRPOScriptArguments) -> list[Any]:
    """The reward model id (if any) followed by the reward functions named in ``--reward_funcs``.

    Args:
        script_args: ``reward_model_name_or_path`` and ``reward_funcs``.

    Returns:
        The list to pass as ``GRPOTrainer(reward_funcs=...)``.

    Raises:
        ValueError: a name that is neither in the registry nor a dotted path.
    """
    registry = reward_registry()
    reward_funcs: list[Any] = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    for name in script_args.reward_funcs or []:
        if name in registry:
            reward_funcs.append(registry[name])
        elif "." in name:
            module_path, attribute = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:  # as TRL: user modules are found from the working directory
                sys.path.insert(0, os.getcwd())
            reward_funcs.append(getattr(importlib.import_module(module_path), attribute))
        else:
            raise ValueError(f"Could not load reward function '{name}'. Expected one of {list(registry)} or a valid "
                             "import path.")
    return reward_funcs


def make_parser(prog: str | None = None) -> TrlParser:
    """The GRPO script's parser: ``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: GRPOScriptArguments, training_args: GRPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``GRPOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.trainer.grpo_trainer import GRPOTrainer

    return run_training_script(GRPOTrainer, script_args, training_args, model_args, dataset_args,
                               reward_funcs=load_reward_funcs(script_args))


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
