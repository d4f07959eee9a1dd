"""What fleets do to a two-process ``jax.distributed`` run: a dead peer (the survivor stops within the heartbeat timeout
with a named error that says which process went silent and where the last complete checkpoint is, and that checkpoint
resumes) and a preemption notice to one process (both checkpoint the same step, exit 0 and resume bit for bit)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torchlike
from tests import tiny
from tests.helpers.distributed import free_port, with_device_count
from torchlike.adapters.distributed.peer_watch import EXIT_PEER_LOST
from torchlike.training import checkpoints

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 10  # TORCHLIKE_PEER_TIMEOUT of the children, seconds

WORKER = """
import json, sys
import torchlike
from tests import tiny

checkpoint, output_dir = sys.argv[1:]
args = torchlike.TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=400,
                                   save_strategy="steps", save_steps=2, logging_steps=1, report_to="none",
                                   disable_tqdm=True, mesh_shape=(2, 1))
trainer = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), args=args,
                            train_dataset=tiny.padded_examples(16, seed=7))
trainer.train()
"""


def launch(script: str, script_args: list[str], tmp_path: Path, name: str,
           **env: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """Starts ``script`` (Python source) as the two processes of one ``jax.distributed`` job of one CPU device each,
    with ``env`` added; returns the processes and their log files (``<name>-<process>.log``)."""
    port, logs, workers = free_port(), [tmp_path / f"{name}-{index}.log" for index in range(2)], []
    for index, log in enumerate(logs):
        environment = dict(os.environ, XLA_FLAGS=with_device_count(1), JAX_PLATFORMS="cpu",
                           JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                           JAX_PROCESS_ID=str(index), PYTHONPATH=str(ROOT), **env)
        with log.open("w") as stream:  # a file, not a pipe: a pipe nobody drains would stall its writer
            workers.append(subprocess.Popen([sys.executable, "-c", script, *script_args], cwd=ROOT,
                                            env=environment, stdout=stream, stderr=subprocess.STDOUT))
    return workers, logs


def both_exit_0(workers: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[str]:
    """Waits for the two processes (killing them on a timeout or an error), asserts that both exited 0 and returns
    their logs."""
    try:
        statuses = [worker.wait(timeout=timeout) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    outputs = [log.read_text() for log in logs]
    assert statuses == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return outputs


def test_the_survivor_names_the_dead_process_and_the_checkpoint_to_resume(tiny_checkpoints, tmp_path,
                                                                         job_compilation_cache):
    checkpoint, output_dir = tiny_checkpoints.path("qwen2"), tmp_path / "run"
    workers, logs = launch(WORKER, [str(checkpoint), str(output_dir)], tmp_path, "run",
                           TORCHLIKE_PEER_TIMEOUT=str(TIMEOUT), **job_compilation_cache)
    try:
        deadline = time.monotonic() + 400
        while not (output_dir / "checkpoint-2" / "trainer_state.json").is_file():
            assert all(worker.poll() is None for worker in workers), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint-2 in 400 s:\n" + logs[0].read_text()[-3000:]
            time.sleep(0.5)
        workers[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = workers[0].wait(timeout=TIMEOUT + 60)
        stopped_after = time.monotonic() - killed
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    output = logs[0].read_text()
    assert status == EXIT_PEER_LOST, output[-3000:]
    assert stopped_after < TIMEOUT + 30, stopped_after
    message = re.search(r"PeerLostError: process 1 of 2 stopped answering: .*? The last complete checkpoint is "
                        r"(\S+checkpoint-\d+);", output)
    assert message is not None, output[-3000:]
    # The named checkpoint is complete and resumes (here on one process) to the next step.
    folder = Path(message.group(1))
    step = json.loads((folder / "trainer_state.json").read_text())["global_step"]
    args = torchlike.TrainingArguments(output_dir=str(tmp_path / "resumed"), per_device_train_batch_size=2,
                                       max_steps=step + 1, save_strategy="no", report_to="none")
    resumed = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), args=args,
                                train_dataset=tiny.padded_examples(16, seed=7))
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.global_step == step + 1


PREEMPTED_WORKER = """
import sys
import torchlike
from torchlike.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

checkpoint, tokenizer, output_dir, kind, mode, steps = sys.argv[1:]
ROWS = [{"prompt": "the quick brown", "completion": " fox jumps"}, {"prompt": "one two", "completion": " three"},
        {"prompt": "hello world", "completion": " this is"}, {"prompt": "lazy dog", "completion": " over the"}] * 4


def length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def run(folder, max_steps, resume=None):
    settings = dict(output_dir=folder, per_device_train_batch_size=2, max_steps=max_steps, save_strategy="no",
                    logging_steps=1, report_to="none", disable_tqdm=True, mesh_shape=(2, 1),
                    enable_jit_checkpoint=True, learning_rate=1e-2,
                    lr_scheduler_type="constant")  # the same rates whatever max_steps says
    processing_class = torchlike.AutoTokenizer.from_pretrained(tokenizer)
    if kind == "sft":
        trainer = SFTTrainer(model=checkpoint, args=SFTConfig(**settings), train_dataset=ROWS,
                             processing_class=processing_class)
    else:  # real sampling: the resumed run must draw what the uninterrupted one draws
        trainer = GRPOTrainer(model=checkpoint, reward_funcs=length_reward, processing_class=processing_class,
                              train_dataset=[{"prompt": row["prompt"]} for row in ROWS],
                              args=GRPOConfig(num_generations=2, max_completion_length=6, **settings))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(folder + "/final")
    print("stopped at", trainer.state.global_step, flush=True)


