"""The configuration every user gets: each trainer with nothing set but ``output_dir``, ``max_steps`` and
``report_to`` (TRL's defaults: ``bf16`` and ``gradient_checkpointing`` on), and rematerialisation that changes no
loss and applies only where gradients are taken."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from flax import nnx

import torchlike
from tests import tiny
from tests.helpers.data import PROMPT_ROWS, SHORT_PREFERENCES, length_reward
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.training import train_step
from torchlike.trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

SFT_DATA = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog"},
            {"prompt": "one two", "completion": " three four five six"},
            {"prompt": "hello world, this is", "completion": " a tiny tokenizer"}] * 6


def run(name, tiny_checkpoints, tokenizer_dir, output_dir, **settings):
    """Trains trainer ``name`` from a model path with only the given settings; returns the trainer."""
    path = str(tiny_checkpoints.path("qwen2"))
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = dict(output_dir=str(output_dir), report_to="none", **settings)
    if name == "Trainer":
        trainer = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(path),
                                    args=torchlike.TrainingArguments(**settings),
                                    train_dataset=tiny.padded_examples(16, seed=1))
    elif name == "SFTTrainer":
        trainer = SFTTrainer(model=path, args=SFTConfig(**settings), train_dataset=SFT_DATA,
                             processing_class=tokenizer)
    elif name == "DPOTrainer":
        trainer = DPOTrainer(model=path, args=DPOConfig(**settings), train_dataset=SHORT_PREFERENCES,
                             processing_class=tokenizer)
    else:  # GRPO samples completions: a CPU-sized completion length and group
        trainer = GRPOTrainer(model=path, reward_funcs=length_reward, train_dataset=PROMPT_ROWS,
                              args=GRPOConfig(max_completion_length=8, num_generations=4, **settings),
                              processing_class=tokenizer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("name", ["Trainer", "SFTTrainer", "DPOTrainer", "GRPOTrainer"])
def test_each_trainer_trains_to_completion_with_its_default_config(name, tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = run(name, tiny_checkpoints, tokenizer_dir, tmp_path, max_steps=2)
    if name != "Trainer":  # TRL's defaults are what ran
        assert trainer.args.bf16 is True and trainer.args.gradient_checkpointing is True
    assert trainer.state.global_step == 2
    assert np.isfinite(trainer.state.log_history[-1]["train_loss"])


@pytest.mark.parametrize("name", ["SFTTrainer", "DPOTrainer", "GRPOTrainer"])
def test_gradient_checkpointing_changes_no_loss(name, tiny_checkpoints, tokenizer_dir, tmp_path,
                                                rematerialised_modules):
    entered = rematerialised_modules
    losses = {}
    for checkpointing in (True, False):
        trainer = run(name, tiny_checkpoints, tokenizer_dir, tmp_path / str(checkpointing), max_steps=3,
                      logging_steps=1, learning_rate=1e-3, gradient_checkpointing=checkpointing)
        losses[checkpointing] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        assert bool(entered) == checkpointing  # traced into the train step only when asked for
        entered.clear()
    assert len(losses[True]) == 3
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


def _checkpoints(jaxpr) -> int:
    """How many rematerialised (``checkpoint``) calls ``jaxpr`` and the jaxprs nested in it hold."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("checkpoint", "remat", "remat2")
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    count += _checkpoints(inner)
    return count


@pytest.mark.parametrize("case", ["qwen2", "llama3", "gemma3"])
def test_rematerialised_wraps_every_layer_while_entered_and_restores_the_module(case, tiny_checkpoints):
    import jax

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case))
    ids, mask, _ = tiny.padded_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    graphdef, params, rest = nnx.split(model.module, nnx.Param, ...)

    def loss_jaxpr(remat: bool):
        def loss(params):
            module = nnx.merge(graphdef, params, rest)
            with train_step.rematerialised(module) if remat else contextlib.nullcontext():
                return sft_loss.sft_step_loss(model.family)(module, batch)[0]

        return jax.make_jaxpr(jax.grad(loss))(params).jaxpr

    before = nnx.graphdef(model.module)
    assert _checkpoints(loss_jaxpr(True)) >= 2  # at least one per layer of the 2-layer model
    assert _checkpoints(loss_jaxpr(False)) == 0
    assert nnx.graphdef(model.module) == before
