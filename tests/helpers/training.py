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