if mode == "preempted":
    run(output_dir, 400)
else:  # resume the preempted run to `steps`, then the same run without the notice
    run(output_dir, int(steps), resume=True)
    run(output_dir + "-straight", int(steps))
"""


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpoint_that_resumes_bit_identically(
        kind, tiny_checkpoints, tokenizer_dir, tmp_path, job_compilation_cache):
    """GKE and spot VMs signal the pods one by one: the notice of process 1 alone makes both processes of an SFT or a
    GRPO run checkpoint the same step and exit 0; both resume from it to the end and equal the run without the
    notice, bit for bit (GRPO's sampling streams and the data position included)."""
    from safetensors.numpy import load_file

    checkpoint, output_dir = str(tiny_checkpoints.path("qwen2")), str(tmp_path / "run")
    common = [checkpoint, str(tokenizer_dir), output_dir, kind]
    workers, logs = launch(PREEMPTED_WORKER, [*common, "preempted", "0"], tmp_path, "preempted",
                           **job_compilation_cache)
    try:
        deadline = time.monotonic() + 400
        while "'loss'" not in logs[0].read_text():  # training has started (process 0 prints the logs)
            assert all(worker.poll() is None for worker in workers), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        workers[1].send_signal(signal.SIGTERM)
    except BaseException:
        for worker in workers:
            worker.kill()
            worker.wait()
        raise
    outputs = both_exit_0(workers, logs, 120)
    steps = {int(re.search(r"stopped at (\d+)", output).group(1)) for output in outputs}
    assert len(steps) == 1
    (step,) = steps
    assert [folder.name for folder in Path(output_dir).glob("checkpoint-*")] == [f"checkpoint-{step}"]

    assert "Preempted: stopped after step" in outputs[0] and "after the notice" in outputs[0]
    workers, logs = launch(PREEMPTED_WORKER, [*common, "resume", str(step + 2)], tmp_path, "resumed",
                           **job_compilation_cache)
    both_exit_0(workers, logs, 400)
    resumed = load_file(Path(output_dir) / "final" / "model.safetensors")
    straight = load_file(Path(output_dir + "-straight") / "final" / "model.safetensors")
    assert [name for name in straight if not (resumed[name] == straight[name]).all()] == []


FULL_DISK_WORKER = """
import errno, sys, types
import jax
import torchlike
from tests import tiny
from torchlike.adapters.checkpoint import orbax_store
from torchlike.training import checkpoints

checkpoint, output_dir = sys.argv[1:]
disk_usage, checked = orbax_store.shutil.disk_usage, []


def full_on_process_1(path):  # the save of step 2: process 1's disk has 100 bytes left for its shards
    checked.append(path)
    usage = disk_usage(path)
    return usage._replace(free=100) if jax.process_index() == 1 and len(checked) == 1 else usage


publish = checkpoints._publish


def publish_fails_at_step_4(staging, folder, state):  # process 0 alone publishes: its trainer_state.json
    if folder.name == "checkpoint-4":
        raise OSError(errno.ENOSPC, "No space left on device (process 0's trainer_state.json)")
    return publish(staging, folder, state)


orbax_store.shutil = types.SimpleNamespace(disk_usage=full_on_process_1, rmtree=orbax_store.shutil.rmtree)
checkpoints._publish = publish_fails_at_step_4
args = torchlike.TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=6,
                                   save_strategy="steps", save_steps=2, logging_steps=1, report_to="none",
                                   disable_tqdm=True, mesh_shape=(2, 1), on_save_error="warn")
trainer = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), args=args,
                            train_dataset=tiny.padded_examples(16, seed=7))
trainer.train()
print("trained to", trainer.state.global_step, flush=True)
"""


def test_a_save_that_fails_on_one_process_fails_on_both_and_with_warn_both_train_on(tiny_checkpoints, tmp_path,
                                                                                      job_compilation_cache):
    """A full disk seen by one process only (no room for process 1's shards at step 2, process 0's
    ``trainer_state.json`` at step 4): both processes learn of it, keep nothing of that save and, with
    ``on_save_error="warn"``, train on to the next save, which is complete."""
    output_dir = tmp_path / "run"
    workers, logs = launch(FULL_DISK_WORKER, [str(tiny_checkpoints.path("qwen2")), str(output_dir)], tmp_path, "disk",
                           **job_compilation_cache)
    outputs = both_exit_0(workers, logs, 400)
    for output in outputs:
        assert "trained to 6" in output
        assert "Step 2 was not checkpointed; training goes on (on_save_error='warn')" in output
        assert "Step 4 was not checkpointed; training goes on (on_save_error='warn')" in output
    assert "process 1's arrays of" in outputs[1] and "process 0's trainer_state.json" in outputs[0]
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-6"]
    checkpoints.check_checkpoint(output_dir / "checkpoint-6")
