"""``torchlike gmpo``: GMPO from the command line, with the flags of TRL's GRPO script (``trl/scripts/grpo.py``) and
``GMPOConfig``'s fields.

Rewards are given as in ``torchlike grpo``: ``--reward_funcs`` (registry names or dotted import paths) and
``--reward_model_name_or_path``.

Example:
    ```bash
    torchlike gmpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --output_dir Qwen2-0.5B-GMPO
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.gmpo.gmpo_config import GMPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.scripts.grpo import GRPOScriptArguments, load_reward_funcs


def make_parser(prog: str | None = None) -> TrlParser:
    """The GMPO script's parser: ``GRPOScriptArguments``, ``GMPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((GRPOScriptArguments, GMPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: GRPOScriptArguments, training_args: GMPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``GMPOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.experimental.gmpo.gmpo_trainer import GMPOTrainer

    return run_training_script(GMPOTrainer, script_args, training_args, model_args, dataset_args,
                               reward_funcs=load_reward_funcs(script_args))


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
