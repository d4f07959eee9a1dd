"""An opt-in pytest plugin: how close each test's comparisons came to their tolerance.

Run the README's command with ``-p tests.helpers.tolerance_margins`` (``tests/conftest.py`` does not load it)::

    python -m pytest -n 2 --dist loadfile -p tests.helpers.tolerance_margins

Each process wraps ``numpy.testing.assert_allclose``. For every call it records the call's *margin*: the largest
``|actual - desired| / (atol + rtol * |desired|)`` over its elements. A margin of 1 is the tolerance itself; a
comparison passes below 1. Each process keeps each test's largest margin, with that call's ``rtol``, ``atol`` and
``err_msg``. It writes them to ``$TORCHLIKE_TOLERANCE_MARGINS`` (default ``tolerance-margins/``) as
``<worker>.json``. The process that ran the session merges the files and prints the tests nearest their tolerance.

Why: the comparisons with TRL and transformers are float32 on both sides, and another CPU rounds differently. A
comparison that sits near 1 on one machine can fail on the next. Two did, when the project's machines changed
(``tests/TIMING.md``). Tests that break a setting on purpose and expect the comparison to fail show margins far above
1; read those as the sharpness they check. Child processes the tests start (the multi-process and mesh jobs) are not
recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.helpers import worker_records
from tests.helpers.worker_records import pytest_runtest_protocol  # noqa: F401  (the hook, by its name)

_largest: dict[str, dict] = {}
_unwrapped = np.testing.assert_allclose


def output_folder() -> Path:
    """Where each process writes its record: ``$TORCHLIKE_TOLERANCE_MARGINS``, default ``tolerance-margins/``."""
    return Path(os.environ.get("TORCHLIKE_TOLERANCE_MARGINS", "tolerance-margins"))


def margin(actual, desired, rtol: float, atol: float) -> float | None:
    """The largest ``|actual - desired| / (atol + rtol * |desired|)`` of a comparison: 0 where the values are equal,
    ``inf`` for a difference with a zero tolerance, ``None`` where the values are not numbers of one shape (then
    ``assert_allclose`` itself says why)."""
    try:
        actual, desired = np.broadcast_arrays(np.asarray(actual, np.float64), np.asarray(desired, np.float64))
        rtol, atol = np.asarray(rtol, np.float64), np.asarray(atol, np.float64)
    except (TypeError, ValueError):
        return None
    finite = np.isfinite(actual) & np.isfinite(desired)
    difference = np.abs(actual - desired)[finite]
    tolerance = np.broadcast_to(atol + rtol * np.abs(desired), desired.shape)[finite]
    if not difference.size:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(difference == 0, 0.0, difference / tolerance)
    return float(ratios.max())


def _recording_assert_allclose(actual, desired, rtol=1e-7, atol=0, equal_nan=True, err_msg="", verbose=True,
                               **kwargs):
    found = margin(actual, desired, rtol, atol)
    test = worker_records.current_test[0]
    if found is not None and found >= _largest.get(test, {}).get("margin", -1.0):
        _largest[test] = {"margin": found, "rtol": float(np.max(rtol)), "atol": float(np.max(atol)),
                          "err_msg": str(err_msg)[:80]}
    return _unwrapped(actual, desired, rtol=rtol, atol=atol, equal_nan=equal_nan, err_msg=err_msg, verbose=verbose,
                      **kwargs)


def pytest_configure(config):
    worker_records.remove_stale(config, output_folder())
    np.testing.assert_allclose = _recording_assert_allclose


def pytest_unconfigure(config):
    np.testing.assert_allclose = _unwrapped


def pytest_sessionfinish(session):
    if worker_records.is_xdist_controller(session.config):
        return  # the workers compared; the controller only merges their files (pytest_terminal_summary)
    worker_records.write(output_folder(), _largest)


def merged(folder: Path) -> dict[str, dict]:
    """Every process's record in ``folder``: each test's largest margin, with its call's tolerance and message."""
    tests: dict[str, dict] = {}
    for record in worker_records.read(folder):
        tests.update(record)
    return tests


def table(tests: dict[str, dict], rows: int = 25) -> list[str]:
    """The tests whose comparisons came nearest their tolerance (or past it), largest margin first."""
    lines = [f"{'margin':>8s} {'rtol':>8s} {'atol':>8s}  test [err_msg]"]
    for name, record in sorted(tests.items(), key=lambda item: -item[1]["margin"])[:rows]:
        message = f" [{record['err_msg']}]" if record["err_msg"] else ""
        lines.append(f"{record['margin']:8.3f} {record['rtol']:8.1e} {record['atol']:8.1e}  {name}{message}")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    folder = output_folder()
    terminalreporter.section(f"tolerance margins ({folder})")
    for line in table(merged(folder)):
        terminalreporter.write_line(line)
