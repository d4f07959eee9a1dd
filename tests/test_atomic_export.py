"""save_pretrained replaces an exported checkpoint atomically: killed at any moment, it leaves model A or model B.

Child processes (tests/kill_during_export.py) overwrite an export of model A (one ``model.safetensors``,
a README and a log folder beside it) with model B (other weights, many small shards, a tokenizer)
and are killed with SIGKILL at each crash point of ``hf_checkpoint.EXPORT_STAGES`` and once from
outside at a random moment. The real ``transformers`` then loads what is left, before and after
torchlike's ``from_pretrained`` finishes an interrupted swap.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchlike
from tests import tiny
from torchlike.adapters.checkpoint import directory_swap, hf_checkpoint
from torchlike.peft import LoraConfig, PeftModel, get_peft_model

ROOT = Path(__file__).resolve().parent.parent
NEW_SHARD_SIZE = "20KB"

# Crash point -> the model a loader must give after a SIGKILL there.
KILL_STAGES = {"shard-written": "A", "old-moved": "B", "swapped": "B", "carried-over": "B"}
# Crash point -> what sits at DIR ("path") and beside it before anything repairs it.
KILL_LEFTOVERS = {
    "shard-written": ["new", "path"],  # B half written beside A
    "old-moved": ["new", "old"],  # between the two renames: DIR does not exist
    "swapped": ["old", "path"],  # B in place, the README still in A's backup
    "carried-over": ["old", "path"],  # the README moved across, the backup not deleted yet
}


@pytest.fixture(scope="module")
def models(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """Models A and B (same architecture, other weights): their HF sources, tensors and torchlike models."""
    source_b = tmp_path_factory.mktemp("model_b")
    tiny.build_hf_model(tiny.CASES["qwen2"](), seed=1).save_pretrained(source_b)
    sources = {"A": tiny_checkpoints.path("qwen2"), "B": source_b}
    loaded = {name: torchlike.AutoModelForCausalLM.from_pretrained(path) for name, path in sources.items()}
    return SimpleNamespace(
        sources=sources,
        tokenizer=tokenizer_dir,
        hf_tensors={name: load_file(path / "model.safetensors") for name, path in sources.items()},
        state_dicts={name: {k: np.asarray(v) for k, v in model.state_dict().items()} for name, model in loaded.items()},
        a=loaded["A"],
    )


def _keep_user_files(out: Path) -> None:
    (out / "README.md").write_text("my notes")
    (out / "runs").mkdir()
    (out / "runs" / "events.log").write_text("step 1")


def _assert_user_files_kept(out: Path) -> None:
    assert (out / "README.md").read_text() == "my notes"
    assert (out / "runs" / "events.log").read_text() == "step 1"


def _start_child(models, out: Path, stage: str, adapter_rank: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}  # JAX_COMPILATION_CACHE_DIR: conftest's
    command = [sys.executable, str(ROOT / "tests" / "kill_during_export.py"), str(models.sources["B"]), str(out),
               stage, "--tokenizer", str(models.tokenizer), "--max-shard-size", NEW_SHARD_SIZE]
    command += [] if adapter_rank is None else ["--adapter-rank", str(adapter_rank)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when_staging_appears(child: subprocess.Popen, out: Path, delay: float) -> None:
    assert child.stdout.readline().strip() == "saving", child.stderr.read()
    deadline = time.monotonic() + 120
    while not any(kind == "new" for kind, _ in directory_swap.siblings(out)):
        assert child.poll() is None and time.monotonic() < deadline, "the export never started"
        time.sleep(0.001)
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)


def _disk_state(out: Path) -> list[str]:
    return sorted((["path"] if out.exists() else []) + [kind for kind, _ in directory_swap.siblings(out)])


@pytest.fixture(scope="module")
def crashed_exports(models, tmp_path_factory):
    """Overwrites an export of A with B in child processes killed at each stage (all children run at once)."""
    root = tmp_path_factory.mktemp("crashes")
    children = {}
    for stage in hf_checkpoint.EXPORT_STAGES:
        out = root / stage / "out"
        models.a.save_pretrained(out)
        _keep_user_files(out)
        children[stage] = (out, _start_child(models, out, stage))
    adapter_out = root / "adapter" / "out"
    get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(models.sources["A"]),
                   LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter_out)
    _keep_user_files(adapter_out)
    children["adapter"] = (adapter_out, _start_child(models, adapter_out, "old-moved", adapter_rank=4))
    external_out = root / "external" / "out"
    models.a.save_pretrained(external_out)
    _keep_user_files(external_out)
    external = _start_child(models, external_out, "none")
    delay = random.uniform(0.0, 0.06)  # an export of B takes about that long
    _kill_when_staging_appears(external, external_out, delay)
    children["external"] = (external_out, external)
    results = {}
    for name, (out, child) in children.items():
        _, stderr = child.communicate(timeout=300)
        results[name] = SimpleNamespace(out=out, returncode=child.returncode, stderr=stderr[-3000:],
                                        leftovers=_disk_state(out), delay=delay)
    return results


def _transformers_weights(out: Path, models) -> str:
    """"A" or "B": whose weights the real transformers loads from ``out`` (anything else fails)."""
    state = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    matches = [name for name, tensors in models.hf_tensors.items()
               if state.keys() == tensors.keys() and all(torch.equal(state[k], t) for k, t in tensors.items())]
    assert len(matches) == 1, f"{out} holds neither model A nor model B"
    return matches[0]


def _torchlike_weights(out: Path, models) -> str:
    """"A" or "B": whose weights torchlike's from_pretrained loads from ``out`` (finishing an interrupted swap)."""
    state = {k: np.asarray(v) for k, v in torchlike.AutoModelForCausalLM.from_pretrained(out).state_dict().items()}
    matches = [name for name, expected in models.state_dicts.items()
               if state.keys() == expected.keys() and all(np.array_equal(state[k], v) for k, v in expected.items())]
    assert len(matches) == 1, f"{out} holds neither model A nor model B"
    return matches[0]


