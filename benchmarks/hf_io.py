"""Hugging Face checkpoint import/export: torchlike against raw safetensors, speed and peak RSS.

What it measures
----------------
A random bf16 Qwen2-shaped checkpoint (``torchlike.testing.tiny_config("qwen2", ...)``, untied embeddings,
default about 0.5 GB; the real byte count is printed), or with ``--family qwen3_moe`` a Qwen3 MoE one (128 experts
per layer, each expert three small tensors as on the Hub, so thousands of tensors), is written with
``safetensors.torch.save_file`` (``{"format": "pt"}`` metadata; ``--shards N`` writes N
files plus ``model.safetensors.index.json``). Then, each in a fresh Python process:

``import-raw``
    ``safetensors.safe_open(..., framework="flax").get_tensor`` of every tensor (what
    ``safetensors.flax.load_file`` does), until every ``jax.Array`` is ready.
``import-raw-numpy``
    ``safe_open(..., framework="numpy").get_tensor`` + ``jax.device_put`` of every tensor.
``import-torchlike``
    ``torchlike.AutoModelForCausalLM.from_pretrained(dir, dtype="bfloat16")``, until every
    parameter is ready (``jax.block_until_ready``).
``export-raw``
    ``safetensors.flax.save_file`` of the loaded model's parameters (the same ``jax.Array``
    objects, NNX names and layout); ``seconds`` excludes and ``seconds_fsync`` includes an
    ``fsync`` of the file (``save_pretrained`` fsyncs every shard).
``export-torchlike``
    ``CausalLM.save_pretrained(outdir)`` (HF names and layout, config files, staging folder,
    fsync); afterwards, untimed, the written tensors are compared bit for bit with the input.

Reported: seconds (best of ``--repeats``), throughput = model bytes / seconds (GB = 1e9 B),
the ratio torchlike throughput / raw throughput (goal >= 0.8), the summary line
``import / raw = X`` (torchlike import seconds / ``import-raw`` seconds, goal <= 1.2; also given
against ``import-raw-numpy``), and the peak RSS increase
during the operation over the RSS just before it (after all imports and a JAX warm-up; for
export, after the model is loaded), as a multiple of the model bytes (goal <= 1.3). The peak
comes from ``VmHWM`` after resetting it through ``/proc/self/clear_refs`` (when permitted) and
from a thread sampling ``/proc/self/status`` every few milliseconds, which also splits it into
anonymous memory and file pages: pages of a memory-mapped checkpoint count in RSS (``RssFile``)
while they are mapped. The checkpoint is read from the page cache (it was just written).

Run (from the repository root; a few minutes at 0.5 GB on 2 cores)::

    .venv/bin/python benchmarks/hf_io.py
    .venv/bin/python benchmarks/hf_io.py --size-mb 2000 --shards 4 --repeats 3
    .venv/bin/python benchmarks/hf_io.py --profile     # + cProfile of the torchlike phases (main thread)
    .venv/bin/python benchmarks/hf_io.py --size-mb 4000 --shards 4 --phases import-raw import-raw-numpy import-torchlike
    .venv/bin/python benchmarks/hf_io.py --family qwen3_moe --size-mb 200

The table is printed and everything is written to ``benchmarks/results/hf_io.json``
(``--output``). One phase alone, as the driver runs it::

    .venv/bin/python benchmarks/hf_io.py --phase import-torchlike --dir /tmp/ckpt --out /tmp/x

This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402  (after the path set-up above)
    Column,
    PeakRss,
    child_environment,
    format_header,
    format_row,
    machine_info,
    print_result,
    profile_text,
    run_child_process,
    write_json,
)

IMPORT_PHASES = ("import-raw", "import-raw-numpy", "import-torchlike")
EXPORT_PHASES = ("export-raw", "export-torchlike")
PHASES = IMPORT_PHASES + EXPORT_PHASES
GOAL_THROUGHPUT_RATIO = 0.8
GOAL_RSS_MULTIPLE = 1.3
GOAL_IMPORT_SECONDS_RATIO = 1.2
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "hf_io.json"
INDEX_NAME = "model.safetensors.index.json"
#: The packages whose versions the results record.
PACKAGES = ("jax", "jaxlib", "flax", "safetensors", "numpy", "torch", "transformers", "torchlike")


# --------------------------------------------------------------------------- checkpoint


def qwen2_config(size_mb: float) -> Any:
    """A Qwen2 config whose untied bf16 weights come to about ``size_mb`` MB (1e6 bytes)."""
    from torchlike.testing import tiny_config

    hidden, intermediate, heads, kv_heads = 1024, 2816, 16, 8
    head_dim = hidden // heads
    target = size_mb * 1e6
    vocab = 32768
    while vocab > 1024 and 2 * vocab * hidden * 2 > target / 3:  # embeddings <= a third
        vocab //= 2
    layer_params = (
        2 * hidden * heads * head_dim  # q_proj, o_proj
        + 2 * hidden * kv_heads * head_dim  # k_proj, v_proj
        + (heads + 2 * kv_heads) * head_dim  # q/k/v biases
        + 3 * hidden * intermediate  # gate, up, down
        + 2 * hidden  # two norms
    )
    layers = max(1, round((target - 2 * vocab * hidden * 2 - hidden * 2) / (layer_params * 2)))
    return tiny_config(
        "qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["Qwen2ForCausalLM"],
    )


def qwen3_moe_config(size_mb: float) -> Any:
    """A Qwen3 MoE config (every layer sparse: 128 experts of 128, 8 chosen per token) whose untied bf16 weights come
    to about ``size_mb`` MB."""
    from torchlike.testing import tiny_config

    hidden, heads, kv_heads, head_dim, experts, expert_size = 1024, 16, 8, 64, 128, 128
    vocab = 32768
    target = size_mb * 1e6
    while vocab > 1024 and 2 * vocab * hidden * 2 > target / 3:  # embeddings <= a third
        vocab //= 2
    layer_params = (
        2 * hidden * heads * head_dim  # q_proj, o_proj
        + 2 * hidden * kv_heads * head_dim  # k_proj, v_proj
        + 2 * head_dim + 2 * hidden  # q/k norms, two layer norms
        + experts * hidden  # router
        + 3 * experts * hidden * expert_size  # each expert's gate, up, down
    )
    layers = max(1, round((target - 2 * vocab * hidden * 2 - hidden * 2) / (layer_params * 2)))
    return tiny_config(
        "qwen3_moe",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=8,
        moe_intermediate_size=expert_size,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM"],
    )


FAMILY_CONFIGS = {"qwen2": qwen2_config, "qwen3_moe": qwen3_moe_config}


def hf_tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen2ForCausalLM or Qwen3MoeForCausalLM state dict, in HF order (a Qwen3 MoE's experts
    as the Hub stores them: three tensors per expert)."""
    if config.model_type == "qwen3_moe":
        return _qwen3_moe_tensor_shapes(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, hidden))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q_out, hidden)),
            (p + "self_attn.q_proj.bias", (q_out,)),
            (p + "self_attn.k_proj.weight", (kv_out, hidden)),
            (p + "self_attn.k_proj.bias", (kv_out,)),
            (p + "self_attn.v_proj.weight", (kv_out, hidden)),
            (p + "self_attn.v_proj.bias", (kv_out,)),
            (p + "self_attn.o_proj.weight", (hidden, q_out)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (config.vocab_size, hidden))]
    return shapes


