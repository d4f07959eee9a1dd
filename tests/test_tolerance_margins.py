"""The opt-in tolerance-margin recorder (tests/helpers/tolerance_margins.py): each xdist worker records each test's
comparison nearest its tolerance, and the run ends with the merged table, nearest first."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.helpers import tolerance_margins

TESTS = '''
import numpy as np


def test_near_its_tolerance():
    np.testing.assert_allclose([1.0, 2.0], [1.0, 2.0 + 8e-4], rtol=1e-3, atol=0.0, err_msg="second")
    np.testing.assert_allclose(1.0, 1.0 + 1e-9, rtol=1e-3)


def test_far_from_it():
    np.testing.assert_allclose(np.zeros(3), np.full(3, 1e-7), rtol=0.0, atol=1e-6)


def test_past_it():
    np.testing.assert_allclose(1.0, 1.1, rtol=0.01)
'''


def test_workers_record_each_tests_largest_margin_and_the_run_prints_the_nearest_first(pytester, monkeypatch):
    folder = pytester.path / "margins"
    folder.mkdir()
    (folder / "gw7.json").write_text(json.dumps({"stale": {"margin": 9.0, "rtol": 0, "atol": 0, "err_msg": ""}}))
    pytester.makepyfile(test_inner=TESTS)
    monkeypatch.setenv("PYTHONPATH", ":".join(path for path in sys.path if path))
    monkeypatch.setenv("TORCHLIKE_TOLERANCE_MARGINS", str(folder))
    result = pytester.runpytest_subprocess("-p", "tests.helpers.tolerance_margins", "-p", "no:cacheprovider",
                                           "-n", "2", "--dist", "load", timeout=120)
    result.assert_outcomes(passed=2, failed=1)  # the recorder changes no outcome
    assert {path.stem for path in folder.glob("*.json")} == {"gw0", "gw1"}  # the earlier run's file is gone

    tests = tolerance_margins.merged(folder)
    assert "stale" not in tests
    near = tests["test_inner.py::test_near_its_tolerance"]
    assert near["margin"] == pytest.approx(8e-4 / (1e-3 * 2.0008), rel=1e-6)  # the call nearest, not the last
    assert (near["rtol"], near["atol"], near["err_msg"]) == (1e-3, 0.0, "second")
    assert tests["test_inner.py::test_far_from_it"]["margin"] == pytest.approx(0.1, rel=1e-6)
    assert tests["test_inner.py::test_past_it"]["margin"] == pytest.approx(0.1 / (0.01 * 1.1), rel=1e-6)

    lines = result.stdout.str().splitlines()
    start = next(index for index, line in enumerate(lines) if f"tolerance margins ({folder})" in line)
    assert lines[start + 1].split() == ["margin", "rtol", "atol", "test", "[err_msg]"]
    rows = [line.split() for line in lines[start + 2:start + 5]]
    assert [row[3] for row in rows] == ["test_inner.py::test_past_it", "test_inner.py::test_near_its_tolerance",
                                        "test_inner.py::test_far_from_it"]
    assert rows[1][0] == f"{near['margin']:.3f}" and rows[1][4] == "[second]"


@pytest.mark.parametrize("actual, desired, rtol, atol, expected", [
    ([1.0, 2.0], [1.0, 2.0], 1e-7, 0.0, 0.0),  # equal: 0 whatever the tolerance
    (1.0, 1.5, 0.0, 1.0, 0.5),
    ([0.0, 3.0], [0.0, 3.3], 0.1, 0.0, 0.3 / 0.33),
    (1.0, 2.0, 0.0, 0.0, math.inf),  # a difference with no tolerance at all
    ([1.0, float("nan")], [1.0, float("nan")], 1e-7, 0.0, 0.0),  # NaNs assert_allclose takes as equal are skipped
])
def test_margin_is_the_largest_difference_over_its_tolerance(actual, desired, rtol, atol, expected):
    assert tolerance_margins.margin(actual, desired, rtol, atol) == pytest.approx(expected)


def test_values_that_are_not_numbers_have_no_margin():
    assert tolerance_margins.margin(["a"], ["b"], 1e-7, 0.0) is None
    assert tolerance_margins.margin([1.0, 2.0], [1.0, 2.0, 3.0], 1e-7, 0.0) is None
