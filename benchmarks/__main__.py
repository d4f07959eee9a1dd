"""Every side-by-side benchmark in one go, with a summary of the speed goals: ``python -m benchmarks``.

Runs, each as a subprocess of its own script (which runs its sides in child processes of its own), one after the
other:

``rollout``
    a GRPO-shaped rollout (prompts x generations, long-tailed lengths): torchlike's paged engine vs its static
    sampler, ``transformers.generate`` and transformers' continuous batching ``generate_batch``; with its KV memory
    as allocated and, on a known device, the share of its memory bandwidth the paged decode reached.
``sft_step``
    torchlike vs ``trl.SFTTrainer`` vs raw Tunix ``PeftTrainer``, full fine-tuning and LoRA, plus torchlike's first
    step on a cold and on a warm compilation cache.
``grpo_step``
    torchlike vs ``trl.GRPOTrainer`` vs raw Tunix ``GRPOLearner``, seconds per step (rollout + update).
``generate``
    torchlike ``generate`` vs ``transformers.generate``, greedy and sampling.
``hf_io``
    Hugging Face checkpoint import/export vs raw ``safetensors``.
``checkpoint_io``
    ``torchlike.save`` / ``torchlike.load`` vs raw Orbax.

The rollout runs first: on a lent device it is the check the run is for.

``--preset gpu`` and ``--preset tpu`` are the *device runs*, one command on a lent GPU or TPU that ends within 10
minutes: only the scripts with that preset (gpu: rollout, sft_step, grpo_step, generate; tpu: rollout, whose
transformers sides are skipped there), each with its ``--quick`` options (the rollout: one round), and a deadline for
the whole run (``--deadline``, 540 s by default there): a script still running then is stopped, and those not started
are listed as such.

Each script writes its JSON to ``--output-dir`` (default ``benchmarks/results/``) and its output to
``<output-dir>/logs/<name>.log`` (also echoed here). The runner then writes:

- ``summary.json``: every goal row, what ran (command, exit status, seconds), the machine (CPU model and cores or GPU
  names, versions, git commit);
- ``summary.md``: the same as a markdown table (benchmark, torchlike, reference, ratio, goal, met?);
- ``summary.png``: a bar chart of the ratios against their goals (skipped, with a message, without matplotlib).

Goals (from the speed issue): SFT tokens/s >= 1.0x TRL and >= 1.0x raw Tunix (full and LoRA); torchlike's LoRA step
<= its full fine-tuning step; its first step on a warm compilation cache <= 0.4x the cold one; GRPO seconds per step
<= 0.5x TRL; generate tokens/s >= 1.5x transformers; rollout useful tokens/s: paged engine >= 2x the static sampler
and >= 1.5x transformers ``generate_batch``, and its long-tailed tokens/s >= 0.6x its full-length tokens/s; checkpoint
and HF import/export seconds <= 1.2x raw.

Run (from the repository root)::

    .venv/bin/python -m benchmarks --quick            # fewer steps and repeats: about 10 minutes on 2 CPU cores
    .venv/bin/python -m benchmarks                    # each script's own defaults (longer)
    .venv/bin/python -m benchmarks --preset gpu       # the device run: rollout, sft_step, grpo_step, generate (<10 min)
    .venv/bin/python -m benchmarks --preset tpu       # the device run on a TPU: the rollout at the issue's workload
    .venv/bin/python -m benchmarks --only grpo_step,generate --extra grpo_step="--repeats 3"
    .venv/bin/python -m benchmarks --summarize-only   # rebuild the summary from the JSON files already there

This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import error_summary, machine_info, write_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUTPUT_DIR = HERE / "results"
REFERENCE_NAMES = {"trl": "TRL", "tunix": "raw Tunix"}
DEVICE_PRESETS = ("gpu", "tpu")
DEVICE_DEADLINE_S = 540.0  # a lent device's command runs 10 minutes at most


@dataclass
class GoalRow:
    """One line of the summary: torchlike's figure, the reference's, their ratio and the goal for it.

    ``direction`` is ``">="`` when a higher ratio is better and ``"<="`` when a lower one is; ``goal`` None marks an
    informational row. ``met`` is None when the ratio could not be computed (see ``note``).
    """

    benchmark: str
    torchlike: float | None
    reference: float | None
    unit: str
    reference_name: str
    ratio: float | None
    direction: str
    goal: float | None
    met: bool | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.ratio is None and self.torchlike and self.reference:
            self.ratio = self.torchlike / self.reference
        if self.goal is not None and self.ratio is not None:
            self.met = self.ratio >= self.goal if self.direction == ">=" else self.ratio <= self.goal


# --------------------------------------------------------------------------- reading each script's JSON


def side_problem(record: dict[str, Any] | None, name: str) -> str:
    """Why ``record`` (a side's result) has no figures: skipped, failed or absent; empty when it has them."""
    if record is None:
        return f"{name}: not run"
    if "skipped" in record:
        return f"{name} skipped: {record['skipped']}"
    if "error" in record:
        return f"{name} failed: {error_summary(record['error'])}"
    return ""


def problems(*named: tuple[dict[str, Any] | None, str]) -> str:
    return "; ".join(problem for problem in (side_problem(record, name) for record, name in named) if problem)


def sft_rows(result: dict[str, Any]) -> list[GoalRow]:
    rows = []
    by_mode = result.get("results", {})
    for mode in ("full", "lora"):
        sides = by_mode.get(mode, {})
        mine = sides.get("torchlike")
        for baseline in ("trl", "tunix"):
            other = sides.get(baseline)
            rows.append(GoalRow(
                f"SFT {mode} tokens/s vs {REFERENCE_NAMES[baseline]}", (mine or {}).get("tokens_per_s"),
                (other or {}).get("tokens_per_s"), "tokens/s", REFERENCE_NAMES[baseline], None, ">=", 1.0,
                note=problems((mine, "torchlike"), (other, baseline))))
    full, lora = by_mode.get("full", {}).get("torchlike"), by_mode.get("lora", {}).get("torchlike")
    rows.append(GoalRow("SFT LoRA step / full step (torchlike)", (lora or {}).get("step_s"),
                        (full or {}).get("step_s"), "s/step", "torchlike full", None, "<=", 1.0,
                        note=problems((lora, "torchlike lora"), (full, "torchlike full"))))
    for mode in ("full", "lora"):
        mine = by_mode.get(mode, {}).get("torchlike") or {}
        note = problems((by_mode.get(mode, {}).get("torchlike"), "torchlike"))
        if not note and mine.get("first_step_warm_s") is None:
            note = "no warm rerun (--no-warm-rerun, or it failed: see sft_step.json)"
        rows.append(GoalRow(f"SFT {mode} first step, warm / cold cache (torchlike)", mine.get("first_step_warm_s"),
                            mine.get("first_step_s"), "s", "cold cache", None, "<=", 0.4, note=note))
    return rows


def grpo_rows(result: dict[str, Any]) -> list[GoalRow]:
    sides = result.get("results", {})
    mine = sides.get("torchlike")
    rows = []
    for baseline, goal in (("trl", 0.5), ("tunix", None)):
        other = sides.get(baseline)
        note = problems((mine, "torchlike"), (other, baseline))
        if not note and (mine or {}).get(f"vs_{baseline}_mean") is not None:
            note = f"medians of the step times; the means give {mine[f'vs_{baseline}_mean']:.2f}"
        rows.append(GoalRow(f"GRPO s/step vs {REFERENCE_NAMES[baseline]}", (mine or {}).get("median_step_s"),
                            (other or {}).get("median_step_s"), "s/step", REFERENCE_NAMES[baseline], None, "<=", goal,
                            note=note))
    threads = (sides.get("trl") or {}).get("torch_threads")
    if threads:
        rows[0].note = (rows[0].note + "; " if rows[0].note else "") + f"TRL on {threads} torch thread(s)"
    return rows


def accumulation_rows(result: dict[str, Any]) -> list[GoalRow]:
    records = {record.get("accumulation"): record for record in result.get("records", [])}
    top = max(records, default=1)
    most, base = records.get(top), records.get(1)
    return [GoalRow(f"train step compile s at accumulation {top} vs 1", (most or {}).get("compile_s"),
                    (base or {}).get("compile_s"), "s", "accumulation 1", None, "<=", 1.5,
                    note=problems((most, f"accumulation {top}"), (base, "accumulation 1")))]


def generate_rows(result: dict[str, Any]) -> list[GoalRow]:
    rows = []
    for mode in ("greedy", "sampling"):
        entry = result.get("modes", {}).get(mode)
        if entry is None:
            rows.append(GoalRow(f"generate {mode} tokens/s vs transformers", None, None, "tokens/s", "transformers",
                                None, ">=", 1.5, note="not in generate.json"))
            continue
        note = f"median of runs; best runs give {entry['best_ratio']:.2f}x"
        if "greedy_tokens_match" in entry:
            note += f"; greedy tokens equal: {entry['greedy_tokens_match']}"
        rows.append(GoalRow(f"generate {mode} tokens/s vs transformers", entry["torchlike_tokens_per_s"],
                            entry["transformers_tokens_per_s"], "tokens/s", "transformers", entry["ratio"], ">=", 1.5,
                            note=note))
    return rows


def rollout_rows(result: dict[str, Any]) -> list[GoalRow]:
    sides = result.get("results", {})
    paged = sides.get("paged")
    rows = []
    for baseline, name, goal in (("static", "static sampler", 2.0),
                                 ("transformers_generate_batch", "transformers generate_batch", 1.5),
                                 ("transformers_generate", "transformers generate", None)):
        other = sides.get(baseline)
        rows.append(GoalRow(f"rollout tokens/s, paged engine vs {name}", (paged or {}).get("tokens_per_s"),
                            (other or {}).get("tokens_per_s"), "tokens/s", name, None, ">=", goal,
                            note=problems((paged, "paged"), (other, baseline))))
    for side, goal in (("paged", 0.6), ("static", None)):
        record = sides.get(side) or {}
        rows.append(GoalRow(f"rollout {side} engine tokens/s, long-tailed / full-length",
                            record.get("tokens_per_s"), (record.get("full_length") or {}).get("tokens_per_s"),
                            "tokens/s", "full length", None, ">=", goal, note=problems((sides.get(side), side))))
    paged_full = (paged or {}).get("full_length") or {}
    static_full = (sides.get("static") or {}).get("full_length") or {}
    rows.append(GoalRow("rollout tokens/s with no early end, paged engine vs static sampler",
                        paged_full.get("tokens_per_s"), static_full.get("tokens_per_s"), "tokens/s", "static sampler",
                        None, ">=", None, note=problems((paged, "paged"), (sides.get("static"), "static"))))
    stream = result.get("stream")
    if stream:
        rows.append(GoalRow(f"rollout paged engine tokens/s, stream of {stream['batches']} batches / full-length",
                            stream["tokens_per_s"],
                            stream["tokens_per_s"] / stream["vs_full_length"] if stream["vs_full_length"] else None,
                            "tokens/s", "full length", stream["vs_full_length"], ">=",
                            0.6, note=stream["note"]))
    memory = result.get("kv_memory")
    if memory:
        rows.append(GoalRow("rollout KV cache, paged peak / static batch", memory["paged_peak_bytes"] / 2**20,
                            memory["static_cache_bytes"] / 2**20, "MiB", "static batch", None, "<=", None))
    if memory and "paged_allocated_bytes" in memory:
        rows.append(GoalRow(f"rollout KV cache as allocated (pool + {memory['attention']} decode view) / static batch",
                            memory["paged_allocated_bytes"] / 2**20, memory["static_cache_bytes"] / 2**20, "MiB",
                            "static batch", None, "<=", None,
                            note=f"pool {memory['paged_pool_allocated_bytes'] / 2**20:.1f} MiB, decode view "
                                 f"{memory['paged_decode_view_bytes'] / 2**20:.1f} MiB"))
    bandwidth = result.get("decode_bandwidth")
    if bandwidth and bandwidth["bytes_per_s"] is not None:
        peak = bandwidth["peak_bytes_per_s"]
        rows.append(GoalRow("rollout paged decode memory traffic / the device's peak bandwidth",
                            bandwidth["bytes_per_s"] / 1e9, None if peak is None else peak / 1e9, "GB/s",
                            bandwidth["device"] or "peak unknown", bandwidth["share_of_peak"], ">=", None,
                            note=("weights + live KV bytes per decode step over the decode seconds (a lower bound); "
                                  + (f"{bandwidth['device_kind']}" if peak else
                                     f"peak unknown for {bandwidth['device_kind']!r}"))))
    return rows


def hf_io_rows(result: dict[str, Any]) -> list[GoalRow]:
    phases = result.get("phases", {})
    rows = []
    for operation in ("import", "export"):
        mine, raw = phases.get(f"{operation}-torchlike"), phases.get(f"{operation}-raw")
        note = "" if mine and raw else f"{operation} phases missing from hf_io.json"
        if operation == "export" and raw and "seconds_fsync" in raw:
            note = f"raw without fsync (torchlike fsyncs); with fsync raw takes {raw['seconds_fsync']:.2f} s"
        rows.append(GoalRow(f"HF checkpoint {operation} s vs raw safetensors", (mine or {}).get("seconds"),
                            (raw or {}).get("seconds"), "s", "raw safetensors", None, "<=", 1.2, note=note))
    return rows


def checkpoint_rows(result: dict[str, Any]) -> list[GoalRow]:
    phases = result.get("phases", {})
    rows = []
    for name, phase in phases.items():
        if phase.get("goal") is None or not phase.get("ratios"):
            continue
        baseline = next(iter(phase["ratios"]))
        rows.append(GoalRow(f"checkpoint {name.removesuffix('-torchlike')} s vs {baseline}", phase["seconds_best"],
                            phases[baseline]["seconds_best"], "s", f"Orbax {baseline}", phase["ratios"][baseline],
                            "<=", phase["goal"]))
    return rows


# --------------------------------------------------------------------------- the benchmarks


@dataclass(frozen=True)
class Benchmark:
    """A script, its options in ``--quick`` mode (per preset), the presets it takes, and its summary rows."""

    name: str
    quick: dict[str, tuple[str, ...]]
    presets: tuple[str, ...]
    rows: Callable[[dict[str, Any]], list[GoalRow]]

    def command(self, output: Path, preset: str, quick: bool, extra: list[str]) -> list[str]:
        arguments = [sys.executable, str(HERE / f"{self.name}.py")]
        if preset in self.presets:
            arguments += ["--preset", preset]
        if quick:
            arguments += list(self.quick.get(preset, self.quick["cpu"]))
        return arguments + extra + ["--output", str(output)]


BENCHMARKS = (
    Benchmark("rollout", {"cpu": ("--new-tokens", "64"), "gpu": ("--repeats", "1"), "tpu": ("--repeats", "1")},
              ("cpu", "gpu", "tpu"), rollout_rows),
    Benchmark("sft_step", {"cpu": ("--warmup", "2", "--steps", "8"), "gpu": ("--warmup", "2", "--steps", "5")},
              ("cpu", "gpu"), sft_rows),
    Benchmark("grpo_step", {"cpu": ("--warmup", "2", "--steps", "6"), "gpu": ("--warmup", "2", "--steps", "3")},
              ("cpu", "gpu"), grpo_rows),
    Benchmark("accumulation", {"cpu": ("--accumulation", "1,8")}, (), accumulation_rows),
    Benchmark("generate", {"cpu": ("--repeats", "3"), "gpu": ("--repeats", "2")}, ("cpu", "gpu"), generate_rows),
    # Its default size (0.5 GB) in quick mode too: at 128 MB fixed costs dominate and the ratios mislead.
    Benchmark("hf_io", {"cpu": ()}, (), hf_io_rows),
    Benchmark("checkpoint_io", {"cpu": ("--layers", "2", "--repeats", "2")}, (), checkpoint_rows),
)
BY_NAME = {benchmark.name: benchmark for benchmark in BENCHMARKS}


def run_benchmark(benchmark: Benchmark, command: list[str], output: Path, log: Path,
                  timeout: float | None) -> dict[str, Any]:
    """Runs one script, echoing and logging its output; returns what ran and how it ended."""
    print(f"\n===== {benchmark.name}: {shlex.join(command)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    record: dict[str, Any] = {"command": command, "log": str(log)}
    with log.open("w") as log_file:
        # A session of its own, so stopping it stops the child processes it runs its sides in (which would
        # otherwise hold the device and keep the output pipe open).
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1, start_new_session=True)
        echo = threading.Thread(target=copy_lines, args=(process.stdout, log_file), daemon=True)
        echo.start()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            record["error"] = f"stopped after {timeout:.0f} s (--timeout, or what --deadline left)"
        except KeyboardInterrupt:
            stop(process)
            raise
        echo.join()
    record.update(returncode=process.returncode, seconds=time.time() - started)
    fresh = output.is_file() and output.stat().st_mtime >= started
    if "error" not in record and (process.returncode != 0 or not fresh):
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        record["error"] = (f"exit {process.returncode}" + ("" if fresh else f", {output.name} not written")
                           + f": {tail[0][:300]}")
    print(f"===== {benchmark.name}: {'FAILED: ' + record['error'] if 'error' in record else 'done'} "
          f"in {record['seconds']:.0f} s", flush=True)
    return record


def stop(process: subprocess.Popen) -> None:
    """Kills a script's process group (the script and the processes it started) and waits for the script."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def copy_lines(source: Any, log_file: Any) -> None:
    """Echoes a child's output here and into its log, line by line, until it closes."""
    for line in source:
        sys.stdout.write(line)
        sys.stdout.flush()
        log_file.write(line)


# --------------------------------------------------------------------------- the summary


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "tokens/s":
        return f"{value:,.0f} {unit}"
    return f"{value:.4g} {unit}"


def markdown(summary: dict[str, Any]) -> str:
    machine = summary["machine"]
    hardware = "; ".join(machine.get("gpus") or []) or f"{machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs"
    git = machine.get("git", {})
    versions = ", ".join(f"{name} {version}" for name, version in machine.get("versions", {}).items() if version)
    rows = [GoalRow(**row) for row in summary["rows"]]
    counted = [row for row in rows if row.goal is not None]
    lines = [
        f"# torchlike benchmarks ({'quick' if summary['quick'] else 'full'} run, preset {summary['preset']})",
        "",
        f"- when: {summary['finished']}",
        f"- hardware: {hardware}",
        f"- platform: {machine.get('platform')}, Python {machine.get('python')}",
        f"- versions: {versions}",
        f"- git commit: {git.get('commit', '?')} ({git.get('uncommitted_files', '?')} uncommitted files)",
        f"- goals met: {sum(row.met is True for row in counted)} of {len(counted)}"
        f" ({sum(row.met is None for row in counted)} without a figure)",
        "",
        "| benchmark | torchlike | reference | ratio | goal | met? |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        goal = "-" if row.goal is None else f"{row.direction} {row.goal:g}"
        met = {True: "yes", False: "**no**", None: "-" if row.goal is None else "n/a"}[row.met]
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        reference = format_value(row.reference, row.unit)
        reference += f" ({row.reference_name})" if row.reference is not None else ""
        lines.append(f"| {row.benchmark} | {format_value(row.torchlike, row.unit)} | {reference} | {ratio} | {goal} "
                     f"| {met} |")
    notes = [f"- {row.benchmark}: {row.note}" for row in rows if row.note]
    if notes:
        lines += ["", "Notes:", "", *notes]
    ran = summary.get("runs", {})
    if ran:
        lines += ["", "Runs:", ""]
        for record in ran.values():
            outcome = f"FAILED ({record['error']})" if "error" in record else "ok"
            lines.append(f"- `{shlex.join(record['command'][1:])}`: {outcome}, {record['seconds']:.0f} s "
                         f"(log: {Path(record['log']).name})")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> str:
    """Draws ``summary.png``; returns what happened, in words."""
    try:
        import matplotlib
    except ImportError:
        return "summary.png skipped: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [GoalRow(**row) for row in summary["rows"] if row["ratio"] is not None and row["ratio"] > 0]
    if not rows:
        return "summary.png skipped: no ratio to draw"
    figure, axes = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6))
    positions = range(len(rows))
    colours = ["tab:green" if row.met else "tab:red" if row.met is False else "tab:gray" for row in rows]
    axes.barh(positions, [row.ratio for row in rows], color=colours, height=0.6)
    for position, row in zip(positions, rows, strict=True):
        if row.goal is not None:
            axes.plot([row.goal, row.goal], [position - 0.4, position + 0.4], color="black", linewidth=2)
        axes.annotate(f"{row.ratio:.2f}" + ("" if row.goal is None else f" (goal {row.direction} {row.goal:g})"),
                      (max(row.ratio, row.goal or 0.0), position), xytext=(4, 0), textcoords="offset points",
                      va="center", fontsize=8)
    axes.set_xscale("log")
    smallest = min(min(row.ratio for row in rows), min((row.goal for row in rows if row.goal), default=1.0))
    largest = max(max(row.ratio for row in rows), max((row.goal for row in rows if row.goal), default=1.0))
    axes.set_xlim(10 ** math.floor(math.log10(smallest)), 10 ** (math.log10(largest) + 0.6))
    axes.axvline(1.0, color="gray", linewidth=0.8, linestyle=":")
    axes.set_yticks(list(positions), [row.benchmark for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("ratio torchlike / reference (log scale); black tick: goal; green met, red missed, grey no goal")
    axes.set_title(f"torchlike benchmarks ({'quick' if summary['quick'] else 'full'}, preset {summary['preset']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"wrote {path}"


def summarize(chosen: list[Benchmark], output_dir: Path, runs: dict[str, dict[str, Any]], args: argparse.Namespace,
              started: float) -> dict[str, Any]:
    rows: list[GoalRow] = []
    for benchmark in chosen:
        path = output_dir / f"{benchmark.name}.json"
        failure = runs.get(benchmark.name, {}).get("error")
        if failure is None and path.is_file():
            rows += benchmark.rows(json.loads(path.read_text()))
        else:
            note = f"FAILED: {failure}" if failure else f"no result: {path} not found (run it first)"
            rows.append(GoalRow(benchmark.name, None, None, "", "", None, "<=", None, note=note))
    machine = machine_info()
    return {"quick": args.quick, "preset": args.preset, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "seconds": time.time() - started, "machine": machine, "runs": runs,
            "rows": [asdict(row) for row in rows]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and repeats, a smaller checkpoint_io tree (about 10 minutes on 2 CPU cores)")
    parser.add_argument("--preset", choices=("cpu", *DEVICE_PRESETS), default="cpu",
                        help="passed to the scripts that have it (gpu: Qwen2-0.5B shape, bf16; rollout: 64 prompts x "
                             "8 generations, 512 new tokens); gpu and tpu are the device runs (quick settings, only "
                             "those scripts, a deadline; see above)")
    parser.add_argument("--only", help="comma-separated subset of " + ",".join(BY_NAME))
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument("--extra", action="append", default=[], metavar='NAME="ARGS"',
                        help='more options for one script, e.g. --extra sft_step="--repeats 3" (repeatable)')
    parser.add_argument("--timeout", type=float, help="seconds each script may run before it is stopped")
    parser.add_argument("--deadline", type=float,
                        help=f"seconds the whole run may take: a script running then is stopped, later ones are not "
                             f"started (default: {DEVICE_DEADLINE_S:.0f} for the device presets, none otherwise; 0: "
                             "none)")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help="where the scripts' JSON, their logs and the summary go")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: rebuild the summary from the JSON files in --output-dir")
    args = parser.parse_args(argv)
    if args.preset in DEVICE_PRESETS:  # a lent device's minutes: the quick settings, within the deadline
        args.quick = True
        if args.deadline is None:
            args.deadline = DEVICE_DEADLINE_S
    return args


def choose(args: argparse.Namespace) -> tuple[list[Benchmark], dict[str, list[str]]]:
    """The benchmarks to run, in their fixed order, and each one's ``--extra`` options: by default every one, or on a
    device preset those that take it."""
    default = [benchmark.name for benchmark in BENCHMARKS
               if args.preset not in DEVICE_PRESETS or args.preset in benchmark.presets]
    names = [name.strip() for name in (args.only or ",".join(default)).split(",") if name.strip()]
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    extra: dict[str, list[str]] = {}
    for item in args.extra:
        name, _, options = item.partition("=")
        extra.setdefault(name.strip(), []).extend(shlex.split(options))
    unknown = sorted((set(names) | skipped | set(extra)) - set(BY_NAME))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {','.join(BY_NAME)}.")
    return [benchmark for benchmark in BENCHMARKS if benchmark.name in names and benchmark.name not in skipped], extra


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    chosen, extra = choose(args)
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: dict[str, dict[str, Any]] = {}
    if not args.summarize_only:
        for benchmark in chosen:
            output = output_dir / f"{benchmark.name}.json"
            command = benchmark.command(output, args.preset, args.quick, extra.get(benchmark.name, []))
            log = output_dir / "logs" / f"{benchmark.name}.log"
            timeout = args.timeout
            if args.deadline:
                left = started + args.deadline - time.time()
                if left <= 0:
                    runs[benchmark.name] = {"command": command, "log": str(log), "returncode": None, "seconds": 0.0,
                                            "error": f"not started: the run's {args.deadline:.0f} s deadline passed"}
                    print(f"===== {benchmark.name}: {runs[benchmark.name]['error']}", flush=True)
                    continue
                timeout = min(timeout or left, left)
            runs[benchmark.name] = run_benchmark(benchmark, command, output, log, timeout)
    summary = summarize(chosen, output_dir, runs, args, started)
    write_json(output_dir / "summary.json", summary)
    text = markdown(summary)
    (output_dir / "summary.md").write_text(text)
    print("\n" + text)
    print(f"wrote {output_dir / 'summary.json'} and {output_dir / 'summary.md'}")
    print(plot(summary, output_dir / "summary.png"))


if __name__ == "__main__":
    main()