def _qwen3_moe_tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, head_dim = config.hidden_size, config.moe_intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, hidden))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q_out, hidden)),
            (p + "self_attn.k_proj.weight", (kv_out, hidden)),
            (p + "self_attn.v_proj.weight", (kv_out, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_out)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "mlp.gate.weight", (config.num_experts, hidden)),
        ]
        for expert in range(config.num_experts):
            shapes += [
                (p + f"mlp.experts.{expert}.gate_proj.weight", (inter, hidden)),
                (p + f"mlp.experts.{expert}.up_proj.weight", (inter, hidden)),
                (p + f"mlp.experts.{expert}.down_proj.weight", (hidden, inter)),
            ]
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (config.vocab_size, hidden))]
    return shapes


def _nbytes(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * 2  # bf16


def split_shards(shapes: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Cuts the tensor list, in order, into ``shards`` groups of roughly equal bytes."""
    total = sum(_nbytes(shape) for _, shape in shapes)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    done = 0
    for name, shape in shapes:
        if groups[-1] and len(groups) < shards and done >= total * len(groups) / shards:
            groups.append([])
        groups[-1].append((name, shape))
        done += _nbytes(shape)
    return groups


def write_checkpoint(directory: Path, size_mb: float, shards: int, seed: int = 0,
                     family: str = "qwen2") -> dict[str, Any]:
    """Writes config.json and random bf16 safetensors weights of ``family`` (:data:`FAMILY_CONFIGS`); returns a
    description."""
    import torch
    from safetensors.torch import save_file

    config = FAMILY_CONFIGS[family](size_mb)
    shapes = hf_tensor_shapes(config)
    groups = split_shards(shapes, max(1, shards))
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for file_name, group in zip(names, groups, strict=True):
        tensors = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(0.02)
            weight_map[name] = file_name
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        del tensors
    model_bytes = sum(_nbytes(shape) for _, shape in shapes)
    if len(groups) > 1:
        index = {"metadata": {"total_size": model_bytes}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return describe_checkpoint(directory)


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, in index order."""
    index = directory / INDEX_NAME
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"].values()
        return [directory / name for name in dict.fromkeys(names)]
    return [directory / "model.safetensors"]


def describe_checkpoint(directory: Path) -> dict[str, Any]:
    """Tensor count and bytes read from the safetensors headers, plus the config's sizes."""
    model_bytes = 0
    tensors = 0
    files = weight_files(directory)
    for path in files:
        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
        header.pop("__metadata__", None)
        tensors += len(header)
        model_bytes += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in header.values())
    config = json.loads((directory / "config.json").read_text())
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "num_local_experts",
        "moe_intermediate_size",
    )
    return {
        "dir": str(directory),
        "files": [path.name for path in files],
        "file_bytes": sum(path.stat().st_size for path in files),
        "model_bytes": model_bytes,
        "tensors": tensors,
        "config": {key: config.get(key) for key in keys},
    }


