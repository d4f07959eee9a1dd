"""GOLDTrainer (``trl.experimental.gold``): General Online Logit Distillation step for step against the real
``trl.experimental.gold.GOLDTrainer`` on the same scripted completions (the generalized JSD with a teacher of the same
vocabulary, and ULD with a teacher of another tokenizer), its data and its checks."""

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
from tests.helpers.data import CONVERSATIONS
from tests.helpers.scripted import MAX_NEW_TOKENS, scripted_hf_generate, scripted_turn
from torchlike.trl.experimental.gkd.gkd_data import dataset_columns
from torchlike.trl.experimental.gold import GOLDConfig, GOLDTrainer
from torchlike.trl.experimental.gold.gold_data import tokenize_row

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_gold = importlib.import_module("trl.experimental.gold")
trl_utils = importlib.import_module("trl.experimental.utils")

#: Answered conversations (TRL's GOLD refuses a row without a completion).
ROWS = [{"messages": messages} for messages in CONVERSATIONS[:8]]
#: Conversational and text prompt/completion pairs (a dataset holds one format: mixed, datasets fills the other
#: format's columns with None, which TRL then reads as that format).
PAIRS = {"conversational": [{"prompt": messages[:1], "completion": messages[1:]} for messages in CONVERSATIONS[8:12]],
         "text": [{"prompt": messages[0]["content"], "completion": " " + messages[1]["content"]}
                  for messages in CONVERSATIONS[8:12]]}


#: The logged losses TRL's GOLD rounds to 4 decimals.
ROUNDED = ("on_policy_loss", "off_policy_loss", "matched_loss", "unmatched_loss")


def comparison_settings(**case) -> dict:
    values = dict(per_device_train_batch_size=4, max_completion_length=MAX_NEW_TOKENS, max_length=24, max_steps=4,
                  learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.02, adam_epsilon=1e-4, logging_steps=1,
                  seed=0, bf16=False, report_to="none", save_strategy="no", temperature=0.8)
    values.update(case)
    return values


def run_trl(student, teacher, tokenizer_path, output_dir, settings):
    from trl.trainer.utils import RepeatSampler

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    trainer = trl_gold.GOLDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=str(teacher), args=trl_gold.GOLDConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(ROWS), eval_dataset=datasets.Dataset.from_list(ROWS[:6]),
        processing_class=tokenizer)
    generations = trainer.args.num_generations
    trainer.model.generate = scripted_hf_generate(tokenizer.pad_token_id, generations)
    # TRL's RepeatSampler without its shuffle (torch's generator draws it), prompts in dataset order.
    trainer._get_train_sampler = lambda dataset=None: RepeatSampler(
        trainer.train_dataset, mini_repeat_count=generations, batch_size=trainer.args.generation_batch_size,
        repeat_count=trainer.args.gradient_accumulation_steps, shuffle=False, seed=trainer.args.seed)
    trainer.train()
    trainer.evaluate()
    params = {name: value.detach().numpy() for name, value in trainer.model.state_dict().items()}
    return trainer.state.log_history, params


def run_torchlike(student, teacher, tokenizer_path, output_dir, settings):
    from safetensors.numpy import load_file

    trainer = GOLDTrainer(model=str(student), teacher_model=str(teacher),
                          args=GOLDConfig(output_dir=str(output_dir), train_sampling_strategy="sequential", **settings),
                          train_dataset=ROWS, eval_dataset=ROWS[:6],
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._generate_single_turn = scripted_turn(trainer)
    trainer.train()
    trainer.evaluate()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


def assert_runs_match(theirs, their_params, ours, params, settings):
    expected = {entry["step"]: entry for entry in theirs if "loss" in entry}
    found = {entry["step"]: entry for entry in ours if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found), (found, expected)
    assert all(expected[step]["grad_norm"] > settings["max_grad_norm"] for step in expected)
    for key in sorted(set().union(*expected.values()) - {"step", "epoch"}):
        steps = [step for step in expected if key in expected[step]]
        # TRL rounds these to 4 decimals: a last-digit difference is one rounding step.
        atol = 1.01e-4 if key in ROUNDED else 1e-6
        np.testing.assert_allclose([found[step][key] for step in steps], [expected[step][key] for step in steps],
                                   rtol=1e-4, atol=atol, err_msg=key)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    their_eval = next(entry for entry in reversed(theirs) if "eval_loss" in entry)
    our_eval = next(entry for entry in reversed(ours) if "eval_loss" in entry)
    assert set(our_eval) == set(their_eval)
    np.testing.assert_allclose(our_eval["eval_loss"], their_eval["eval_loss"], rtol=1e-4, atol=1e-6)


#: The ULD teacher's tokenizer: byte-level (any text encodes), trained on other texts, so it splits the student's
#: words differently; its model's vocabulary is that tokenizer's.
TEACHER_CORPUS = ("user assistant the lazy dog jumps", "a tiny test of the world over hello", "brown fox, nine ten")
TEACHER_VOCAB = 300


@pytest.fixture(scope="module")
def uld_teacher_dir(tmp_path_factory):
    """A tiny Qwen2 teacher with its own byte-level tokenizer (and vocabulary size) beside it."""
    from torchlike.testing import build_tokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("gold") / "uld_teacher", corpus=TEACHER_CORPUS,
                           vocab_size=TEACHER_VOCAB - 8, any_text=True, pad_token="<pad>")
    tiny.build_hf_model(tiny.tiny_config("qwen2", vocab_size=TEACHER_VOCAB), seed=2).save_pretrained(path)
    return path


