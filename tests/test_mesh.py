"""On a simulated 8-device mesh (fsdp=4 x tp=2): same logits, parameters really sharded, SFT losses equal to one
device's; and two processes of 4 devices joined by jax.distributed train like one process of 8."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import sft_worker

MESH_CASES = ["qwen2", "qwen3_tied", "llama32", "gemma3"]
# (query projection path, its full shape, its shard shape on fsdp=4 x tp=2)
QUERY_PROJECTION = {"gemma3": ("layers.0.attn.q_einsum.w", [4, 64, 16], [2, 16, 16])}
DECODER_QUERY_PROJECTION = ("layers.0.attn.q_proj.w", [64, 4, 16], [16, 2, 16])
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mesh_results(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """Runs every 8-device check in one subprocess (XLA fixes the device count at start-up)."""
    out = tmp_path_factory.mktemp("mesh") / "results.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    cases = [f"{case}={tiny_checkpoints.path(case)}" for case in MESH_CASES]
    completed = subprocess.run([sys.executable, "-m", "tests.mesh_checks", str(out), str(tokenizer_dir), *cases],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def test_mesh_has_eight_devices(mesh_results):
    assert mesh_results["device_count"] == 8


@pytest.mark.parametrize("case", MESH_CASES)
def test_logits_on_the_mesh_match_transformers(mesh_results, case):
    assert mesh_results[case]["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("case", MESH_CASES)
def test_parameters_are_sharded_over_fsdp_and_tp(mesh_results, case):
    shardings = mesh_results[case]["shardings"]
    path, shape, shard_shape = QUERY_PROJECTION.get(case, DECODER_QUERY_PROJECTION)
    query = shardings[path]
    assert {"fsdp", "tp"} <= set(query["spec"])
    assert query["shape"] == shape and query["shard_shapes"] == [shard_shape]
    gate = shardings["layers.0.mlp.gate_proj.kernel"]
    assert gate["spec"] == ["fsdp", "tp"] and gate["shard_shapes"] == [[16, 64]]
    assert all(entry["devices"] == 8 for entry in shardings.values())


@pytest.mark.parametrize("case", MESH_CASES)
def test_export_from_sharded_parameters_is_bit_exact(mesh_results, case):
    assert mesh_results[case]["export_equal"]


def test_load_state_dict_restores_straight_into_the_mesh_sharding(mesh_results):
    assert mesh_results["restore"] == {"all_matched": True, "same_sharding": True, "sharded_on_8": True,
                                       "values_equal": True}


@pytest.fixture(scope="session")
def one_device_sft(tiny_checkpoints):
    """The same SFT runs on this process's single device, global batch 8."""
    path = tiny_checkpoints.path(MESH_CASES[0])
    return {"full": sft_worker.train_losses(path, None, per_device=8),
            "lora": sft_worker.train_losses(path, None, per_device=8, lora=True)}


def test_sft_on_fsdp4_tp2_gives_the_losses_of_one_device(mesh_results, one_device_sft):
    eight, one = mesh_results["sft"], one_device_sft["full"]
    assert eight["global_batch"] == one["global_batch"] == 8  # 2 per device x data-parallel 4
    np.testing.assert_allclose(eight["losses"], one["losses"], rtol=1e-4)
    assert eight["traces"] == 1


def test_lora_sft_on_fsdp4_tp2_gives_the_losses_of_one_device(mesh_results, one_device_sft):
    np.testing.assert_allclose(mesh_results["sft_lora"]["losses"], one_device_sft["lora"]["losses"], rtol=1e-4)
    assert mesh_results["sft_lora"]["traces"] == one_device_sft["lora"]["traces"] == 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def two_process_sft(tiny_checkpoints, tmp_path_factory):
    """Two processes x 4 CPU devices, joined by jax.distributed (gloo collectives) into one 8-device mesh."""
    folder = tmp_path_factory.mktemp("distributed")
    port = _free_port()
    workers = []
    for index in range(2):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index))
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "tests.sft_worker", str(folder / f"{index}.json"),
             str(tiny_checkpoints.path(MESH_CASES[0])), str(folder / "sft_two_processes")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [worker.communicate(timeout=600)[0] for worker in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-4000:]
    return {"results": [json.loads((folder / f"{index}.json").read_text()) for index in range(2)],
            "output_dir": folder / "sft_two_processes"}


def test_two_processes_of_four_devices_train_like_one_process_of_eight(two_process_sft, mesh_results):
    results = two_process_sft["results"]
    assert [(r["process_index"], r["process_count"], r["local_devices"], r["devices"]) for r in results] == \
        [(0, 2, 4, 8), (1, 2, 4, 8)]
    for result in results:
        assert result["global_batch"] == 8
        np.testing.assert_allclose(result["losses"], mesh_results["sft"]["losses"], rtol=1e-4)


def test_two_processes_write_one_checkpoint_equal_to_one_process_of_eight(two_process_sft, mesh_results):
    import torchlike

    two = Path(two_process_sft["output_dir"]) / "checkpoint-4"
    one = Path(mesh_results["sft_output_dir"]) / "checkpoint-4"
    assert not (two.parent / "checkpoint-2").exists()  # save_total_limit=1 rotated it away
    assert json.loads((two / "trainer_state.json").read_text())["global_step"] == 4
    for part in ("model", "optimizer"):
        restored_two, restored_one = torchlike.load(two / part), torchlike.load(one / part)
        assert sorted(restored_two.keys()) == sorted(restored_one.keys())
        for key in restored_one.keys():
            np.testing.assert_allclose(np.asarray(restored_two[key]), np.asarray(restored_one[key]), rtol=1e-4,
                                       atol=1e-6, err_msg=f"{part}/{key}")


def test_grpo_with_lora_runs_on_fsdp4_tp2_and_resumes_exactly(mesh_results):
    straight, resumed = mesh_results["grpo_lora"]["straight"], mesh_results["grpo_lora"]["resumed"]
    assert len(straight) == 3 and np.isfinite(straight).all()
    assert resumed == pytest.approx(straight, rel=1e-5)  # step 1 from the checkpoint's log, steps 2-3 re-run
