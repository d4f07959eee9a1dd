"""A pytest plugin (``tests/conftest.py`` loads it) for pytest-xdist workers that die of a native fault.

- Each worker writes Python's fault handler output (every thread's stack, on SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE)
  to a file the controller names; when the run ends, the controller prints every such file that is not empty under a
  "crashed worker" heading. Without it a dead worker shows only "node down: Not properly terminated".
- A test whose worker died runs once more on the replacement worker (pytest-xdist requeues the rest of the file; the
  suite allows ``--max-worker-restart=4``): the crash is reported as ``RERUN`` (``R``) with the test's name, and the
  second run's result is the test's result. A test that kills its worker twice fails, and so does every crash past
  the run's fourth.

Why: XLA:CPU (jaxlib 0.10) segfaulted inside its compiler (``backend_compile_and_load``) in long-lived workers,
about once per cold run of the suite, at a different test each time and never when that test reran, in a new worker
or alone: the compiled programs' code had filled the process's memory mappings (``vm.max_map_count``), which
tests/helpers/memory_maps.py now prevents. A rerun keeps any other such crash from failing the run; the printed stacks
keep it visible.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_KEY = "torchlike_fault_log_dir"
_log = None  # the open log of this worker (kept open for the fault handler)
MAX_CRASH_RERUNS = 4  # per run; keep equal to --max-worker-restart in pyproject.toml's addopts
_crashed: list[str] = []  # controller: the tests whose worker died, in order


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which points it at stderr
def pytest_configure(config):
    global _log
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        if config.pluginmanager.hasplugin("xdist"):
            config._torchlike_fault_log_dir = tempfile.mkdtemp(prefix="torchlike-worker-faults-")
        return
    folder = workerinput.get(_KEY)
    if folder:
        _log = open(os.path.join(folder, f"{workerinput['workerid']}.log"), "w")  # noqa: SIM115
        faulthandler.enable(file=_log, all_threads=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's hook: hands each worker the folder for its fault log."""
    folder = getattr(node.config, "_torchlike_fault_log_dir", None)
    if folder:
        node.workerinput[_KEY] = folder


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist's hook for a test whose worker died: the first crash of a test (up to ``MAX_CRASH_RERUNS`` a run)
    becomes a rerun, since the load-file scheduler has already requeued the file's unfinished tests, this one
    included, for the replacement worker."""
    first = crashitem not in _crashed
    _crashed.append(crashitem)
    # pytest-xdist 3.8's load-file scheduler requeues every file the dead worker was ever given, finished ones too;
    # a worker then handed only a finished file gets no test to run, reports nothing and is never given more work,
    # and the run hangs. The finished files are taken off the queue (they ran; their results are in).
    workqueue = getattr(sched, "workqueue", None)
    if workqueue is None:  # another scheduler (plain --dist load drops the crashed test): the crash stays a failure
        return
    for scope in [scope for scope, tests in workqueue.items() if all(tests.values())]:
        del workqueue[scope]
    # requeued: waiting in the queue, or already handed to a surviving worker by the scheduler's own rescheduling
    units = [*workqueue.values(), *(unit for assigned in getattr(sched, "assigned_work", {}).values()
                                    for unit in assigned.values())]
    requeued = any(tests.get(crashitem) is False for tests in units)
    if first and requeued and len(_crashed) <= MAX_CRASH_RERUNS:
        report.outcome = "rerun"
        report.longrepr = f"{report.longrepr}; it runs again on the replacement worker"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_unconfigure(config):
    folder = getattr(config, "_torchlike_fault_log_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for nodeid in dict.fromkeys(_crashed):
        terminalreporter.write_line(f"CRASHED WORKER while running {nodeid} ({_crashed.count(nodeid)} time(s))")
    folder = getattr(config, "_torchlike_fault_log_dir", None)
    if not folder:
        return
    for log in sorted(Path(folder).glob("*.log")):
        text = log.read_text(errors="replace").strip()
        if text:
            terminalreporter.section(f"crashed worker {log.stem}: its fault handler's stacks", sep="=")
            terminalreporter.write_line(text)
