"""torchlike.trl.experimental.gkd: TRL 1.16's experimental GKD trainer step for step against the real
``trl.experimental.gkd.GKDTrainer`` (off-policy, on-policy and sequence-level KD on the same scripted completions), its
loss against ``GKDTrainer.generalized_jsd_loss``, TRL's on-policy draws and errors, and GKDConfig against TRL's."""

from __future__ import annotations

import importlib
import os
import types
import zlib
from collections.abc import Callable

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from tests.helpers.data import CONVERSATIONS
from tests.helpers.evaluation import assert_student_predictions_match, recorded_predictions
from torchlike.adapters.losses import distillation as distillation_loss
from torchlike.testing import tiny_config
from torchlike.trl.experimental.gkd import GKDConfig, GKDTrainer
from torchlike.trl.experimental.gkd.gkd_data import dataset_columns, tokenize_conversation

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_gkd = importlib.import_module("trl.experimental.gkd")

MAX_NEW_TOKENS = 6


# --- the data ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_length", [1024, 14])
def test_conversations_are_tokenised_and_labelled_as_trls_chatml_collator(chat_tokenizer_dir, max_length):
    """Whole, and cut to their last 14 tokens (part of each prompt dropped)."""
    from trl.experimental.utils import DataCollatorForChatML

    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    rows = [{"messages": messages} for messages in CONVERSATIONS[:5]]
    expected = {key: value.numpy() for key, value in DataCollatorForChatML(tokenizer, max_length=max_length)(
        rows).items() if key in ("input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask")}
    tokenized = [tokenize_conversation(row, tokenizer, max_length) for row in rows]
    ours = dataset_columns(tokenized, expected["input_ids"].shape[1], tokenizer.pad_token_id)
    labelled = expected["labels"][:, 1:] != -100

    assert max_length > 100 or all(len(row["input_ids"]) == max_length for row in tokenized)
    np.testing.assert_array_equal(ours["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(ours["attention_mask"], expected["attention_mask"])
    np.testing.assert_array_equal(ours["completion_mask"], labelled)
    np.testing.assert_array_equal(ours["label_count"], labelled.sum(axis=1))
    prompts = [ids[mask == 1].tolist() for ids, mask in zip(expected["prompts"], expected["prompt_attention_mask"],
                                                             strict=True)]
    assert [row["prompt_ids"] for row in tokenized] == prompts


# --- the loss on the same logits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("num_items_in_batch", [None, 13])
def test_generalized_jsd_equals_trls_gkd_loss_on_the_same_logits(beta, num_items_in_batch):
    rng = np.random.default_rng(int(beta * 10))
    student = (3 * rng.normal(size=(3, 7, 33))).astype(np.float32)
    teacher = (3 * rng.normal(size=(3, 7, 33))).astype(np.float32)
    mask = (rng.random((3, 7)) > 0.3).astype(np.int64)
    labels = np.where(mask == 1, 5, -100)
    student_torch = torch.tensor(student, requires_grad=True)
    expected = trl_gkd.GKDTrainer.generalized_jsd_loss(student_torch, torch.tensor(teacher), torch.tensor(labels),
                                                       beta=beta, num_items_in_batch=num_items_in_batch)
    expected.backward()

    def loss(logits):
        return distillation_loss.generalized_jsd_loss(logits, jnp.asarray(teacher), jnp.asarray(mask), beta, 1.0,
                                                      num_items_in_batch)[0]

    np.testing.assert_allclose(float(loss(jnp.asarray(student))), expected.item(), rtol=1e-6)
    grad = np.asarray(jax.grad(loss)(jnp.asarray(student)))
    np.testing.assert_allclose(grad, student_torch.grad.numpy(), rtol=1e-4,
                               atol=1e-5 * np.abs(student_torch.grad.numpy()).max())


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("with_labels", [True, False])
def test_the_static_loss_equals_trls_for_every_reduction(reduction, with_labels):
    rng = np.random.default_rng(7)
    student, teacher = rng.normal(size=(2, 5, 17)).astype(np.float32), rng.normal(size=(2, 5, 17)).astype(np.float32)
    labels = np.where(rng.random((2, 5)) > 0.4, 3, -100) if with_labels else None
    expected = trl_gkd.GKDTrainer.generalized_jsd_loss(
        torch.tensor(student), torch.tensor(teacher), None if labels is None else torch.tensor(labels), beta=0.4,
        temperature=0.8, reduction=reduction)
    ours = GKDTrainer.generalized_jsd_loss(jnp.asarray(student), jnp.asarray(teacher), labels, beta=0.4,
                                           temperature=0.8, reduction=reduction)
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), rtol=1e-5, atol=1e-7)


