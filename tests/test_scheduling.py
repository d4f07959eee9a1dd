"""tests/helpers/scheduling.py: the suite's files in the order xdist hands them out, longest first by the recorded
costs (a file without one costs a second a test), each file's tests in their own order; the costs come from a run's
junit report."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.helpers import scheduling


def test_files_are_ordered_longest_first_and_keep_their_tests_order(tmp_path, monkeypatch):
    costs = tmp_path / "file_costs.json"
    costs.write_text(json.dumps({"tests/test_slow.py": 100.0, "tests/test_fast.py": 0.5}))
    monkeypatch.setattr(scheduling, "COSTS", costs)
    ids = ["tests/test_fast.py::a", "tests/test_new.py::a", "tests/test_new.py::b", "tests/test_slow.py::b",
           "tests/test_slow.py::a", "tests/test_fast.py::b"]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in ids]
    scheduling.pytest_collection_modifyitems(None, None, items)
    # test_new.py has no recorded cost: two tests, two seconds, between the slow and the fast file.
    assert [item.nodeid for item in items] == ["tests/test_slow.py::b", "tests/test_slow.py::a",
                                               "tests/test_new.py::a", "tests/test_new.py::b",
                                               "tests/test_fast.py::a", "tests/test_fast.py::b"]


def test_costs_are_each_files_summed_test_time_from_a_junit_report(tmp_path, monkeypatch):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="x" time="1.5"/>'
                     '<testcase classname="tests.test_a" name="y" time="2.0"/>'
                     '<testcase classname="tests.test_b" name="z" time="9.0"/></testsuite></testsuites>')
    monkeypatch.setattr(scheduling, "COSTS", tmp_path / "file_costs.json")
    assert scheduling.write_costs(junit) == {"tests/test_b.py": 9.0, "tests/test_a.py": 3.5}
    assert json.loads((tmp_path / "file_costs.json").read_text()) == {"tests/test_b.py": 9.0, "tests/test_a.py": 3.5}
