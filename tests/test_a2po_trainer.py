"""A2POTrainer (``trl.experimental.a2po``, A*-PO): both stages step for step against the real
``trl.experimental.a2po.A2POTrainer`` on the same scripted completions, and its checks."""

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
from tests.helpers.scripted import MAX_NEW_TOKENS, scripted_completion
from torchlike.adapters.losses.a2po import optimal_values
from torchlike.trl.experimental.a2po import A2POConfig, A2POTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_a2po = importlib.import_module("trl.experimental.a2po")

VALUE_SAMPLES = 4
#: What TRL's A2PO logs besides loss, grad_norm and learning_rate.
METRICS = ("reward", "v_star", "implicit_reward", "advantage")
ROWS = [{"prompt": prompt, "letter": letter} for prompt, letter in zip(tiny.PROMPTS[:8], "etaoinsh", strict=True)]
EVAL_ROWS = [{"prompt": prompt, "letter": "e"} for prompt in tiny.EVAL_PROMPTS[:3]]


def scripted_generate(stage: int, pad_token_id: int):
    """``generate`` as TRL's A2PO calls it: stage 1 on the reference with ``num_return_sequences`` samples of each
    prompt (consecutive rows), stage 2 on the policy with one."""

    def generate(input_ids, attention_mask, generation_config, **kwargs):
        copies = generation_config.num_return_sequences or 1
        input_ids, attention_mask = input_ids.repeat_interleave(copies, 0), attention_mask.repeat_interleave(copies, 0)
        completions = [scripted_completion(ids[mask.bool()].tolist(), stage, row % copies)
                       for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True))]
        tokens = torch.full((len(completions), max(map(len, completions))), pad_token_id, dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return torch.cat([input_ids, tokens], dim=1)

    return generate


def scripted_turn(prompt_ids, seed, vision=None, worker=None):
    """torchlike's ``_generate_single_turn`` giving the same completions (the reference's worker in stage 1, whose
    rows hold each prompt VALUE_SAMPLES times in a row)."""
    if worker is None:
        return [scripted_completion(ids, 2, 0) for ids in prompt_ids], None
    return [scripted_completion(ids, 1, row % VALUE_SAMPLES) for row, ids in enumerate(prompt_ids)], None


def odd_length_reward(prompts, completions, **kwargs):
    """1 when the completion text has an odd length (A*-PO's rewards are 0 or 1)."""
    assert len(prompts) == len(completions)
    return [float(len(text) % 2) for text in completions]


def letter_reward(completions, letter, **kwargs):
    """1 when the completion contains the row's ``letter`` column."""
    return [float(value in text) for text, value in zip(completions, letter, strict=True)]


def comparison_settings(**case) -> dict:
    """Both trainers' settings: a decaying learning rate, weight decay, clipping below every step's norm, an Adam
    epsilon above float noise, prompts in dataset order, gradient checkpointing on (TRL's default), float32 (bf16
    off) and a beta2 large enough that the implicit reward moves the loss."""
    return dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_completion_length=MAX_NEW_TOKENS,
                num_value_samples=VALUE_SAMPLES, max_steps=4, learning_rate=1e-2, weight_decay=0.1,
                max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False, report_to="none",
                save_strategy="no", beta2=0.05, reward_weights=[1.0, 0.5], **case)


def run_trl(path, tokenizer_path, output_dir, settings):
    from torch.utils.data import SequentialSampler

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    trainer = trl_a2po.A2POTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[odd_length_reward, letter_reward],
        args=trl_a2po.A2POConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(ROWS), eval_dataset=datasets.Dataset.from_list(EVAL_ROWS),
        processing_class=tokenizer)
    trainer.model.generate = scripted_generate(2, tokenizer.pad_token_id)
    trainer.ref_model.generate = scripted_generate(1, tokenizer.pad_token_id)
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    metrics = {key: value for key, value in trainer.evaluate().items() if not key.endswith(("runtime", "per_second"))}
    return trainer, tiny.saved_hf_params(trainer.model, output_dir / "model"), metrics


