"""``torchlike dpo``: direct preference optimisation from the command line, TRL's ``trl/scripts/dpo.py`` on
torchlike.

Example:
    ```bash
    torchlike dpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --learning_rate 5.0e-7 --per_device_train_batch_size 2 --max_steps 1000 --output_dir Qwen2-0.5B-DPO
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.dpo_config import DPOConfig


def make_parser(prog: str | None = None) -> TrlParser:
    """The DPO script's parser: ``ScriptArguments``, ``DPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: DPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``DPOTrainer`` and save the model to ``output_dir``; returns the trainer.

    ``--ignore_bias_buffers`` (a torch DDP workaround) has nothing to do on JAX and is ignored.
    """
    from torchlike.trl.trainer.dpo_trainer import DPOTrainer

    return run_training_script(DPOTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
