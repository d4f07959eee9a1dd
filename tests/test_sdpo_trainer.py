"""SDPOTrainer (``trl.experimental.sdpo``): the policy term, the teacher contexts built from successful rollouts and
the self-distillation, step for step against the real ``trl.experimental.sdpo.SDPOTrainer`` on the same scripted
completions."""

from __future__ import annotations

import importlib
import os

import datasets
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from tests.helpers.scripted import MAX_NEW_TOKENS, scripted_trl_generate, scripted_turn
from tests.helpers.tokenizers import CHAT_TEMPLATE
from torchlike.trl.experimental.sdpo import SDPOConfig, SDPOTrainer
from torchlike.trl.experimental.sdpo.sdpo_trainer import group_advantages

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_sdpo = importlib.import_module("trl.experimental.sdpo")

FEEDBACK = ["", "try a longer answer", "", "mention the fox"]
ROWS = [{"prompt": prompt, "letter": "etaoinsh"[index], "privileged_context": FEEDBACK[index % 4]}
        for index, prompt in enumerate(tiny.PROMPTS[:8])]
EVAL_ROWS = [{"prompt": prompt, "letter": "e", "privileged_context": ""} for prompt in tiny.EVAL_PROMPTS[:2]]
DIAGNOSTICS = ("reward_mean", "reward_std", "reward_min", "reward_max", "group_reward_std_mean",
               "flat_group_fraction", "rewards/odd_length_reward", "rewards/letter_reward", "success_group_fraction",
               "success_sample_fraction", "feedback_available_fraction", "feedback_used_fraction",
               "reprompt_sample_fraction")
COMPLETIONS = ("mean_length", "min_length", "max_length", "clipped_ratio", "mean_terminated_length",
               "min_terminated_length", "max_terminated_length")


def odd_length_reward(completions, **kwargs):
    """1 when the completion's text has an odd length (SDPO's success threshold is 1)."""
    texts = [completion if isinstance(completion, str) else completion[0]["content"] for completion in completions]
    return [float(len(text) % 2) for text in texts]


def letter_reward(completions, letter, completion_ids, trainer_state, **kwargs):
    """0.5 x whether the completion holds the row's letter; reads a dataset column, the ids and the state."""
    assert len(completion_ids) == len(completions) and trainer_state is not None
    texts = [completion if isinstance(completion, str) else completion[0]["content"] for completion in completions]
    return [float(value in text) for text, value in zip(texts, letter, strict=True)]


def comparison_settings(**case) -> dict:
    values = dict(per_device_train_batch_size=4, per_device_eval_batch_size=2, num_generations=2,
                  max_completion_length=MAX_NEW_TOKENS, max_steps=4, learning_rate=1e-2, weight_decay=0.1,
                  max_grad_norm=0.01, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False, report_to="none",
                  save_strategy="no", shuffle_dataset=False, reward_weights=[1.0, 0.5])
    values.update(case)
    return values


def prompt_rows(conversational: bool, source: list[dict]) -> list[dict]:
    if not conversational:
        return source
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in source]


def run_trl(path, tokenizer_path, output_dir, settings, conversational):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    trainer = trl_sdpo.SDPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[odd_length_reward, letter_reward],
        args=trl_sdpo.SDPOConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(prompt_rows(conversational, ROWS)),
        eval_dataset=datasets.Dataset.from_list(prompt_rows(conversational, EVAL_ROWS)), processing_class=tokenizer)
    trainer._generate = scripted_trl_generate(trainer)
    trainer.train()
    trainer.evaluate()
    return trainer, tiny.saved_hf_params(trainer.model, output_dir / "model")


def run_torchlike(path, tokenizer_path, output_dir, settings, conversational):
    from safetensors.numpy import load_file

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    trainer = SDPOTrainer(model=str(path), reward_funcs=[odd_length_reward, letter_reward],
                          args=SDPOConfig(output_dir=str(output_dir), **settings),
                          train_dataset=prompt_rows(conversational, ROWS),
                          eval_dataset=prompt_rows(conversational, EVAL_ROWS), processing_class=tokenizer)
    trainer._generate_single_turn = scripted_turn(trainer)
    trainer.train()
    trainer.evaluate()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer, load_file(output_dir / "model" / "model.safetensors")


