"""torchlike.save / torchlike.load: round trips, lazy and partial restore, crash safety, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import torchlike
from tests import kill_during_save
from torchlike.adapters.checkpoint import orbax_store
from torchlike.serialization import CheckpointCorruptedError, LazyCheckpoint

ROOT = Path(__file__).resolve().parent.parent


def assert_same(actual, expected, where="") -> None:
    """Equal structure, container types, key types, dtypes and bits."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(expected), where
        assert [type(k) for k in actual] == [type(k) for k in expected], where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, (np.ndarray, jax.Array)):
        actual, expected = np.asarray(actual), np.asarray(expected)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert actual.tobytes() == expected.tobytes(), where
    else:
        assert type(actual) is type(expected) and actual == expected, where


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*"))


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


# ----------------------------------------------------------------------------- round trips


def test_flat_state_dict_round_trips_every_dtype_and_leaf_kind(tmp_path):
    state = {
        "layers.0.attn.q_proj.w": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
        "layers.0.attn.q_proj.w_lora_a": np.arange(6).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "layers.0.mlp.ids": np.arange(5, dtype=np.int32),
        "jax.bf16": jnp.linspace(-1, 1, 7, dtype=jnp.bfloat16),
        "jax.f32": jnp.ones((2, 2), jnp.float32),
        "torch.bf16": torch.linspace(-2, 2, 5, dtype=torch.bfloat16),
        "torch.f32": torch.arange(3, dtype=torch.float32, requires_grad=True),
        "numpy_scalar": np.float32(1.5),
        "step": 10,
        "lr": 1e-3,
        "frozen": True,
    }
    torchlike.save(state, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")

    assert isinstance(ckpt, LazyCheckpoint) and ckpt.flat
    assert list(ckpt) == list(state) and len(ckpt) == len(state)
    assert "step" in ckpt and "missing" not in ckpt
    expected = dict(state)
    expected["torch.bf16"] = state["torch.bf16"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    expected["torch.f32"] = state["torch.f32"].detach().numpy()
    expected["numpy_scalar"] = np.asarray(state["numpy_scalar"])
    assert_same(ckpt.to_dict(), expected)
    assert_same(ckpt["jax.bf16"], np.asarray(state["jax.bf16"]))
    assert ckpt["step"] == 10 and type(ckpt["frozen"]) is bool
    assert ckpt.shape_dtype("layers.0.attn.q_proj.w_lora_a") == ((2, 3), np.dtype(ml_dtypes.bfloat16))
    assert ckpt.shape_dtype("numpy_scalar") == ((), np.dtype(np.float32))
    with pytest.raises(TypeError, match="'step' .* is a scalar"):
        ckpt.shape_dtype("step")
    with pytest.raises(KeyError):
        ckpt["missing"]


def test_nested_tree_keeps_int_keys_lists_tuples_and_scalars(tmp_path):
    mu = {0: np.ones((2, 2), np.float32), 1: np.arange(3).astype(ml_dtypes.bfloat16)}
    state = {
        "step": 3,
        "opt": {"mu": mu, "count": np.asarray(2, np.int32), "empty": {}},
        7: [1.0, (np.zeros(2, np.int32), None), []],
    }
    torchlike.save(state, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")

    assert not ckpt.flat
    assert list(ckpt) == ["step", "opt", 7]
    assert_same(ckpt.to_dict(), state)
    assert_same(ckpt["opt"], state["opt"])
    restored = ckpt.restore({"opt": None})
    assert set(restored) == {"opt"}
    assert isinstance(restored["opt"]["mu"][0], jax.Array)
    assert_same(restored["opt"]["mu"], mu)


def test_flat_dotted_key_and_nested_path_stay_distinct(tmp_path):
    # Orbax alone would store both under the name "a.b".
    state = {
        "a.b": np.full(2, 1.0, np.float32),
        "a": {"b": np.full(2, 2.0, np.float32)},
        1: np.ones(1),
        "1": np.zeros(1),
    }
    torchlike.save(state, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")
    assert_same(ckpt.to_dict(), state)
    assert ckpt["a.b"][0] == 1.0 and ckpt["a"]["b"][0] == 2.0
    assert ckpt[1].tobytes() != ckpt["1"].tobytes()


def test_metadata_round_trips_with_torchlike_version(tmp_path):
    metadata = {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, "family": "qwen2"}
    torchlike.save({"w": np.zeros(2)}, tmp_path / "ckpt", metadata=metadata)
    ckpt = torchlike.load(tmp_path / "ckpt")
    assert ckpt.metadata == {**metadata, "torchlike_version": torchlike.__version__, "format": "torchlike-orbax-1"}
    ckpt.metadata["family"] = "changed"  # a copy: the checkpoint's metadata stays as saved
    assert ckpt.metadata["family"] == "qwen2"
    # Saving again with the loaded metadata works (the reserved keys are refreshed, not rejected).
    torchlike.save({"w": np.zeros(2)}, tmp_path / "again", metadata=ckpt.metadata)
    assert torchlike.load(tmp_path / "again").metadata == ckpt.metadata
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
        torchlike.save({"w": np.zeros(2)}, tmp_path / "bad", metadata={"array": np.zeros(2)})
    assert not (tmp_path / "bad").exists()


def test_empty_and_scalar_only_dicts(tmp_path):
    torchlike.save({}, tmp_path / "empty")
    assert torchlike.load(tmp_path / "empty").to_dict() == {}
    torchlike.save({"step": 5}, tmp_path / "scalars")
    assert torchlike.load(tmp_path / "scalars").to_dict() == {"step": 5}
    assert not (tmp_path / "scalars" / "arrays").exists()


# ----------------------------------------------------------------------------- lazy and partial reads


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (page cache included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.platform("Linux /proc")
@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_load_reads_only_the_manifest_and_restore_only_the_requested_keys(tmp_path):
    big = np.random.default_rng(0).standard_normal(1024 * 1024).astype(np.float32)  # 4 MB, incompressible
    state = {f"layers.{i}.w": np.full((4, 4), i, np.float32) for i in range(20)}
    state["embed.w"] = big
    torchlike.save(state, tmp_path / "ckpt")
    torchlike.load(tmp_path / "ckpt").restore({"layers.0.w": None})  # warm up Orbax's lazy imports

    before = _bytes_read()
    ckpt = torchlike.load(tmp_path / "ckpt")
    assert ckpt.shape_dtype("embed.w") == ((1024 * 1024,), np.dtype(np.float32))
    manifest_bytes = (tmp_path / "ckpt" / "manifest.json").stat().st_size
    assert _bytes_read() - before <= manifest_bytes + 4096

    before = _bytes_read()
    restored = ckpt.restore({"layers.3.w": None})
    small_read = _bytes_read() - before
    assert list(restored) == ["layers.3.w"]
    np.testing.assert_array_equal(np.asarray(restored["layers.3.w"]), state["layers.3.w"])

    before = _bytes_read()
    np.testing.assert_array_equal(ckpt["embed.w"], big)
    big_read = _bytes_read() - before
    # The measurement sees the big array when it is read, and restoring a 64-byte array
    # does not touch it.
    assert big_read >= big.nbytes * 0.9, big_read
    assert small_read < big.nbytes / 4, small_read


def test_restore_goes_straight_into_the_given_sharding(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(4).astype(ml_dtypes.bfloat16)}
    torchlike.save(state, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")
    mesh = jax.make_mesh((1,), ("fsdp",))
    named = NamedSharding(mesh, PartitionSpec("fsdp", None))
    single = SingleDeviceSharding(jax.devices()[0])

    restored = ckpt.restore({"w": named, "b": single})
    assert list(restored) == ["w", "b"]
    assert restored["w"].sharding == named and restored["b"].sharding == single
    assert_same(restored["w"], state["w"])
    assert_same(restored["b"], state["b"])

    # A jax.Array (or ShapeDtypeStruct) target lends its sharding and dtype, and its shape must match.
    like = jax.device_put(jnp.zeros((3, 4), jnp.bfloat16), named)
    from_like = ckpt.restore({"w": like})["w"]
    assert from_like.sharding == named and from_like.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"Shape mismatch for 'w'.*\(3, 4\).*\(4, 3\)"):
        ckpt.restore({"w": jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=named)})
    with pytest.raises(ValueError, match="Cannot restore 'b'"):
        ckpt.restore({"b": named})  # rank-2 spec for a rank-1 array
    with pytest.raises(KeyError, match="not in the checkpoint"):
        ckpt.restore({"nope": None})
    with pytest.raises(TypeError, match="targets must be a mapping"):
        ckpt.restore(["w"])


def test_restore_casts_dtype_while_reading(tmp_path):
    values = np.array([0.1, 1.7, -3.25, 1e-3], np.float32)
    torchlike.save({"f32": values, "bf16": values.astype(ml_dtypes.bfloat16)}, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")
    restored = ckpt.restore({"f32": None, "bf16": None}, dtypes={"f32": jnp.bfloat16, "bf16": "float32"})
    assert restored["f32"].dtype == jnp.bfloat16 and restored["bf16"].dtype == jnp.float32
    assert_same(restored["f32"], values.astype(ml_dtypes.bfloat16))
    assert_same(restored["bf16"], values.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert ckpt.restore({"bf16": None}, dtypes={"bf16": torch.float32})["bf16"].dtype == jnp.float32


def test_reading_after_the_checkpoint_was_replaced_raises_instead_of_mixing(tmp_path):
    torchlike.save({"w": np.zeros(2, np.float32)}, tmp_path / "ckpt")
    ckpt = torchlike.load(tmp_path / "ckpt")
    torchlike.save({"v": np.ones(3, np.float32), "w": np.ones(2, np.float32)}, tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="replaced or removed after load"):
        ckpt["w"]
    assert_same(torchlike.load(tmp_path / "ckpt")["w"], np.ones(2, np.float32))


# ----------------------------------------------------------------------------- crash safety


# Stage -> which checkpoint load() must return after a SIGKILL there.
KILL_STAGES = {
    "orbax-finalize": "old",  # inside Orbax's save: data written, not committed
    "orbax-written": "old",  # Orbax done, manifest (commit marker) not yet written
    "staged": "old",  # new checkpoint complete beside the old one, no rename yet
    "old-moved": "new",  # between the two renames: PATH does not exist
    "swapped": "new",  # new in place, backup not deleted yet
    "backup-unmarked": "new",  # backup's manifest removed, rest of it not deleted yet
    "done": "new",  # killed right at the end
}
EXTERNAL_KILL_DELAYS = (0.0, 0.03, 0.1)


def _disk_state(path: Path) -> dict[str, str]:
    """What a crash left: {"path" | "new" | "old": "complete" | "incomplete" | "in-orbax-write"}."""
    found = {}
    candidates = [("path", path)] + [
        (kind, child)
        for child in path.parent.iterdir()
        for kind, tag in (("new", orbax_store.NEW_TAG), ("old", orbax_store.OLD_TAG))
        if child.name.startswith(path.name + tag)
    ]
    for kind, directory in candidates:
        if not directory.exists():
            continue
        if (directory / "manifest.json").is_file():
            found[kind] = "complete"
        elif any(".orbax-checkpoint-tmp" in child.name for child in directory.iterdir()):
            found[kind] = "in-orbax-write"
        else:
            found[kind] = "incomplete"
    return found


# Stage -> what the crash must have left on disk (checked before load() repairs anything).
KILL_LEFTOVERS = {
    "orbax-finalize": {"path": "complete", "new": "in-orbax-write"},
    "orbax-written": {"path": "complete", "new": "incomplete"},
    "staged": {"path": "complete", "new": "complete"},
    "old-moved": {"new": "complete", "old": "complete"},
    "swapped": {"path": "complete", "old": "complete"},
    "backup-unmarked": {"path": "complete", "old": "incomplete"},
    "done": {"path": "complete"},
}


def _start_child(path: Path, stage: str, big: bool = False) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(ROOT / "tests" / "kill_during_save.py"), str(path), stage]
    command += ["--big"] if big else []
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when_staging_appears(child: subprocess.Popen, path: Path, delay: float) -> None:
    assert child.stdout.readline().strip() == "saving", child.stderr.read()
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(path.name + orbax_store.NEW_TAG) for p in path.parent.iterdir()):
        assert child.poll() is None and time.monotonic() < deadline, "the save never started"
        time.sleep(0.001)
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def crashed_saves(tmp_path_factory):
    """Overwrites an old checkpoint in child processes killed at each stage (all children run at once)."""
    root = tmp_path_factory.mktemp("crashes")
    runs = {}
    for stage in KILL_STAGES:
        path = root / stage / "ckpt"
        torchlike.save(kill_during_save.old_state(), path, metadata=kill_during_save.OLD_METADATA)
        runs[stage] = (path, _start_child(path, stage))
    external = {}
    for delay in EXTERNAL_KILL_DELAYS:
        path = root / f"external-{delay}" / "ckpt"
        torchlike.save(kill_during_save.old_state(), path, metadata=kill_during_save.OLD_METADATA)
        child = _start_child(path, "none", big=True)
        _kill_when_staging_appears(child, path, delay)
        external[delay] = (path, child)
    results = {}
    for name, (path, child) in [*runs.items(), *external.items()]:
        _, stderr = child.communicate(timeout=300)
        results[name] = (path, child.returncode, stderr, _disk_state(path))
    return results


def _expected(which: str, big: bool = False) -> tuple[dict, dict]:
    if which == "old":
        return kill_during_save.old_state(), kill_during_save.OLD_METADATA
    return kill_during_save.new_state(big), kill_during_save.NEW_METADATA


@pytest.mark.parametrize("stage", list(KILL_STAGES))
def test_sigkill_during_overwrite_leaves_old_or_new_checkpoint(crashed_saves, stage):
    path, returncode, stderr, leftovers = crashed_saves[stage]
    assert returncode == -signal.SIGKILL, stderr[-3000:]
    assert leftovers == KILL_LEFTOVERS[stage]
    state, metadata = _expected(KILL_STAGES[stage])
    ckpt = torchlike.load(path)
    assert_same(ckpt.to_dict(), state)
    assert ckpt.metadata["which"] == metadata["which"]
    if KILL_STAGES[stage] == "new":
        # load() finished the interrupted swap: the checkpoint is in place and no backup is left.
        assert siblings(path) == []
        assert_same(torchlike.load(path).to_dict(), state)
    # The next save works and clears whatever the crash left beside the checkpoint.
    torchlike.save({"after": np.ones(1, np.float32)}, path)
    assert siblings(path) == []
    assert list(torchlike.load(path)) == ["after"]


@pytest.mark.parametrize("delay", EXTERNAL_KILL_DELAYS)
def test_external_sigkill_at_any_moment_leaves_old_or_new_checkpoint(crashed_saves, delay):
    path, returncode, stderr, leftovers = crashed_saves[delay]
    assert returncode in (-signal.SIGKILL, 0), stderr[-3000:]
    ckpt = torchlike.load(path)
    which = ckpt.metadata["which"]
    print(f"killed {delay}s after staging began: left {leftovers}, load() returned the {which} checkpoint")
    assert_same(ckpt.to_dict(), _expected(which, big=True)[0])


def test_load_finishes_a_swap_interrupted_between_the_renames(tmp_path):
    # The same state as the "old-moved" crash, built by hand: PATH is missing, the new
    # checkpoint and the backup sit beside it.
    path = tmp_path / "ckpt"
    torchlike.save({"w": np.zeros(2)}, path)
    torchlike.save({"w": np.ones(2)}, tmp_path / "staged")
    token = json.loads((tmp_path / "staged" / "manifest.json").read_text())["token"]
    os.rename(path, tmp_path / f"ckpt{orbax_store.OLD_TAG}{token}")
    os.rename(tmp_path / "staged", tmp_path / f"ckpt{orbax_store.NEW_TAG}{token}")
    assert_same(torchlike.load(path)["w"], np.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_falls_back_to_the_backup_when_only_the_backup_is_complete(tmp_path):
    path = tmp_path / "ckpt"
    torchlike.save({"w": np.zeros(2)}, path)
    os.rename(path, tmp_path / f"ckpt{orbax_store.OLD_TAG}0123")
    (tmp_path / f"ckpt{orbax_store.NEW_TAG}0123").mkdir()  # incomplete new one
    assert_same(torchlike.load(path)["w"], np.zeros(2))
    assert (path / "manifest.json").is_file()


# ----------------------------------------------------------------------------- errors


def test_load_of_a_missing_path_names_it_and_the_leftovers(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"No torchlike checkpoint at {tmp_path / 'nope'}"):
        torchlike.load(tmp_path / "nope")
    (tmp_path / f"nope{orbax_store.NEW_TAG}abcd").mkdir()
    with pytest.raises(FileNotFoundError, match=r"nope\.torchlike-new-abcd \(incomplete\)"):
        torchlike.load(tmp_path / "nope")
    assert (tmp_path / f"nope{orbax_store.NEW_TAG}abcd").is_dir()  # nothing deleted


def _data_files(path: Path) -> list[Path]:
    return [p for p in (path / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]


# When one array of a read fails, Orbax gives up while TensorStore still finishes the other
# reads; their callbacks then hit Orbax's closed event loop ("Event loop is closed", reported
# as unraisable). Harmless: the test waits for them so that they are reported here, and ignores them.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["garbled-manifest", "no-array-data", "truncated-data", "deleted-data"])
def test_damaged_checkpoint_raises_a_clear_error_and_deletes_nothing(tmp_path, damage):
    path = tmp_path / "ckpt"
    torchlike.save({"w": np.arange(100, dtype=np.float32), "b": np.ones(3, np.int32)}, path)
    if damage == "garbled-manifest":
        (path / "manifest.json").write_text('{"format": "torchlike-orbax-1", "entr')
    elif damage == "no-array-data":
        for item in (path / "arrays").iterdir():
            if item.is_file():
                item.unlink()
    else:
        for data_file in _data_files(path):
            if damage == "truncated-data":
                os.truncate(data_file, 10)
            else:
                data_file.unlink()
    before = listing(tmp_path)
    with pytest.raises(CheckpointCorruptedError) as error:
        torchlike.load(path).to_dict()
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    assert f"The checkpoint at {path} is damaged" in message and "re-save it or restore it from a backup" in message
    assert listing(tmp_path) == before
    time.sleep(0.3)  # let TensorStore's abandoned reads finish inside this test (see above)


def test_a_damaged_checkpoint_with_a_backup_beside_it_points_at_the_backup(tmp_path):
    # A crash after the swap left the backup; then the new checkpoint lost its array data.
    path = tmp_path / "ckpt"
    torchlike.save({"w": np.zeros(2)}, path)
    token = json.loads((path / "manifest.json").read_text())["token"]
    torchlike.save({"w": np.ones(2)}, tmp_path / f"ckpt{orbax_store.OLD_TAG}{token}")
    (path / "arrays" / "_METADATA").unlink()
    before = listing(tmp_path)
    with pytest.raises(CheckpointCorruptedError, match=rf"ckpt\.torchlike-old-{token} \(complete\)"):
        torchlike.load(path)
    assert listing(tmp_path) == before  # the backup is kept: it is the good copy


def test_a_directory_that_is_not_a_torchlike_checkpoint_is_refused(tmp_path):
    import orbax.checkpoint as ocp  # a raw Orbax checkpoint, as a user might point load() at

    raw = tmp_path / "raw"
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(raw, {"w": np.zeros(2)})
    before = listing(tmp_path)
    with pytest.raises(CheckpointCorruptedError, match=f"{raw} is not a torchlike checkpoint"):
        torchlike.load(raw)
    with pytest.raises(FileExistsError, match="is not a torchlike checkpoint.*refusing to replace it"):
        torchlike.save({"w": np.ones(2)}, raw)
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        torchlike.save({"w": np.ones(2)}, tmp_path / "file.pt")
    assert listing(tmp_path) == sorted(before + [("file.pt", 1)])


@pytest.mark.parametrize("obj", [[np.zeros(2)], np.zeros(2), "weights"])
def test_save_of_a_non_dict_raises_type_error(tmp_path, obj):
    expected = rf"Expected a dict-like object \(e.g. model.state_dict\(\)\), got {type(obj).__name__}"
    with pytest.raises(TypeError, match=expected):
        torchlike.save(obj, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "state, pattern",
    [
        ({"a": {"b": [1, "text"]}}, r"\['a'\]\['b'\]\[1\].*got str"),
        ({"a": {"b": object()}}, r"\['a'\]\['b'\].*got object"),
        ({"a": np.array(["x"])}, r"\['a'\].*dtype <U1 is not numeric"),
        ({"a": {(1, 2): np.zeros(1)}}, r"key \(1, 2\) \(tuple\) at \['a'\].*str or int"),
    ],
)
def test_save_of_an_unsupported_leaf_or_key_names_its_path(tmp_path, state, pattern):
    torchlike.save({"w": np.zeros(1)}, tmp_path / "ckpt")
    with pytest.raises(TypeError, match=pattern):
        torchlike.save(state, tmp_path / "ckpt")
    assert siblings(tmp_path / "ckpt") == []
    assert_same(torchlike.load(tmp_path / "ckpt").to_dict(), {"w": np.zeros(1)})  # the old one is intact


def test_exports():
    from torchlike import serialization

    assert torchlike.save is serialization.save and torchlike.load is serialization.load
    assert torchlike.LazyCheckpoint is LazyCheckpoint
    assert {"save", "load", "LazyCheckpoint"} <= set(torchlike.__all__)
