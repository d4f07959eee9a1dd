"""Best-model tracking as transformers' Trainer does it: ``metric_for_best_model`` / ``greater_is_better``,
``state.best_metric`` / ``best_model_checkpoint``, ``save_strategy="best"``, ``save_total_limit`` keeping the best
checkpoint, ``EarlyStoppingCallback``, ``load_best_model_at_end`` and the callback states a checkpoint keeps.

Most tests feed the same scripted sequence of evaluation metrics to torchlike's Trainer (on a plain NNX module) and to
the real ``transformers.Trainer`` (on a torch module of the same shape) and compare what each decides.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers import EarlyStoppingCallback, TrainerCallback

import torchlike

LR = 0.1


class Slope(nnx.Module):
    """Training loss ``sum(w)`` (gradient 1: constant-rate SGD moves ``w`` by ``-LR`` a step); evaluation rows
    (``mode == 1``) score ``(w[0] - target)**2``."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((2,), jnp.float32))


def slope_loss(model, batch):
    mode = batch["mode"].max()  # rows padding a batch are zeros: max and min read the real rows
    w = model.w[...]
    return jnp.where(mode > 0, (w[0] - batch["target"].min()) ** 2, w.sum())


class TorchSlope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))

    def forward(self, mode, target, labels=None):
        return {"loss": self.w.sum() + 0.0 * mode.sum()}


def rows(count, mode, target=0.0):
    return [{"mode": np.float32(mode), "target": np.float32(target)} for _ in range(count)]


def scripted(trainer_class, name, sequence):
    """``trainer_class`` whose ``evaluate`` reports ``sequence[global_step - 1]`` as ``eval_<name>``, logged and sent
    to ``on_evaluate`` as each library's own ``evaluate`` does."""

    class Scripted(trainer_class):
        def evaluate(self, *args, **kwargs):
            metrics = {f"eval_{name}": sequence[self.state.global_step - 1]}
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    return Scripted


