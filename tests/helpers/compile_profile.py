"""An opt-in pytest plugin: where the suite's compile time goes, by program.

Run the README's command with ``-p tests.helpers.compile_profile`` (``tests/conftest.py`` does not load it)::

    python -m pytest -n 2 --dist loadfile -p tests.helpers.compile_profile

Each process (the xdist workers, or the one process without ``-n``) records JAX's compile events
(``jax.monitoring``: tracing, lowering to StableHLO and XLA's backend compile, each with its program's name) and the
test that caused them, and writes them to ``$TORCHLIKE_COMPILE_PROFILE`` (default ``compile-profile/``) as
``<worker>.json``. It also fingerprints each module handed to XLA (its StableHLO text, devices and compile
options): a module compiled again in the same process is a *repeat*, the share a process-wide cache of compiled
programs could save. The process that ran the session (the xdist controller) merges the files and prints the table
at the end of the run. Child processes the tests start (the multi-process and mesh jobs) are not recorded.

What it measured on the suite is in ``tests/TIMING.md``.
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

from tests.helpers import worker_records
from tests.helpers.worker_records import pytest_runtest_protocol  # noqa: F401  (the hook, by its name)

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
"""JAX's compile events, by the phase they time."""

_by_program: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_by_test: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_seen_modules: set[str] = set()
_last_was_repeat = [False]  # set by the fingerprint of a module, read by the compile event that follows it


def output_folder() -> Path:
    """Where each process writes its record: ``$TORCHLIKE_COMPILE_PROFILE``, default ``compile-profile/``."""
    return Path(os.environ.get("TORCHLIKE_COMPILE_PROFILE", "compile-profile"))


def program_name(name: str) -> str:
    """One name per program whatever the phase: tracing reports ``step``, lowering and compiling ``jit(step)``."""
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


def _listen(event: str, seconds: float, **kwargs) -> None:
    phase = PHASES.get(event)
    if phase is None:
        return
    name = program_name(str(kwargs.get("fun_name", "?")))
    for record in (_by_program[name], _by_test[worker_records.current_test[0]]):
        record[phase] += seconds
        if phase == "compile":
            record["compiles"] += 1
            record["repeats"] += _last_was_repeat[0]
    if phase == "compile":
        _last_was_repeat[0] = False


def _count_repeats() -> None:
    """Wraps the function JAX hands each module to XLA with (``jax._src.compiler.compile_or_get_cached``, private:
    a JAX that moved it is profiled without repeats) to fingerprint the module."""
    try:
        from jax._src import compiler
    except ImportError:
        return
    compile_or_get_cached = getattr(compiler, "compile_or_get_cached", None)
    if compile_or_get_cached is None or getattr(compile_or_get_cached, "_profiled", False):
        return

    def fingerprinted(backend, computation, devices, compile_options, *args, **kwargs):
        try:
            digest = hashlib.sha256(str(computation).encode())  # its text: the bytecode differs run to run
            digest.update(repr([device.id for device in devices.flat]).encode())
            digest.update(compile_options.SerializeAsString())
            key = digest.hexdigest()
            _last_was_repeat[0] = key in _seen_modules  # JAX's compile event, timed around this call, reads it
            _seen_modules.add(key)
        except Exception:  # noqa: BLE001 - a profiler never fails the compile it watches
            pass
        return compile_or_get_cached(backend, computation, devices, compile_options, *args, **kwargs)

    fingerprinted._profiled = True
    compiler.compile_or_get_cached = fingerprinted


def pytest_configure(config):
    import jax

    worker_records.remove_stale(config, output_folder())
    jax.monitoring.register_event_duration_secs_listener(_listen)
    _count_repeats()


def pytest_sessionfinish(session):
    if worker_records.is_xdist_controller(session.config):
        return  # the workers compiled; the controller only merges their files (pytest_terminal_summary)
    record = {"programs": {name: dict(counts) for name, counts in _by_program.items()},
              "tests": {name: dict(counts) for name, counts in _by_test.items()}}
    worker_records.write(output_folder(), record)


def merged(folder: Path) -> dict[str, collections.Counter]:
    """Every process's record in ``folder``, summed by program."""
    programs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in worker_records.read(folder):
        for name, counts in record["programs"].items():
            programs[name].update(counts)
    return programs


def table(programs: dict[str, collections.Counter], rows: int = 15) -> list[str]:
    """The programs taking the most trace + lower + compile seconds, then the totals."""
    def seconds(counts):
        return counts["trace"] + counts["lower"] + counts["compile"]

    lines = [f"{'program':40s} {'compiles':>8s} {'repeats':>7s} {'trace':>8s} {'lower':>8s} {'compile':>8s}"]
    ranked = sorted(programs.items(), key=lambda item: -seconds(item[1]))
    for name, counts in ranked[:rows]:
        lines.append(f"{name[:40]:40s} {counts['compiles']:8d} {counts['repeats']:7d} {counts['trace']:8.1f} "
                     f"{counts['lower']:8.1f} {counts['compile']:8.1f}")
    total = collections.Counter()
    for counts in programs.values():
        total.update(counts)
    lines.append(f"{'all ' + str(len(programs)) + ' programs':40s} {total['compiles']:8d} {total['repeats']:7d} "
                 f"{total['trace']:8.1f} {total['lower']:8.1f} {total['compile']:8.1f}")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    folder = output_folder()
    terminalreporter.section(f"compile profile ({folder})")
    for line in table(merged(folder)):
        terminalreporter.write_line(line)
