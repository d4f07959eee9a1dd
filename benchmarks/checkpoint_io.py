"""torchlike.save / torchlike.load against raw Orbax on the same tree: seconds and ratios.

What it measures
----------------
A flat state dict of random bf16 ``jax.Array`` values shaped like a Qwen2-0.5B model cut to
``--layers`` decoder layers (default 8: tied 151936 x 896 embedding + 8 layers + LoRA
adapters of rank 16 on q/v, about 0.51 GB in 130 arrays; the real byte count is printed).
Every phase runs ``--repeats`` times; raw and torchlike versions of one operation run back to
back, in alternating order. The best time counts (the median is shown too):

``save-raw``
    ``ocp.PyTreeCheckpointer().save(dir, args=PyTreeSave(tree))`` into a fresh directory
    (synchronous: returns once written and committed).
``save-raw-standard``
    ``ocp.StandardCheckpointer().save(dir, tree)`` + ``wait_until_finished()`` (informational).
``save-torchlike``
    ``torchlike.save(tree, dir)`` into a fresh directory.
``overwrite-raw`` / ``overwrite-raw-beside`` / ``overwrite-torchlike``
    The same over an existing checkpoint: raw Orbax ``force=True`` (deletes the old one
    first, not atomic); raw Orbax written beside the old one, swapped in by two renames, old
    one deleted (the same atomic protocol as torchlike, by hand, without manifest or
    checks); ``torchlike.save``. Writing while the old checkpoint still exists can cost more
    than writing into just-freed space (on this benchmark's VM disk it did, for raw Orbax
    too: compare ``overwrite-raw-beside`` with ``overwrite-raw``); atomicity needs it.
``restore-raw`` / ``restore-torchlike``
    Every array back as a ``jax.Array`` on the first device: raw ``PyTreeRestore`` with an
    ``ArrayRestoreArgs`` per leaf against ``torchlike.load(dir).restore({key: sharding})``
    (the ``load`` is inside the timing), until every array is ready.
``partial-raw`` / ``partial-torchlike``
    Only the LoRA arrays (``*_lora_a``/``*_lora_b``): raw ``partial_restore=True`` against
    ``torchlike.load(dir).restore(subset)``; ``partial-torchlike`` is also compared with
    ``restore-torchlike`` (goal: far below 1).

Ratios are torchlike seconds / raw seconds (goal <= 1.2). Before each timed run, untimed,
``os.sync()`` writes back what earlier phases left dirty (otherwise a phase pays for its
predecessor's writeback, which doubled some times on a shared machine). Checkpoints are read
from the page cache (they were just written); nothing is fsynced by either side beyond what
Orbax does, except torchlike's manifest and directory entries.

Later phases plug in through ``Phase`` objects; e.g. ``load_state_dict_phase`` times
``model.load_state_dict(torchlike.load(path), strict=False)`` given that callable.

Run (from the repository root; about a minute on 2 cores)::

    .venv/bin/python benchmarks/checkpoint_io.py
    .venv/bin/python benchmarks/checkpoint_io.py --layers 24 --repeats 5

The table is printed and everything is written to ``benchmarks/results/checkpoint_io.json``
(``--output``). This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

import torchlike

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Column, format_table, machine_info, timed, write_json  # noqa: E402

GOAL_RATIO = 1.2
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"
HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM, LORA_RANK = 896, 4864, 151936, 14, 2, 64, 16


# --------------------------------------------------------------------------- the tree


def make_model(layers: int, seed: int = 0):
    """A real torchlike Qwen2-0.5B-shaped model (``layers`` layers, bf16, random weights) with LoRA on q/v."""
    from torchlike.peft import LoraConfig, get_peft_model
    from torchlike.testing import tiny_config

    config = tiny_config("qwen2", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         num_hidden_layers=layers, tie_word_embeddings=True)
    base = torchlike.AutoModelForCausalLM.from_config(config, dtype="bfloat16", seed=seed)
    return get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules=["q_proj", "v_proj"]))


def make_tree(model) -> dict[str, jax.Array]:
    """The model's state dict (the arrays themselves), with random LoRA B so nothing is all-zero."""
    rng = np.random.default_rng(1)
    tree = dict(model.state_dict())
    for name in lora_keys(tree):
        tree[name] = jax.device_put(rng.standard_normal(tree[name].shape, np.float32).astype(ml_dtypes.bfloat16))
    return tree


def lora_keys(tree: dict[str, Any]) -> list[str]:
    return [name for name in tree if "_lora_" in name]


def tree_bytes(tree: dict[str, Any]) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in tree.values())


def ready(result: Any) -> Any:
    return jax.block_until_ready(result)


# --------------------------------------------------------------------------- phases


