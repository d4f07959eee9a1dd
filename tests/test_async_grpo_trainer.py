"""AsyncGRPOTrainer against TRL 1.16's ``trl.experimental.async_grpo``.

TRL's trainer cannot run here (it needs a vLLM server and its rollout worker process), so its own code is called on
the numbers torchlike's run recorded:

- advantages: TRL's ``_AsyncRolloutLoop._score_group`` coroutine, called unbound. Stubbed: the loop object (only the
  attributes the method reads: reward functions, their names, no environments) and the reward functions, which return
  the rewards torchlike scored.
- loss and metrics: TRL's ``AsyncGRPOTrainer.compute_loss``, called unbound on each micro-batch, packed by TRL's own
  ``TreeRow`` and ``DataCollatorForRollout`` from torchlike's recorded completions, sampler log-probs and advantages.
  Stubbed: the trainer object (clipping range, accumulation steps, a one-process accelerator, the metric sink) and the
  model, which returns the policy's log-probs and entropies torchlike computed with the weights of that step.

One module-scoped run of each kind serves the tests: a run sampling two batches ahead (checkpointed at step 2), and the
same run resumed from that checkpoint with ``max_staleness=0``, one batch ahead and ``weight_sync_steps=2``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from flax import nnx

from tests.helpers.logs import logged
from tests.helpers.tokenizers import tokenizer_for
from torchlike.adapters.losses import async_grpo as async_losses
from torchlike.adapters.losses import grpo as grpo_losses
from torchlike.trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

PROMPTS = ["the quick brown", "one two three", "hello world", "lazy dog", "four five", "tiny test", "seven eight",
           "the fox", "nine ten", "over the", "jumps over", "brown fox"]
ACCUMULATION = 2
METRICS = ("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def length_reward(completions, **kwargs):
    """Prefers completions of 20 characters; ``None`` (unscorable) for those whose length is a multiple of 5."""
    return [None if len(text) % 5 == 0 else -abs(len(text) - 20) / 20 for text in completions]


def config(output_dir, **overrides) -> AsyncGRPOConfig:
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=ACCUMULATION,
                  num_generations=4, max_completion_length=12, max_steps=3, learning_rate=5e-2, epsilon=0.05,
                  epsilon_high=0.03, max_staleness=2, report_to="none", save_strategy="steps",
                  save_steps=2, disable_tqdm=True, seed=3)
    return AsyncGRPOConfig(**{**values, **overrides})


def recording(trainer: AsyncGRPOTrainer) -> dict:
    """Records, for each optimizer step, its micro-batches (with the sampler's log-probs as the engine gave them, in a
    column of their own), the policy's log-probs and entropies with the weights the step starts from and the step's
    loss; for each generation batch, the advantages' inputs and outputs and the completions left out as stale."""
    record = {"steps": [], "advantages": [], "stale": []}
    run_step, advantages, stale = trainer._run_step, trainer.algorithm.advantages, trainer._record_staleness
    step_columns = trainer.algorithm.step_columns
    family, temperature = trainer.model.family, trainer.sampling.temperature
    dtype = trainer._compute_dtype()  # the train step's (bf16, TRL's default)

    @nnx.jit
    def scores(module, batch):
        return grpo_losses.completion_scores(family, module, batch, temperature, with_entropies=True,
                                             compute_dtype=dtype)

    def recording_step(step_fn, batch, step):
        host = {key: np.asarray(value) for key, value in batch.items()}
        micro_batches = [{key: value[index] for key, value in host.items()} for index in range(ACCUMULATION)]
        policy = [scores(trainer._module, micro) for micro in micro_batches]
        outputs = run_step(step_fn, batch, step)
        record["steps"].append({"micro_batches": micro_batches,
                                "policy": [(np.asarray(s.log_probs), np.asarray(s.entropies)) for s in policy],
                                "loss": float(np.asarray(outputs["loss"]))})
        return outputs

    def recording_advantages(rewards, batch, log_probs, reward_weights, num_generations):
        result = advantages(rewards, batch, log_probs, reward_weights, num_generations)
        record["advantages"].append((np.array(rewards), num_generations, result[0]))
        return result

    def recording_staleness(versions):
        dropped = stale(versions)
        record["stale"].append((versions, trainer.rollout_worker.weights_version, dropped))
        return dropped

    def recording_columns(batch, log_probs):
        step_columns(batch, log_probs)
        batch["recorded_sampler_logps"] = batch["sampling_logps"].copy()

    trainer._run_step = recording_step
    trainer.algorithm.step_columns = recording_columns
    trainer.algorithm.advantages = recording_advantages
    trainer._record_staleness = recording_staleness
    return record


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("async_grpo")
    model, dataset = str(tiny_checkpoints.path("qwen2")), [{"prompt": prompt} for prompt in PROMPTS]
    ahead = AsyncGRPOTrainer(model, reward_funcs=length_reward, args=config(folder / "ahead"), train_dataset=dataset,
                             processing_class=tokenizer_for(tokenizer_dir))
    ahead_record = recording(ahead)
    ahead.train()
    resumed = AsyncGRPOTrainer(model, reward_funcs=length_reward,
                               args=config(folder / "ahead", max_steps=5, max_staleness=0, max_inflight_tasks=8,
                                           weight_sync_steps=2, save_strategy="no"),
                               train_dataset=dataset, processing_class=tokenizer_for(tokenizer_dir))
    resumed_record = recording(resumed)
    # The drops do not depend on the machine's load: each hand-over waits until the batches sampled ahead are done,
    # so every token of them is drawn with the weights before it (without the wait, the engine's thread draws their
    # first tokens before the hand-over in practice, but a busy machine could delay it).
    worker = resumed.rollout_worker
    hand_over = worker.weights_changed

    hand_overs = []

    def after_the_batches_ahead(version):
        for _, pending in worker._shared.ahead.values():
            pending.result()
        hand_overs.append(version)
        hand_over(version)

    worker.weights_changed = after_the_batches_ahead
    saved = json.loads((folder / "ahead" / "checkpoint-2" / "rollout_state.json").read_text())
    resumed.train(resume_from_checkpoint=str(folder / "ahead" / "checkpoint-2"))
    return types.SimpleNamespace(ahead=ahead, ahead_record=ahead_record, resumed=resumed,
                                 resumed_record=resumed_record, saved=saved, hand_overs=hand_overs)


