"""IWOPDTrainer (``trl.experimental.iw_opd``): the IW-OPD objective and the generalized JSD on TRL's top-k supports,
step for step against the real ``trl.experimental.iw_opd.IWOPDTrainer`` on the same scripted completions, its data
and its checks."""

from __future__ import annotations

import importlib
import os
import types

import datasets
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests.helpers.data import CONVERSATIONS
from tests.helpers.evaluation import assert_student_predictions_match, recorded_predictions
from tests.helpers.scripted import MAX_NEW_TOKENS, scripted_hf_generate, scripted_turn
from torchlike.adapters.losses.iw_opd import IWOPDLossSettings, support_divergence
from torchlike.trl.experimental.gkd.gkd_data import dataset_columns
from torchlike.trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from torchlike.trl.experimental.iw_opd.iw_opd_data import tokenize_row

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_iw_opd = importlib.import_module("trl.experimental.iw_opd")
trl_iw_opd_trainer = importlib.import_module("trl.experimental.iw_opd.iw_opd_trainer")

#: A prompt-only conversation beside the answered ones (on-policy training samples its completion).
ROWS = [{"messages": messages} for messages in CONVERSATIONS[:7]] + [{"messages": CONVERSATIONS[7][:1]}]


def comparison_settings(**case) -> dict:
    values = dict(per_device_train_batch_size=4, max_completion_length=MAX_NEW_TOKENS, max_length=24, max_steps=4,
                  learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.02, adam_epsilon=1e-4, logging_steps=1,
                  seed=0, bf16=False, report_to="none", save_strategy="no", temperature=0.8)
    values.update(case)
    return values


def run_trl(student, teacher, tokenizer_path, output_dir, settings):
    from trl.trainer.utils import RepeatSampler

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    trainer = trl_iw_opd.IWOPDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
        args=trl_iw_opd.IWOPDConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(ROWS), eval_dataset=datasets.Dataset.from_list(ROWS[:6]),
        processing_class=tokenizer)
    generations = trainer.args.num_generations
    trainer.model.generate = scripted_hf_generate(tokenizer.pad_token_id, generations)
    # TRL's RepeatSampler without its shuffle (torch's generator draws it), prompts in dataset order.
    trainer._get_train_sampler = lambda dataset=None: RepeatSampler(
        trainer.train_dataset, mini_repeat_count=generations, batch_size=trainer.args.generation_batch_size,
        shuffle=False, seed=trainer.args.seed)
    trainer.train()
    trainer.evaluate()
    params = {name: value.detach().numpy() for name, value in trainer.model.state_dict().items()}
    return trainer.state.log_history, params


