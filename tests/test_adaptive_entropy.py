"""Adaptive entropy control (``use_adaptive_entropy``) moves GRPO's entropy coefficient as the real
``trl.GRPOTrainer`` does, step for step, and a resumed run continues with the coefficient its checkpoint saved.

Both trainers get the same scripted completions (``tests.tiny.scripted_rollout``) with the rows of a generation batch
in order. The target sits among the steps' entropies, so the coefficient rises and falls (and is applied or not)
within a few steps; with two micro-batches per step, the entropy the controller measures is the token mean over both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import tiny
from tests.helpers.logs import evaluated, logged
from torchlike.adapters.runtime import tracing
from torchlike.trl.online.entropy_control import STATE_FILE

# The steps' entropies (about 4.65, 4.61, 4.61, 4.60, 4.57, 4.59 nats: the tiny model on these completions) straddle
# the target, 3e-3 or more away from it: the coefficient falls to the minimum, rises once the entropy is at or below the
# target (applied from the step after) and stops at the maximum: 0.02, 0, 0, 0.03, 0.06, 0.08.
ADAPTIVE = dict(use_adaptive_entropy=True, gradient_accumulation_steps=2, entropy_coef=0.05, entropy_coef_delta=0.03,
                entropy_coef_min=0.0, entropy_coef_max=0.08, entropy_target=4.605, max_steps=6)
METRICS = ("loss", "grad_norm", "entropy", "entropy_coef", "policy_loss")


def trained_and_evaluated(trainer) -> tuple[list[dict], dict[str, float]]:
    trainer.train()
    return trainer.state.log_history, evaluated(trainer)


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """TRL's and torchlike's run (``"trl"``, ``"ours"``: log history and the evaluation after training), saving a
    checkpoint every 2 steps under ``"root"``, and how many times torchlike's train step was traced
    (``"train_traces"``)."""
    path = tiny_checkpoints.path("qwen2")
    root = tmp_path_factory.mktemp("adaptive_entropy")
    settings = dict(ADAPTIVE, save_strategy="steps", save_steps=2, per_device_eval_batch_size=16,
                    eval_prompts=tiny.EVAL_PROMPTS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        theirs = trained_and_evaluated(tiny.trl_grpo_trainer(path, tokenizer_dir, root / "trl", monkeypatch,
                                                             **settings))
    traced = tracing.TRACE_COUNTS["train_step"]
    ours = trained_and_evaluated(tiny.torchlike_grpo_trainer(path, tokenizer_dir, root / "ours", **settings))
    return {"trl": theirs, "ours": ours, "root": root, "train_traces": tracing.TRACE_COUNTS["train_step"] - traced}


def test_adaptive_entropy_matches_trl_step_for_step(runs):
    (expected, _), (history, _) = runs["trl"], runs["ours"]
    assert len(logged(history, "loss")) == len(logged(expected, "loss")) == ADAPTIVE["max_steps"]
    for key in METRICS:
        np.testing.assert_allclose(logged(history, key), logged(expected, key), rtol=1e-4, atol=1e-6,
                                   err_msg=key)


def test_the_coefficient_rises_and_falls(runs):
    coefficients = np.array([ADAPTIVE["entropy_coef"], *logged(runs["ours"][0], "entropy_coef")])
    steps = np.diff(coefficients)
    assert (steps > 0).any() and (steps < 0).any(), coefficients


def test_the_coefficient_changes_without_recompiling_the_step(runs):
    assert runs["train_traces"] == 1


def test_evaluation_applies_the_coefficient_as_trl(runs):
    """After training the last entropy is below the target, so TRL's eval loss subtracts the coefficient's bonus; it
    logs no ``eval_entropy_coef``."""
    (_, expected), (_, metrics) = runs["trl"], runs["ours"]
    assert sorted(metrics) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_checkpoints_hold_trls_controller_state(runs):
    root = runs["root"]
    for step in (2, 4, 6):
        theirs = json.loads((root / "trl" / f"checkpoint-{step}" / STATE_FILE).read_text())
        ours = json.loads((root / "ours" / f"checkpoint-{step}" / STATE_FILE).read_text())
        assert ours.keys() == theirs.keys()
        np.testing.assert_allclose([ours[key] for key in theirs], list(theirs.values()), rtol=1e-5)


def test_resume_continues_with_the_saved_coefficient(runs, tiny_checkpoints, tokenizer_dir):
    root = runs["root"]
    resumed = tiny.torchlike_grpo_trainer(tiny_checkpoints.path("qwen2"), tokenizer_dir, root / "ours",
                                          save_strategy="no", **ADAPTIVE)
    resumed.train(resume_from_checkpoint=str(root / "ours" / "checkpoint-4"))
    after = [entry for entry in resumed.state.log_history if "loss" in entry and entry["step"] > 4]
    uninterrupted = [entry for entry in runs["ours"][0] if "loss" in entry and entry["step"] > 4]
    for key in ("loss", "entropy_coef"):
        np.testing.assert_allclose([entry[key] for entry in after], [entry[key] for entry in uninterrupted],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
