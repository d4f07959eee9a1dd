"""SFTTrainer equals the real ``trl.SFTTrainer`` step for step, through the data path.

A prompt-completion text dataset of unequal lengths is tokenised, masked (completion-only loss), padded and batched
by each library itself; gradient accumulation, warmup, weight decay and active gradient clipping are on. Per-step
loss and grad norm must agree to 1e-4: close enough that ignoring any one of those settings fails the test.
"""

from __future__ import annotations

import numpy as np

import torchlike
from tests.helpers.data import prompt_completion_data
from tests.helpers.logs import logged
from torchlike.trl import SFTConfig, SFTTrainer

# bf16 off: the comparison is in float32 on both sides (gradient checkpointing stays at TRL's default, on).
# Clipping is active (grad norms are well above max_grad_norm); Adam's epsilon sits above float noise, so entries
# whose gradient is ~0 do not take lr-sized steps of random sign in one library and not the other.
SETTINGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=20, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=4, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4,
                max_length=32, logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")


def test_sft_matches_trl_step_for_step_on_padded_prompt_completion_data(tiny_checkpoints, tokenizer_dir, tmp_path):
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    path = tiny_checkpoints.path("qwen2")
    data = prompt_completion_data(48)
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **SETTINGS),
        train_dataset=datasets.Dataset.from_list(data),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()

    trainer = SFTTrainer(model=str(path), args=SFTConfig(output_dir=str(tmp_path / "ours"),
                                                         train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=data, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()

    expected, ours = reference.state.log_history, trainer.state.log_history
    assert len(logged(ours, "loss")) == len(logged(expected, "loss")) == 20
    assert min(logged(expected, "grad_norm")) > 2 * SETTINGS["max_grad_norm"]  # clipping is active every step
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == 20, key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    # TRL's eval metrics (metric_for_best_model may name them): means over the eval batches of 8 examples.
    held_out = prompt_completion_data(16, seed=1)
    expected_eval = reference.evaluate(eval_dataset=datasets.Dataset.from_list(held_out))
    ours_eval = trainer.evaluate(eval_dataset=held_out)
    for key in ("eval_entropy", "eval_mean_token_accuracy"):
        np.testing.assert_allclose(ours_eval[key], expected_eval[key], rtol=1e-4, err_msg=key)
