"""Rollout engines by name: an engine registered from outside torchlike (here, from this test module) runs GRPO and
``generate`` through ``rollout_engine="<name>"`` with no change to any trainer, and the names are checked where the
configs and ``generate`` read them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers

import torchlike
from tests.helpers.data import PROMPT_ROWS, length_reward
from torchlike.adapters import rollout
from torchlike.adapters.rollout import PagedEngine, StaticEngine
from torchlike.peft import LoraConfig
from torchlike.trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer


class RecordingEngine:
    """A third engine: the static one inside, recording what it was built with and asked for."""

    built: list[RecordingEngine] = []

    def __init__(self, module, context):
        self.context = context
        self.inner = StaticEngine(module, eos_token_ids=context.eos_token_ids, pad_token_id=context.pad_token_id,
                                  lora=context.lora)
        self.requests = 0
        self.updates = 0
        RecordingEngine.built.append(self)

    def generate(self, requests, settings):
        self.requests += len(requests)
        return self.inner.generate(requests, settings)

    def update_weights(self, module):
        self.updates += 1
        self.inner.update_weights(module)

    def close(self):
        self.inner.close()


@pytest.fixture
def recording():
    torchlike.register_rollout_engine("recording", RecordingEngine)
    yield RecordingEngine
    torchlike.unregister_rollout_engine("recording")
    RecordingEngine.built.clear()


def test_a_registered_engine_samples_grpos_completions_without_a_change_to_the_trainer(recording, tiny_checkpoints,
                                                                                          tokenizer_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=2, max_completion_length=6,
                      num_generations=4, per_device_train_batch_size=4, logging_steps=1,
                      rollout_engine="recording", rollout_max_num_seqs=3)
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward, args=args,
                          train_dataset=PROMPT_ROWS, processing_class=torchlike.AutoTokenizer.from_pretrained(
                              tokenizer_dir))
    trainer.train()
    [engine] = recording.built
    assert trainer.rollout_engine is engine
    assert engine.requests == 2  # one generation batch of 4 completions (1 prompt x 4 samples) per step
    assert engine.updates >= 1  # the policy is handed over after the optimizer steps
    # The engine gets the config's rollout_* settings (without the prefix) and the trainer's end token.
    assert engine.context.settings["max_num_seqs"] == 3 and "engine" not in engine.context.settings
    assert engine.context.eos_token_ids == tuple(trainer.eos_token_ids)
    assert all(np.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


def test_generate_takes_a_registered_engine_and_returns_its_tokens(recording, tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    ids = np.array([[5, 9, 14, 3], [8, 2, 11, 7]])
    theirs = model.generate(ids, max_new_tokens=5, do_sample=False, rollout_engine="recording")
    static = model.generate(ids, max_new_tokens=5, do_sample=False, rollout_engine="static")
    assert recording.built[0].requests == 2
    np.testing.assert_array_equal(theirs, static)


def test_the_default_engine_is_the_backends_fastest_paged_on_the_cpu(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                     monkeypatch):
    """``rollout_engine=None`` (every default) builds the paged engine on the CPU, where benchmarks/rollout.py's presets
    measure it fastest, for GRPO and RLOO (Distillation: tests/test_distillation_trainer.py) and ``generate``; the
    static engine stays one argument away and gives the same tokens."""
    assert jax.default_backend() == "cpu"
    assert rollout.default_engine() == "paged"
    assert (rollout.default_engine("gpu"), rollout.default_engine("tpu"), rollout.default_engine("other")) == (
        "static", "static", "static")
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    for config, trainer_class in ((GRPOConfig, GRPOTrainer), (RLOOConfig, RLOOTrainer)):
        args = config(output_dir=str(tmp_path), report_to="none", max_steps=1, max_completion_length=6,
                      num_generations=4, per_device_train_batch_size=4)
        assert args.rollout_engine is None
        trainer = trainer_class(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward, args=args,
                                train_dataset=PROMPT_ROWS, processing_class=tokenizer)
        assert isinstance(trainer.rollout_engine, PagedEngine), trainer_class.__name__

    built = []
    build = rollout.build_engine
    monkeypatch.setattr(rollout, "build_engine", lambda *args: built.append(build(*args)) or built[-1])
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    ids = np.array([[5, 9, 14, 3], [8, 2, 11, 7]])
    default = model.generate(ids, max_new_tokens=5, do_sample=True, seed=3)
    static = model.generate(ids, max_new_tokens=5, do_sample=True, seed=3, rollout_engine="static")
    assert [type(engine) for engine in built] == [PagedEngine, StaticEngine]
    np.testing.assert_array_equal(default, static)


def test_engine_names_are_checked_where_they_are_read(recording, tmp_path):
    assert torchlike.generation.rollout_engine_names() == ("static", "paged", "vllm_server", "recording")
    with pytest.raises(ValueError, match="rollout_engine='vllm'.*'static', 'paged', 'vllm_server', 'recording'"):
        GRPOConfig(output_dir=str(tmp_path), rollout_engine="vllm")
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        torchlike.register_rollout_engine("recording", RecordingEngine)
    torchlike.register_rollout_engine("recording", RecordingEngine, replace=True)
    with pytest.raises(ValueError, match="built-in engine"):
        torchlike.register_rollout_engine("paged", RecordingEngine)
    with pytest.raises(TypeError, match="must be callable"):
        torchlike.register_rollout_engine("other", "not a builder")
    with pytest.raises(KeyError, match="No registered rollout engine is named 'static'"):
        torchlike.unregister_rollout_engine("static")


class ShippedWeightsEngine(RecordingEngine):
    """An engine that would live in another process (vLLM's): it takes the policy's weights as Hugging Face tensors
    with their version, not as a module."""

    def update_weights(self, module):
        self.shipped = getattr(self, "shipped", [])
        self.shipped.append((self.context.weights_version(), self.context.hf_weights()))
        self.inner.update_weights(module)


class MergedWeightsAt(transformers.TrainerCallback):
    """Keeps the merged Hugging Face weights after each optimizer step."""

    def __init__(self):
        self.after: dict[int, dict[str, np.ndarray]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = self.trainer.model.hf_tensors()


def test_an_engine_can_take_the_merged_weights_in_hugging_face_names_with_their_version(tiny_checkpoints,
                                                                                       tokenizer_dir, tmp_path):
    from safetensors.numpy import load_file

    torchlike.register_rollout_engine("shipped", ShippedWeightsEngine)
    try:
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=2, max_completion_length=6,
                          num_generations=4, per_device_train_batch_size=4, learning_rate=1e-2,
                          rollout_engine="shipped")
        weights = MergedWeightsAt()
        trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward, args=args,
                              train_dataset=PROMPT_ROWS, callbacks=[weights],
                              processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        weights.trainer = trainer
        trainer.train()
    finally:
        torchlike.unregister_rollout_engine("shipped")
    [engine] = [built for built in RecordingEngine.built if isinstance(built, ShippedWeightsEngine)]
    RecordingEngine.built.clear()
    assert [version for version, _ in engine.shipped] == [0, 1]  # the weights of each generation round
    (_, first), (_, second) = engine.shipped
    base = load_file(tiny_checkpoints.path("qwen2") / "model.safetensors")
    assert first.keys() == base.keys()  # the checkpoint's names: no LoRA factor, no torchlike path
    assert all(np.array_equal(first[name], base[name]) for name in base)  # a new adapter merges to the base
    assert second.keys() == weights.after[1].keys()
    assert all(np.array_equal(second[name], weights.after[1][name]) for name in second)
    changed = sorted({name.split(".")[-2] for name in second if not np.array_equal(second[name], base[name])})
    assert changed == ["q_proj", "v_proj"]  # the adapted layers, merged