# --- step for step against trl.experimental.gkd.GKDTrainer -----------------------------------------------------------

def scripted_completion(prompt_ids) -> list[int]:
    """A fixed completion per prompt: 2 to MAX_NEW_TOKENS tokens, ending with EOS when shorter than the limit (where
    generation stops), with or without it at the limit."""
    rng = np.random.default_rng(zlib.crc32(bytes(np.asarray(prompt_ids, np.uint8))))
    length = int(rng.integers(2, MAX_NEW_TOKENS + 1))
    completion = rng.integers(3, tiny.VOCAB, size=length).tolist()
    if length < MAX_NEW_TOKENS or rng.random() < 0.5:
        completion[-1] = tiny.EOS
    return completion


def scripted_generate(which: str, calls: list, pad_token_id: int):
    """``model.generate`` as TRL's ``generate_on_policy_outputs`` calls it, returning the scripted completions (the
    prompt echoed, completions padded to the longest, as transformers pads finished rows); records ``which``."""

    def generate(input_ids, attention_mask, generation_config, return_dict_in_generate):
        calls.append(which)
        completions = [scripted_completion(ids[mask.bool()].tolist())
                       for ids, mask in zip(input_ids, attention_mask, strict=True)]
        width = max(map(len, completions))
        tokens = torch.full((len(completions), width), pad_token_id, dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return types.SimpleNamespace(sequences=torch.cat([input_ids, tokens], dim=1))

    return generate


def comparison_settings(**case) -> dict:
    """Both trainers' settings: gradient accumulation, warmup, weight decay, clipping below every step's norm, a
    second epoch (16 conversations, 8 per step), gradient checkpointing on (TRL's default), float32
    (TRL's bf16 is autocast, torchlike's casts the weights: equal only to bf16 precision), conversations in dataset
    order (torch's RandomSampler draws its order from torch's global generator)."""
    return dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_new_tokens=MAX_NEW_TOKENS,
                max_steps=3, learning_rate=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=0.02,
                adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False, report_to="none",
                save_strategy="no", train_sampling_strategy="sequential", **case)