def run_torchlike(path, tokenizer_path, output_dir, settings):
    from safetensors.numpy import load_file

    trainer = A2POTrainer(model=str(path), reward_funcs=[odd_length_reward, letter_reward],
                          args=A2POConfig(output_dir=str(output_dir), train_sampling_strategy="sequential",
                                          **settings),
                          train_dataset=ROWS, eval_dataset=EVAL_ROWS,
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._generate_single_turn = scripted_turn
    trainer.train()
    metrics = {key: value for key, value in trainer.evaluate().items() if not key.endswith(("runtime", "per_second"))}
    trainer.model.save_pretrained(output_dir / "model")
    return trainer, load_file(output_dir / "model" / "model.safetensors"), metrics


CASES = {
    # 7 or fewer prompts after filtering in micro-batches of 2: a partial last one in every epoch.
    "one micro-batch per step": {},
    # Two micro-batches per step, each sampled with the weights before the step: their losses' mean is trained on.
    "gradient accumulation 2": dict(gradient_accumulation_steps=2, max_steps=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_both_stages_match_trl_step_for_step(tiny_checkpoints, pad_tokenizer_dir, tmp_path, case):
    settings = {**comparison_settings(), **CASES[case]}
    path = tiny_checkpoints.path("qwen2")
    theirs, their_params, their_eval = run_trl(path, pad_tokenizer_dir, tmp_path / "trl", settings)
    ours, params, our_eval = run_torchlike(path, pad_tokenizer_dir, tmp_path / "ours", settings)
    # Stage 1: the same optimal values, and the same prompts filtered out (some prompts' samples all scored 0).
    assert ours._optimal_values.keys() == theirs._optimal_values.keys()
    np.testing.assert_allclose([ours._optimal_values[key] for key in theirs._optimal_values],
                               list(theirs._optimal_values.values()), rtol=1e-6)
    assert [row["prompt"] for row in ours.train_dataset] == list(theirs.train_dataset["prompt"])
    assert 0 < len(ours.train_dataset) < len(ROWS)
    # Stage 2: every logged value of every step, then the final weights and the evaluation.
    expected = {entry["step"]: entry for entry in theirs.state.log_history if "loss" in entry}
    found = {entry["step"]: entry for entry in ours.state.log_history if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found)
    assert all(expected[step]["grad_norm"] > settings["max_grad_norm"] for step in expected)
    for key in ("loss", "grad_norm", "learning_rate", *METRICS):
        np.testing.assert_allclose([found[step][key] for step in found], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-7, err_msg=key)
    assert set(params) == set(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    # TRL's evaluate() returns eval_loss and logs the metrics beside it; torchlike's returns them too.
    their_logged = next(entry for entry in reversed(theirs.state.log_history) if "eval_loss" in entry)
    our_logged = next(entry for entry in reversed(ours.state.log_history) if "eval_loss" in entry)
    assert set(their_eval) == {"eval_loss"}
    assert set(our_eval) == {f"eval_{key}" for key in ("loss", *METRICS)} <= set(their_logged)
    assert set(our_logged) == set(their_logged)
    for key in ("loss", *METRICS):
        np.testing.assert_allclose(our_logged[f"eval_{key}"], their_logged[f"eval_{key}"], rtol=1e-4, atol=1e-7,
                                   err_msg=key)


def test_optimal_values_are_trls_formula():
    rewards = np.array([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    beta1 = 0.5
    expected = beta1 * (torch.logsumexp(torch.tensor(rewards) / beta1, dim=1) - np.log(4)).numpy()
    np.testing.assert_allclose(optimal_values(rewards, beta1), expected, rtol=1e-6)
    np.testing.assert_allclose(optimal_values(rewards, beta1)[1:], [0.0, 1.0], atol=1e-6)


def test_reward_weights_must_match_the_reward_functions(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"Number of reward weights \(1\) must match number of reward functions \(2\)"):
        A2POTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=[odd_length_reward, letter_reward],
                    args=A2POConfig(output_dir=str(tmp_path), report_to="none", reward_weights=[1.0]),
                    train_dataset=ROWS)


def test_a_reward_model_path_is_refused_naming_the_callable_convention(tiny_checkpoints, tmp_path):
    with pytest.raises(TypeError, match=r"reward_funcs are callables f\(prompts, completions"):
        A2POTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs="path/to/reward-model",
                    args=A2POConfig(output_dir=str(tmp_path), report_to="none"), train_dataset=ROWS)


def test_every_prompt_filtered_out_is_refused_saying_why(tiny_checkpoints, tokenizer_dir, tmp_path):
    def never(completions, **kwargs):
        return [0.0] * len(completions)

    settings = {**comparison_settings(), "reward_weights": None}
    trainer = A2POTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=never,
                          args=A2POConfig(output_dir=str(tmp_path), **settings), train_dataset=ROWS,
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer._generate_single_turn = scripted_turn
    with pytest.raises(ValueError, match="filter_all_incorrect dropped all 8 training prompts"):
        trainer.train()
