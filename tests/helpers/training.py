"""The ``TrainingArguments`` of the tests' short ``Trainer`` runs: float32, six steps, a constant learning rate, a
loss logged every step, nothing saved or reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torchlike


def training_arguments(tmp_path: Path, **overrides: Any) -> torchlike.TrainingArguments:
    """Six float32 steps of batch 4 at a constant learning rate 1e-3 into ``tmp_path/out``, ``overrides`` over
    them."""
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  bf16=False, gradient_checkpointing=False, max_grad_norm=1.0, weight_decay=0.0)
    values.update(overrides)
    return torchlike.TrainingArguments(**values)


def sft_losses_with_the_default_config(model_path: Path, tokenizer_dir: Path, output_dir: Path) -> list[float]:
    """Six SFT steps of a tiny model with TRL's defaults (bf16 and gradient checkpointing on, checked) on two short
    prompt-completion examples: the logged losses."""
    from torchlike.trl import SFTConfig, SFTTrainer

    data = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog"},
            {"prompt": "one two", "completion": " three four five six"}] * 4
    args = SFTConfig(output_dir=str(output_dir), max_length=32, per_device_train_batch_size=4, max_steps=6,
                     learning_rate=1e-2, logging_steps=2, report_to="none", save_strategy="no")
    assert args.bf16 and args.gradient_checkpointing
    trainer = SFTTrainer(model=str(model_path), args=args, train_dataset=data,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