def run_trl_gkd(student, teacher, tokenizer_path, output_dir, settings):
    """``trl.experimental.gkd.GKDTrainer`` on the conversations, generating the scripted completions: its log history,
    final parameters and which model generated for each micro-batch."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    trainer = trl_gkd.GKDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
        args=trl_gkd.GKDConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS}),
        processing_class=tokenizer)
    calls = []
    trainer.model.generate = scripted_generate("student", calls, tokenizer.pad_token_id)
    trainer.teacher_model.generate = scripted_generate("teacher", calls, tokenizer.pad_token_id)
    trainer.train()
    params = {name: value.detach().numpy() for name, value in trainer.model.state_dict().items()}
    return trainer.state.log_history, params, calls


def run_torchlike_gkd(student, teacher, tokenizer_path, output_dir, settings):
    """torchlike's GKDTrainer as :func:`run_trl_gkd`."""
    from safetensors.numpy import load_file

    trainer = GKDTrainer(model=str(student), teacher_model=str(teacher),
                         args=GKDConfig(output_dir=str(output_dir), **settings),
                         train_dataset=[{"messages": messages} for messages in CONVERSATIONS],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    calls = []

    def scripted_turn(prompt_ids, seed, worker=None):
        sampler = (worker or trainer.rollout_worker).model()
        calls.append("teacher" if sampler is trainer.teacher_model.module else "student")
        return [scripted_completion(ids) for ids in prompt_ids], None

    trainer._generate_single_turn = scripted_turn
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors"), calls


COMPARISON_CASES = {
    "off-policy, beta 0.5": dict(lmbda=0.0, beta=0.5),
    "on-policy, beta 1 (reverse KL)": dict(lmbda=1.0, beta=1.0, temperature=0.7),
    "seq_kd, beta 0.3": dict(lmbda=0.0, beta=0.3, seq_kd=True),
    "mixed: lmbda 0.5 with seq_kd, beta 0 (forward KL)": dict(lmbda=0.5, beta=0.0, seq_kd=True),
}
EXPECTED_CALLS = {"off-policy, beta 0.5": [], "on-policy, beta 1 (reverse KL)": ["student"] * 6,
                  "seq_kd, beta 0.3": ["teacher"] * 6}


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_losses_and_weights_match_trl_step_for_step(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path,
                                                    case):
    settings = comparison_settings(**COMPARISON_CASES[case])
    student = tiny_checkpoints.path("qwen2")
    expected_history, expected_params, expected_calls = run_trl_gkd(student, teacher_path, chat_tokenizer_dir,
                                                                    tmp_path / "trl", settings)
    history, params, calls = run_torchlike_gkd(student, teacher_path, chat_tokenizer_dir, tmp_path / "ours",
                                               settings)
    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}

    assert calls == expected_calls == EXPECTED_CALLS.get(case, expected_calls)  # TRL's draws, micro-batch by one
    if case.startswith("mixed"):
        assert {"student", "teacher"} <= set(calls)
    assert list(ours) == list(expected) == [1, 2, 3]
    assert all(set(ours[step]) == set(expected[step]) - {"step_time"} for step in ours)
    assert all(entry["grad_norm"] > settings["max_grad_norm"] for entry in expected.values())  # clipping is on
    for key in ("loss", "grad_norm", "learning_rate"):
        np.testing.assert_allclose([ours[step][key] for step in ours], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-7, err_msg=key)
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


def test_breaking_the_loss_fails_the_comparison(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path,
                                                monkeypatch):
    """The comparison above is sharp: a loss off by a factor of 1.01 (here: the weight of the labels) is caught."""
    original = distillation_loss.gkd_step_loss

    def off_by_one_percent(*args, **kwargs):
        loss = original(*args, **kwargs)

        def scaled(pair, batch, num_items_in_batch=None):
            value, weight, metrics = loss(pair, batch, num_items_in_batch)
            return value, weight * 1.01, metrics

        return scaled

    settings = {**comparison_settings(lmbda=0.0, beta=0.5), "max_steps": 1}
    expected_history, _, _ = run_trl_gkd(tiny_checkpoints.path("qwen2"), teacher_path, chat_tokenizer_dir,
                                         tmp_path / "trl", settings)
    monkeypatch.setattr(distillation_loss, "gkd_step_loss", off_by_one_percent)
    history, _, _ = run_torchlike_gkd(tiny_checkpoints.path("qwen2"), teacher_path, chat_tokenizer_dir,
                                      tmp_path / "ours", settings)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(history[0]["loss"], expected_history[0]["loss"], rtol=1e-4)


# --- sampling for real -----------------------------------------------------------------------------------------------

def gkd_trainer(tiny_checkpoints, teacher_path, tokenizer_path, output_dir, compute_metrics: Callable | None = None,
                **settings) -> GKDTrainer:
    return GKDTrainer(model=str(tiny_checkpoints.path("qwen2")), teacher_model=str(teacher_path),
                      args=GKDConfig(output_dir=str(output_dir), report_to="none", save_strategy="no", **settings),
                      train_dataset=[{"messages": messages} for messages in CONVERSATIONS],
                      eval_dataset=[{"messages": messages} for messages in CONVERSATIONS[:6]],
                      processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path),
                      compute_metrics=compute_metrics)


