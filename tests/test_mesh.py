"""Loading on a simulated 8-device mesh (fsdp=4 x tp=2): same logits, parameters really sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MESH_CASES = ["qwen2", "qwen3_tied", "llama32", "gemma3"]
# (query projection path, its full shape, its shard shape on fsdp=4 x tp=2)
QUERY_PROJECTION = {"gemma3": ("layers.0.attn.q_einsum.w", [4, 64, 16], [2, 16, 16])}
DECODER_QUERY_PROJECTION = ("layers.0.attn.q_proj.w", [64, 4, 16], [16, 2, 16])
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mesh_results(tiny_checkpoints, tmp_path_factory):
    """Runs every 8-device check in one subprocess (XLA fixes the device count at start-up)."""
    out = tmp_path_factory.mktemp("mesh") / "results.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    cases = [f"{case}={tiny_checkpoints.path(case)}" for case in MESH_CASES]
    completed = subprocess.run([sys.executable, "-m", "tests.mesh_checks", str(out), *cases], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=900)
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
