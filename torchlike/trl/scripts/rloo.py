"""``torchlike rloo``: RLOO from the command line, TRL's ``trl/scripts/rloo.py`` on torchlike.

Rewards are given as in ``torchlike grpo``: ``--reward_funcs`` (registry names or dotted import paths) and
``--reward_model_name_or_path``.

Example:
    ```bash
    torchlike rloo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --output_dir Qwen2-0.5B-RLOO
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.scripts.grpo import GRPOScriptArguments, load_reward_funcs
from torchlike.trl.trainer.rloo_config import RLOOConfig


@dataclass
class RLOOScriptArguments(GRPOScriptArguments):
    """TRL's ``RLOOScriptArguments``: the same fields as ``GRPOScriptArguments`` (``reward_model_name_or_path``,
    ``reward_funcs``)."""


def make_parser(prog: str | None = None) -> TrlParser:
    """The RLOO script's parser: ``RLOOScriptArguments``, ``RLOOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: RLOOScriptArguments, training_args: RLOOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``RLOOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.trainer.rloo_trainer import RLOOTrainer

    return run_training_script(RLOOTrainer, script_args, training_args, model_args, dataset_args,
                               reward_funcs=load_reward_funcs(script_args))


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
