"""``torchlike kto``: KTO from the command line, TRL's ``trl/scripts/kto.py`` on torchlike.

Example:
    ```bash
    torchlike kto --model_name_or_path trl-lib/qwen1.5-1.8b-sft --dataset_name trl-lib/kto-mix-14k \\
        --per_device_train_batch_size 16 --learning_rate 5e-7 --output_dir kto-aligned-model
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.kto_config import KTOConfig


def make_parser(prog: str | None = None) -> TrlParser:
    """The KTO script's parser: ``ScriptArguments``, ``KTOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: KTOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``KTOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.trainer.kto_trainer import KTOTrainer

    return run_training_script(KTOTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