# --------------------------------------------------------------------------- measuring


@contextmanager
def measured(profile: bool) -> Iterator[dict[str, Any]]:
    """Times the block and its peak RSS into the yielded dict (and a cProfile when asked)."""
    record: dict[str, Any] = {}
    profiler = cProfile.Profile() if profile else None
    with PeakRss() as memory:
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        yield record
        if profiler is not None:
            profiler.disable()
        record["seconds"] = time.perf_counter() - start
    record["memory"] = memory.result()
    if profiler is not None:
        record["profile"] = profile_text(profiler, cumulative=30, own=20)


# --------------------------------------------------------------------------- phases (child side)


def warm_up() -> dict[str, Any]:
    """Imports everything any phase uses and starts the JAX backend, so baselines are equal."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
    import safetensors.flax  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, GenerationConfig, Qwen2Config  # noqa: F401

    import torchlike.modeling  # noqa: F401
    from torchlike.adapters.families import all_families

    all_families()
    # AutoConfig's first use imports transformers' auto-modeling stack (torch, ~2.5 s on 2 cores);
    # do it here so the timed load measures checkpoint reading, not a once-per-process import.
    AutoConfig.for_model("qwen2")
    GenerationConfig()
    jnp.zeros(8).block_until_ready()
    return {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def _ready(arrays: list[Any]) -> int:
    import jax

    jax.block_until_ready(arrays)
    return sum(int(array.nbytes) for array in arrays)


def load_torchlike(directory: Path) -> Any:
    from torchlike import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype="bfloat16")


def phase_import_raw(directory: Path, profile: bool) -> dict[str, Any]:
    from safetensors import safe_open

    with measured(profile) as record:
        arrays: dict[str, Any] = {}
        for path in weight_files(directory):
            with safe_open(str(path), framework="flax") as handle:
                for name in handle.offset_keys():
                    arrays[name] = handle.get_tensor(name)
        record["bytes"] = _ready(list(arrays.values()))
    return record


def phase_import_raw_numpy(directory: Path, profile: bool) -> dict[str, Any]:
    import jax
    from safetensors import safe_open

    with measured(profile) as record:
        arrays: dict[str, Any] = {}
        for path in weight_files(directory):
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.offset_keys():
                    arrays[name] = jax.device_put(handle.get_tensor(name))
        record["bytes"] = _ready(list(arrays.values()))
    return record


def phase_import_torchlike(directory: Path, profile: bool) -> dict[str, Any]:
    with measured(profile) as record:
        model = load_torchlike(directory)
        record["bytes"] = _ready(list(model.parameters()))
    return record


def phase_export_raw(directory: Path, out: Path, profile: bool) -> dict[str, Any]:
    from safetensors.flax import save_file

    model = load_torchlike(directory)
    params = dict(model.named_parameters())
    _ready(list(params.values()))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    target = out / "model.safetensors"
    with measured(profile) as record:
        start = time.perf_counter()
        save_file(dict(params), str(target), metadata={"format": "pt"})  # save_file edits its dict
        written = time.perf_counter()
        descriptor = os.open(target, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        record["fsync_seconds"] = time.perf_counter() - written
    record["seconds_fsync"] = record["seconds"]  # comparable with save_pretrained, which fsyncs
    record["seconds"] = written - start
    record["bytes"] = sum(int(array.nbytes) for array in params.values())
    return record


def phase_export_torchlike(directory: Path, out: Path, profile: bool, verify: bool) -> dict[str, Any]:
    model = load_torchlike(directory)
    record_bytes = _ready(list(model.parameters()))
    shutil.rmtree(out, ignore_errors=True)
    with measured(profile) as record:
        model.save_pretrained(out)
    record["bytes"] = record_bytes
    if verify:
        record["verified"] = same_tensors(weight_files(directory), weight_files(out))
    return record


def same_tensors(expected_files: list[Path], actual_files: list[Path]) -> bool:
    """True when both file sets hold the same tensor names with identical bytes."""
    import numpy as np
    from safetensors import safe_open

    def tensors(files: list[Path]) -> dict[str, tuple[Path, str]]:
        found = {}
        for path in files:
            with safe_open(str(path), framework="numpy") as handle:
                found.update({name: (path, name) for name in handle.keys()})
        return found

    expected, actual = tensors(expected_files), tensors(actual_files)
    if set(expected) != set(actual):
        return False
    for name in expected:
        with (
            safe_open(str(expected[name][0]), framework="numpy") as a,
            safe_open(str(actual[name][0]), framework="numpy") as b,
        ):
            left, right = a.get_tensor(name), b.get_tensor(name)
            if left.shape != right.shape or left.dtype != right.dtype:
                return False
            if not np.array_equal(left.view(np.uint16), right.view(np.uint16)):
                return False
    return True


def run_child(args: argparse.Namespace) -> None:
    """Runs one ``--phase`` and prints its result line."""
    environment = warm_up()
    directory = Path(args.dir)
    out = Path(args.out) if args.out else directory.parent / f"{directory.name}-{args.phase}"
    phases: dict[str, Callable[[], dict[str, Any]]] = {
        "import-raw": lambda: phase_import_raw(directory, args.profile),
        "import-raw-numpy": lambda: phase_import_raw_numpy(directory, args.profile),
        "import-torchlike": lambda: phase_import_torchlike(directory, args.profile),
        "export-raw": lambda: phase_export_raw(directory, out, args.profile),
        "export-torchlike": lambda: phase_export_torchlike(directory, out, args.profile, not args.no_verify),
    }
    record = phases[args.phase]()
    record.update(phase=args.phase, profiled=args.profile, **environment)
    if args.phase.startswith("export"):
        shutil.rmtree(out, ignore_errors=True)
    print_result(record)


# --------------------------------------------------------------------------- driver


def run_phase(
    phase: str, args: argparse.Namespace, directory: Path, work: Path, profile: bool = False
) -> dict[str, Any]:
    """Runs one phase in a fresh interpreter and returns its result record."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--phase",
        phase,
        "--dir",
        str(directory),
        "--out",
        str(work / f"out-{phase}"),
    ]
    if profile:
        command.append("--profile")
    if args.no_verify:
        command.append("--no-verify")
    os.sync()  # no writeback from an earlier phase competes with this one
    record = run_child_process(command, child_environment())
    if "error" in record:
        raise RuntimeError(f"phase {phase} failed: {record['error']}")
    return record


