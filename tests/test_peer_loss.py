"""A dead peer: when one of two ``jax.distributed`` processes dies mid-run, the other stops within the heartbeat
timeout with a named error that says which process went silent and where the last complete checkpoint is, and that
checkpoint resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torchlike
from tests import tiny
from tests.helpers.distributed import free_port, with_device_count
from torchlike.adapters.distributed.peer_watch import EXIT_PEER_LOST

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 10  # TORCHLIKE_PEER_TIMEOUT of the children, seconds

WORKER = """
import json, sys
import torchlike
from tests import tiny

checkpoint, output_dir = sys.argv[1:]
args = torchlike.TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=400,
                                   save_strategy="steps", save_steps=2, logging_steps=1, report_to="none",
                                   disable_tqdm=True, bf16=False, mesh_shape=(2, 1))
trainer = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), args=args,
                            train_dataset=tiny.padded_examples(16, seed=7))
trainer.train()
"""


def test_the_survivor_names_the_dead_process_and_the_checkpoint_to_resume(tiny_checkpoints, tmp_path):
    checkpoint, output_dir = tiny_checkpoints.path("qwen2"), tmp_path / "run"
    port, logs, workers = free_port(), [tmp_path / f"{index}.log" for index in range(2)], []
    for index, log in enumerate(logs):
        env = dict(os.environ, XLA_FLAGS=with_device_count(1), JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index),
                   TORCHLIKE_PEER_TIMEOUT=str(TIMEOUT), PYTHONPATH=str(ROOT))
        with log.open("w") as stream:
            workers.append(subprocess.Popen([sys.executable, "-c", WORKER, str(checkpoint), str(output_dir)],
                                            cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT))
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
                                       max_steps=step + 1, save_strategy="no", report_to="none", bf16=False)
    resumed = torchlike.Trainer(model=torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), args=args,
                                train_dataset=tiny.padded_examples(16, seed=7))
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.global_step == step + 1
