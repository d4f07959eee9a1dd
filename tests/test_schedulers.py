"""Learning-rate schedules: every ``lr_scheduler_type`` and ``lr_scheduler_kwargs`` torchlike runs gives, step for step,
the rate of ``transformers.get_scheduler`` stepping a torch optimizer, in the logs and in the update itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers import TrainerCallback

import torchlike
from torchlike.optim import learning_rate_schedule

PEAK = 0.5
STEPS = 14

# (lr_scheduler_type, warmup_steps, lr_scheduler_kwargs): each type with its keywords, warmup as steps and as a ratio.
CASES = [
    ("linear", 3, None),
    ("cosine", 0.2, None),
    ("cosine", 2, {"num_cycles": 1.5}),
    ("cosine_with_restarts", 2, {"num_cycles": 3}),
    ("polynomial", 3, {"power": 2.0, "lr_end": 1e-3}),
    ("constant", 0, None),
    ("constant_with_warmup", 4, None),
    ("inverse_sqrt", 3, {"timescale": 5}),
    ("inverse_sqrt", 0, None),
    ("cosine_with_min_lr", 2, {"min_lr": 1e-2}),
    ("cosine_with_min_lr", 2, {"min_lr_rate": 0.1, "num_cycles": 0.75}),
    ("cosine_warmup_with_min_lr", 3, {"min_lr_rate": 0.05}),
    ("cosine_warmup_with_min_lr", 3, {"min_lr": 1e-2, "warmup_lr_rate": 0.1}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 5}),
    ("warmup_stable_decay", 3, {"num_stable_steps": 4, "num_decay_steps": 5, "warmup_type": "cosine",
                                "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 6, "warmup_type": "1-sqrt", "decay_type": "linear",
                                "num_cycles": 1.0}),
]
IDS = [f"{name}-{warmup}-{kwargs}" for name, warmup, kwargs in CASES]


def transformers_rates(name, warmup, kwargs, steps=STEPS) -> list[float]:
    """The rate each optimizer step uses in transformers: the optimizer's lr before the k-th ``scheduler.step()``."""
    parameter = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([parameter], lr=PEAK)
    arguments = transformers.TrainingArguments("unused", warmup_steps=warmup, report_to="none")
    scheduler = transformers.get_scheduler(name, optimizer, num_warmup_steps=arguments.get_warmup_steps(steps),
                                           num_training_steps=steps, scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def arguments(tmp_path, name, warmup, kwargs, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=STEPS,
                  learning_rate=PEAK, lr_scheduler_type=name, warmup_steps=warmup, lr_scheduler_kwargs=kwargs,
                  optim="sgd", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, disable_tqdm=True)
    values.update(overrides)
    return torchlike.TrainingArguments(**values)


@pytest.mark.parametrize(("name", "warmup", "kwargs"), CASES, ids=IDS)
def test_each_steps_rate_is_transformers_get_scheduler_rate(tmp_path, name, warmup, kwargs):
    expected = transformers_rates(name, warmup, kwargs)
    schedule = learning_rate_schedule(arguments(tmp_path, name, warmup, kwargs), STEPS)
    np.testing.assert_allclose([schedule.learning_rate(step) for step in range(STEPS)], expected, rtol=1e-12)
    # The train step's rates (float32, read at a traced step count) round transformers' values once.
    in_step = jax.jit(jax.vmap(schedule))(np.arange(STEPS, dtype=np.int32))
    np.testing.assert_allclose(np.asarray(in_step, np.float64), expected, rtol=1e-7, atol=0)


class Slope(nnx.Module):
    """A module whose loss ``sum(w)`` has gradient 1 everywhere, so each SGD step moves ``w`` by exactly the step's
    learning rate."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((2,), jnp.float32))


def slope_loss(model, batch):
    return model.w[...].sum() + 0.0 * batch["x"].sum()


class RecordWeights(TrainerCallback):
    def __init__(self):
        self.weights = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append(float(np.asarray(model.w[...])[0]))


@pytest.mark.parametrize(("name", "warmup", "kwargs"), [CASES[i] for i in (0, 3, 4, 7, 10, 12, 14)],
                         ids=[IDS[i] for i in (0, 3, 4, 7, 10, 12, 14)])
def test_a_training_run_logs_and_applies_transformers_rates(tmp_path, name, warmup, kwargs):
    expected = transformers_rates(name, warmup, kwargs)
    recorder = RecordWeights()
    data = [{"x": np.ones((1,), np.float32)} for _ in range(4)]
    trainer = torchlike.Trainer(model=Slope(), args=arguments(tmp_path, name, warmup, kwargs), train_dataset=data,
                                loss_fn=slope_loss, callbacks=[recorder])
    trainer.train()
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == STEPS
    np.testing.assert_allclose(logged, expected, rtol=1e-7, atol=0)
    moves = -np.diff([0.0, *recorder.weights])  # SGD on a unit gradient: w moves by the rate it was given
    np.testing.assert_allclose(moves, expected, rtol=1e-5, atol=1e-7)


def test_a_schedule_without_its_required_keyword_raises_transformers_error(tmp_path):
    args = arguments(tmp_path, "cosine_with_min_lr", 2, None)
    with pytest.raises(ValueError, match="One of min_lr or min_lr_rate should be set"):
        learning_rate_schedule(args, STEPS)
    with pytest.raises(TypeError, match="power"):
        learning_rate_schedule(arguments(tmp_path, "cosine", 2, {"power": 2.0}), STEPS)


@pytest.mark.parametrize("name", ["reduce_lr_on_plateau", "greedy"])
def test_metric_driven_schedules_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=rf"lr_scheduler_type='{name}' is not supported.*evaluation metrics"):
        torchlike.TrainingArguments(lr_scheduler_type=name)


def test_lr_scheduler_kwargs_from_a_command_line_reach_the_schedule(tmp_path):
    args = arguments(tmp_path, "cosine_with_restarts", 2, '{"num_cycles": 2}')
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    schedule = learning_rate_schedule(args, STEPS)
    assert [schedule.learning_rate(k) for k in range(STEPS)] == transformers_rates("cosine_with_restarts", 2,
                                                                                   {"num_cycles": 2})