def summarize(runs: dict[str, list[dict[str, Any]]], model_bytes: int) -> dict[str, Any]:
    """Best run per phase, throughputs, ratios and RSS multiples, plus goal verdicts."""
    summary: dict[str, Any] = {}
    for phase, records in runs.items():
        if not records:
            continue
        best = min(records, key=lambda record: record["seconds"])
        peak = max(record["memory"]["peak_rss_increase"] for record in records)
        row = {
            "seconds": best["seconds"],
            "seconds_all": [record["seconds"] for record in records],
            "gb_per_s": model_bytes / best["seconds"] / 1e9,
            "peak_rss_increase": peak,
            "rss_multiple": peak / model_bytes,
            "sampled_peak_anon_increase": max(r["memory"]["sampled_peak_anon_increase"] for r in records),
            "sampled_peak_file_increase": max(r["memory"]["sampled_peak_file_increase"] for r in records),
        }
        if phase == "export-raw":
            seconds_fsync = min(record["seconds_fsync"] for record in records)
            row.update(seconds_fsync=seconds_fsync, gb_per_s_fsync=model_bytes / seconds_fsync / 1e9)
        if "verified" in best:
            row["verified"] = all(record.get("verified") for record in records)
        summary[phase] = row

    def ratio(phase: str, baseline: str, key: str = "gb_per_s") -> float | None:
        if phase in summary and baseline in summary:
            return summary[phase]["gb_per_s"] / summary[baseline][key]
        return None

    ratios = {
        "import_vs_raw_flax": ratio("import-torchlike", "import-raw"),
        "import_vs_raw_numpy_device_put": ratio("import-torchlike", "import-raw-numpy"),
        "export_vs_raw_save_file": ratio("export-torchlike", "export-raw"),
        "export_vs_raw_save_file_fsync": ratio("export-torchlike", "export-raw", "gb_per_s_fsync"),
    }
    for baseline, key in (("import-raw", "import_seconds_vs_raw_flax"),
                          ("import-raw-numpy", "import_seconds_vs_raw_numpy_device_put")):
        if "import-torchlike" in summary and baseline in summary:
            ratios[key] = summary["import-torchlike"]["seconds"] / summary[baseline]["seconds"]
        else:
            ratios[key] = None
    goals = {}
    if ratios["import_seconds_vs_raw_flax"] is not None:
        goals["import_seconds_ratio"] = ratios["import_seconds_vs_raw_flax"] <= GOAL_IMPORT_SECONDS_RATIO
    if ratios["import_vs_raw_flax"] is not None:
        goals["import_throughput_ratio"] = ratios["import_vs_raw_flax"] >= GOAL_THROUGHPUT_RATIO
    if ratios["export_vs_raw_save_file"] is not None:
        goals["export_throughput_ratio"] = ratios["export_vs_raw_save_file"] >= GOAL_THROUGHPUT_RATIO
    for phase, key in (("import-torchlike", "import_rss"), ("export-torchlike", "export_rss")):
        if phase in summary:
            goals[key] = summary[phase]["rss_multiple"] <= GOAL_RSS_MULTIPLE
    return {"phases": summary, "ratios": ratios, "goals": goals}