def run_torchlike(student, teacher, tokenizer_path, output_dir, settings):
    from safetensors.numpy import load_file

    trainer = IWOPDTrainer(model=str(student), teacher_model=str(teacher),
                           args=IWOPDConfig(output_dir=str(output_dir), train_sampling_strategy="sequential",
                                            **settings),
                           train_dataset=ROWS, eval_dataset=ROWS[:6],
                           processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._generate_single_turn = scripted_turn(trainer)
    trainer.train()
    trainer.evaluate()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


CASES = {
    # TRL's defaults: the IW-OPD objective, every micro-batch on-policy.
    "iw_opd": dict(iw_opd_gamma=0.7),
    # The generalized JSD on the teacher's top-1 and the sampled token with the tail bucket (TRL's default support),
    # micro-batches on- or off-policy as Python's random draws them.
    "jsd, top-1 support, lmbda 0.5": dict(distillation_objective="jsd", beta=0.5, lmbda=0.5),
    # The reverse KL on the student's top-5 renormalised; each prompt twice in a step.
    "jsd, reverse KL on top-5, two generations": dict(distillation_objective="jsd", beta=1.0, loss_top_k=5,
                                                      loss_add_tail=False, num_generations=2),
    # The forward KL over the whole vocabulary, two accumulated micro-batches.
    "jsd, full vocabulary, accumulation 2": dict(distillation_objective="jsd", beta=0.0, loss_top_k=0, lmbda=0.5,
                                                 per_device_train_batch_size=2, gradient_accumulation_steps=2),
}


@pytest.fixture(scope="module")
def teacher_dir(teacher_path, chat_tokenizer_dir, tmp_path_factory):
    """The teacher with the student's tokenizer beside it (TRL's IW-OPD checks that the two tokenizers match)."""
    import shutil

    path = shutil.copytree(teacher_path, tmp_path_factory.mktemp("iw_opd") / "teacher")
    transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_iw_opd_matches_trl_step_for_step(tiny_checkpoints, teacher_dir, chat_tokenizer_dir, tmp_path, case):
    settings = comparison_settings(**CASES[case])
    teacher_path = teacher_dir
    student = tiny_checkpoints.path("qwen2")
    theirs, their_params = run_trl(student, teacher_path, chat_tokenizer_dir, tmp_path / "trl", settings)
    ours, params = run_torchlike(student, teacher_path, chat_tokenizer_dir, tmp_path / "ours", settings)
    expected = {entry["step"]: entry for entry in theirs if "loss" in entry}
    found = {entry["step"]: entry for entry in ours if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found), (found, expected)
    assert all(expected[step]["grad_norm"] > settings["max_grad_norm"] for step in expected)
    for key in sorted(set(expected[1]) - {"step", "epoch"}):
        steps = [step for step in expected if key in expected[step]]
        np.testing.assert_allclose([found[step][key] for step in steps], [expected[step][key] for step in steps],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    # evaluate() on the dataset's completions (per_device_eval_batch_size 8: one batch of 6).
    their_eval = next(entry for entry in reversed(theirs) if "eval_loss" in entry)
    our_eval = next(entry for entry in reversed(ours) if "eval_loss" in entry)
    assert set(our_eval) == set(their_eval)
    for key in [key for key in their_eval if key.startswith("eval_") and "runtime" not in key
                and "per_second" not in key]:
        np.testing.assert_allclose(our_eval[key], their_eval[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_rows_are_tokenised_as_trls_collator(chat_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    collator = trl_iw_opd_trainer._DistillationCollator(tokenizer, max_length=12, max_prompt_length=8)
    expected = {key: value.numpy() for key, value in collator(ROWS).items()}
    tokenized = [tokenize_row(row, tokenizer, 12, 8) for row in ROWS]
    ours = dataset_columns(tokenized, expected["input_ids"].shape[1], tokenizer.pad_token_id)
    np.testing.assert_array_equal(ours["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(ours["attention_mask"], expected["attention_mask"])
    np.testing.assert_array_equal(ours["completion_mask"], expected["labels"][:, 1:] != -100)


@pytest.mark.parametrize(("beta", "top_k", "tail"), [(0.0, 3, True), (0.4, 3, False), (1.0, 0, True), (0.4, 1, True)])
def test_divergence_on_each_support_is_trls(beta, top_k, tail):
    rng = np.random.default_rng(0)
    student, teacher = (rng.normal(size=(2, 4, 11)).astype(np.float32) for _ in range(2))
    targets = rng.integers(0, 11, size=(2, 4))
    labels = torch.tensor(targets)
    if beta > 0 and top_k == 1:
        trainer = types.SimpleNamespace(beta=beta, temperature=1.0, loss_add_tail=tail, reverse_kl_top_1_mode="sampled",
                                        _get_reverse_kl_top_1_tokens=lambda scores, tokens: tokens,
                                        _reduce_divergence_loss=trl_iw_opd.IWOPDTrainer._reduce_divergence_loss)
        trainer._compute_sparse_top_1_divergence_loss = \
            lambda **kw: trl_iw_opd.IWOPDTrainer._compute_sparse_top_1_divergence_loss(trainer, **kw)
        expected = trl_iw_opd.IWOPDTrainer._compute_local_sparse_top_1_divergence_loss(
            trainer, torch.tensor(student), torch.tensor(teacher), labels, labels)
    else:
        expected = trl_iw_opd.IWOPDTrainer.generalized_jsd_loss(torch.tensor(student), torch.tensor(teacher), labels,
                                                                 beta=beta, top_k=top_k, add_tail=tail)
    settings = IWOPDLossSettings(distillation_objective="jsd", beta=beta, loss_top_k=top_k, loss_add_tail=tail)
    ours = np.asarray(support_divergence(student, teacher, targets, settings)).sum() / targets.size
    np.testing.assert_allclose(ours, float(expected), rtol=1e-5)


def test_iw_opd_needs_lmbda_1_as_in_trl(tmp_path):
    with pytest.raises(ValueError, match="distillation_objective='iw_opd' requires lmbda=1.0"):
        IWOPDConfig(output_dir=str(tmp_path), lmbda=0.5)


def test_compute_metrics_gets_what_trls_prediction_step_gives(tiny_checkpoints, teacher_dir, chat_tokenizer_dir,
                                                               tmp_path):
    """The student's logits and the collator's labels of each eval batch (6 rows in batches of 4: a short last one),
    left-padded, -100 across batches, beside TRL's eval_loss."""
    found, expected_found = [], []
    settings = comparison_settings(per_device_eval_batch_size=4, include_for_metrics=["inputs"])
    student = tiny_checkpoints.path("qwen2")
    expected_trainer = trl_iw_opd.IWOPDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32),
        args=trl_iw_opd.IWOPDConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(ROWS), eval_dataset=datasets.Dataset.from_list(ROWS[:6]),
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir),
        compute_metrics=recorded_predictions(expected_found))
    trainer = IWOPDTrainer(model=str(student), teacher_model=str(teacher_dir),
                           args=IWOPDConfig(output_dir=str(tmp_path / "ours"), **settings),
                           train_dataset=ROWS, eval_dataset=ROWS[:6],
                           processing_class=torchlike.AutoTokenizer.from_pretrained(chat_tokenizer_dir),
                           compute_metrics=recorded_predictions(found))
    expected, metrics = expected_trainer.evaluate(), trainer.evaluate()
    np.testing.assert_allclose(metrics["eval_loss"], expected["eval_loss"], rtol=1e-4)
    assert metrics["eval_labelled"] == expected["eval_labelled"]
    (expected_predictions,) = expected_found
    assert_student_predictions_match(found[-1], expected_predictions, expected_trainer.processing_class.pad_token_id)
