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