# --- TRL's code, called on torchlike's numbers ---------------------------------------------------------------------

def trl_advantages(rewards_per_func: np.ndarray, num_generations: int) -> np.ndarray:
    """TRL's ``_AsyncRolloutLoop._score_group`` on each group of ``rewards_per_func`` (NaN: the function returned
    ``None``); the stub loop's reward functions return the given rewards."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TrainingSequence, _AsyncRolloutLoop

    PartialState(cpu=True)  # TRL's logger needs accelerate's state, as in TRL's rollout worker process
    advantages = []
    for start in range(0, len(rewards_per_func), num_generations):
        group_rewards = rewards_per_func[start:start + num_generations]
        functions = [functools.partial(lambda column, **kwargs: [None if np.isnan(value) else float(value)
                                                                 for value in column], group_rewards[:, index])
                     for index in range(group_rewards.shape[1])]
        loop = types.SimpleNamespace(reward_funcs=functions, _env_reward_types=[], _provides_rollout_reward=False,
                                     reward_func_names=[f"f{index}" for index in range(len(functions))])
        sequences = [[TrainingSequence([1, 2], [0, 1], [0.0, -1.0], f"r{row}")] for row in range(num_generations)]
        group = RolloutGroup(prompts=["p"] * num_generations, reward_kwargs={},
                             completions=["c"] * num_generations, completions_ids=[[2]] * num_generations,
                             completions_sequences=sequences, tool_call_counts=[0] * num_generations,
                             tool_failure_counts=[0] * num_generations, model_version=1, group_id=start,
                             env_rewards=[None] * num_generations, rollout_rewards=[None] * num_generations)
        samples = asyncio.run(_AsyncRolloutLoop._score_group(loop, group))
        advantages += [sample.advantage for sample in samples]
    return np.array(advantages)


def trl_step(micro_batches: list[dict], policy: list[tuple], trainer: AsyncGRPOTrainer) -> tuple[float, dict]:
    """TRL's ``AsyncGRPOTrainer.compute_loss`` summed over one optimizer step's micro-batches, and its metrics (one
    value per micro-batch)."""
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer as TRLAsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    one_process = types.SimpleNamespace(num_processes=1, reduce=lambda tensor, reduction: tensor,
                                        gather=lambda tensor: tensor.reshape(1))
    stub = types.SimpleNamespace(epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
                                 aux_loss_enabled=False, accelerator=one_process,
                                 current_gradient_accumulation_steps=len(micro_batches),
                                 _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0,
                                 _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0,
                                 _step_forward_s=0.0)
    total = 0.0
    for batch, (log_probs, entropies) in zip(micro_batches, policy, strict=True):
        row, policy_terms, entropy_terms = TreeRow(), [], []
        prompt_width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        for index in range(len(batch["input_ids"])):
            mask = batch["completion_mask"][index].astype(bool)
            real = batch["attention_mask"][index].astype(bool)
            prompt_length = int(real[:prompt_width].sum())
            length = int(real[prompt_width:].sum())
            row.add({"input_ids": batch["input_ids"][index][real],
                     "completion_mask": np.concatenate([np.zeros(prompt_length, np.int64), mask[:length]]),
                     "old_log_probs": np.concatenate([np.zeros(prompt_length, np.float32),
                                                      batch["recorded_sampler_logps"][index][:length]]),
                     "advantage": float(batch["advantages"][index]), "group_id": index, "metrics": {}})
            policy_terms.append(log_probs[index][mask])
            entropy_terms.append(entropies[index][mask])
        inputs = DataCollatorForRollout(pad_token_id=trainer.pad_token_id).torch_call([[row]])
        token_index = inputs["token_index"][inputs["token_index"] >= 0]
        forwarded = int(inputs["attention_mask"].sum())

        def model(policy_terms=policy_terms, entropy_terms=entropy_terms, token_index=token_index,
                  forwarded=forwarded, **kwargs):
            flat = {}
            for name, terms in (("log_probs", policy_terms), ("entropy", entropy_terms)):
                flat[name] = torch.zeros(forwarded)
                flat[name][token_index] = torch.tensor(np.concatenate(terms), dtype=torch.float32)
                flat[name] = flat[name].unsqueeze(0)
            return types.SimpleNamespace(**flat)

        total += float(TRLAsyncGRPOTrainer.compute_loss(stub, model, inputs))
    return total, stub._metrics["train"]


# --- tests -----------------------------------------------------------------------------------------------------------

def test_advantages_equal_trls_rollout_worker_with_none_rewards():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(12, 2))
    rewards[1, 0] = np.nan  # one function could not score it: the other's reward counts
    rewards[2] = np.nan  # no function could: advantage 0, left out of its group's mean and std
    rewards[4:8] = np.nan  # a group nobody could score
    rewards[8:12, 0] = 0.5  # a group with no spread in the first function
    rewards[8:12, 1] = 0.25
    ours, metrics = async_losses.async_grpo_advantages(rewards, 4)
    theirs = trl_advantages(rewards, 4)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert ours[2] == 0 and (ours[4:12] == 0).all() and ours[0] != 0
    assert metrics["reward"] == pytest.approx(np.nanmean(np.where(np.isnan(rewards).all(1), np.nan,
                                                                  np.nansum(rewards, 1))))


def test_advantages_of_the_run_equal_trls_rollout_worker(runs):
    recorded = runs.ahead_record["advantages"] + runs.resumed_record["advantages"]
    assert any(np.isnan(rewards).any() for rewards, _, _ in recorded)  # some completions were unscorable
    for rewards, num_generations, ours in recorded:
        np.testing.assert_allclose(ours, trl_advantages(rewards, num_generations), rtol=1e-6, atol=1e-7)


def test_loss_and_metrics_of_each_step_equal_trls_compute_loss(runs):
    trainer, steps = runs.ahead, runs.ahead_record["steps"]
    history = trainer.state.log_history
    assert len(steps) == 3
    for index, step in enumerate(steps):
        loss, metrics = trl_step(step["micro_batches"], step["policy"], trainer)
        np.testing.assert_allclose(step["loss"], loss, rtol=1e-5, atol=1e-7)
        # TRL logs the mean of its micro-batches' values (of low_min and high_max, their extreme: torchlike's step
        # averages those too, a known difference with gradient accumulation).
        for key in (*METRICS, "clip_ratio/low_min", "clip_ratio/high_max"):
            np.testing.assert_allclose(logged(history, key)[index], np.mean(metrics[key]), rtol=1e-5, atol=1e-7,
                                       err_msg=key)
    # The batches sampled ahead were drawn with older weights: their ratios move and some tokens are clipped.
    assert max(logged(history, "clip_ratio/region_mean")) > 0
    assert {"reward", "reward_std", "rewards/length_reward"} <= set(history[0])


def test_batches_sampled_ahead_within_max_staleness_are_all_trained(runs):
    history = runs.ahead.state.log_history
    for versions, current, dropped in runs.ahead_record["stale"]:
        drawn = versions[versions >= 0]
        assert current - drawn.min() <= 2 and not dropped.any()
    assert max(logged(history, "sample/staleness_max")) >= 1  # batches were sampled ahead of the weights
    assert not logged(history, "sample/dropped_stale_total")


def test_stale_completions_are_dropped_counted_and_training_goes_on(runs):
    trainer, record = runs.resumed, runs.resumed_record
    history = trainer.state.log_history
    assert runs.hand_overs == [3, 4]  # at the start (the restored weights) and after step 4 (weight_sync_steps=2)
    assert trainer.state.global_step == 5 and np.isfinite(logged(history, "loss")).all()
    dropped_per_batch = []
    for versions, current, dropped in record["stale"]:
        oldest = np.where(versions >= 0, versions, current).min(axis=1)
        np.testing.assert_array_equal(dropped, current - oldest > 0)  # max_staleness=0
        dropped_per_batch.append(int(dropped.sum()))
    assert sum(dropped_per_batch) > 0
    assert sum(logged(history, "sample/dropped_stale_total")) == sum(dropped_per_batch)
    # Each step trains one generation batch; a dropped completion stays in its micro-batch with no loss token (every
    # completion has at least one).
    for step, dropped in zip(record["steps"], dropped_per_batch, strict=True):
        assert sum(int((micro["completion_mask"].sum(1) == 0).sum()) for micro in step["micro_batches"]) == dropped
    # A step whose completions were all dropped trains nothing and logs no loss metric (TRL never trains one).
    entries = [entry for entry in history if "loss" in entry and entry["step"] > 2]
    for entry, dropped in zip(entries, dropped_per_batch, strict=True):
        if dropped == trainer.args.generation_batch_size:
            assert entry["loss"] == 0 and "ratio" not in entry
        else:
            assert "ratio" in entry


def test_the_model_version_is_saved_with_the_checkpoint_and_restored_on_resume(runs):
    # Run one: 1 when training starts, +1 after each step (weight_sync_steps=1); the checkpoint of step 2 is written
    # before step 2's hand-over.
    assert runs.saved == {"model_version": 2}
    assert runs.ahead.model_version == 3
    # The resumed run restores 2 and hands the restored weights over as 3 (the uninterrupted run's version after step
    # 2), then every second step (weight_sync_steps=2): after step 4 only.
    versions = [np.unique(versions[versions >= 0]).tolist() for versions, _, _ in runs.resumed_record["stale"]]
    assert versions[0] == [3]
    assert runs.resumed.model_version == 4
    assert all(set(seen) <= {3, 4} for seen in versions)


def test_config_has_trls_defaults():
    import dataclasses

    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    ours, theirs = AsyncGRPOConfig("out", use_cpu=True), TRLAsyncGRPOConfig("out", use_cpu=True)
    for field in ("learning_rate", "logging_steps", "lr_scheduler_type", "ignore_data_skip", "max_staleness",
                  "max_inflight_tasks", "weight_sync_steps", "dtype", "max_completion_length", "num_generations",
                  "gradient_checkpointing", "bf16"):
        assert getattr(ours, field) == getattr(getattr(theirs, field), "value", getattr(theirs, field)), field
    assert {f.name for f in dataclasses.fields(TRLAsyncGRPOConfig)} <= {f.name for f in dataclasses.fields(ours)}
    assert ours.rollout_engine == "paged"
