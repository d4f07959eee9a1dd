"""Checkpoints under faults: a save that runs out of disk fails with a named error, leaves nothing of itself and the
earlier checkpoints intact (or, with ``on_save_error="warn"``, training goes on); a checkpoint that a crash or a copy
left incomplete or damaged is refused by path, naming the file, and skipped by ``resume_from_checkpoint=True``, which
resumes from the latest complete one, bit for bit."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import resource
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from transformers import TrainerCallback

import torchlike
from tests import tiny
from tests.helpers.training import training_arguments
from torchlike import serialization
from torchlike.adapters.checkpoint import orbax_store, safetensors_io
from torchlike.serialization import CheckpointCorruptedError
from torchlike.training import checkpoints
from torchlike.training.checkpoints import CheckpointSaveError

STEPS = 4  # checkpoints at steps 2 and 4


def trainer_for(tiny_checkpoints, output_dir: Path, **overrides) -> torchlike.Trainer:
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    args = training_arguments(output_dir.parent, output_dir=str(output_dir), max_steps=STEPS, save_strategy="steps",
                              save_steps=2, disable_tqdm=True, **overrides)
    return torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(16, seed=7))


def weights(trainer: torchlike.Trainer) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in trainer.model.state_dict().items()}


def contents(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


class FullDisk:
    """Stands in for ``open`` in the modules that write checkpoint files: once armed, the ``file``-th file opened for
    writing raises ``OSError(ENOSPC)`` after ``after_bytes`` bytes, as a write on a full disk does; the next files
    find room again."""

    def __init__(self, file: int = 1, after_bytes: int = 0):
        self.file, self.after_bytes = file, after_bytes
        self.armed = False
        self.opened = 0

    def __call__(self, path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        if not self.armed or not any(flag in mode for flag in "wax"):
            return handle
        self.opened += 1
        return _FillingFile(handle, self.after_bytes) if self.opened == self.file else handle


class _FillingFile:
    def __init__(self, handle, room: int):
        self._handle, self._room = handle, room

    def write(self, data) -> int:
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= size
        return self._handle.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def full_disk(monkeypatch, module, **fault) -> FullDisk:
    disk = FullDisk(**fault)
    monkeypatch.setattr(module, "open", disk, raising=False)
    return disk


class FileSizeLimit:
    """Stands in for ``torchlike.save``: once armed, the next save of a ``model`` store runs under a file size limit
    (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored), so TensorStore's write of its arrays fails with ``EFBIG`` where a full
    disk gives ``ENOSPC``: the error path of a real Orbax write, which Python's ``open`` never sees."""

    def __init__(self, save):
        self.save, self.armed = save, False

    def __call__(self, tree, path, *args, **kwargs):
        if not self.armed or Path(path).name != "model":
            return self.save(tree, path, *args, **kwargs)
        self.armed = False
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return self.save(tree, path, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)


def file_size_limit(monkeypatch) -> FileSizeLimit:
    limit = FileSizeLimit(serialization.save)
    monkeypatch.setattr(serialization, "save", limit)
    return limit