@pytest.mark.parametrize("stage", hf_checkpoint.EXPORT_STAGES)
def test_sigkill_during_overwrite_leaves_model_a_or_model_b(crashed_exports, models, stage):
    run = crashed_exports[stage]
    expected = KILL_STAGES[stage]
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert run.leftovers == KILL_LEFTOVERS[stage]
    if run.out.exists():
        assert _transformers_weights(run.out, models) == expected  # as the crash left it, nothing repaired
    assert _torchlike_weights(run.out, models) == expected
    assert _transformers_weights(run.out, models) == expected
    _assert_user_files_kept(run.out)
    assert (run.out / "tokenizer.json").exists() == (expected == "B")
    if expected == "B":
        assert not (run.out / "model.safetensors").exists()  # A's single file is stale beside B's shards
    # Only an unfinished staging folder may stay (it could belong to a running save): the next save deletes it.
    assert [kind for kind, _ in directory_swap.siblings(run.out)] in ([], ["new"])
    models.a.save_pretrained(run.out)
    assert directory_swap.siblings(run.out) == []
    assert _transformers_weights(run.out, models) == "A"
    _assert_user_files_kept(run.out)


def test_external_sigkill_at_a_random_moment_leaves_model_a_or_model_b(crashed_exports, models):
    run = crashed_exports["external"]
    assert run.returncode in (-signal.SIGKILL, 0), run.stderr
    which = _torchlike_weights(run.out, models)
    print(f"killed {run.delay:.3f}s after staging began: left {run.leftovers}, from_pretrained gave model {which}")
    assert _transformers_weights(run.out, models) == which
    _assert_user_files_kept(run.out)


def test_sigkill_between_the_renames_of_an_adapter_export_leaves_the_new_adapter(crashed_exports, models):
    run = crashed_exports["adapter"]
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert run.leftovers == ["new", "old"]
    base = torchlike.AutoModelForCausalLM.from_pretrained(models.sources["A"])
    assert PeftModel.from_pretrained(base, run.out).active_peft_config.r == 4  # finishes the swap
    reference = load_file(f"{run.out}.reference/adapter_model.safetensors")
    saved = load_file(run.out / "adapter_model.safetensors")
    assert saved.keys() == reference.keys() and all(torch.equal(saved[k], v) for k, v in reference.items())
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(models.sources["A"], dtype=torch.float32)
    assert peft.PeftModel.from_pretrained(hf_base, run.out).peft_config["default"].r == 4
    assert (run.out / "tokenizer.json").exists()
    _assert_user_files_kept(run.out)
    assert directory_swap.siblings(run.out) == []


def test_overwrite_drops_stale_weights_of_either_format_and_keeps_user_folders(models, tmp_path):
    out = tmp_path / "out"
    models.a.save_pretrained(out)
    (out / "pytorch_model.bin").write_bytes(b"stale")
    _keep_user_files(out)
    torchlike.AutoModelForCausalLM.from_pretrained(models.sources["B"]).save_pretrained(out, max_shard_size="20KB")

    assert not (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    assert _transformers_weights(out, models) == "B"
    _assert_user_files_kept(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_adapter_saved_into_a_model_folder_keeps_the_model(models, tmp_path):
    out = tmp_path / "out"
    models.a.save_pretrained(out)
    adapter = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(models.sources["A"]),
                             LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(out)

    assert {"config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in out.iterdir()}
    assert torchlike.AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"


def test_saving_into_the_working_directory_leaves_the_process_in_the_new_checkpoint(models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    models.a.save_pretrained(out)
    monkeypatch.chdir(out)
    models.a.save_pretrained(".")
    assert Path.cwd() == out and Path("config.json").is_file()


def test_an_interrupted_swap_is_finished_by_finish_interrupted_save(models, tmp_path):
    # The "old-moved" crash state, built by hand: DIR is missing, the new export and the backup sit beside it.
    out = tmp_path / "out"
    models.a.save_pretrained(out)
    _keep_user_files(out)
    torchlike.AutoModelForCausalLM.from_pretrained(models.sources["B"]).save_pretrained(tmp_path / "staged")
    os.rename(out, directory_swap.sibling(out, directory_swap.OLD_TAG, "model-0123"))
    os.rename(tmp_path / "staged", directory_swap.sibling(out, directory_swap.NEW_TAG, "model-0123"))

    hf_checkpoint.finish_interrupted_save(out)
    assert _transformers_weights(out, models) == "B"
    _assert_user_files_kept(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