CASES = {
    # TRL's defaults (lmbda 0.5, beta 0.5): micro-batches on- or off-policy as Python's random draws them.
    "jsd, defaults": dict(),
    # The forward KL, each prompt twice in a step, every micro-batch on-policy.
    "jsd, forward KL, two generations": dict(beta=0.0, lmbda=1.0, num_generations=2),
    # The reverse KL over two accumulated micro-batches, one generation batch split between them.
    "jsd, reverse KL, accumulation 2": dict(beta=1.0, per_device_train_batch_size=2, gradient_accumulation_steps=2),
    # ULD against a teacher with its own tokenizer: byte-offset alignment, "observed" merges, two accumulated
    # micro-batches (TRL's ULD loss is not divided by the window's labels).
    "uld, extended, accumulation 2": dict(use_uld_loss=True, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2),
    # ULD by position with "bayesian" merges, the hybrid loss (adaptive weights) and the student's cross-entropy.
    "uld, positional, bayesian, hybrid": dict(use_uld_loss=True, use_extended_uld=False,
                                              uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=True,
                                              uld_crossentropy_weight=0.5, lmbda=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gold_matches_trl_step_for_step(tiny_checkpoints, teacher_path, uld_teacher_dir, chat_tokenizer_dir,
                                        tmp_path, case):
    settings = comparison_settings(**CASES[case])
    student = tiny_checkpoints.path("qwen2")
    teacher = uld_teacher_dir if settings.get("use_uld_loss") else teacher_path
    theirs, their_params = run_trl(student, teacher, chat_tokenizer_dir, tmp_path / "trl", settings)
    ours, params = run_torchlike(student, teacher, chat_tokenizer_dir, tmp_path / "ours", settings)
    assert_runs_match(theirs, their_params, ours, params, settings)


@pytest.mark.parametrize(("data", "max_length"), [("messages", 24), ("messages", 20), ("conversational", 24),
                                                  ("text", 12)])
def test_rows_are_tokenised_as_trls_preparation_and_collator(chat_tokenizer_dir, data, max_length):
    """Conversations and prompt/completion rows, whole and cut to their last ``max_length`` tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    source = ROWS if data == "messages" else PAIRS[data]
    args = trl_gold.GOLDConfig(output_dir="unused", max_length=max_length, max_completion_length=4, report_to="none",
                               use_cpu=True)
    prepared = trl_gold.GOLDTrainer._prepare_dataset_with_original_text(
        None, datasets.Dataset.from_list(source), tokenizer, args, False, None, "train")
    collator = trl_utils.DataCollatorForChatML(tokenizer=tokenizer, max_length=max_length)
    expected = {key: value.numpy() if hasattr(value, "numpy") else value
                for key, value in collator(list(prepared)).items()}
    rows = [tokenize_row(row, tokenizer, "text", max_length, False) for row in source]
    for row, theirs in zip(rows, prepared, strict=True):
        assert row["original_prompt_text"] == theirs["original_prompt_text"]
        assert row["original_completion_text"] == theirs["original_completion_text"]
    ours = dataset_columns(rows, expected["input_ids"].shape[1], tokenizer.pad_token_id)
    np.testing.assert_array_equal(ours["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(ours["attention_mask"], expected["attention_mask"])
    np.testing.assert_array_equal(ours["completion_mask"], expected["labels"][:, 1:] != -100)


def test_config_checks_are_trls(tmp_path):
    with pytest.raises(ValueError, match="must exactly partition the local optimizer-step batch"):
        GOLDConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=2)
    with pytest.raises(ValueError, match="uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must both"):
        GOLDConfig(output_dir=str(tmp_path), use_uld_loss=True, uld_use_hybrid_loss=True,
                   uld_hybrid_matched_weight=0.5)


def test_a_teacher_with_another_vocabulary_needs_uld(tiny_checkpoints, chat_tokenizer_dir, tmp_path):
    tiny.build_hf_model(tiny.tiny_config("qwen2", vocab_size=tiny.VOCAB + 8)).save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match="vocab_size"):
        GOLDTrainer(model=str(tiny_checkpoints.path("qwen2")), teacher_model=str(tmp_path / "teacher"),
                    args=GOLDConfig(output_dir=str(tmp_path), max_length=24, max_completion_length=6),
                    train_dataset=ROWS, processing_class=torchlike.AutoTokenizer.from_pretrained(chat_tokenizer_dir))


def test_uld_tokenises_an_already_tokenised_row_again_for_its_texts(chat_tokenizer_dir):
    """As TRL's ``_prepare_dataset``: without ULD a row's ``input_ids`` are kept; with ULD every row is tokenised
    again with its texts, which the teacher reads."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    fresh = tokenize_row(ROWS[0], tokenizer, "text", 24, True)
    stale = {**ROWS[0], "input_ids": fresh["input_ids"][:-2], "completion_mask": fresh["completion_mask"][:-2]}
    assert tokenize_row(stale, tokenizer, "text", 24, False)["input_ids"] == stale["input_ids"]
    again = tokenize_row(stale, tokenizer, "text", 24, True, keep_tokenized=False)
    assert again["input_ids"] == fresh["input_ids"]
    assert again["original_completion_text"] == fresh["original_completion_text"]