@pytest.mark.parametrize("sampler", ["student", "teacher"])
def test_on_policy_and_seq_kd_sample_from_their_model_and_train_only_the_student(
        tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path, sampler):
    trainer = gkd_trainer(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path, per_device_train_batch_size=4,
                          max_steps=2, max_new_tokens=5, learning_rate=1e-2, logging_steps=1,
                          lmbda=1.0 if sampler == "student" else 0.0, seq_kd=sampler == "teacher")
    student_before = {key: np.asarray(value) for key, value in trainer.model.state_dict().items()}
    teacher_before = {key: np.asarray(value) for key, value in trainer.teacher_model.state_dict().items()}
    sampled, sample = [], trainer._generate_single_turn

    def recording(prompt_ids, seed, worker=None):
        from_teacher = (worker or trainer.rollout_worker).model() is trainer.teacher_model.module
        sampled.append((from_teacher, sample(prompt_ids, seed, worker=worker)[0]))
        return sample(prompt_ids, seed, worker=worker)

    trainer._generate_single_turn = recording
    trainer.train()

    assert [from_teacher for from_teacher, _ in sampled] == [sampler == "teacher"] * 2
    assert all(1 <= len(ids) <= 5 and tiny.EOS not in ids[:-1] for _, batch in sampled for ids in batch)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(np.isfinite(loss) and loss > 0 for loss in losses)
    assert any(not np.array_equal(np.asarray(value), student_before[key])
               for key, value in trainer.model.state_dict().items())
    assert all(np.array_equal(np.asarray(value), teacher_before[key])
               for key, value in trainer.teacher_model.state_dict().items())


def test_evaluation_loss_and_compute_metrics_are_trls_on_the_dataset(tiny_checkpoints, teacher_path,
                                                                     chat_tokenizer_dir, tmp_path):
    """TRL evaluates GKD on the dataset's conversations (no sampling): each batch's loss is its divergence per label,
    ``eval_loss`` their mean over rows; ``compute_metrics`` gets what transformers' ``prediction_step`` gives it,
    the student's logits and the collator's labels, each batch (6 rows in batches of 4: a short last one) left-padded
    to its longest row and padded with -100 across batches."""
    found, expected_found = [], []
    trainer = gkd_trainer(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path, per_device_eval_batch_size=4,
                          bf16=False, include_for_metrics=["inputs"], compute_metrics=recorded_predictions(found))
    expected_trainer = trl_gkd.GKDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32),
        args=trl_gkd.GKDConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                               per_device_eval_batch_size=4, include_for_metrics=["inputs"]),
        train_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS}),
        eval_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS[:6]}),
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir),
        compute_metrics=recorded_predictions(expected_found))
    expected = expected_trainer.evaluate()
    metrics = trainer.evaluate()
    np.testing.assert_allclose(metrics["eval_loss"], expected["eval_loss"], rtol=1e-4)
    assert metrics["eval_labelled"] == expected["eval_labelled"]
    (expected_predictions,) = expected_found
    assert_student_predictions_match(found[-1], expected_predictions, expected_trainer.processing_class.pad_token_id)


# --- TRL's errors ----------------------------------------------------------------------------------------------------

def trl_error(tiny_checkpoints, tokenizer, teacher, tmp_path, **config) -> str:
    with pytest.raises(ValueError) as caught:
        trl_gkd.GKDTrainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
            teacher_model=teacher, args=trl_gkd.GKDConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                                          **config),
            train_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS}), processing_class=tokenizer)
    return str(caught.value)


def torchlike_error(tiny_checkpoints, tokenizer, teacher, tmp_path, **config) -> str:
    with pytest.raises(ValueError) as caught:
        GKDTrainer(model=str(tiny_checkpoints.path("qwen2")), teacher_model=teacher,
                   args=GKDConfig(output_dir=str(tmp_path), report_to="none", **config),
                   train_dataset=[{"messages": messages} for messages in CONVERSATIONS], processing_class=tokenizer)
    return str(caught.value)


