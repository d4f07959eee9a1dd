"""CPOTrainer (``trl.experimental.cpo``): TRL's numbers step for step for each loss type, its checks and messages."""

from __future__ import annotations

import numpy as np
import pytest
import trl.experimental.cpo as trl_cpo

from tests import tiny
from torchlike.trl.experimental.cpo import CPOConfig, CPOTrainer

DATA = [{"prompt": "the quick brown", "chosen": " fox jumps over the lazy dog", "rejected": " dog"},
        {"prompt": "one two", "chosen": " three four five", "rejected": " hello world, this is a tiny tokenizer"},
        {"prompt": "hello world, this is", "chosen": " a tiny tokenizer", "rejected": " one two three four"},
        {"prompt": "seven eight", "chosen": " nine ten", "rejected": " the lazy fox"}] * 4
METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss")


def comparison_settings(**overrides) -> dict:
    """Both trainers' settings: gradient accumulation, max_length=12 (several responses are cut), a warmup, weight
    decay and clipping (max_grad_norm below every step's norm); float32 on both sides (bf16 off)."""
    values = dict(max_length=12, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                  learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.01, adam_epsilon=1e-4,
                  logging_steps=1, seed=0, bf16=False, beta=0.2, report_to="none", save_strategy="no")
    return {**values, **overrides}


CASES = {
    "sigmoid, label smoothing": dict(loss_type="sigmoid", label_smoothing=0.1),
    "hinge": dict(loss_type="hinge"),
    "ipo": dict(loss_type="ipo"),
    "simpo, cpo_alpha 0.5": dict(loss_type="simpo", simpo_gamma=0.3, cpo_alpha=0.5),
    "alphapo (simpo, no NLL, AlphaPO rewards)": dict(loss_type="alphapo", alpha=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpo_losses_metrics_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path, case):
    path = tiny_checkpoints.path("qwen2")
    settings = comparison_settings(**CASES[case])
    theirs, their_params, _ = tiny.run_trl_pairwise(trl_cpo.CPOTrainer, trl_cpo.CPOConfig, path, tokenizer_dir,
                                                 tmp_path / "trl", DATA, settings)
    ours, params, _ = tiny.run_torchlike_pairwise(CPOTrainer, CPOConfig, path, tokenizer_dir, tmp_path / "ours", DATA,
                                               settings)
    tiny.compare_pairwise_logs(ours, theirs, METRICS, settings["max_grad_norm"])
    assert set(params) == set(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
