"""``torchlike reward``: reward-model training from the command line, TRL's ``trl/scripts/reward.py`` on torchlike.

Example:
    ```bash
    torchlike reward --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --per_device_train_batch_size 8 --output_dir Qwen2-0.5B-Reward
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.reward_config import RewardConfig


def make_parser(prog: str | None = None) -> TrlParser:
    """The reward script's parser: ``ScriptArguments``, ``RewardConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: RewardConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``RewardTrainer`` and save the classifier to ``output_dir``; returns the trainer."""
    from torchlike.trl.trainer.reward_trainer import RewardTrainer

    return run_training_script(RewardTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