class ArmAtStep(TrainerCallback):
    """Arms the fault once ``step`` is done (before that step's save), after snapshotting the checkpoints so far."""

    def __init__(self, disk: FullDisk | FileSizeLimit, step: int, output_dir: Path):
        self.disk, self.step, self.output_dir = disk, step, output_dir
        self.before: dict[str, dict[str, bytes]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.before = {folder.name: contents(folder) for folder in checkpoints.checkpoint_folders(self.output_dir)}
            self.disk.armed = True


# Where the save of step 4 fails: in the middle of model.safetensors (the Hugging Face export, the only large file
# Python writes), at the manifest that commits the model store (the first torchlike.save) or the optimizer store (the
# second), or in TensorStore's write of the model store's arrays. (the fault, its errno, what the error says was
# being written)
FAULTS = {"hf-export": (lambda patch: full_disk(patch, safetensors_io, after_bytes=4096), errno.ENOSPC,
                        "model.safetensors"),
          "model-store": (lambda patch: full_disk(patch, orbax_store, file=1), errno.ENOSPC, "the model state"),
          "optimizer-store": (lambda patch: full_disk(patch, orbax_store, file=2), errno.ENOSPC,
                              "the optimizer state"),
          "model-store-arrays": (file_size_limit, errno.EFBIG, "the model state")}


# TensorStore finishes the writes Orbax gave up on after the failed one; their callbacks then meet Orbax's closed
# event loop ("Event loop is closed", reported as unraisable): harmless, as in tests/test_serialization.py.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", FAULTS)
def test_a_full_disk_raises_a_named_error_leaves_no_new_folder_and_keeps_the_previous_checkpoint(
        tiny_checkpoints, tmp_path, monkeypatch, where):
    install, code, written = FAULTS[where]
    output_dir = tmp_path / "out"
    disk = install(monkeypatch)
    trainer = trainer_for(tiny_checkpoints, output_dir, save_total_limit=1)
    arm = ArmAtStep(disk, STEPS, output_dir)
    trainer.add_callback(arm)
    with pytest.raises(CheckpointSaveError) as raised:
        trainer.train()
    message = str(raised.value)
    assert raised.value.errno == code
    assert f"Could not save {output_dir / 'checkpoint-4'}" in message and os.strerror(code) in message
    assert "bytes) are free there" in message and "lower save_total_limit (now 1)" in message
    assert "on_save_error='warn'" in message and written in message
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]
    assert contents(output_dir / "checkpoint-2") == arm.before["checkpoint-2"]
    checkpoints.check_checkpoint(output_dir / "checkpoint-2")


def test_with_on_save_error_warn_training_goes_on_and_the_next_save_succeeds(tiny_checkpoints, tmp_path, monkeypatch,
                                                                               caplog):
    output_dir = tmp_path / "out"
    disk = full_disk(monkeypatch, orbax_store, file=2)
    disk.armed = True  # the save of step 2 fails at its optimizer store; the one of step 4 finds room
    trainer = trainer_for(tiny_checkpoints, output_dir, on_save_error="warn")
    with caplog.at_level(logging.WARNING, logger="torchlike"):
        trainer.train()
    assert trainer.state.global_step == STEPS
    assert "Step 2 was not checkpointed; training goes on (on_save_error='warn')" in caplog.text
    assert "No space left on device" in caplog.text
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-4"]
    checkpoints.check_checkpoint(output_dir / "checkpoint-4")


def test_on_save_error_accepts_raise_and_warn_only(tmp_path):
    with pytest.raises(ValueError, match="on_save_error.*'ignore'.*'raise', 'warn'"):
        training_arguments(tmp_path, on_save_error="ignore")


@pytest.fixture(scope="module")
def straight_run(tiny_checkpoints, tmp_path_factory):
    """An uninterrupted run with its checkpoints of steps 2 and 4, and its final weights."""
    output_dir = tmp_path_factory.mktemp("straight") / "out"
    trainer = trainer_for(tiny_checkpoints, output_dir)
    trainer.train()
    return output_dir, weights(trainer)


