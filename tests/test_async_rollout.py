"""Online trainers on the rollout engine: GRPO on the paged engine equals GRPO on the static sampler step for step,
generation overlapped with training (``max_staleness``) trains on batches sampled with the weights from before the
last step, and TRL's importance-sampling correction of the sampler's log-probs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers.logs import logged
from torchlike.adapters.losses import grpo as grpo_losses
from torchlike.trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

PROMPTS = ["the quick brown", "one two three", "hello world", "lazy dog", "four five", "tiny test", "seven eight",
           "the fox"]


def length_reward(completions, **kwargs):
    return [-abs(len(completion) - 20) / 20 for completion in completions]


def trainer_for(tiny_checkpoints, tokenizer, tmp_path, trainer_class=GRPOTrainer, config_class=GRPOConfig,
                case: str = "qwen2", **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=12, max_steps=2, learning_rate=3e-2, logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True)
    values.update(overrides)
    return trainer_class(model=str(tiny_checkpoints.path(case)), reward_funcs=length_reward,
                         args=config_class(**values), train_dataset=[{"prompt": p} for p in PROMPTS],
                         processing_class=tokenizer)


def trl_vllm_importance_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's inline computation (``GRPOTrainer._generate_and_score_completions``,
    ``trl/trainer/grpo_trainer.py``: ``per_token_logps_diff`` ... ``masked_fill``), transcribed in torch."""
    per_token_logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


@pytest.mark.parametrize("mode", grpo_losses.SAMPLER_CORRECTION_MODES)
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 1.5)])
def test_sampler_importance_ratio_equals_trls_formula(mode, clip_min, clip_max):
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 0.5, (6, 9)).astype(np.float32)
    sampling = (old + rng.normal(0.0, 0.2, old.shape)).astype(np.float32)
    sampling[2, 3] = np.nan  # a token the sampler could not score
    mask = (rng.random(old.shape) < 0.8).astype(np.float32)
    ours = grpo_losses.sampler_importance_ratio(old, sampling, mask, mode, clip_min, clip_max)
    theirs = trl_vllm_importance_sampling_ratio(torch.tensor(old, dtype=torch.float64),
                                                torch.tensor(sampling, dtype=torch.float64),
                                                torch.tensor(mask, dtype=torch.float64), mode, clip_min, clip_max)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    assert ours.shape == ((6, 1) if mode.startswith("sequence") else (6, 9))


# Qwen3.5: recurrent state in the engines' slots, its attention layers read through JAX's GPU paged-attention kernel
# (interpreted on the CPU); Qwen2 (a Tunix decoder) through the gathered page view.
@pytest.mark.parametrize(("case", "attention"), [("qwen2", "gather"), ("qwen3_5", "pallas_gpu")])
def test_grpo_on_the_paged_engine_equals_grpo_on_the_static_sampler(case, attention, tiny_checkpoints, tokenizer,
                                                                    tmp_path):
    # Prompts prefilled one token at a time (rollout_max_num_batched_tokens): chunked prefill changes no token.
    paged = trainer_for(tiny_checkpoints, tokenizer, tmp_path / "paged", case=case, rollout_engine="paged",
                        rollout_max_num_batched_tokens=1, rollout_attention=attention)
    static = trainer_for(tiny_checkpoints, tokenizer, tmp_path / "static", case=case, rollout_engine="static")
    paged.train()
    static.train()
    assert paged.rollout_engine.kernel["attention"] == attention
    chunks = [request for request, _, _ in paged.rollout_engine.stats.prefill_chunks]
    assert len(chunks) > len(set(chunks))  # some prompt took several chunks
    np.testing.assert_array_equal(paged._last_rollout["input_ids"], static._last_rollout["input_ids"])
    for key in ("loss", "grad_norm", "reward"):
        np.testing.assert_allclose(logged(paged.state.log_history, key), logged(static.state.log_history, key),
                                   rtol=1e-5)


def test_staleness_one_trains_on_a_batch_sampled_with_the_weights_from_before_the_last_step(
        tiny_checkpoints, tokenizer, tmp_path):
    ahead = trainer_for(tiny_checkpoints, tokenizer, tmp_path / "ahead", max_staleness=1)
    ahead.train()
    # The second generation batch (trained at step 2) was sampled with the initial weights, while step 1 trained.
    untrained = trainer_for(tiny_checkpoints, tokenizer, tmp_path / "untrained")
    prompts = [untrained.train_dataset[int(i)] for i in untrained._get_train_sampler(0)[2:4]]
    stale = untrained._rollout(prompts, 0, 1)
    np.testing.assert_array_equal(ahead._last_rollout["input_ids"], stale["input_ids"])
    # A synchronous run samples that batch with the weights after step 1: other completions.
    synchronous = trainer_for(tiny_checkpoints, tokenizer, tmp_path / "synchronous")
    synchronous.train()
    assert not np.array_equal(synchronous._last_rollout["input_ids"], stale["input_ids"])
    # The first batch is sampled before any step: both runs score the same completions.
    for key in ("reward", "completions/mean_length"):
        assert logged(ahead.state.log_history, key)[0] == logged(synchronous.state.log_history, key)[0]


