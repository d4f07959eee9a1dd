"""The opt-in compile profiler (tests/helpers/compile_profile.py): each xdist worker records its programs' compiles
and the seconds of each phase by test, a module compiled again in the same process counts as a repeat, and the run
ends with the merged table."""

from __future__ import annotations

import json
import sys

from tests.helpers import compile_profile

TESTS = '''
import jax
import jax.numpy as jnp


def doubled_plus_one(values):
    return values * 2.0 + 1.0


def shifted(values):
    return values - 3.0


def test_compiles_one_program_twice():
    values = jnp.arange(3.0)
    jax.jit(doubled_plus_one)(values).block_until_ready()
    jax.clear_caches()  # as tests/helpers/memory_maps.py may between files: the same module is compiled again
    jax.jit(doubled_plus_one)(values).block_until_ready()


def test_compiles_another_program():
    jax.jit(shifted)(jnp.arange(4.0)).block_until_ready()
'''


def test_workers_record_compiles_and_repeats_by_program_and_test_and_the_run_prints_the_merged_table(
        pytester, monkeypatch):
    folder = pytester.path / "profile"
    folder.mkdir()
    (folder / "gw7.json").write_text(json.dumps({"programs": {"stale": {"compiles": 9}}, "tests": {}}))
    pytester.makepyfile(test_inner=TESTS)
    monkeypatch.setenv("PYTHONPATH", ":".join(path for path in sys.path if path))
    monkeypatch.setenv("TORCHLIKE_COMPILE_PROFILE", str(folder))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    result = pytester.runpytest_subprocess("-p", "tests.helpers.compile_profile", "-p", "no:cacheprovider",
                                           "-n", "2", "--dist", "load", timeout=180)
    assert result.ret == 0
    records = {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}
    assert set(records) == {"gw0", "gw1"}  # the earlier run's file is gone, the controller writes none

    programs = compile_profile.merged(folder)
    assert "stale" not in programs
    twice, once = programs["doubled_plus_one"], programs["shifted"]
    assert (twice["compiles"], twice["repeats"]) == (2, 1)
    assert (once["compiles"], once["repeats"]) == (1, 0)
    for counts in (twice, once):
        assert counts["trace"] > 0 and counts["lower"] > 0 and counts["compile"] > 0

    tests = {}
    for record in records.values():
        tests.update(record["tests"])
    first = tests["test_inner.py::test_compiles_one_program_twice"]
    assert first["compiles"] >= 2 and first["repeats"] == 1  # jnp.arange compiles programs of its own too
    assert tests["test_inner.py::test_compiles_another_program"]["repeats"] == 0

    out = result.stdout.str()
    assert f"compile profile ({folder})" in out
    row = next(line for line in out.splitlines() if line.startswith("doubled_plus_one "))
    assert row.split()[1:3] == ["2", "1"]
    assert any(line.startswith("all ") for line in out.splitlines())
