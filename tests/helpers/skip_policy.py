"""The suite's skip policy, a pytest plugin (``tests/conftest.py`` loads it): a skipped test fails, saying why it
skipped, unless it is marked ``opt_in`` (it runs only when a setting is made, e.g. vLLM's venv) or ``platform`` (it
tests a platform feature, e.g. glibc's allocator). The suite compares with reference libraries it installs or fetches
itself, so a skip would hide a comparison that did not run."""

from __future__ import annotations

import pytest

SKIP_ALLOWED = ("opt_in", "platform")


def pytest_configure(config):
    config.addinivalue_line("markers", "opt_in(reason): a test that runs only when its reason's setting is made "
                            "(vLLM's venv); it may skip")
    config.addinivalue_line("markers", "platform(reason): a test of a platform feature (glibc, /proc); it may skip "
                            "elsewhere")


def _skip_refused(report, markers) -> None:
    """Turns ``report``'s skip into a failure (the skip's reason kept) unless one of ``markers`` allows it."""
    if not report.skipped or hasattr(report, "wasxfail") or any(name in markers for name in SKIP_ALLOWED):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{reason}\nThe suite allows no skip: install what the test needs (README's test command does) "
                       f"or mark a test that is meant to be optional with pytest.mark.opt_in / pytest.mark.platform.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    _skip_refused(report, {mark.name for mark in item.iter_markers()})


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    _skip_refused(report, {mark.name for mark in getattr(collector, "own_markers", [])})
