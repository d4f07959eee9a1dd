"""``torchlike orpo``: ORPO from the command line, as TRL's ``examples/scripts/orpo.py`` runs
``trl.experimental.orpo`` (TRL 1.16's ``trl`` command has no ``orpo``).

The dataset is a paired preference one (``prompt``/``chosen``/``rejected``, or implicit-prompt ``chosen``/``rejected``).
ORPO has no reference model, and its trainer takes no quantised model: ``--load_in_4bit``/``--load_in_8bit`` are
refused.

Example:
    ```bash
    torchlike orpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --learning_rate 8e-6 --per_device_train_batch_size 8 --max_length 1024 --output_dir Qwen2-0.5B-ORPO
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.orpo.orpo_config import ORPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script


def make_parser(prog: str | None = None) -> TrlParser:
    """The ORPO script's parser: ``ScriptArguments``, ``ORPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, ORPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: ORPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``ORPOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.experimental.orpo.orpo_trainer import ORPOTrainer

    return run_training_script(ORPOTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
