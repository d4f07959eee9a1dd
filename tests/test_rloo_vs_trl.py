"""RLOOTrainer equals the real ``trl.RLOOTrainer`` step for step.

Both trainers get the same completions: TRL's ``_generate_single_turn`` and torchlike's ``rollout_func`` return the
completion scripted for each (prompt tokens, index in its group); both keep the rows of a generation batch in order.
Per-step loss, grad norm, KL, rewards, advantages and the final parameters must agree. float32 on both sides (bf16
off): TRL's CPU autocast and XLA's bf16 round differently, far above the 1e-4 tolerance.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import torchlike
from tests import tiny
from tests.helpers.logs import logged
from tests.tiny import EOS, PROMPTS, length_reward, token_reward
from torchlike.trl import RLOOConfig, RLOOTrainer

COMPLETION_LENGTH = 8
STEPS = 10

# Together: the KL penalty in the reward (default beta) with accumulation; then normalised advantages, clipped rewards,
# two iterations over each generation batch (the stored old log-probs), an asymmetric clip, masked truncations and
# several micro-steps per generation.
CASES = {
    "defaults (beta 0.05), accumulation 2": dict(gradient_accumulation_steps=2),
    "normalised, clipped rewards, 2 iterations, masked truncations": dict(
        beta=0.0, normalize_advantages=True, reward_clip_range=(0.2, 0.9), num_iterations=2, epsilon_high=0.28,
        mask_truncated_completions=True, steps_per_generation=2),
    # TRL adds a mixture-of-experts model's router loss with the config's coefficient by default.
    "Qwen3-MoE with its router loss, accumulation 2": dict(model="qwen3_moe", gradient_accumulation_steps=2),
}


def scripted_completion(prompt_ids: list[int], index: int) -> list[int]:
    """A fixed completion of varying length for a prompt and its index in the group: some end with EOS, some are
    cut at ``max_completion_length``, some stop without EOS."""
    rng = np.random.default_rng([zlib.crc32(bytes(str(list(prompt_ids)), "utf8")), index])
    length = int(rng.integers(2, COMPLETION_LENGTH + 1))
    ids = rng.integers(3, tiny.VOCAB, size=length).tolist()
    if rng.random() < 0.5 and length < COMPLETION_LENGTH:
        ids[-1] = EOS
    return ids


def settings(**case):
    values = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=COMPLETION_LENGTH,
                  max_steps=STEPS, learning_rate=1e-2, adam_epsilon=1e-4, weight_decay=0.01, max_grad_norm=0.5,
                  logging_steps=1, seed=0, report_to="none", save_strategy="no", bf16=False, shuffle_dataset=False,
                  reward_weights=[1.0, 0.5])
    values.update(case)
    return values


def run_trl(path, tokenizer_path, output_dir, monkeypatch, **case):
    import datasets
    import transformers
    import trl
    import trl.trainer.rloo_trainer as trl_rloo

    monkeypatch.setattr(trl_rloo, "shuffle_sequence_dict", lambda batch: batch)
    trainer = trl.RLOOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[token_reward, length_reward],
        args=trl.RLOOConfig(output_dir=str(output_dir), use_cpu=True, **settings(**case)),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path))
    generations = trainer.args.num_generations
    trainer._generate_single_turn = lambda prompt_ids, images, fields: [
        scripted_completion(ids, index % generations) for index, ids in enumerate(prompt_ids)]
    return tiny.train_trl_recording_advantages(trainer, output_dir)


def run_torchlike(path, tokenizer_path, output_dir, **case):
    def rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class(prompt)["input_ids"] for prompt in prompts]
        generations = trainer.args.num_generations
        return {"prompt_ids": prompt_ids, "logprobs": None,
                "completion_ids": [scripted_completion(ids, index % generations)
                                   for index, ids in enumerate(prompt_ids)]}

    trainer = RLOOTrainer(model=str(path), reward_funcs=[token_reward, length_reward],
                          args=RLOOConfig(output_dir=str(output_dir), **settings(**case)),
                          train_dataset=[{"prompt": p} for p in PROMPTS],
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path),
                          rollout_func=rollout)
    return tiny.train_torchlike_recording_advantages(trainer, output_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_rloo_matches_trl_step_for_step_on_the_same_completions(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                 monkeypatch, case):
    case = dict(CASES[case])
    path = tiny_checkpoints.path(case.pop("model", "qwen2"))
    expected_history, expected_advantages, expected_params = run_trl(path, tokenizer_dir, tmp_path / "trl",
                                                                     monkeypatch, **case)
    history, advantages, params = run_torchlike(path, tokenizer_dir, tmp_path / "ours", **case)

    assert len(logged(history, "loss")) == len(logged(expected_history, "loss")) == STEPS
    assert ("aux_loss" in expected_history[0]) == path.name.startswith("qwen3_moe")
    for key in ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy",
                "clip_ratio/region_mean", "completions/mean_length", "aux_loss"):
        if key not in expected_history[0]:
            assert key not in history[0], key
            continue
        # kl is a difference of two summed log-probabilities (~ -30): float32 leaves a few 1e-6 of it.
        np.testing.assert_allclose(logged(history, key), logged(expected_history, key), rtol=1e-4,
                                   atol=1e-5 if key == "kl" else 1e-6, err_msg=key)
    assert len(advantages) == len(expected_advantages)
    # With beta > 0 an advantage holds beta x that summed-log-probability difference, and its float32 noise.
    advantage_atol = 2e-5 if case.get("beta", 0.05) else 1e-6
    for ours, theirs in zip(advantages, expected_advantages, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=advantage_atol)
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


def test_evaluate_reports_trls_eval_loss_kl_and_metrics(tiny_checkpoints, tokenizer_dir, tmp_path, monkeypatch):
    """TRL's RLOO evaluation: the KL penalty enters the eval rewards as in training, and ``eval_loss`` is the step loss
    on the eval completions (ratio 1). One eval batch holds every prompt (TRL shuffles eval prompts; one batch's metrics
    do not depend on their order). Trained 2 steps first, so the policy has moved from the reference."""
    import datasets
    import transformers
    import trl

    path, eval_prompts = tiny_checkpoints.path("qwen2"), PROMPTS[:4]
    values = settings(max_steps=2, per_device_eval_batch_size=8)

    def without_timing(metrics):
        return {key: value for key, value in metrics.items()
                if key not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")}

    trl_trainer = trl.RLOOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[token_reward, length_reward],
        args=trl.RLOOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **values),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=datasets.Dataset.from_dict({"prompt": eval_prompts}),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    trl_trainer._generate_single_turn = lambda prompt_ids, images, fields: [
        scripted_completion(ids, index % 2) for index, ids in enumerate(prompt_ids)]
    trl_trainer.train()
    theirs = without_timing(trl_trainer.evaluate())

    def rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class(prompt)["input_ids"] for prompt in prompts]
        return {"prompt_ids": prompt_ids, "logprobs": None,
                "completion_ids": [scripted_completion(ids, index % 2) for index, ids in enumerate(prompt_ids)]}

    trainer = RLOOTrainer(model=str(path), reward_funcs=[token_reward, length_reward],
                          args=RLOOConfig(output_dir=str(tmp_path / "ours"), **values),
                          train_dataset=[{"prompt": p} for p in PROMPTS],
                          eval_dataset=[{"prompt": p} for p in eval_prompts],
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir), rollout_func=rollout)
    trainer.train()
    ours = without_timing(trainer.evaluate())

    assert sorted(ours) == sorted(theirs), set(ours) ^ set(theirs)
    # The policy has moved from the reference. (``eval_loss`` is no such check: at ratio 1 the leave-one-out advantages
    # of a group sum to zero, so it is zero up to rounding, which may give exactly 0.0: TRL's was 0.0 and torchlike's
    # 6.7e-7, the float32 rounding of advantages of size ~1, so it gets the eval KL's atol of 1e-5.)
    assert theirs["eval_kl"] != 0.0
    for key, value in theirs.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-4, atol=1e-5 if key in ("eval_kl", "eval_loss") else 1e-6,
                                   err_msg=key)