@dataclass
class Phase:
    """One timed operation.

    Attributes:
        name: row name in the table.
        run: the operation (its result is passed to ``jax.block_until_ready``).
        setup: untimed preparation before each repeat (e.g. delete the output directory).
        baselines: names of phases to divide by (ratio = this / baseline).
        goal: the ratio to stay under, for the first baseline (None: informational).
        group: the operation (``save``, ``restore``...; default: ``name`` up to its first
            ``-``); phases of one group are timed back to back, in alternating order.
    """

    name: str
    run: Callable[[], Any]
    setup: Callable[[], None] = lambda: None
    baselines: tuple[str, ...] = ()
    goal: float | None = None
    group: str = ""
    seconds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group = self.group or self.name.split("-", 1)[0]


def load_state_dict_phase(
    checkpoint_dir: Path,
    load_into: Callable[[torchlike.LazyCheckpoint], Any],
    name: str = "load_state_dict-torchlike",
    baselines: tuple[str, ...] = ("restore-raw",),
) -> Phase:
    """A phase timing ``load_into(torchlike.load(checkpoint_dir))``.

    Args:
        checkpoint_dir: a directory written by ``torchlike.save`` (``main`` passes the torchlike one).
        load_into: e.g. ``lambda ckpt: model.load_state_dict(ckpt, strict=False)``; whatever it
            returns is waited on with ``jax.block_until_ready``, so return the loaded arrays
            (or block inside) for an honest time.
        name: row name.
        baselines: phases to compare with.

    Returns:
        The ``Phase``; add it to ``main(extra_phases=...)``.
    """
    return Phase(name, lambda: load_into(torchlike.load(checkpoint_dir)), baselines=baselines, goal=GOAL_RATIO,
                 group="restore")


def _fresh(directory: Path) -> Callable[[], None]:
    return lambda: shutil.rmtree(directory, ignore_errors=True)


def _raw_save(directory: Path, tree: dict[str, Any], force: bool = False) -> None:
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(item=tree), force=force)


def _raw_save_beside(directory: Path, tree: dict[str, Any]) -> None:
    """Raw Orbax with the atomic overwrite done by hand: write beside, swap by renames, delete the old one."""
    staging, backup = directory.with_name(directory.name + ".new"), directory.with_name(directory.name + ".old")
    _raw_save(staging, tree)
    if directory.exists():
        os.rename(directory, backup)
    os.rename(staging, directory)
    shutil.rmtree(backup, ignore_errors=True)


def _raw_save_standard(directory: Path, tree: dict[str, Any]) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, tree)
        checkpointer.wait_until_finished()


def _raw_restore(directory: Path, tree: dict[str, Any], keys: list[str] | None = None) -> dict[str, jax.Array]:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    keys = list(tree) if keys is None else keys
    args = {k: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(tree[k].shape)) for k in keys}
    partial = len(keys) < len(tree)
    request = ocp.args.PyTreeRestore(item={k: 0 for k in keys}, restore_args=args, partial_restore=partial)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(directory, args=request)


def _torchlike_restore(directory: Path, keys: list[str] | None = None) -> dict[str, jax.Array]:
    ckpt = torchlike.load(directory)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return ckpt.restore({k: sharding for k in (list(ckpt) if keys is None else keys)})


def build_phases(tree: dict[str, jax.Array], work: Path) -> tuple[list[Phase], Path]:
    """The standard phases; returns them and the torchlike checkpoint the read phases use."""
    raw_dir, raw_std_dir, tl_dir = work / "raw", work / "raw_standard", work / "torchlike"
    raw_beside_dir = work / "raw_beside"
    raw_read, tl_read = work / "raw_read", work / "torchlike_read"
    subset = lora_keys(tree)
    phases = [
        Phase("save-raw", lambda: _raw_save(raw_dir, tree), setup=_fresh(raw_dir)),
        Phase("save-raw-standard", lambda: _raw_save_standard(raw_std_dir, tree), setup=_fresh(raw_std_dir),
              baselines=("save-raw",)),
        Phase("save-torchlike", lambda: torchlike.save(tree, tl_dir), setup=_fresh(tl_dir),
              baselines=("save-raw",), goal=GOAL_RATIO),
        # The save phases leave a checkpoint behind, so these overwrite one.
        Phase("overwrite-raw", lambda: _raw_save(raw_dir, tree, force=True)),
        Phase("overwrite-raw-beside", lambda: _raw_save_beside(raw_beside_dir, tree), baselines=("overwrite-raw",)),
        Phase("overwrite-torchlike", lambda: torchlike.save(tree, tl_dir),
              baselines=("overwrite-raw", "overwrite-raw-beside"), goal=GOAL_RATIO),
        Phase("restore-raw", lambda: _raw_restore(raw_read, tree)),
        Phase("restore-torchlike", lambda: _torchlike_restore(tl_read), baselines=("restore-raw",), goal=GOAL_RATIO),
        Phase("partial-raw", lambda: _raw_restore(raw_read, tree, subset), baselines=("restore-raw",)),
        Phase("partial-torchlike", lambda: _torchlike_restore(tl_read, subset),
              baselines=("partial-raw", "restore-torchlike"), goal=GOAL_RATIO),
    ]
    # Read phases use their own copies so that the save phases cannot change what they read.
    _raw_save(raw_read, tree)
    torchlike.save(tree, tl_read)
    _raw_save(raw_beside_dir, tree)
    return phases, tl_read


