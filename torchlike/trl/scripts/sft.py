"""``torchlike sft``: supervised fine-tuning from the command line, TRL's ``trl/scripts/sft.py`` on torchlike.

Example:
    ```bash
    torchlike sft --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/Capybara \\
        --learning_rate 2.0e-5 --num_train_epochs 1 --per_device_train_batch_size 2 \\
        --eos_token '<|im_end|>' --output_dir Qwen2-0.5B-SFT [--use_peft --lora_r 32 --lora_alpha 16]
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.sft_config import SFTConfig


def make_parser(prog: str | None = None) -> TrlParser:
    """The SFT script's parser: ``ScriptArguments``, ``SFTConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: SFTConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``SFTTrainer`` and save the model to ``output_dir``; returns the trainer."""
    from torchlike.trl.trainer.sft_trainer import SFTTrainer

    return run_training_script(SFTTrainer, script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
