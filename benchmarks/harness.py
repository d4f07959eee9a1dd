"""What the benchmark scripts share: the machine record, the child-process protocol, timing and memory probes, tables.

Each script in ``benchmarks/`` measures one thing; the pieces they all need live here, once:

- :func:`machine_info`: CPU model, cores, memory, platform, Python, package versions, git commit, GPU names;
- the child-process protocol: a child runs one side or phase and prints its record with :func:`print_result` (one
  line starting with :data:`RESULT_MARKER`); the driver runs it with :func:`run_child_process`, which parses that
  line and returns the record, or one with ``error`` (the exit status and the stderr tail) that
  :func:`error_summary` shortens to its exception line; :func:`child_environment` is the environment a child gets;
- timing: :class:`StepClock` (marks at training-step boundaries), :func:`hf_callback` (feeds it from a
  ``transformers`` trainer), :func:`best_of` (the least disturbed repeat), :func:`record_compilations` (XLA
  compilations, through ``jax.monitoring``), :func:`timed` and :func:`profiled`;
- memory: :class:`PeakRss`, the peak RSS of a block;
- the models: :func:`tiny_qwen2` (the random Qwen2 of a benchmark's shape; :func:`tiny_decoder_config` for
  another family) and :func:`tunix_model` (the raw Tunix Qwen2 the trainer benchmarks compare against);
- tables: :class:`Column` specs and :func:`format_table`;
- a script's plumbing: :func:`missing_packages`, :func:`fill_from_preset`, :func:`write_json`.

Nothing here imports JAX, torch or torchlike at module level: a driver that imported JAX would take GPU memory its
children need, and importing torchlike tunes the allocator of a torch child.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "BENCHMARK_RESULT "
#: The packages whose versions :func:`machine_info` records unless told others.
DEFAULT_PACKAGES = ("jax", "jaxlib", "flax", "optax", "qwix", "google-tunix", "torch", "transformers", "trl", "peft",
                    "torchlike")
STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")

Result = TypeVar("Result")


# --------------------------------------------------------------------------- the machine


def machine_info(packages: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, Any]:
    """What the figures were measured on.

    Args:
        packages: distribution names whose installed versions to record (None for one that is not installed).

    Returns:
        ``cpu_count``, ``cpus_usable`` (the cores this process may run on), ``platform``, ``python``, ``cpu_model``
        and ``mem_total_bytes`` (where ``/proc`` tells), ``versions``, ``git`` (``commit`` and
        ``uncommitted_files``, where git answers) and ``gpus`` (see :func:`gpu_names`).
    """
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    info["versions"] = versions
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        info["git"] = {"commit": commit, "uncommitted_files": len(changed.splitlines())}
    except OSError:
        pass
    info["gpus"] = gpu_names()
    return info


def gpu_names() -> list[str]:
    """The GPUs JAX would see, as ``nvidia-smi`` lists them (name and memory); empty without it.

    Asked of ``nvidia-smi``, not of JAX: a driver process that started JAX's GPU backend would hold GPU memory its
    children need.
    """
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
    return [line.strip() for line in listing.stdout.splitlines() if line.strip()]


def missing_packages(names: Iterable[str]) -> list[str]:
    """The packages among ``names`` that this Python cannot import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


# --------------------------------------------------------------------------- child processes


