"""Trainer / SFT numerics against the real TRL, accumulation, LoRA, traces and resume."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from transformers import TrainerCallback

import torchlike
from tests import tiny
from tests.helpers.logs import logged
from tests.helpers.training import training_arguments
from torchlike.adapters.runtime import tracing
from torchlike.peft import LoraConfig, get_peft_model


def sequential(trainer, count):
    trainer._get_train_sampler = lambda epoch: np.arange(count)
    return trainer


def test_gradient_accumulation_4x2_equals_batch_8_on_padded_examples(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("qwen2")
    examples = tiny.padded_examples(16, seed=2)

    def train(**overrides):
        model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path),
                               LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        # SGD keeps the update linear in the gradient; Adam would turn float noise in near-zero
        # gradient entries into lr-sized steps and hide what this test checks.
        args = training_arguments(tmp_path, max_steps=2, learning_rate=1e-1, optim="sgd", max_grad_norm=0.0,
                                  **overrides)
        trainer = sequential(torchlike.Trainer(model=model, args=args, train_dataset=examples), 16)
        trainer.train()
        return model.state_dict()

    whole = train(per_device_train_batch_size=8)
    accumulated = train(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert max(float(np.abs(np.asarray(whole[k]) - np.asarray(accumulated[k])).max()) for k in whole) <= 1e-5


def test_lora_sft_lowers_the_loss_and_changes_only_lora_parameters(tiny_checkpoints, tmp_path):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    before = {k: np.asarray(v) for k, v in model.state_dict().items()}
    examples = tiny.padded_examples(8, seed=3)
    args = training_arguments(tmp_path, max_steps=15, learning_rate=5e-3)
    trainer = sequential(torchlike.Trainer(model=model, args=args, train_dataset=examples), 8)
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert losses[-1] < losses[0] - 0.5
    changed = {k for k, v in model.state_dict().items() if not np.array_equal(np.asarray(v), before[k])}
    assert changed and all("_lora_" in k for k in changed)


def test_second_epoch_and_last_partial_batch_add_no_trace(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    examples = tiny.padded_examples(10, seed=4)  # 10 = 2 full batches of 4 + a partial one of 2
    trainer = torchlike.Trainer(model=model, args=training_arguments(tmp_path, max_steps=-1, num_train_epochs=2),
                                train_dataset=examples)
    before = tracing.TRACE_COUNTS["train_step"]
    trainer.train()
    assert trainer.state.global_step == 6
    assert tracing.TRACE_COUNTS["train_step"] - before == 1


def test_resume_from_a_checkpoint_continues_exactly(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("qwen2")
    examples = tiny.padded_examples(24, seed=5)

    def trainer_for(output, **overrides):
        model = torchlike.AutoModelForCausalLM.from_pretrained(path)
        args = training_arguments(tmp_path, output_dir=str(tmp_path / output), max_steps=10, save_strategy="steps",
                                  save_steps=5, lr_scheduler_type="linear", weight_decay=0.01, **overrides)
        return torchlike.Trainer(model=model, args=args, train_dataset=examples)

    straight = trainer_for("straight")
    straight.train()

    class StopAtFive(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 5

    interrupted = trainer_for("resumed")
    interrupted.add_callback(StopAtFive())
    interrupted.train()
    assert interrupted.state.global_step == 5
    resumed = trainer_for("resumed")
    resumed.train(resume_from_checkpoint=True)

    assert logged(resumed.state.log_history, "loss") == logged(straight.state.log_history, "loss")
    for name, value in straight.model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(resumed.model.state_dict()[name]), np.asarray(value))


def test_plain_nnx_module_trains_with_a_jax_native_loss_fn(tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    class Regressor(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        error = model.linear(batch["x"])[:, 0] - batch["y"]
        return (error ** 2).mean(), {"max_error": jnp.abs(error).max()}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    data = [{"x": row, "y": np.float32(row @ np.array([1.0, -2.0, 0.5, 3.0]))} for row in x]
    module = Regressor()
    trainer = torchlike.Trainer(model=module, args=training_arguments(tmp_path, max_steps=60, learning_rate=0.1),
                                train_dataset=data, loss_fn=loss_fn)
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert losses[-1] < 0.05 * losses[0]
    max_errors = [entry["max_error"] for entry in trainer.state.log_history if "max_error" in entry]
    assert len(max_errors) == len(losses) and max_errors[-1] < max_errors[0]


def test_compute_loss_func_and_loss_fn_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="either compute_loss_func .* or loss_fn"):
        torchlike.Trainer(model=None, args=training_arguments(tmp_path), compute_loss_func=lambda *a, **k: 0.0,
                          loss_fn=lambda model, batch: 0.0)


def test_compute_loss_func_on_a_causal_lm_matches_the_built_in_loss(tiny_checkpoints, tmp_path):
    import jax.numpy as jnp
    import optax

    def causal_lm_loss(outputs, labels, num_items_in_batch=None):
        logits, targets = outputs.logits[:, :-1], labels[:, 1:]
        valid = targets != -100
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
        return jnp.where(valid, nll, 0.0).sum() / num_items_in_batch

    examples = tiny.padded_examples(16, seed=6)
    labelled = [{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"],
                 "labels": np.where(e["attention_mask"] == 1, e["input_ids"], -100)} for e in examples]
    runs = []
    for rows, hook in ((examples, None), (labelled, causal_lm_loss)):
        model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
        args = training_arguments(tmp_path, max_steps=2, gradient_accumulation_steps=2,
                                  train_sampling_strategy="sequential")
        trainer = torchlike.Trainer(model=model, args=args, train_dataset=rows, compute_loss_func=hook)
        trainer.train()
        runs.append(logged(trainer.state.log_history, "loss"))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def test_each_new_trace_is_logged_with_its_shapes(tiny_checkpoints, tmp_path, caplog):
    import logging

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    trainer = torchlike.Trainer(model=model, args=training_arguments(tmp_path, max_steps=2,
                                                                     gradient_accumulation_steps=2),
                                train_dataset=tiny.padded_examples(16, seed=9))
    with caplog.at_level(logging.INFO, logger="torchlike.adapters.runtime.tracing"):
        trainer.train()
    traces = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tracing train_step")]
    assert len(traces) == 1 and f"input_ids (2, 4, {tiny.EXAMPLE_LENGTH}) int32" in traces[0]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lora_step_is_traced_once_with_or_without_dropout(tiny_checkpoints, tmp_path, dropout):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    trainer = torchlike.Trainer(model=model, args=training_arguments(tmp_path, max_steps=3),
                                train_dataset=tiny.padded_examples(12, seed=2))
    before = tracing.TRACE_COUNTS["train_step"]
    trainer.train()
    assert tracing.TRACE_COUNTS["train_step"] - before == 1


def test_bf16_parameters_keep_bf16_optimizer_state_and_one_trace(tiny_checkpoints, tmp_path):
    from flax import nnx

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="bfloat16")
    trainer = torchlike.Trainer(model=model, args=training_arguments(tmp_path, max_steps=3, bf16=True),
                                train_dataset=tiny.padded_examples(12, seed=2))
    before = tracing.TRACE_COUNTS["train_step"]
    trainer.train()
    assert tracing.TRACE_COUNTS["train_step"] - before == 1
    moments = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(trainer.optimizer, nnx.OptState))
               if v.get_value().ndim > 1]
    assert moments and all(m.dtype == np.dtype("bfloat16") for m in moments)


def test_neftune_in_the_base_trainer_perturbs_training_steps_only(tiny_checkpoints, tmp_path):
    path, examples = tiny_checkpoints.path("qwen2"), tiny.padded_examples(8, seed=4)

    def run(alpha):
        args = training_arguments(tmp_path, max_steps=2, neftune_noise_alpha=alpha)
        trainer = sequential(torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(path), args=args,
                                               train_dataset=examples, eval_dataset=examples), 8)
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        return before, logged(trainer.state.log_history, "loss")

    clean_eval, clean = run(None)
    noisy_eval, noisy = run(5.0)
    assert noisy_eval == clean_eval  # evaluation sees no noise
    assert abs(noisy[0] - clean[0]) > 1e-4  # the first training step already does
    assert run(5.0)[1] == noisy  # the noise is seeded


def test_neftune_needs_a_causal_lm(tmp_path):
    from flax import nnx

    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0 .* plain Linear"):
        torchlike.Trainer(model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                          args=training_arguments(tmp_path, neftune_noise_alpha=5.0),
                          train_dataset=[{"x": [0.0, 1.0]}], loss_fn=lambda model, batch: model(batch["x"]).sum())


def test_metrics_and_state_files_are_transformers(tmp_path, capsys):
    """``log_metrics``, ``save_metrics`` and ``save_state`` (which TRL's example scripts call after ``evaluate()``)
    print and write what transformers' ``Trainer`` methods do with the same metrics and state."""
    import json
    import types

    from flax import nnx
    from transformers import trainer_pt_utils

    class Regressor(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    data = [{"x": np.ones(2, np.float32), "y": np.float32(1.0)}] * 4
    def loss_fn(model, batch):
        return ((model.linear(batch["x"])[:, 0] - batch["y"]) ** 2).mean()

    trainer = torchlike.Trainer(model=Regressor(), args=training_arguments(tmp_path / "ours", max_steps=2),
                                train_dataset=data, loss_fn=loss_fn)
    metrics = trainer.train().metrics | {"eval_loss": 0.123456789, "eval_runtime": 3723.25}
    capsys.readouterr()
    reference = types.SimpleNamespace(is_world_process_zero=lambda: True, state=trainer.state,
                                      args=types.SimpleNamespace(output_dir=str(tmp_path / "transformers")))
    (tmp_path / "transformers").mkdir()
    printed = []
    for log_metrics, save_metrics, save_state in (
            (trainer.log_metrics, trainer.save_metrics, trainer.save_state),
            tuple(functools.partial(function, reference) for function in (
                trainer_pt_utils.log_metrics, trainer_pt_utils.save_metrics, trainer_pt_utils.save_state))):
        log_metrics("eval", metrics)
        printed.append(capsys.readouterr().out)
        save_metrics("train", {"train_loss": 1.5})
        save_metrics("eval", metrics)
        save_state()
    assert printed[0] == printed[1] and "***** eval metrics *****" in printed[0] and "1:02:03.25" in printed[0]
    for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json"):
        ours, theirs = Path(trainer.args.output_dir) / name, tmp_path / "transformers" / name
        assert ours.read_text() == theirs.read_text(), name
    assert json.loads((Path(trainer.args.output_dir) / "all_results.json").read_text()) == {"train_loss": 1.5} | metrics
    assert not list(Path(trainer.args.output_dir).glob("*.partial"))
