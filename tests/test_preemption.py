"""Preemption (transformers' ``enable_jit_checkpoint``): SIGTERM makes every process checkpoint the step in progress
and stop, the job exits 0, a second SIGTERM during that save changes nothing, and ``resume_from_checkpoint=True``
continues bit for bit as the run would have without the notice (SFT in a child process, GRPO with real sampling)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import transformers

import torchlike
from torchlike.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

ROWS = [{"prompt": "the quick brown", "completion": " fox jumps"}, {"prompt": "one two", "completion": " three"},
        {"prompt": "hello world", "completion": " this is"}, {"prompt": "lazy dog", "completion": " over the"}] * 3
SFT_SETTINGS = dict(max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                    report_to="none", save_strategy="steps", save_steps=2, enable_jit_checkpoint=True)
NOTICE_STEP = 3  # between the checkpoints of steps 2 and 4

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import transformers
    import torchlike
    from torchlike.training import checkpoints
    from torchlike.trl import SFTConfig, SFTTrainer

    model, tokenizer, output_dir, settings, rows, notice_step = json.loads(sys.argv[1])

    class NoticeAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == notice_step:
                os.kill(os.getpid(), signal.SIGTERM)

    write = checkpoints.write_checkpoint

    def write_while_notified_again(output_dir, step, *args, **kwargs):
        if step == notice_step:  # a second SIGTERM while the preemption checkpoint is being written
            os.kill(os.getpid(), signal.SIGTERM)
        return write(output_dir, step, *args, **kwargs)

    checkpoints.write_checkpoint = write_while_notified_again
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=output_dir, **settings), train_dataset=rows,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer), callbacks=[NoticeAt()])
    trainer.train()
    trainer.save_model()
    print("stopped at", trainer.state.global_step)
""")


def weights(trainer) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in trainer.model.state_dict().items()}


def assert_bit_identical(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert found.keys() == expected.keys()
    different = [name for name in expected if not np.array_equal(found[name], expected[name])]
    assert not different, different


def saved_step(folder: Path) -> int:
    return json.loads((folder / "trainer_state.json").read_text())["global_step"]


def test_sigterm_checkpoints_the_step_exits_0_and_the_resumed_sft_run_is_bit_identical(tiny_checkpoints,
                                                                                        tokenizer_dir, tmp_path):
    model, output_dir = str(tiny_checkpoints.path("qwen2")), tmp_path / "preempted"
    arguments = [model, str(tokenizer_dir), str(output_dir), SFT_SETTINGS, ROWS, NOTICE_STEP]
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(arguments)], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert child.returncode == 0, child.stderr[-3000:]
    assert f"stopped at {NOTICE_STEP}" in child.stdout
    assert "Preempted: stopped after step 3" in child.stderr
    # The regular checkpoint before the notice is intact beside the preemption one; nothing after the notice.
    assert [saved_step(folder) for folder in sorted(output_dir.glob("checkpoint-*"))] == [2, NOTICE_STEP]

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    resumed = SFTTrainer(model=model, args=SFTConfig(output_dir=str(output_dir), **SFT_SETTINGS), train_dataset=ROWS,
                         processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=True)
    uninterrupted = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "straight"), **SFT_SETTINGS),
                               train_dataset=ROWS, processing_class=tokenizer)
    uninterrupted.train()
    assert resumed.state.global_step == uninterrupted.state.global_step == SFT_SETTINGS["max_steps"]
    assert_bit_identical(weights(resumed), weights(uninterrupted))


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


