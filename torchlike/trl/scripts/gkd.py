"""``torchlike gkd``: generalized knowledge distillation from the command line, as TRL's ``examples/scripts/gkd.py``
runs ``trl.experimental.gkd`` (TRL 1.16's ``trl`` command has no ``gkd``).

The teacher is ``--teacher_model_name_or_path`` (a ``GKDConfig`` field), loaded with the model's revision, dtype and
attention settings under the user's ``teacher_model_init_kwargs``, as TRL's script does. The dataset's rows are
``messages`` conversations whose last message is the completion, rendered with the tokenizer's chat template
(``--chat_template_path`` replaces it).

Example:
    ```bash
    torchlike gkd --model_name_or_path Qwen/Qwen2-0.5B-Instruct --teacher_model_name_or_path Qwen/Qwen2-1.5B-Instruct \\
        --dataset_name trl-lib/chatbot_arena_completions --learning_rate 2e-5 --per_device_train_batch_size 4 \\
        --output_dir gkd-model
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.gkd.gkd_config import GKDConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script


def make_parser(prog: str | None = None) -> TrlParser:
    """The GKD script's parser: ``ScriptArguments``, ``GKDConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, GKDConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: GKDConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``GKDTrainer`` against the teacher of ``--teacher_model_name_or_path`` and save the student to
    ``output_dir``; returns the trainer.

    Raises:
        ValueError: no ``--teacher_model_name_or_path``.
    """
    from torchlike.trl.experimental.gkd.gkd_trainer import GKDTrainer

    if training_args.teacher_model_name_or_path is None:
        raise ValueError("GKD distils a teacher into the model: set it with `--teacher_model_name_or_path`.")
    teacher_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                               attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    teacher_init_kwargs.update(training_args.teacher_model_init_kwargs or {})
    training_args.teacher_model_init_kwargs = teacher_init_kwargs
    return run_training_script(GKDTrainer, script_args, training_args, model_args, dataset_args,
                               teacher_model=training_args.teacher_model_name_or_path)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