CASES = {
    # TRL's defaults: distillation only, the sampled-token reverse KL, an EMA teacher (here half-way each step); two
    # micro-batches per generation, so the rollout's log-probabilities weigh the second step.
    "defaults: distillation only, EMA teacher, importance weights": dict(teacher_model_kind="ema",
                                                                        teacher_update_rate=0.5,
                                                                        steps_per_generation=2),
    # Half policy term (grpo reduction, sequence-level ratios to the rollout's log-probabilities: two micro-batches per
    # generation; batch-scaled advantages), half the top-k divergence against the initial student; feedback shown to
    # rollouts without a solution; truncated completions masked; conversational prompts.
    "mixed, top-k, base teacher, feedback, conversations": dict(steps_per_generation=2,
        distillation_weight=0.5, distillation_mode="topk_logits", distillation_alpha=0.5, distillation_topk=20,
        teacher_model_kind="base", loss_type="grpo", importance_sampling_level="sequence", scale_rewards="batch",
        include_environment_feedback=True, environment_feedback_only_without_solution=True,
        mask_truncated_completions=True, conversational=True),
    # The policy term alone (no teacher pass), dr_grpo's reduction, unscaled advantages, two accumulated steps.
    "policy only, dr_grpo": dict(distillation_weight=0.0, loss_type="dr_grpo", scale_rewards="none",
                                 gradient_accumulation_steps=2, max_steps=2, teacher_model_kind="live"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpo_matches_trl_step_for_step(tiny_checkpoints, pad_tokenizer_dir, tmp_path, case):
    settings = comparison_settings(**CASES[case])
    conversational = settings.pop("conversational", False)
    path = tiny_checkpoints.path("qwen2")
    theirs, their_params = run_trl(path, pad_tokenizer_dir, tmp_path / "trl", settings, conversational)
    ours, params = run_torchlike(path, pad_tokenizer_dir, tmp_path / "ours", settings, conversational)
    expected = {entry["step"]: entry for entry in theirs.state.log_history if "loss" in entry}
    found = {entry["step"]: entry for entry in ours.state.log_history if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found), (found, expected)
    assert all(expected[step]["grad_norm"] > settings["max_grad_norm"] for step in expected)
    keys = ["loss", "grad_norm", "learning_rate", "self_distillation/distillation_loss", "sdpo/distillation_loss",
            "self_distillation/policy_loss", *(f"self_distillation/{key}" for key in DIAGNOSTICS),
            *(f"completions/{key}" for key in COMPLETIONS)]
    compared = 0
    for key in keys:
        steps = [step for step in expected if key in expected[step]]
        compared += bool(steps)
        np.testing.assert_allclose([found[step][key] for step in steps], [expected[step][key] for step in steps],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    assert compared >= len(keys) - 2  # each case logs the distillation or the policy term, or both
    assert set(params) == set(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    their_eval = next(entry for entry in reversed(theirs.state.log_history) if "eval_loss" in entry)
    our_eval = next(entry for entry in reversed(ours.state.log_history) if "eval_loss" in entry)
    assert set(our_eval) == set(their_eval)
    for key in [key for key in their_eval if key.startswith("eval_") and "runtime" not in key
                and "per_second" not in key]:
        np.testing.assert_allclose(our_eval[key], their_eval[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_are_trls(scale_rewards):
    rewards = np.array([1.0, 0.0, 1.5, 1.5, 0.5, 0.0], np.float32)
    tensor = torch.tensor(rewards)
    means = tensor.view(-1, 2).mean(dim=1).repeat_interleave(2)
    std = {"group": tensor.view(-1, 2).std(dim=1).repeat_interleave(2), "batch": tensor.std().expand(6),
           "none": torch.ones(6)}[scale_rewards]
    np.testing.assert_allclose(group_advantages(rewards, 2, scale_rewards)[0], ((tensor - means) / (std + 1e-4)),
                               rtol=1e-5, atol=1e-6)


def test_reward_funcs_are_required_as_in_trl(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="`reward_funcs` is required for SDPOTrainer because SDPO must score"):
        SDPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=ROWS,
                    args=SDPOConfig(output_dir=str(tmp_path), report_to="none"))
    with pytest.raises(ValueError, match=r"`distillation_weight` must be in \[0, 1\], got 1.5"):
        SDPOConfig(output_dir=str(tmp_path), distillation_weight=1.5)