class NoticeAt(transformers.TrainerCallback):
    """Sends this process SIGTERM at the end of one optimizer step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preempted_grpo_run_resumes_with_the_same_sampling_streams(tiny_checkpoints, tokenizer_dir, tmp_path):
    """GRPO samples its completions (no script): the resumed run draws what the uninterrupted one drew after the
    notice, so the final weights are the same bits."""
    model = str(tiny_checkpoints.path("qwen2"))
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [{"prompt": row["prompt"]} for row in ROWS[:4]]
    settings = dict(max_steps=4, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                    learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                    enable_jit_checkpoint=True)

    def trainer(output_dir, callbacks=None):
        return GRPOTrainer(model=model, reward_funcs=_length_reward, train_dataset=prompts, processing_class=tokenizer,
                           args=GRPOConfig(output_dir=str(output_dir), **settings), callbacks=callbacks)

    preempted = trainer(tmp_path / "preempted", [NoticeAt(2)])
    handler = signal.getsignal(signal.SIGTERM)
    preempted.train()
    assert preempted.state.global_step == 2
    assert signal.getsignal(signal.SIGTERM) == handler  # train() restores the handler it replaced
    assert [folder.name for folder in (tmp_path / "preempted").glob("checkpoint-*")] == ["checkpoint-2"]
    resumed = trainer(tmp_path / "preempted")
    resumed.train(resume_from_checkpoint=True)
    uninterrupted = trainer(tmp_path / "straight")
    uninterrupted.train()
    assert resumed.state.global_step == uninterrupted.state.global_step == 4
    assert_bit_identical(weights(resumed), weights(uninterrupted))


def test_the_grace_period_is_checked_against_measured_steps_and_saves_and_a_notice_skips_evaluation(
        tiny_checkpoints, tokenizer_dir, tmp_path, caplog):
    """``jit_checkpoint_grace_period``: steps and saves that would not fit in it are named once, the preemption
    checkpoint's log says how long it took after the notice, and the step of the notice is not evaluated."""
    settings = {**SFT_SETTINGS, "eval_strategy": "steps", "eval_steps": 1, "jit_checkpoint_grace_period": 1e-6}
    trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=ROWS, eval_dataset=ROWS[:2],
                         args=SFTConfig(output_dir=str(tmp_path), **settings), callbacks=[NoticeAt(NOTICE_STEP)],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == NOTICE_STEP
    evaluated = [log["step"] for log in trainer.state.log_history if "eval_loss" in log]
    assert evaluated == [1, 2]  # not step 3, the step of the notice
    over = [record.getMessage() for record in caplog.records if "needs up to" in record.getMessage()]
    assert len(over) == 1 and "jit_checkpoint_grace_period=1e-06 s" in over[0], over
    preempted = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Preempted")]
    assert len(preempted) == 1 and "s after the notice, longer than jit_checkpoint_grace_period=1e-06 s" in \
        preempted[0], preempted


def test_the_grace_period_warning_comes_once_and_only_when_a_step_and_a_save_exceed_it(caplog):
    from torchlike.adapters.distributed.preemption import PreemptionWatch

    watch = PreemptionWatch(grace_period=30.0)
    with caplog.at_level("WARNING"):
        watch.record(step_seconds=12.0)
        watch.record(save_seconds=17.0)  # 29 s: fits
        assert caplog.records == []
        watch.record(step_seconds=14.0)  # 31 s
        watch.record(save_seconds=40.0)
    assert len(caplog.records) == 1
    assert "up to 14.0 s and a checkpoint 17.0 s" in caplog.records[0].getMessage()
    assert "at least 32 s" in caplog.records[0].getMessage()
    for grace in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="jit_checkpoint_grace_period"):
            torchlike.TrainingArguments(output_dir="unused", jit_checkpoint_grace_period=grace)


def test_a_notice_at_an_epochs_last_step_skips_the_epochs_evaluation_and_save(tiny_checkpoints, tokenizer_dir,
                                                                               tmp_path):
    settings = {**SFT_SETTINGS, "eval_strategy": "epoch", "save_strategy": "epoch"}
    steps = len(ROWS) // settings["per_device_train_batch_size"]  # one epoch
    trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=ROWS, eval_dataset=ROWS[:2],
                         args=SFTConfig(output_dir=str(tmp_path), **{**settings, "max_steps": steps}),
                         callbacks=[NoticeAt(steps)],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    assert [log for log in trainer.state.log_history if "eval_loss" in log] == []
    assert [saved_step(folder) for folder in tmp_path.glob("checkpoint-*")] == [steps]  # the preemption one