SETTINGS = dict(per_device_train_batch_size=2, max_steps=10, learning_rate=LR, lr_scheduler_type="constant",
                optim="sgd", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, eval_strategy="steps",
                eval_steps=1, save_steps=1, report_to="none", seed=0, disable_tqdm=True)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run_torchlike(output_dir, name, sequence, callbacks=(), resume=None, **overrides):
    args = torchlike.TrainingArguments(output_dir=str(output_dir), **{**SETTINGS, **overrides})
    trainer = scripted(torchlike.Trainer, name, sequence)(
        model=Slope(), args=args, train_dataset=rows(8, 0), eval_dataset=rows(2, 1), loss_fn=slope_loss,
        callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def run_transformers(output_dir, name, sequence, callbacks=(), **overrides):
    args = transformers.TrainingArguments(output_dir=str(output_dir), use_cpu=True, remove_unused_columns=False,
                                          **{**SETTINGS, **overrides})
    data = [{"mode": torch.tensor(0.0), "target": torch.tensor(0.0)} for _ in range(8)]
    trainer = scripted(transformers.Trainer, name, sequence)(
        model=TorchSlope(), args=args, train_dataset=data, eval_dataset=data[:2], callbacks=list(callbacks))
    trainer.train()
    return trainer


def folders(output_dir) -> list[str]:
    return sorted((p.name for p in Path(output_dir).glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def best_record(trainer) -> tuple:
    state = trainer.state
    best = Path(state.best_model_checkpoint).name if state.best_model_checkpoint else None
    return state.global_step, state.best_metric, state.best_global_step, best


def early_stopping_counter(trainer):
    return next(c for c in trainer.callback_handler.callbacks
                if isinstance(c, EarlyStoppingCallback)).early_stopping_patience_counter


# (metric name, metric per step, early-stopping patience and threshold, arguments): what transformers decides.
SCENARIOS = {
    # A tie is no improvement; stops at step 6, the best is step 4; the best stays among 2 kept folders.
    "loss-ties": ("loss", [5.0, 4.0, 4.0, 3.0, 3.5, 3.0, 2.9, 2.95, 3.1, 1.0], (2, 0.0),
                  dict(load_best_model_at_end=True, save_total_limit=2)),
    # Higher is better; improvements within the threshold count for the best metric but not for patience.
    "accuracy-threshold": ("accuracy", [0.1, 0.3, 0.32, 0.31, 0.33, 0.4, 0.42, 0.41, 0.43, 0.44], (3, 0.05),
                           dict(load_best_model_at_end=True, metric_for_best_model="accuracy", save_total_limit=3)),
    # save_strategy="best": a checkpoint only after a new best.
    "save-best": ("loss", [3.0, 2.0, 2.5, 1.5, 1.6, 1.7, 1.8, 0.5, 0.6, 0.7], (4, 0.0),
                  dict(save_strategy="best", metric_for_best_model="loss", load_best_model_at_end=True)),
    # save_total_limit=1: the best is kept beside the newest while training, and alone at the end.
    "limit-one": ("loss", [5.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], (3, 0.0),
                  dict(load_best_model_at_end=True, save_total_limit=1)),
    # No load_best_model_at_end: the metric is still tracked; the run goes to the end without early stopping.
    "tracking-only": ("loss", [5.0, 2.0, 3.0, 1.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], None,
                      dict(metric_for_best_model="loss", save_total_limit=2)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_best_metric_checkpoints_early_stop_and_final_weights_match_transformers(tmp_path, scenario):
    name, sequence, patience, overrides = SCENARIOS[scenario]
    stopping = [EarlyStoppingCallback(*patience)] if patience else []
    reference = run_transformers(tmp_path / "hf", name, sequence,
                                 [EarlyStoppingCallback(*patience)] if patience else [], **overrides)
    ours = run_torchlike(tmp_path / "tl", name, sequence, stopping, **overrides)

    assert best_record(ours) == best_record(reference)
    assert folders(tmp_path / "tl") == folders(tmp_path / "hf")
    if patience:
        assert early_stopping_counter(ours) == early_stopping_counter(reference)
    # Same updates (w -= LR each step) and, with load_best_model_at_end, the same checkpoint loaded back.
    np.testing.assert_allclose(np.asarray(ours.model.w[...]), reference.model.w.detach().numpy(), rtol=1e-6)
    if overrides.get("load_best_model_at_end"):
        stored = torchlike.load(Path(ours.state.best_model_checkpoint) / "model")
        for key, value in ours._trainable_model.state_dict().items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(stored[key]))


def test_load_best_model_at_end_restores_the_best_checkpoints_weights_exactly_from_real_evaluations(tmp_path):
    # Eval score (w[0] + 0.33)**2 with w[0] = -0.1 * step: best after step 3, worse after; patience 2 stops at step 5.
    args = torchlike.TrainingArguments(output_dir=str(tmp_path / "out"), load_best_model_at_end=True,
                                       save_total_limit=2, **SETTINGS)
    trainer = torchlike.Trainer(model=Slope(), args=args, train_dataset=rows(8, 0),
                                eval_dataset=rows(2, 1, target=-0.33), loss_fn=slope_loss,
                                callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    eval_losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(eval_losses) == 5 and int(np.argmin(eval_losses)) == 2
    assert trainer.state.global_step == 5
    assert trainer.state.best_metric == eval_losses[2]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-3")
    assert folders(tmp_path / "out") == ["checkpoint-3", "checkpoint-5"]
    stored = torchlike.load(tmp_path / "out" / "checkpoint-3" / "model")
    latest = torchlike.load(tmp_path / "out" / "checkpoint-5" / "model")
    weights = trainer._trainable_model.state_dict()
    assert set(weights) == set(stored)
    for key, value in weights.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(stored[key]))
        assert not np.array_equal(np.asarray(value), np.asarray(latest[key]))
    saved = json.loads((tmp_path / "out" / "checkpoint-5" / "trainer_state.json").read_text())
    assert (saved["best_global_step"], saved["best_metric"]) == (3, eval_losses[2])


def test_checkpoints_write_callback_states_as_transformers_and_resume_restores_them(tmp_path):
    # Patience 3: the counter is 2 after step 4, and step 5 stops the run.
    sequence = [5.0, 4.0, 4.5, 4.6, 4.7, 3.0, 2.0, 1.0, 0.5, 0.4]
    overrides = dict(metric_for_best_model="loss")
    straight = run_torchlike(tmp_path / "straight", "loss", sequence, [EarlyStoppingCallback(3)], **overrides)
    assert straight.state.global_step == 5

    reference = run_transformers(tmp_path / "hf", "loss", sequence, [EarlyStoppingCallback(3), StopAt(4)],
                                 **overrides)
    interrupted = run_torchlike(tmp_path / "tl", "loss", sequence, [EarlyStoppingCallback(3), StopAt(4)], **overrides)
    assert interrupted.state.global_step == reference.state.global_step == 4
    theirs = json.loads((tmp_path / "hf" / "checkpoint-4" / "trainer_state.json").read_text())
    ours = json.loads((tmp_path / "tl" / "checkpoint-4" / "trainer_state.json").read_text())
    assert ours["stateful_callbacks"] == theirs["stateful_callbacks"]
    assert ours["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {"early_stopping_patience_counter": 2}
    for key in ("best_metric", "best_global_step", "global_step"):
        assert ours[key] == theirs[key], key

    resumed = run_torchlike(tmp_path / "tl", "loss", sequence, [EarlyStoppingCallback(3)],
                            resume=str(tmp_path / "tl" / "checkpoint-4"),
                            restore_callback_states_from_checkpoint=True, **overrides)
    assert resumed.state.global_step == 5 and early_stopping_counter(resumed) == 3
    assert resumed.state.best_metric == 4.0 and resumed.state.best_global_step == 2

    fresh_callbacks = run_torchlike(tmp_path / "tl", "loss", sequence, [EarlyStoppingCallback(3)],
                                    resume=str(tmp_path / "tl" / "checkpoint-4"), **overrides)
    assert fresh_callbacks.state.global_step == 10  # the counter started again from 0, as in transformers


def test_a_metric_missing_from_the_evaluation_raises_transformers_error(tmp_path):
    with pytest.raises(KeyError, match="'eval_accuracy', which is not found in the evaluation metrics"):
        run_torchlike(tmp_path, "loss", [1.0] * 10, metric_for_best_model="accuracy")


def test_save_strategy_best_needs_metric_for_best_model(tmp_path):
    args = torchlike.TrainingArguments(output_dir=str(tmp_path), save_strategy="best", report_to="none")
    with pytest.raises(ValueError, match="`args.metric_for_best_model` must be provided when using 'best'"):
        torchlike.Trainer(model=Slope(), args=args, loss_fn=slope_loss)


@pytest.mark.parametrize("given", [dict(load_best_model_at_end=True), dict(metric_for_best_model="accuracy"),
                                   dict(metric_for_best_model="eval_loss"),
                                   dict(metric_for_best_model="loss", greater_is_better=True)])
def test_best_model_defaults_are_transformers(tmp_path, given):
    common = dict(output_dir=str(tmp_path), report_to="none", eval_strategy="steps", eval_steps=5, save_steps=5)
    ours = torchlike.TrainingArguments(**common, **given)
    theirs = transformers.TrainingArguments(**common, **given)
    assert (ours.metric_for_best_model, ours.greater_is_better) == (theirs.metric_for_best_model,
                                                                     theirs.greater_is_better)


def test_train_without_a_train_dataset_raises_transformers_error(tmp_path):
    args = torchlike.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="^Trainer: training requires a train_dataset.$"):
        torchlike.Trainer(model=Slope(), args=args, loss_fn=slope_loss).train()


def test_a_lora_causal_lm_ends_with_the_weights_of_its_best_eval_loss_checkpoint(tiny_checkpoints, tmp_path):
    from tests import tiny
    from torchlike.peft import LoraConfig, get_peft_model

    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    # greater_is_better=True on a falling eval loss: the best is the first evaluation, not the last weights.
    args = torchlike.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=5e-3,
        eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1, load_best_model_at_end=True,
        greater_is_better=True, report_to="none", seed=0, bf16=False, gradient_checkpointing=False,
        disable_tqdm=True)
    trainer = torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(8, seed=3),
                                eval_dataset=tiny.padded_examples(4, seed=3))
    trainer.train()
    evaluations = [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [step for step, _ in evaluations] == [2, 4, 6]
    assert evaluations[0][1] > evaluations[-1][1]
    assert (trainer.state.best_global_step, trainer.state.best_metric) == evaluations[0]
    assert folders(tmp_path / "out") == ["checkpoint-2"]  # save_total_limit=1 keeps only the best at the end
    stored = torchlike.load(tmp_path / "out" / "checkpoint-2" / "model")
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(stored[key]), err_msg=key)
