"""``torchlike gold``: General Online Logit Distillation from the command line, as TRL's ``examples/scripts/gold.py``
runs ``trl.experimental.gold`` (TRL 1.16's ``trl`` command has no ``gold``).

The teacher is ``--teacher_model_name_or_path`` (a ``GOLDConfig`` field), loaded with its own revision
(``--teacher_model_revision``) and the model's dtype and attention settings under the user's
``teacher_model_init_kwargs``, as TRL's script does; with ``--use_uld_loss`` its tokenizer defaults to the teacher's
path. The dataset's rows are ``messages`` conversations or ``prompt``/``completion`` pairs. With an ``eval_strategy``,
the test split (or ``validation``, or ``dev``) is evaluated and the completions of 8 of its prompts are logged
(``LogCompletionsCallback``).

Example:
    ```bash
    torchlike gold --model_name_or_path meta-llama/Llama-3.2-1B-Instruct \\
        --teacher_model_name_or_path Qwen/Qwen2-1.5B-Instruct --use_uld_loss \\
        --dataset_name trl-lib/chatbot_arena_completions --learning_rate 2e-5 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 8 --output_dir gold-model
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.gold.gold_config import GOLDConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser


def make_parser(prog: str | None = None) -> TrlParser:
    """The GOLD script's parser: ``ScriptArguments``, ``GOLDConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, GOLDConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: ScriptArguments, training_args: GOLDConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``GOLDTrainer`` against the teacher of ``--teacher_model_name_or_path`` and save the student to
    ``output_dir``; returns the trainer.

    Raises:
        ValueError: no ``--model_name_or_path`` or no ``--teacher_model_name_or_path``.
    """
    from transformers import GenerationConfig

    from torchlike import AutoTokenizer
    from torchlike.trl.experimental.gold.gold_trainer import GOLDTrainer
    from torchlike.trl.script_utils import get_peft_config
    from torchlike.trl.scripts.common import load_script_dataset
    from torchlike.trl.trainer.callbacks import LogCompletionsCallback

    if model_args.model_name_or_path is None:
        raise ValueError("`model_name_or_path` is required.")
    if training_args.teacher_model_name_or_path is None:
        raise ValueError("GOLD distils a teacher into the model: set it with `--teacher_model_name_or_path`.")
    training_args.model_init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype,
                                       "attn_implementation": model_args.attn_implementation,
                                       **(training_args.model_init_kwargs or {})}
    if training_args.teacher_tokenizer_name_or_path is None and training_args.use_uld_loss:
        training_args.teacher_tokenizer_name_or_path = training_args.teacher_model_name_or_path
    teacher_init_kwargs = {"revision": training_args.teacher_model_revision, "dtype": model_args.dtype,
                           "attn_implementation": model_args.attn_implementation}
    teacher_init_kwargs.update(training_args.teacher_model_init_kwargs or {})
    training_args.teacher_model_init_kwargs = teacher_init_kwargs
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_script_dataset(script_args, dataset_args)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        split = next((name for name in (script_args.dataset_test_split, "validation", "dev") if name in dataset), None)
        eval_dataset = dataset[split] if split is not None else None
    trainer = GOLDTrainer(model=model_args.model_name_or_path, teacher_model=training_args.teacher_model_name_or_path,
                          args=training_args, train_dataset=dataset[script_args.dataset_train_split],
                          eval_dataset=eval_dataset, processing_class=tokenizer,
                          peft_config=get_peft_config(model_args))
    if training_args.eval_strategy != "no":
        generation_config = GenerationConfig(max_new_tokens=training_args.max_completion_length, do_sample=True,
                                             temperature=training_args.temperature)
        trainer.add_callback(LogCompletionsCallback(trainer, generation_config, num_prompts=8))
    trainer.train()
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
