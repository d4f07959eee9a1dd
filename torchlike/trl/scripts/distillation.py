"""``torchlike distillation``: on-policy distillation from the command line, TRL's ``trl/scripts/distillation.py``
on torchlike.

Example:
    ```bash
    torchlike distillation --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --dataset_name trl-lib/chatbot_arena_completions \\
        --output_dir Qwen2.5-0.5B-Distilled
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.trainer.distillation_config import DistillationConfig


def make_parser(prog: str | None = None) -> TrlParser:
    """The distillation script's parser: ``ScriptArguments``, ``DistillationConfig``, ``ModelConfig``,
    ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, DistillationConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: DistillationConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``DistillationTrainer`` (the teacher from ``--teacher_model_name_or_path``, loaded with
    ``teacher_model_init_kwargs`` over the model's revision, dtype and attention settings, as TRL's script does) and
    save the student to ``output_dir``; returns the trainer.

    Raises:
        ValueError: no ``--teacher_model_name_or_path``.
    """
    from torchlike.trl.trainer.distillation_trainer import DistillationTrainer

    if training_args.teacher_model_name_or_path is None:
        raise ValueError("A teacher model is required for distillation training. Set it with "
                         "`--teacher_model_name_or_path`.")
    teacher_init_kwargs = dict(revision=training_args.teacher_model_revision,
                               trust_remote_code=training_args.trust_remote_code,
                               attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    teacher_init_kwargs.update(training_args.teacher_model_init_kwargs or {})
    training_args.teacher_model_init_kwargs = teacher_init_kwargs
    return run_training_script(DistillationTrainer, script_args, training_args, model_args, dataset_args,
                               teacher_model=training_args.teacher_model_name_or_path)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