MB = 1e6


def megabytes(key: str) -> Callable[[dict[str, Any]], float]:
    """A table value: the record's bytes under ``key`` in MB."""
    return lambda row: row[key] / MB


TABLE = (
    Column("phase", 22, "phase", align="<"), Column("seconds", 9, "seconds", ".2f"),
    Column("GB/s", 8, "gb_per_s", ".3f"), Column("vs raw", 8, "ratio", ".2f", missing=""),
    Column("peak RSS +MB", 14, megabytes("peak_rss_increase"), ".0f"), Column("x model", 9, "rss_multiple", ".2f"),
    Column("anon +MB", 10, megabytes("sampled_peak_anon_increase"), ".0f"),
    Column("file +MB", 10, megabytes("sampled_peak_file_increase"), ".0f"),
)


def summary_table(summary: dict[str, Any], model_bytes: int) -> str:
    """The human-readable table: a row per phase (``export-raw`` with fsync too), then ratios and goals."""
    header = format_header(TABLE)
    lines = [header, "-" * len(header)]
    phases = summary["phases"]
    ratios = summary["ratios"]
    versus = {
        "import-torchlike": ratios["import_vs_raw_flax"],
        "export-torchlike": ratios["export_vs_raw_save_file"],
    }
    for phase in PHASES:
        if phase not in phases:
            continue
        row = phases[phase]
        lines.append(format_row(TABLE, {**row, "phase": phase, "ratio": versus.get(phase)}))
        if phase == "export-raw":
            fsync = {"phase": "  (+ fsync)", "seconds": row["seconds_fsync"], "gb_per_s": row["gb_per_s_fsync"]}
            lines.append(format_row(TABLE[:3], fsync))
    lines.append("")
    lines.append(f"model bytes: {model_bytes:,} ({model_bytes / MB:.1f} MB)")
    for name, value in ratios.items():
        if value is not None:
            lines.append(f"ratio {name}: {value:.2f}")
    if ratios["import_seconds_vs_raw_flax"] is not None:
        against_numpy = ratios["import_seconds_vs_raw_numpy_device_put"]
        lines.append(
            f"import / raw = {ratios['import_seconds_vs_raw_flax']:.2f} (goal <= {GOAL_IMPORT_SECONDS_RATIO})"
            + ("" if against_numpy is None else f"; against import-raw-numpy: {against_numpy:.2f}")
        )
    targets = {
        "import_seconds_ratio": f"<= {GOAL_IMPORT_SECONDS_RATIO}",
        "import_throughput_ratio": f">= {GOAL_THROUGHPUT_RATIO}",
        "export_throughput_ratio": f">= {GOAL_THROUGHPUT_RATIO}",
        "import_rss": f"<= {GOAL_RSS_MULTIPLE}x",
        "export_rss": f"<= {GOAL_RSS_MULTIPLE}x",
    }
    for name, met in summary["goals"].items():
        lines.append(f"goal {name} ({targets[name]}): {'met' if met else 'MISSED'}")
    if "export-torchlike" in phases and "verified" in phases["export-torchlike"]:
        lines.append(f"export-torchlike bit-exact round trip: {phases['export-torchlike']['verified']}")
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> None:
    """Writes (or reuses) the checkpoint, runs every phase in fresh processes, reports."""
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hf_io_"))
    directory = Path(args.dir) if args.dir else work / "checkpoint"
    created = False
    if args.regenerate or not (directory / "config.json").is_file():
        shutil.rmtree(directory, ignore_errors=True)
        print(
            f"writing a ~{args.size_mb:g} MB random bf16 {args.family} checkpoint ({args.shards} file(s)) to "
            f"{directory} ...",
            flush=True,
        )
        started = time.perf_counter()
        checkpoint = write_checkpoint(directory, args.size_mb, args.shards, family=args.family)
        print(f"  written in {time.perf_counter() - started:.1f}s", flush=True)
        created = True
    else:
        checkpoint = describe_checkpoint(directory)
    model_bytes = checkpoint["model_bytes"]
    print(
        f"checkpoint: {checkpoint['tensors']} tensors, {model_bytes:,} bytes of bf16 weights "
        f"({model_bytes / 1e9:.3f} GB) in {len(checkpoint['files'])} file(s); "
        f"config {checkpoint['config']}",
        flush=True,
    )

    phases = [phase for phase in PHASES if phase in args.phases]
    runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in phases}
    environment: dict[str, Any] = {}
    for repeat in range(args.repeats):
        for phase in phases:
            record = run_phase(phase, args, directory, work)
            environment = {"backend": record["backend"], "devices": record["devices"]}
            runs[phase].append(record)
            memory = record["memory"]
            print(
                f"  [{repeat + 1}/{args.repeats}] {phase:<18} {record['seconds']:7.2f}s "
                f"{model_bytes / record['seconds'] / 1e9:6.3f} GB/s  "
                f"peak RSS +{memory['peak_rss_increase'] / 1e6:.0f} MB "
                f"(process {record['process_seconds']:.1f}s)",
                flush=True,
            )
    profiles: dict[str, str] = {}
    if args.profile:
        for phase in (phase for phase in ("import-torchlike", "export-torchlike") if phase in phases):
            profiles[phase] = run_phase(phase, args, directory, work, profile=True)["profile"]

    summary = summarize(runs, model_bytes)
    table = summary_table(summary, model_bytes)
    machine = machine_info(PACKAGES) | environment
    print()
    print(
        f"machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs "
        f"({machine['cpus_usable']} usable), {machine.get('mem_total_bytes', 0) / 2**30:.0f} GiB, "
        f"{machine['platform']}, JAX backend {environment.get('backend')}"
    )
    print(table)
    for phase, text in profiles.items():
        print(f"\n===== cProfile: {phase} (profiled run, slower than the timed ones) =====")
        print(text)

    result = {
        "command": [sys.executable, *sys.argv],
        "machine": machine,
        "checkpoint": checkpoint,
        "model_bytes": model_bytes,
        "repeats": args.repeats,
        "goals_targets": {
            "throughput_ratio_min": GOAL_THROUGHPUT_RATIO,
            "rss_multiple_max": GOAL_RSS_MULTIPLE,
            "import_seconds_ratio_max": GOAL_IMPORT_SECONDS_RATIO,
        },
        **summary,
        "runs": runs,
        "profiles": profiles,
        "table": table,
    }
    print(f"\nwrote {write_json(args.output, result)}")
    if not args.keep and not args.work and not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    elif created:
        print(f"checkpoint kept in {directory}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=512.0, help="approximate weight bytes, in MB (1e6)")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files to split the checkpoint into")
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILY_CONFIGS),
                        help="the checkpoint's model family (qwen3_moe: one tensor per expert and projection)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per phase (best time, worst RSS reported)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="phases to run")
    parser.add_argument("--profile", action="store_true", help="also cProfile one run of each torchlike phase")
    parser.add_argument("--dir", help="checkpoint directory (reused when it holds config.json)")
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    parser.add_argument("--regenerate", action="store_true", help="rewrite the checkpoint even if --dir has one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary scratch directory")
    parser.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of the export")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="JSON results file")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--out", help=argparse.SUPPRESS)  # child mode: export directory
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase:
        if not args.dir:
            raise SystemExit("--phase needs --dir")
        run_child(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