def test_staleness_one_applies_the_sampler_correction_and_logs_trls_metrics(tiny_checkpoints, tokenizer, tmp_path):
    ahead = trainer_for(tiny_checkpoints, tokenizer, tmp_path, max_staleness=1, max_steps=3,
                        vllm_importance_sampling_mode="token_truncate", rollout_engine="paged")
    ahead.train()
    means = logged(ahead.state.log_history, "sampling/importance_sampling_ratio/mean")
    differences = logged(ahead.state.log_history, "sampling/sampling_logp_difference/max")
    assert len(means) == 3 and np.isfinite(means).all()
    # The batch of step 1 was sampled with the weights it trains (the gap is bf16 compute against the engine's);
    # later batches are one step stale, a larger gap.
    assert differences[0] < 0.1 < min(differences[1:])
    ratio = ahead._last_rollout["importance_sampling_ratio"]
    assert ratio.shape == ahead._last_rollout["completion_mask"].shape and (ratio <= 3.0).all()


def test_rloo_sampled_ahead_takes_the_ratio_against_the_samplers_log_probs(tiny_checkpoints, tokenizer, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tokenizer, tmp_path, trainer_class=RLOOTrainer, config_class=RLOOConfig,
                          max_staleness=1)
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert "sampling_logps" not in trainer._last_rollout


def test_sampling_ahead_refuses_more_steps_per_batch_than_max_staleness(tiny_checkpoints, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="more than max_staleness=1"):
        trainer_for(tiny_checkpoints, tokenizer, tmp_path, max_staleness=1, num_iterations=2)


def test_sampling_ahead_refuses_a_rollout_func(tiny_checkpoints, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="max_staleness=0 with them"):
        GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                                    max_staleness=1, report_to="none"),
                    train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                    rollout_func=lambda prompts, trainer: {})


def test_staleness_one_on_the_paged_engine_samples_on_one_stream_within_max_staleness(tiny_checkpoints, tokenizer,
                                                                                       tmp_path):
    """The policy's one paged engine samples every batch on its stream (no second engine); each batch's tokens were
    drawn at most max_staleness steps before the step that trains it, and TRL's correction of the sampler's
    log-probs is TRL's formula on those numbers."""
    trainer = trainer_for(tiny_checkpoints, tokenizer, tmp_path, max_staleness=1, max_steps=3,
                          rollout_engine="paged", vllm_importance_sampling_mode="token_truncate")
    versions_seen, corrections = [], []
    record_staleness, correct = trainer._record_staleness, trainer.algorithm.sampler_correction

    def recording_staleness(versions):
        versions_seen.append((trainer.state.global_step, versions))
        record_staleness(versions)

    def recording_correction(batch, old_logps):
        correct(batch, old_logps)
        corrections.append((old_logps, batch["sampling_logps"], grpo_losses.loss_mask(batch),
                            batch["importance_sampling_ratio"]))

    trainer._record_staleness = recording_staleness
    trainer.algorithm.sampler_correction = recording_correction
    trainer.train()
    shared = trainer.rollout_worker._shared
    assert shared.background_engine is None and shared.stream is None  # one engine; its stream closed at the end
    assert trainer.rollout_worker.engine.stats.weight_updates >= 1  # the stream took new weights mid-run
    assert [step for step, _ in versions_seen] == [0, 1, 2]
    for step, versions in versions_seen:
        drawn = versions[versions >= 0]
        assert drawn.size and step - drawn.min() <= 1 and drawn.max() <= step
    assert max(logged(trainer.state.log_history, "sample/staleness_max")) <= 1
    assert len(corrections) == 3
    for old, sampling, mask, ratio in corrections:
        theirs = trl_vllm_importance_sampling_ratio(torch.tensor(old, dtype=torch.float64),
                                                    torch.tensor(sampling, dtype=torch.float64),
                                                    torch.tensor(mask, dtype=torch.float64), "token_truncate",
                                                    trainer.args.vllm_importance_sampling_clip_min,
                                                    trainer.args.vllm_importance_sampling_clip_max)
        np.testing.assert_allclose(ratio, theirs.numpy(), rtol=1e-6)


def test_a_resumed_run_sampling_ahead_tags_its_tokens_with_the_restored_step(tiny_checkpoints, tokenizer, tmp_path):
    """Resuming GRPO with ``max_staleness=1`` on the paged stream: the stream starts with the restored weights tagged
    with the checkpoint's step (not 0), so the resumed steps' tokens are within ``max_staleness`` of them and the run
    trains on instead of refusing its first batch as stale."""
    first = trainer_for(tiny_checkpoints, tokenizer, tmp_path, max_staleness=1, max_steps=2, rollout_engine="paged",
                        save_strategy="steps", save_steps=2)
    first.train()
    resumed = trainer_for(tiny_checkpoints, tokenizer, tmp_path, max_staleness=1, max_steps=4, rollout_engine="paged")
    versions_seen = []
    record_staleness = resumed._record_staleness

    def recording_staleness(versions):
        versions_seen.append((resumed.state.global_step, versions))
        return record_staleness(versions)

    resumed._record_staleness = recording_staleness
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert [step for step, _ in versions_seen] == [2, 3]
    for step, versions in versions_seen:
        drawn = versions[versions >= 0]
        assert drawn.size and drawn.min() >= 2 and step - drawn.min() <= 1 and drawn.max() <= step