def test_a_tokenizer_without_a_pad_token_is_refused_as_in_trl(tiny_checkpoints, tokenizer_dir, teacher_path,
                                                              tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.pad_token_id is None
    expected = trl_error(tiny_checkpoints, tokenizer, str(teacher_path), tmp_path / "trl")
    assert torchlike_error(tiny_checkpoints, tokenizer, str(teacher_path), tmp_path / "ours") == expected


def test_init_kwargs_for_a_loaded_teacher_are_refused_as_in_trl(tiny_checkpoints, chat_tokenizer_dir, teacher_path,
                                                                tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    expected = trl_error(tiny_checkpoints, tokenizer, transformers.AutoModelForCausalLM.from_pretrained(teacher_path),
                         tmp_path / "trl", teacher_model_init_kwargs={"dtype": "float32"})
    ours = torchlike_error(tiny_checkpoints, tokenizer, torchlike.AutoModelForCausalLM.from_pretrained(teacher_path),
                           tmp_path / "ours", teacher_model_init_kwargs={"dtype": "float32"})
    assert ours == expected


def test_a_teacher_with_another_vocabulary_is_refused_in_trls_words(tiny_checkpoints, chat_tokenizer_dir, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    config = tiny_config("qwen2", vocab_size=160)
    expected = trl_error(tiny_checkpoints, tokenizer, transformers.AutoModelForCausalLM.from_config(config),
                         tmp_path / "trl")
    ours = torchlike_error(tiny_checkpoints, tokenizer, torchlike.AutoModelForCausalLM.from_config(config),
                           tmp_path / "ours")
    shared = "requires a shared vocabulary."
    assert ours[:ours.index(shared)] == expected[:expected.index(shared)]


def test_a_row_without_prompt_tokens_after_truncation_is_refused_as_in_trl(tiny_checkpoints, chat_tokenizer_dir,
                                                                           teacher_path, tmp_path):
    """TRL's collator raises when the first batch is built; torchlike tokenises at construction and raises there."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    trainer = trl_gkd.GKDTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
        teacher_model=str(teacher_path), args=trl_gkd.GKDConfig(output_dir=str(tmp_path), use_cpu=True, max_length=3,
                                                                report_to="none"),
        train_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS}), processing_class=tokenizer)
    with pytest.raises(ValueError) as expected:
        next(iter(trainer.get_train_dataloader()))
    assert torchlike_error(tiny_checkpoints, tokenizer, str(teacher_path), tmp_path, max_length=3) == \
        str(expected.value)


# --- GKDConfig against trl.experimental.gkd.GKDConfig (its field walk: test_config_parity.py) ------------------

@pytest.mark.parametrize("values", [{"lmbda": -0.1}, {"lmbda": 1.5}, {"beta": -0.5}, {"beta": 2.0}])
def test_lmbda_and_beta_outside_0_1_are_refused_in_trls_words(tmp_path, values):
    with pytest.raises(ValueError) as expected:
        trl_gkd.GKDConfig(output_dir=str(tmp_path), use_cpu=True, **values)
    with pytest.raises(ValueError) as ours:
        GKDConfig(output_dir=str(tmp_path), **values)
    assert str(ours.value) == str(expected.value)


def test_gkd_defaults_are_trls(tmp_path):
    theirs, ours = trl_gkd.GKDConfig(output_dir=str(tmp_path), use_cpu=True), GKDConfig(output_dir=str(tmp_path))
    for name in ("temperature", "lmbda", "beta", "max_new_tokens", "disable_dropout", "seq_kd", "learning_rate",
                 "max_length", "logging_steps", "gradient_checkpointing"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_the_constructor_takes_trls_arguments_in_trls_order():
    import inspect

    theirs = list(inspect.signature(trl_gkd.GKDTrainer.__init__).parameters)
    ours = list(inspect.signature(GKDTrainer.__init__).parameters)
    assert ours[:len(theirs)] == theirs and ours[len(theirs):] == ["quantization_config"]


def test_a_resumed_run_continues_trls_draws(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path):
    """TRL's resumed run restores Python's generator from the checkpoint; torchlike's skips the draws of the steps
    done, in this epoch and the ones before, so both continue the uninterrupted sequence."""
    import random

    trainer = gkd_trainer(tiny_checkpoints, teacher_path, chat_tokenizer_dir, tmp_path, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, seed=3)
    uninterrupted = random.Random(3)
    draws = [uninterrupted.random() for _ in range(12)]  # 4 micro-batches per epoch (16 conversations, 4 each)
    assert next(trainer._policy_draws(0, 0)) == draws[0]
    resumed = trainer._policy_draws(0, 1)
    assert [next(resumed) for _ in range(4)] == draws[2:6]
    resumed = trainer._policy_draws(2, 1)
    assert [next(resumed) for _ in range(2)] == draws[10:12]
