"""GMPOTrainer equals the real ``trl.experimental.gmpo.GMPOTrainer`` step for step, on the same completions
(``tiny.scripted_rollout`` given to both, the rows of each generation batch kept in order, as in
``tests/test_grpo_vs_trl.py``): loss, grad norm, rewards, every logged metric, advantages and the final parameters."""

from __future__ import annotations

import numpy as np
import pytest

from tests import tiny
from tests.helpers.logs import logged

# One run moves everything GMPO's loss reads: a narrow asymmetric log-space clipping range (so tokens are clipped),
# old log-probs (two passes per generation batch), gradient accumulation (each micro-batch's mean loss divided by it
# whatever loss_type says), a reference's KL and the high-entropy token mask. (GMPO's default range is checked with
# the config below.)
CASES = {
    "narrow clip, beta 0.04, top 60% entropy tokens, 2 iterations, accumulation 2": dict(
        epsilon=0.02, epsilon_high=0.01, beta=0.04, top_entropy_quantile=0.6, num_iterations=2,
        gradient_accumulation_steps=2),
}
METRICS = ("loss", "grad_norm", "reward", "reward_std", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")


@pytest.mark.parametrize("case", list(CASES))
def test_gmpo_matches_trl_step_for_step_on_the_same_completions(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                 monkeypatch, case):
    case = CASES[case]
    path = tiny_checkpoints.path("qwen2")
    theirs = tiny.trl_grpo_trainer(path, tokenizer_dir, tmp_path / "trl", monkeypatch, algorithm="gmpo", **case)
    expected_history, expected_advantages, expected_params = tiny.train_trl_recording_advantages(theirs,
                                                                                                 tmp_path / "trl")
    ours = tiny.torchlike_grpo_trainer(path, tokenizer_dir, tmp_path / "ours", algorithm="gmpo", **case)
    history, advantages, params = tiny.train_torchlike_recording_advantages(ours, tmp_path / "ours")

    assert len(logged(history, "loss")) == len(logged(expected_history, "loss")) == 3
    logged_keys = set(expected_history[0])
    assert set(METRICS) - {"kl"} <= logged_keys and ("kl" in logged_keys) == ("beta" in case)
    for key in METRICS:
        if key not in expected_history[0]:
            assert key not in history[0], key
            continue
        np.testing.assert_allclose(logged(history, key), logged(expected_history, key), rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    if "epsilon_high" in case:  # the narrow range clips, so the clipping metrics are not all zero
        assert max(logged(expected_history, "clip_ratio/region_mean")) > 0
    for ours_advantages, their_advantages in zip(advantages, expected_advantages, strict=True):
        np.testing.assert_allclose(ours_advantages, their_advantages, rtol=1e-4, atol=1e-6)
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


def test_gmpo_has_trls_defaults_and_its_own_tags(tiny_checkpoints, tokenizer_dir, tmp_path, monkeypatch):
    import trl.experimental.gmpo as trl_gmpo

    import torchlike
    from torchlike.trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    assert GMPOConfig(str(tmp_path)).epsilon == trl_gmpo.GMPOConfig(str(tmp_path), use_cpu=True).epsilon == 0.4
    trainer = GMPOTrainer(str(tiny_checkpoints.path("qwen2")), reward_funcs=tiny.token_reward,
                          train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    assert trainer.args.output_dir.endswith("-GMPO")
    assert {"trl", "gmpo"} <= set(trainer.model.model_tags)
    assert trainer.epsilon_low == 0.4 and trainer.epsilon_high == 0.4
