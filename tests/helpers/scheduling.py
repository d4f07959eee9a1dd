"""The suite's files handed out longest first: pytest-xdist's ``--dist loadfile`` gives each worker whole files in
the order of the collection (with ``--no-loadscope-reorder``; by default it orders them by their number of tests,
which put the few-test multi-process files, minutes each, last), so the longest start first and short files fill the
end of both workers' runs instead of one worker running a long file alone.

The cost of a file is its test time in a recent full run (:data:`COSTS`, written by ``python -m
tests.helpers.scheduling <junit.xml>`` from the run's ``--junitxml``); a file not listed costs one second a test.
Within a file the tests keep their order.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

COSTS = Path(__file__).with_name("file_costs.json")
"""``{"tests/test_x.py": seconds}``: each file's summed test time in a recent full run."""


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items) -> None:
    costs = json.loads(COSTS.read_text()) if COSTS.is_file() else {}
    counts = collections.Counter(file_of(item.nodeid) for item in items)
    first = {}
    for index, item in enumerate(items):
        first.setdefault(file_of(item.nodeid), index)

    def key(item):
        name = file_of(item.nodeid)
        return -costs.get(name, float(counts[name])), first[name]

    items.sort(key=key)  # stable: a file's tests keep their order


def write_costs(junit: Path) -> dict[str, float]:
    """Each file's summed test time in ``junit`` (pytest's ``--junitxml``), written to :data:`COSTS`."""
    import xml.etree.ElementTree as ElementTree

    costs: collections.Counter = collections.Counter()
    for case in ElementTree.parse(junit).iter("testcase"):
        name = "tests/" + case.get("classname").split(".")[-1] + ".py"
        costs[name] += float(case.get("time") or 0.0)
    table = {name: round(seconds, 1) for name, seconds in costs.most_common()}
    COSTS.write_text(json.dumps(table, indent=1) + "\n")
    return table


if __name__ == "__main__":
    write_costs(Path(sys.argv[1]))
