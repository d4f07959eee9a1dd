"""Reward models in GRPO and RLOO: a sequence classifier given in ``reward_funcs`` (a path, or loaded with its
tokenizer in ``reward_processing_classes``) scores each completion as TRL 1.16 does, equal to the transformers
classifier on the same texts."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import transformers
from trl.data_utils import apply_chat_template

import torchlike
from tests import tiny
from tests.helpers.models import hf_classifier
from tests.helpers.tokenizers import CHAT_TEMPLATE
from torchlike.trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from torchlike.trl.online.reward_models import RewardModel

PROMPTS = ["the quick brown", "one two three", "hello world", "lazy dog"]
COMPLETION_LENGTH = 8


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer_dir):
    """A transformers Qwen2ForSequenceClassification with one label, saved with its tokenizer (chat template
    included), as a reward model on the Hub is. The tokenizer names its pad token: beside a qwen2 config.json,
    transformers loads it as a Qwen2Tokenizer, which would otherwise add a pad token outside the tiny vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-reward-model")
    hf_classifier("qwen2", num_labels=1, seed=1).save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    return folder


def scripted_rollout(prompts, trainer):
    """TRL's ``rollout_func``: a fixed random completion per (prompt, index in its group), some ending with EOS."""
    tokenizer = trainer.processing_class
    generations = trainer.args.num_generations
    prompt_ids, completion_ids = [], []
    for index, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        rng = np.random.default_rng([zlib.crc32(text.encode()), index % generations])
        ids = rng.integers(3, tiny.VOCAB, size=int(rng.integers(2, COMPLETION_LENGTH + 1))).tolist()
        if rng.random() < 0.5:
            ids[-1] = 2
        if isinstance(prompt, str):
            prompt_ids.append(tokenizer(prompt)["input_ids"])
        else:
            prompt_ids.append(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
        completion_ids.append(ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids]}


def transformers_rewards(path, prompts, completions) -> np.ndarray:
    """What TRL computes with the transformers classifier: its text rule, tokenisation and ``logits[:, 0]``."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if isinstance(prompts[0], list):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"]
                 for p, c in zip(prompts, completions, strict=True)]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[:, 0].numpy()


def run_recording_rewards(trainer) -> list[tuple[list, list, np.ndarray]]:
    """Trains two steps, recording each generation batch's prompts, completion texts (as the reward functions get
    them) and reward table."""
    recorded = []
    score = trainer.reward_scorer.rewards

    def recording(rows, completion_ids, extra, **kwargs):
        table = score(rows, completion_ids, extra, **kwargs)
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [row["prompt"] for row in rows]
        completions = texts if isinstance(prompts[0], str) else [[{"role": "assistant", "content": text}]
                                                                 for text in texts]
        recorded.append((prompts, completions, table))
        return table

    trainer.reward_scorer.rewards = recording
    trainer.train()
    return recorded


def settings(**overrides) -> dict:
    return dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=COMPLETION_LENGTH,
                max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                disable_tqdm=True, **overrides)


@pytest.mark.parametrize(("trainer_class", "config_class"), [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)],
                         ids=["GRPO", "RLOO"])
def test_a_reward_model_path_scores_standard_completions_as_transformers(tiny_checkpoints, tokenizer_dir,
                                                                         reward_model_dir, tmp_path, trainer_class,
                                                                         config_class):
    trainer = trainer_class(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=str(reward_model_dir),
                            args=config_class(output_dir=str(tmp_path), **settings()),
                            train_dataset=[{"prompt": prompt} for prompt in PROMPTS],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                            rollout_func=scripted_rollout)
    # TRL's attribute: the reward model's own tokenizer, loaded from its path.
    assert trainer.reward_processing_classes == [trainer.reward_funcs[0].tokenizer]
    assert trainer.reward_processing_classes[0].name_or_path == str(reward_model_dir)
    recorded = run_recording_rewards(trainer)
    assert len(recorded) == 2
    for prompts, completions, table in recorded:
        np.testing.assert_allclose(table[:, 0], transformers_rewards(reward_model_dir, prompts, completions),
                                   rtol=1e-4, atol=1e-5)
    name = reward_model_dir.name  # TRL names the reward after the last part of the model's path
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(f"rewards/{name}/mean" in entry and f"rewards/{name}/std" in entry for entry in logged)
    np.testing.assert_allclose(logged[0][f"rewards/{name}/mean"], recorded[0][2][:, 0].mean(), rtol=1e-5)


def test_a_loaded_reward_model_scores_conversations_with_its_chat_template(tiny_checkpoints, tokenizer_dir,
                                                                           reward_model_dir, tmp_path):
    def short(completions, **kwargs):
        return [-len(completion[0]["content"]) / 10 for completion in completions]

    policy_tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    policy_tokenizer.chat_template = CHAT_TEMPLATE
    reward_model = torchlike.AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    reward_tokenizer = torchlike.AutoTokenizer.from_pretrained(reward_model_dir)
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=[reward_model, short],
                          reward_processing_classes=[reward_tokenizer, None],
                          args=GRPOConfig(output_dir=str(tmp_path), **settings()),
                          train_dataset=[{"prompt": [{"role": "user", "content": prompt}]} for prompt in PROMPTS],
                          processing_class=policy_tokenizer, rollout_func=scripted_rollout)
    assert isinstance(trainer.reward_funcs[0], RewardModel) and trainer.reward_funcs[1] is short
    assert trainer.reward_processing_classes == [reward_tokenizer, None]  # TRL's attribute
    recorded = run_recording_rewards(trainer)
    for prompts, completions, table in recorded:
        np.testing.assert_allclose(table[:, 0], transformers_rewards(reward_model_dir, prompts, completions),
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(table[:, 1], short(completions), rtol=1e-6)
    assert reward_model.mesh is trainer.mesh  # scored on the trainer's mesh


def test_reward_processing_classes_of_another_length_are_refused(tiny_checkpoints, tokenizer_dir, reward_model_dir,
                                                                 tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match=r"number of reward processing classes \(2\) must match the number of "
                                         r"reward functions \(1\)"):
        GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=str(reward_model_dir),
                    reward_processing_classes=[tokenizer, tokenizer],
                    args=GRPOConfig(output_dir=str(tmp_path), **settings()),
                    train_dataset=[{"prompt": prompt} for prompt in PROMPTS], processing_class=tokenizer)