def warm_up(work: Path) -> None:
    """One tiny save and restore each way, so imports and first-call costs are not timed."""
    small = {"a": jax.numpy.ones((8, 8)), "b": jax.numpy.zeros(4)}
    _raw_save(work / "warm_raw", small)
    _raw_restore(work / "warm_raw", small)
    torchlike.save(small, work / "warm_torchlike")
    _torchlike_restore(work / "warm_torchlike")


def run(phases: list[Phase], repeats: int) -> None:
    """Times every phase ``repeats`` times.

    Phases of one operation (their ``group``, e.g. ``restore``) run back to back, and their
    order flips every repeat, so that raw and torchlike see the same machine state; groups run
    in their listed order (the save group first, so overwrite phases always find a checkpoint).
    """
    groups: dict[str, list[Phase]] = {}
    for phase in phases:
        groups.setdefault(phase.group, []).append(phase)
    for repeat in range(repeats):
        for members in groups.values():
            for phase in members if repeat % 2 == 0 else members[::-1]:
                phase.setup()
                gc.collect()
                # Write back what earlier phases left dirty, so no phase pays for its predecessor's I/O.
                os.sync()
                phase.seconds.append(timed(lambda phase=phase: ready(phase.run()))[0])
                print(f"  repeat {repeat + 1}: {phase.name:<26} {phase.seconds[-1]:.3f} s", flush=True)


def summarize(phases: list[Phase], nbytes: int) -> dict[str, Any]:
    best = {p.name: min(p.seconds) for p in phases}
    rows = {}
    for p in phases:
        ratios = {b: best[p.name] / best[b] for b in p.baselines if b in best}
        first = ratios.get(p.baselines[0]) if p.baselines else None
        rows[p.name] = {
            "seconds_best": best[p.name],
            "seconds_median": statistics.median(p.seconds),
            "seconds_all": p.seconds,
            "gb_per_s": nbytes / best[p.name] / 1e9 if not p.name.startswith("partial") else None,
            "ratios": ratios,
            "goal": p.goal,
            "meets_goal": None if p.goal is None or first is None else first <= p.goal,
        }
    return rows


def ratios_text(row: Mapping[str, Any]) -> str:
    """A phase's ratios to its baselines, and whether the first one meets the goal."""
    ratios = ", ".join(f"{r:.3f} vs {b}" for b, r in row["ratios"].items()) or "-"
    verdict = "" if row["meets_goal"] is None else (" OK" if row["meets_goal"] else f" > goal {row['goal']}")
    return ratios + verdict


TABLE = (
    Column("phase", 26, "phase", align="<"), Column("best s", 8, "seconds_best", ".3f", gap=" "),
    Column("median s", 9, "seconds_median", ".3f", gap=" "),
    Column("GB/s", 6, lambda row: row["gb_per_s"] or None, ".2f", gap=" "),
    Column("ratio (vs baseline)", 0, ratios_text, align="<", gap="  "),
)


def main(argv: list[str] | None = None, extra_phases: Callable[[Path], list[Phase]] | None = None) -> dict[str, Any]:
    """Runs the benchmark.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` when None).
        extra_phases: called with the torchlike checkpoint directory; returns more phases to
            time (e.g. ``[load_state_dict_phase(path, lambda ckpt: model.load_state_dict(ckpt, strict=False))]``).

    Returns:
        The results written to the JSON file.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="checkpoint_io_", dir=args.workdir))
    try:
        model = make_model(args.layers)
        tree = make_tree(model)
        nbytes = tree_bytes(tree)
        subset = lora_keys(tree)
        subset_bytes = sum(tree_bytes({k: tree[k]}) for k in subset)
        print(f"tree: {len(tree)} bf16 arrays, {nbytes / 1e9:.3f} GB; partial subset: {len(subset)} LoRA arrays "
              f"({len(subset) / len(tree):.0%} of keys, {subset_bytes / nbytes:.2%} of bytes)", flush=True)
        warm_up(work)
        phases, torchlike_dir = build_phases(tree, work)
        phases.append(load_state_dict_phase(
            torchlike_dir, lambda ckpt: (model.load_state_dict(ckpt, strict=False), list(model.state_dict().values()))))
        if extra_phases is not None:
            phases += extra_phases(torchlike_dir)
        run(phases, args.repeats)
        rows = summarize(phases, nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(format_table(TABLE, ({"phase": name, **row} for name, row in rows.items()), rule=False))
    results = {
        "tree": {"arrays": len(tree), "bytes": nbytes, "dtype": "bfloat16", "layers": args.layers,
                 "partial_arrays": len(subset), "partial_bytes": subset_bytes},
        "repeats": args.repeats,
        "goal_ratio": GOAL_RATIO,
        "phases": rows,
        "machine": machine_info(("jax", "jaxlib", "orbax-checkpoint", "torchlike")) | {"device": str(jax.devices()[0])},
    }
    print(f"\nwritten to {write_json(args.output, results)}")
    return results


if __name__ == "__main__":
    main()
