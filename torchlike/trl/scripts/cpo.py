"""``torchlike cpo``: CPO from the command line, as TRL's ``examples/scripts/cpo.py`` runs
``trl.experimental.cpo`` (TRL 1.16's ``trl`` command has no ``cpo``).

The dataset is a paired preference one (``prompt``/``chosen``/``rejected``, or implicit-prompt ``chosen``/``rejected``).
CPO has no reference model, and its trainer takes no quantised model: ``--load_in_4bit``/``--load_in_8bit`` are
refused.

Example:
    ```bash
    torchlike cpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --learning_rate 8e-6 --per_device_train_batch_size 8 --loss_type simpo --cpo_alpha 0.0 \\
        --output_dir Qwen2-0.5B-SimPO
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.cpo.cpo_config import CPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script


def make_parser(prog: str | None = None) -> TrlParser:
    """The CPO script's parser: ``ScriptArguments``, ``CPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, CPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: CPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``CPOTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.experimental.cpo.cpo_trainer import CPOTrainer

    return run_training_script(CPOTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
