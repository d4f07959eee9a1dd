"""GRPOTrainer equals the real ``trl.GRPOTrainer`` step for step.

Both trainers get the same completions for the same prompts through TRL's ``rollout_func`` (one function given to
both), and both keep the rows of a generation batch in order (TRL's ``shuffle_sequence_dict`` and torchlike's
``_shuffled`` replaced by the identity), so the comparison is free of sampling noise: per-step loss, grad norm,
rewards, advantages and the parameters after the run must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import tiny
from tests.helpers.logs import evaluated, logged

# Each case varies what TRL's loss and batching depend on; together they cover every loss_type, every scale_rewards
# mode, gradient accumulation, steps_per_generation != gradient_accumulation_steps (dividing or not), num_iterations,
# a KL reference, mask_truncated_completions and the entropy bonus with and without the high-entropy token mask.
CASES = {
    "dapo, accumulation 2": dict(loss_type="dapo", gradient_accumulation_steps=2),
    "grpo, 3 steps per generation of 2 (old log-probs)": dict(loss_type="grpo", gradient_accumulation_steps=3,
                                                             steps_per_generation=2, scale_rewards="batch"),
    "bnpo, generation every 4 micro-batches, accumulation 2": dict(loss_type="bnpo", gradient_accumulation_steps=2,
                                                                    steps_per_generation=4, scale_rewards="none"),
    "dr_grpo, 2 iterations": dict(loss_type="dr_grpo", num_iterations=2),
    "cispo, beta 0.04 with a reference": dict(loss_type="cispo", beta=0.04, gradient_accumulation_steps=2),
    "sapo, truncated completions masked": dict(loss_type="sapo", mask_truncated_completions=True),
    "luspo, one generation per micro-batch": dict(loss_type="luspo", gradient_accumulation_steps=2,
                                                 steps_per_generation=1),
    "vespo, 2 iterations, accumulation 2": dict(loss_type="vespo", num_iterations=2, gradient_accumulation_steps=2,
                                               epsilon_high=0.28),
    "dapo, entropy bonus on the top 40% entropy tokens, accumulation 2": dict(
        loss_type="dapo", gradient_accumulation_steps=2, entropy_coef=0.05, top_entropy_quantile=0.4),
    "grpo, entropy bonus, 3 steps per generation of 2": dict(loss_type="grpo", gradient_accumulation_steps=3,
                                                            steps_per_generation=2, entropy_coef=0.1),
    # TRL adds a mixture-of-experts model's router loss, divided by the accumulation steps (here a token-summed loss).
    "dapo, Qwen3-MoE with its router loss, accumulation 2": dict(model="qwen3_moe", loss_type="dapo",
                                                                gradient_accumulation_steps=2,
                                                                router_aux_loss_coef=0.05),
    # The native decoder: a dense family (Mistral, sliding window) and a mixture-of-experts one (GPT-OSS, its router
    # loss).
    "grpo, Mistral, 3 steps per generation of 2": dict(model="mistral", loss_type="grpo",
                                                       gradient_accumulation_steps=3, steps_per_generation=2),
    "dapo, GPT-OSS with its router loss, accumulation 2": dict(model="gpt_oss", loss_type="dapo",
                                                              gradient_accumulation_steps=2,
                                                              router_aux_loss_coef=0.05),
    # The hybrids: Qwen3.5 (gated DeltaNet layers, a reference's KL) and Qwen3.5-MoE with its router loss. Both step
    # at 1e-3. At 1e-2 the MoE case's losses still agree to 1e-4 but later grad norms move by up to 0.4%, the tiny
    # routers' top-2 choices being near ties that float rounding can swap after large updates. At 1e-2 the dense
    # case's second iteration is far from its reference (a KL term of 6.15, grad norm 366), where exp(ref - logp)
    # amplifies float rounding: its third grad norm came out 2.4e-4 apart on one CPU and within 1e-4 on another.
    "grpo, Qwen3.5, beta 0.04, 2 iterations": dict(model="qwen3_5", loss_type="grpo", beta=0.04, num_iterations=2,
                                                   learning_rate=1e-3),
    "dapo, Qwen3.5-MoE with its router loss, accumulation 2": dict(model="qwen3_5_moe", loss_type="dapo",
                                                                  gradient_accumulation_steps=2,
                                                                  router_aux_loss_coef=0.05, learning_rate=1e-3),
}


def run_trl(path, tokenizer_path, output_dir, monkeypatch, **case):
    trainer = tiny.trl_grpo_trainer(path, tokenizer_path, output_dir, monkeypatch, **case)
    return tiny.train_trl_recording_advantages(trainer, output_dir)


def run_torchlike(path, tokenizer_path, output_dir, **case):
    trainer = tiny.torchlike_grpo_trainer(path, tokenizer_path, output_dir, **case)
    return tiny.train_torchlike_recording_advantages(trainer, output_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_matches_trl_step_for_step_on_the_same_completions(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                 monkeypatch, case):
    case = dict(CASES[case])
    path = tiny_checkpoints.path(case.pop("model", "qwen2"))
    expected_history, expected_advantages, expected_params = run_trl(path, tokenizer_dir, tmp_path / "trl",
                                                                     monkeypatch, **case)
    history, advantages, params = run_torchlike(path, tokenizer_dir, tmp_path / "ours", **case)

    assert len(logged(history, "loss")) == len(logged(expected_history, "loss")) == 3
    assert ("aux_loss" in expected_history[0]) == ("router_aux_loss_coef" in case)
    for key in ("loss", "grad_norm", "reward", "reward_std", "entropy", "policy_loss", "entropy_coef", "aux_loss"):
        if key not in expected_history[0]:
            assert key not in history[0], key
            continue
        np.testing.assert_allclose(logged(history, key), logged(expected_history, key), rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    assert len(advantages) == len(expected_advantages)
    for ours, theirs in zip(advantages, expected_advantages, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


# Each case trains 2 steps, then evaluates: a reference's KL (beta), a token-summed loss, masked truncations, the
# entropy bonus (TRL logs policy_loss in evaluation, entropy_coef in training only).
EVAL_CASES = {"grpo, beta 0.04": dict(loss_type="grpo", beta=0.04),
              "dapo, truncated completions masked": dict(loss_type="dapo", mask_truncated_completions=True),
              "grpo, entropy bonus (no eval_entropy_coef)": dict(loss_type="grpo", entropy_coef=0.1)}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_evaluate_reports_trls_eval_loss_and_metrics(tiny_checkpoints, tokenizer_dir, tmp_path, monkeypatch, case):
    """TRL's GRPO evaluation samples ``num_generations_eval`` completions per eval prompt, scores them and reports the
    step loss on them (``eval_loss``) with the loss's and the rollout's metrics. One eval batch holds every prompt (TRL
    shuffles eval prompts; the metrics of one batch do not depend on their order)."""
    path = tiny_checkpoints.path("qwen2")
    values = dict(EVAL_CASES[case], max_steps=2, per_device_eval_batch_size=16, eval_prompts=tiny.EVAL_PROMPTS)
    trainer = tiny.trl_grpo_trainer(path, tokenizer_dir, tmp_path / "trl", monkeypatch, **values)
    trainer.train()
    theirs = evaluated(trainer)
    trainer = tiny.torchlike_grpo_trainer(path, tokenizer_dir, tmp_path / "ours", **values)
    trainer.train()
    ours = evaluated(trainer)

    assert sorted(ours) == sorted(theirs), (set(ours) ^ set(theirs))
    assert theirs["eval_loss"] != 0.0
    for key, value in theirs.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
