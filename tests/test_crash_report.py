"""A pytest-xdist worker killed by a native fault (tests/helpers/crash_report.py): its stacks are printed, the test
it was running runs once more on the replacement worker, and a test that kills its worker twice fails the run."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from tests.helpers import crash_report

TESTS = '''
import ctypes
import os
import pathlib


def test_first():
    pass


def test_crashes_once():
    marker = pathlib.Path(os.environ["CRASH_MARKER"])
    if not marker.exists():
        marker.write_text("crashed")
        ctypes.string_at(0)  # a segmentation fault, as XLA:CPU's compiler has had


def test_after_the_crash():
    pass


def test_crashes_always():
    if os.environ.get("CRASH_ALWAYS"):
        ctypes.string_at(0)
'''


#: Files that run (and finish) before the crashing one: pytest-xdist orders files by size, biggest first.
FINISHED_FIRST = {f"test_finished_{index}": "".join(f"def test_{name}():\n    pass\n" for name in "abcde")
                  for index in range(4)}


def _run(pytester, monkeypatch, always: bool, dist: str = "loadfile"):
    pytester.makepyfile(test_inner=TESTS, **FINISHED_FIRST)
    monkeypatch.setenv("CRASH_MARKER", str(pytester.path / "crashed-once"))
    if always:
        monkeypatch.setenv("CRASH_ALWAYS", "1")
    monkeypatch.setenv("PYTHONPATH", ":".join(path for path in sys.path if path))
    return pytester.runpytest_subprocess("-p", "tests.helpers.crash_report", "-p", "no:cacheprovider", "-n", "1",
                                         "--dist", dist, "--max-worker-restart=2", timeout=120)


def test_a_crashed_test_reruns_once_on_a_new_worker_and_its_stacks_are_printed(pytester, monkeypatch):
    """The files the dead worker had finished are not run again, and the run ends (pytest-xdist alone hangs)."""
    result = _run(pytester, monkeypatch, always=False)
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("rerun"), outcomes.get("failed")) == (4 + 5 * 4, 1, None)
    assert result.ret == 0
    out = result.stdout.str()
    assert "CRASHED WORKER while running test_inner.py::test_crashes_once (1 time(s))" in out
    result.stdout.fnmatch_lines(["*crashed worker gw0: its fault handler's stacks*", "*Segmentation fault*",
                                 "*in test_crashes_once*"])


def test_a_test_that_crashes_its_worker_twice_fails_the_run(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, always=True)
    assert result.ret == 1
    out = result.stdout.str()
    assert "FAILED test_inner.py::test_crashes_always" in out
    assert "CRASHED WORKER while running test_inner.py::test_crashes_always" in out


def test_under_a_scheduler_that_drops_the_crashed_test_the_crash_stays_a_failure(pytester, monkeypatch):
    """pytest-xdist's plain load scheduling does not run a crashed test again, so it must not become a rerun."""
    result = _run(pytester, monkeypatch, always=False, dist="load")
    assert result.ret == 1
    assert "FAILED test_inner.py::test_crashes_once" in result.stdout.str()


def test_the_suite_replaces_as_many_workers_as_it_reruns_crashed_tests():
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    addopts = project["tool"]["pytest"]["ini_options"]["addopts"]
    assert f"--max-worker-restart={crash_report.MAX_CRASH_RERUNS}" in addopts
