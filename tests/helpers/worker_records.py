"""What the opt-in recording plugins (``compile_profile``, ``tolerance_margins``) share: each process of a run writes
its record to one folder as ``<worker>.json``, and the process that ran the session clears the earlier run's files
first and merges the workers' at the end. A plugin that records by test imports :func:`pytest_runtest_protocol` (pytest
finds the hook by its name in the plugin's module) and reads :data:`current_test`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The node id of the test this process is running (``<outside a test>`` between tests).
current_test = ["<outside a test>"]


def remove_stale(config, folder: Path) -> None:
    """In the session's own process (not an xdist worker): removes the records an earlier run left in ``folder``."""
    if not hasattr(config, "workerinput"):
        for stale in folder.glob("*.json"):
            stale.unlink()


def is_xdist_controller(config) -> bool:
    """Whether this process only hands tests to xdist workers (it runs none, so it records nothing)."""
    return getattr(config.option, "numprocesses", None) not in (None, 0) and not hasattr(config, "workerinput")


def write(folder: Path, record) -> None:
    """Writes this process's ``record`` as JSON to ``folder/<worker>.json`` (``main`` without xdist), whole or not at
    all."""
    folder.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    partial = folder / f".{worker}.json.partial"
    partial.write_text(json.dumps(record))
    partial.replace(folder / f"{worker}.json")


def read(folder: Path) -> Iterator:
    """Every process's record in ``folder``, in the order of their file names."""
    for path in sorted(folder.glob("*.json")):
        yield json.loads(path.read_text())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Keeps :data:`current_test` on the test being run."""
    current_test[0] = item.nodeid
    yield
    current_test[0] = "<outside a test>"