def _truncate_model_safetensors(folder: Path) -> Path:
    target = folder / "model.safetensors"
    os.truncate(target, target.stat().st_size // 2)
    return target


def _index_a_missing_shard(folder: Path) -> Path:
    names = safetensors_io.SafetensorsReader(folder / "model.safetensors").keys()
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / "model.safetensors.index.json"


def _delete_the_model_manifest(folder: Path) -> Path:
    target = folder / "model" / "manifest.json"
    target.unlink()
    return target


def _truncate_an_optimizer_array_file(folder: Path) -> Path:
    target = max((path for path in (folder / "optimizer" / "arrays").rglob("*") if path.is_file()),
                 key=lambda path: path.stat().st_size)
    os.truncate(target, target.stat().st_size - 1)
    return target


def _delete_trainer_state(folder: Path) -> Path:
    target = folder / "trainer_state.json"
    target.unlink()
    return target


# Each damage, and what the error must name.
DAMAGES = {"truncated-safetensors": _truncate_model_safetensors,
           "index-naming-a-missing-shard": _index_a_missing_shard,
           "orbax-store-without-manifest": _delete_the_model_manifest,
           "truncated-orbax-array-file": _truncate_an_optimizer_array_file,
           "no-trainer-state": _delete_trainer_state}
NAMED = {"index-naming-a-missing-shard": "model-00002-of-00002.safetensors"}


@pytest.fixture(params=DAMAGES)
def damaged(request, straight_run, tmp_path):
    """A copy of the straight run's output_dir whose checkpoint-4 is damaged: (output_dir, what the error names)."""
    output_dir = tmp_path / "out"
    shutil.copytree(straight_run[0], output_dir)
    target = DAMAGES[request.param](output_dir / "checkpoint-4")
    return output_dir, NAMED.get(request.param, str(target))


def test_a_damaged_checkpoint_passed_by_path_is_refused_naming_the_file(tiny_checkpoints, damaged):
    output_dir, named = damaged
    trainer = trainer_for(tiny_checkpoints, output_dir)
    with pytest.raises(CheckpointCorruptedError) as raised:
        trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-4"))
    message = str(raised.value)
    assert f"Cannot resume from {output_dir / 'checkpoint-4'}" in message and named in message
    assert "resume_from_checkpoint=True for the latest complete one" in message


def test_resume_true_skips_a_damaged_latest_checkpoint_and_continues_bit_for_bit(tiny_checkpoints, straight_run,
                                                                                 damaged):
    output_dir, named = damaged
    trainer = trainer_for(tiny_checkpoints, output_dir)
    with pytest.warns(UserWarning, match="skips .*checkpoint-4, which is incomplete or damaged, and resumes from "
                                         "checkpoint-2") as warned:
        trainer.train(resume_from_checkpoint=True)
    assert any(named in str(warning.message) for warning in warned)
    assert trainer.state.global_step == STEPS
    expected = straight_run[1]
    found = weights(trainer)
    assert found.keys() == expected.keys()
    assert [name for name in expected if not np.array_equal(found[name], expected[name])] == []
    checkpoints.check_checkpoint(output_dir / "checkpoint-4")  # the resumed run replaced the damaged folder


def test_a_save_first_finishes_or_deletes_what_interrupted_saves_left(tiny_checkpoints, straight_run, tmp_path):
    output_dir = tmp_path / "out"
    shutil.copytree(straight_run[0], output_dir)
    # A save killed while writing its staging folder, and one killed between the two renames of its swap.
    shutil.copytree(output_dir / "checkpoint-2", output_dir / "checkpoint-8.torchlike-new-save")
    (output_dir / "checkpoint-8.torchlike-new-save" / "trainer_state.json").unlink()
    shutil.copytree(output_dir / "checkpoint-4", output_dir / "checkpoint-6.torchlike-new-save")
    shutil.copytree(output_dir / "checkpoint-2", output_dir / "checkpoint-6.torchlike-old-save")
    trainer = trainer_for(tiny_checkpoints, output_dir)
    trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert contents(output_dir / "checkpoint-6") == contents(straight_run[0] / "checkpoint-4")


def test_a_disk_without_room_for_the_arrays_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Each process checks that its share of a store fits before Orbax writes (so that on several processes all fail
    alike, before Orbax's own barriers); the error says how much is needed and free, and nothing is left."""
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(orbax_store.shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=1000))
    with pytest.raises(OSError, match=r"arrays of .* need 4,096 bytes and 1,000 are free") as raised:
        serialization.save({"weight": np.zeros((32, 32), np.float32)}, tmp_path / "store")
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
    # A mount that counts no space (a total of 0, as some FUSE and object-storage mounts report) is not refused.
    monkeypatch.setattr(orbax_store.shutil, "disk_usage", lambda path: disk_usage(path)._replace(total=0, free=0))
    serialization.save({"weight": np.zeros((32, 32), np.float32)}, tmp_path / "store")
    assert (tmp_path / "store").is_dir()