def child_environment(cpu: bool = False, compilation_cache: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment of a benchmark's child process: this one's, offline, without tokenizer threads.

    Args:
        cpu: hide every GPU (``JAX_PLATFORMS=cpu``, ``CUDA_VISIBLE_DEVICES=""``).
        compilation_cache: the directory of torchlike's persistent XLA compilation cache
            (``TORCHLIKE_COMPILATION_CACHE``; JAX's own ``JAX_COMPILATION_CACHE_DIR`` is dropped so that it is the
            only one); None leaves the cache settings as they are.

    Returns:
        The environment, for ``subprocess.run(env=...)`` or :func:`run_child_process`.
    """
    environment = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if compilation_cache is not None:
        environment["TORCHLIKE_COMPILATION_CACHE"] = str(compilation_cache)
        environment.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cpu:
        environment.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    return environment


def print_result(record: Mapping[str, Any]) -> None:
    """Prints a child's record as its result line (:data:`RESULT_MARKER` and the record as JSON)."""
    print(RESULT_MARKER + json.dumps(record), flush=True)


def run_child_process(command: Sequence[str], env: Mapping[str, str] | None = None,
                      labels: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Runs a child in a fresh interpreter and returns the record of its result line.

    Args:
        command: the child's command line.
        env: its environment (default: :func:`child_environment`'s).
        labels: keys an error record carries, naming what ran (a child's own record names itself).

    Returns:
        The child's record (its last result line) with ``process_seconds`` (the process's wall time) and
        ``load_before`` (the 1-minute load average when it started: other work on the machine skews the times); when
        it exits non-zero or prints no result line, ``labels`` with ``error`` (``"exit N: "`` and the tail of its
        stderr) and ``load_before``.
    """
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.run(list(command), capture_output=True, text=True,
                             env=dict(env) if env is not None else child_environment())
    lines = [line for line in process.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if process.returncode != 0 or not lines:
        missing = "" if lines or process.returncode != 0 else ", no result line"
        return {**(labels or {}), "error": f"exit {process.returncode}{missing}: {process.stderr[-3000:]}",
                "load_before": load_before}
    record = json.loads(lines[-1][len(RESULT_MARKER):])
    record.update(process_seconds=time.perf_counter() - started, load_before=load_before)
    return record


def error_summary(error: str) -> str:
    """The exception line of a child's stderr (its last line that names an error), else its last line."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    return (named or lines or ["no output"])[-1]


# --------------------------------------------------------------------------- timing


class StepClock:
    """Wall-clock marks at step boundaries, each taken after ``sync()`` has waited for dispatched work.

    Marks are taken at three boundaries only (the end of step 1, of the last warmup step and of the last step), so
    that waiting does not slow an asynchronous loop; between them, the host's own time per step is recorded.

    Args:
        sync: waits until every step dispatched so far has finished.
        warmup: steps before the measured window.
        total: warmup + measured steps.
    """

    def __init__(self, sync: Callable[[], Any], warmup: int, total: int):
        self.sync, self.warmup, self.total = sync, warmup, total
        self.started: float | None = None
        self.marks: dict[int, float] = {}
        self.host_marks: list[tuple[int, float, float]] = []  # (steps done, reached, resumed after any sync)

    def start(self) -> None:
        """Call just before ``train()``."""
        self.started = time.perf_counter()

    def steps_done(self, completed: int) -> None:
        """``completed`` steps have been dispatched; marks the boundaries (first, end of warmup, last)."""
        reached = time.perf_counter()
        resumed = reached
        if completed in (1, self.warmup, self.total) and completed not in self.marks:
            self.sync()
            resumed = self.marks[completed] = time.perf_counter()
        self.host_marks.append((completed, reached, resumed))

    def result(self, batch: int, seq: int) -> dict[str, Any]:
        """``first_step_s``, ``warmup_end_s``, ``step_s`` and ``tokens_per_s`` (``batch * seq`` tokens a step),
        ``host_step_s`` (the median host time between marks after the warmup) and ``train_called_at``."""
        first = self.marks.get(1)
        record: dict[str, Any] = {"first_step_s": None if first is None else first - self.started,
                                  "train_called_at": self.started}
        if self.warmup in self.marks and self.total in self.marks and self.total > self.warmup:
            step = (self.marks[self.total] - self.marks[self.warmup]) / (self.total - self.warmup)
            record.update(step_s=step, tokens_per_s=batch * seq / step,
                          warmup_end_s=self.marks[self.warmup] - self.started)
        # From the previous mark (after its sync, if any) to this one, before its sync: the loop's own time.
        intervals = [reached - previous[2] for previous, (_, reached, _) in
                     zip(self.host_marks, self.host_marks[1:], strict=False)]
        steady = [gap for (step, _, _), gap in zip(self.host_marks[1:], intervals, strict=True) if step > self.warmup]
        record["host_step_s"] = statistics.median(steady) if steady else None
        record["host_intervals_s"] = intervals
        return record


def hf_callback(clock: StepClock, stop_after_first: bool = False) -> Any:
    """A ``transformers.TrainerCallback`` feeding ``clock`` from ``on_step_end`` (and stopping after step 1)."""
    import transformers

    class StepClockCallback(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.steps_done(state.global_step)
            if stop_after_first:
                control.should_training_stop = True
            return control

    return StepClockCallback()


def best_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the shortest step (the least disturbed by other processes), with every repeat's figures."""
    timed_records = [r for r in records if r.get("step_s")]
    if not timed_records:
        return records[-1]
    best = dict(min(timed_records, key=lambda r: r["step_s"]))
    best["first_step_warm_s"] = next((r["first_step_warm_s"] for r in records if "first_step_warm_s" in r), None)
    best["step_s_all"] = [r["step_s"] for r in timed_records]
    best["first_step_s_all"] = [r["first_step_s"] for r in timed_records]
    best["failed_repeats"] = len(records) - len(timed_records)
    return best


def record_compilations() -> list[tuple[float, float]]:
    """Starts collecting ``(end time, seconds)`` of every XLA backend compilation in this process.

    Returns:
        The list ``jax.monitoring`` appends to from now on (``time.perf_counter()`` at the end of each compilation).
    """
    import jax

    compilations: list[tuple[float, float]] = []

    def listen(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compilations.append((time.perf_counter(), seconds))

    jax.monitoring.register_event_duration_secs_listener(listen)
    return compilations


def timed(run: Callable[[], Result]) -> tuple[float, Result]:
    """``run()``'s wall seconds and its result."""
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def profile_text(profiler: cProfile.Profile, cumulative: int = 35, own: int = 25) -> str:
    """The top ``cumulative`` functions by cumulative time and the top ``own`` by their own time."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("cumulative").print_stats(cumulative)
    stats.sort_stats("tottime").print_stats(own)
    return text.getvalue()


def profiled(enabled: bool, run: Callable[[], Result]) -> tuple[Result, str | None]:
    """``run()``, under cProfile when ``enabled``; returns its result and :func:`profile_text` (None unprofiled)."""
    if not enabled:
        return run(), None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = run()
    finally:
        profiler.disable()
    return result, profile_text(profiler)


# --------------------------------------------------------------------------- memory


def read_status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem`` of this process, in bytes."""
    values: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_high_water_mark() -> bool:
    """Resets ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS over a ``with`` block: ``VmHWM`` (reset on entry) and a sampling thread.

    Args:
        interval_s: sampling period of the thread (it also gives the anon/file split).
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.hwm_reset = False
        self.before: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.hwm_reset = reset_high_water_mark()
        self.before = read_status()
        self.peak = dict(self.before)
        self.thread.start()
        return self

    def update(self, status: dict[str, int]) -> None:
        """Raises the peaks to ``status`` where it is higher."""
        for key in ("VmRSS", "RssAnon", "RssFile"):
            self.peak[key] = max(self.peak.get(key, 0), status.get(key, 0))
        self.samples += 1

    def sample(self) -> None:
        """The sampling thread's loop, until the block ends."""
        while not self.stopped.wait(self.interval_s):
            self.update(read_status())

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()
        self.after = read_status()
        self.update(self.after)

    def result(self) -> dict[str, Any]:
        """The peak (the larger of ``VmHWM`` and the samples), its increase over the RSS before, and the split."""
        sampled = self.peak["VmRSS"]
        hwm = self.after.get("VmHWM", 0) if self.hwm_reset else 0
        peak = max(sampled, hwm)
        return {
            "rss_before": self.before["VmRSS"],
            "rss_after": self.after["VmRSS"],
            "peak_rss": peak,
            "peak_rss_increase": peak - self.before["VmRSS"],
            "peak_source": "VmHWM" if hwm >= sampled else "sampled",
            "sampled_peak_anon_increase": self.peak["RssAnon"] - self.before.get("RssAnon", 0),
            "sampled_peak_file_increase": self.peak["RssFile"] - self.before.get("RssFile", 0),
            "anon_increase_after": self.after.get("RssAnon", 0) - self.before.get("RssAnon", 0),
            "file_increase_after": self.after.get("RssFile", 0) - self.before.get("RssFile", 0),
            "hwm_reset": self.hwm_reset,
            "samples": self.samples,
            "sample_interval_s": self.interval_s,
        }


# --------------------------------------------------------------------------- the models


def tiny_qwen2(shape: Mapping[str, Any], max_positions: int, **overrides: Any) -> Any:
    """The ``transformers`` Qwen2 config of a benchmark's shape (:func:`tiny_decoder_config`), tied embeddings."""
    return tiny_decoder_config("qwen2", shape, max_positions, **overrides)


def tiny_decoder_config(family: str, shape: Mapping[str, Any], max_positions: int, **overrides: Any) -> Any:
    """The ``transformers`` config of ``family`` (``torchlike.testing.tiny_config``) at a benchmark's shape, tied
    embeddings.

    Args:
        family: a tiny config's name (``qwen2``, ``mistral``...).
        shape: ``vocab``, ``hidden``, ``intermediate``, ``layers``, ``heads``, ``kv_heads`` and, where it has one,
            ``rope_theta``.
        max_positions: ``max_position_embeddings``.
        overrides: more config fields, or other values for these.
    """
    from torchlike.testing import tiny_config

    fields = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], max_position_embeddings=max_positions,
                  tie_word_embeddings=True)
    if "rope_theta" in shape:
        fields["rope_theta"] = shape["rope_theta"]
    return tiny_config(family, **(fields | overrides))


def tunix_model(checkpoint: Path, spec: Mapping[str, Any], rematerialise: bool = True) -> Any:
    """The Tunix Qwen2 with a checkpoint's weights, loaded by Tunix's own safetensors loader.

    Args:
        checkpoint: the HF checkpoint directory.
        spec: its shape (``layers``, ``vocab``, ``hidden``, ``intermediate``, ``heads``, ``kv_heads``,
            ``rope_theta``; tied embeddings) and ``dtype``.
        rematerialise: recompute each decoder layer in the backward pass (``RematConfig.DECODER``, what
            ``gradient_checkpointing`` does on the other sides).
    """
    import jax.numpy as jnp
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params

    dtype = getattr(jnp, spec["dtype"])
    config = qwen2_model.ModelConfig(
        num_layers=spec["layers"], vocab_size=spec["vocab"], embed_dim=spec["hidden"],
        hidden_dim=spec["intermediate"], num_heads=spec["heads"], head_dim=spec["hidden"] // spec["heads"],
        num_kv_heads=spec["kv_heads"], rope_theta=int(spec["rope_theta"]), norm_eps=1e-6, use_tied_embedding=True,
        dtype=dtype, param_dtype=dtype, use_flash_attention=False,
        remat_config=qwen2_model.RematConfig.DECODER if rematerialise else qwen2_model.RematConfig.NONE)
    return qwen2_params.create_model_from_safe_tensors(str(checkpoint), config, mesh=None, dtype=dtype)


# --------------------------------------------------------------------------- scripts' plumbing


def fill_from_preset(args: argparse.Namespace, preset: Mapping[str, Any]) -> None:
    """Sets every option of ``args`` left at None to the preset's value, in place."""
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def write_json(path: str | os.PathLike[str], result: Any) -> Path:
    """Writes ``result`` as indented JSON to ``path`` (making its folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    """One column of a text table.

    Args:
        header: the column's title.
        width: its width in characters: header and values are padded to it (0: not padded).
        key: the record key its value comes from, or a function of the record that gives it.
        format: the format spec of a value (``".2f"``, ``","``, ``"d"``), or a function of the value giving its text.
        align: ``">"`` (right: numbers) or ``"<"`` (left: labels).
        missing: what a None value shows.
        gap: the text before the column (between it and the previous one).
    """

    header: str
    width: int
    key: str | Callable[[Mapping[str, Any]], Any]
    format: str | Callable[[Any], str] = ""
    align: str = ">"
    missing: str = "-"
    gap: str = ""

    def pad(self, text: str) -> str:
        """``text`` padded to the column's width, with its gap before it."""
        return self.gap + (format(text, f"{self.align}{self.width}") if self.width else text)

    def cell(self, record: Mapping[str, Any]) -> str:
        """The column's text for ``record``."""
        value = self.key(record) if callable(self.key) else record.get(self.key)
        if value is None:
            return self.pad(self.missing)
        return self.pad(self.format(value) if callable(self.format) else format(value, self.format))


def format_header(columns: Sequence[Column]) -> str:
    """The columns' titles on one line."""
    return "".join(column.pad(column.header) for column in columns)


def format_row(columns: Sequence[Column], record: Mapping[str, Any]) -> str:
    """One record on one line."""
    return "".join(column.cell(record) for column in columns)


def skipped_or_failed(record: Mapping[str, Any]) -> str | None:
    """The text that stands for the figures of a side that was skipped or failed (None when it has figures)."""
    if "skipped" in record:
        return f"  skipped: {record['skipped'][:160]}"
    if "error" in record:
        return f"  FAILED: {error_summary(record['error'])[:160]}"
    return None


def format_table(columns: Sequence[Column], records: Iterable[Mapping[str, Any]], *, rule: bool = True,
                 labels: int = 1, problem: Callable[[Mapping[str, Any]], str | None] = skipped_or_failed) -> str:
    """A text table: a header line, a rule of ``-`` under it (``rule``), a line per record.

    Args:
        columns: the table's columns, left to right.
        records: one per line.
        rule: draw the rule under the header.
        labels: how many leading columns name a record; a record ``problem`` has text for shows them, then that text.
        problem: the text standing for a record's figures when it has none (default :func:`skipped_or_failed`).
    """
    header = format_header(columns)
    lines = [header, "-" * len(header)] if rule else [header]
    for record in records:
        text = problem(record)
        lines.append(format_row(columns, record) if text is None else format_row(columns[:labels], record) + text)
    return "\n".join(lines)
