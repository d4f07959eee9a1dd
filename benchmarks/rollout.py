"""Rollout throughput on a GRPO-shaped workload: torchlike's paged engine against its static sampler and transformers.

What it measures
----------------
A random Qwen2 (hidden 896, 4 layers, bfloat16; built with ``torchlike.testing`` and saved to a temporary
directory) is loaded by both libraries. ``P`` prompts of random ids (lengths drawn between 7/8 of ``--prompt`` and
``--prompt``) each get ``G`` sampled completions (TRL's ``num_generations``) of up to ``N`` new tokens, with GRPO's
default sampling (temperature 1.0, top-p 1.0, top-k 0). Preset ``gpu`` is the issue's workload: 64 prompts x 8
generations, 512 new tokens, vocabulary 151936 (the Qwen2.5-0.5B width). Preset ``cpu`` (the default) is scaled
down to finish in about 10 minutes on 2 cores: 8 prompts x 4 generations, 128 new tokens, vocabulary 32000.

Random weights sample every token alike, so the checkpoint gets an *end-token feature*: hidden dimension 0 of the
residual stream is a constant (every embedding row holds it, no layer writes to it, the layers' norms ignore it),
so after the final norm it is a positive input to the logits that the tokens change little, and the end token's
``lm_head`` row reads only it. Its weight is set on a forward pass of 16 rows of random ids, at the positions
completions take, so that half of those rows would end within ``N / 4`` tokens (lengths then spread about
geometrically: most completions are short, a few run to ``N``, as GRPO rollouts do). The measured length
distribution is printed for every side.

Sides, on the same requests in the same process:

``paged``
    ``PagedEngine`` (paged KV cache, continuous batching, one prefill per prompt shared by its ``G`` completions);
    ``--max-num-seqs`` slots (default: every completion), pages of ``--page-size`` tokens.
``static``
    ``StaticEngine``: every completion is a row of one left-padded batch decoded until its longest row ends (the
    sampler torchlike used before the paged engine).
``transformers_generate``
    ``model.generate`` on the same left-padded batch (each prompt repeated ``G`` times), ``do_sample=True``.
``transformers_generate_batch``
    transformers' continuous batching ``model.generate_batch`` on the repeated prompts, with TRL's settings for
    ``use_transformers_paged`` (``max_memory_percent=0.5``); a failure is recorded and the run goes on.

The torchlike engines run once untimed on the same requests (compilation happens there: ``first_call_s``), then
``--repeats`` timed rounds, taking turns (paged, static, paged, static...: this machine's speed drifts by up to
1.5x between minutes, and a slow spell then hits both); the transformers sides run a small untimed warm-up, then
once timed. Each side reports *useful* tokens/s: the tokens of every completion up to and including its end token,
summed, over the wall seconds of the call (an engine: its median round; every round is listed). In each round the
engines also run the *full-length* variant (no end token, every completion runs ``N`` tokens) and report the
median of their tokens/s ratios long-tailed / full-length. ``paged_vs_static`` is the median of the rounds'
ratios. KV memory: the paged engine's peak pages in use
x page size x bytes per token, against the static batch's cache (rows x ``cache_size(prompt, N)`` x bytes per
token). The paged engine's timed long-tailed call also times its three programs (prefill, admit, decode) and
counts its decode steps and how many of their rows were live, to show where its time goes.

Goals (from the rollout issue): paged tokens/s >= 2x the static sampler and >= 1.5x transformers ``generate_batch``;
paged vs ``transformers.generate`` is reported without a goal; the paged engine's long-tailed tokens/s >= 0.6x its
full-length tokens/s.

Run (from the repository root)::

    nice -n 10 .venv/bin/python benchmarks/rollout.py                  # CPU preset: 8 x 4, 128 new tokens
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset cpu-refill   # 16 x 8, 256 new tokens, 64 slots
    .venv/bin/python benchmarks/rollout.py --preset gpu                # 64 x 8, 512 new tokens (the issue's)
    .venv/bin/python benchmarks/rollout.py --prompts 16 --new-tokens 64 --vocab 151936
    # the gpu preset's workload on the CPU, paged (64 slots) against static and generate_batch (about an hour):
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset gpu --max-num-seqs 64 --repeats 1 --no-full-length \
        --skip transformers_generate

Results are printed and written to ``benchmarks/results/rollout.json`` (``--output``).
This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402  (after the path set-up above)
    fill_from_preset,
    machine_info,
    timed,
    tiny_qwen2,
    write_json,
)

if TYPE_CHECKING:
    from torchlike.adapters.rollout import RolloutEngine, RolloutRequest
    from torchlike.adapters.rollout.sampling_settings import SamplingSettings

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "rollout.json"
PRESETS: dict[str, dict[str, Any]] = {
    # Scaled down for 2 cores: the 151936-row lm_head is most of a decode step's weights, and the transformers
    # sides take most of the run.
    "cpu": dict(prompts=8, generations=4, new_tokens=128, prompt=128, layers=4, hidden=896, intermediate=4864,
                heads=14, kv_heads=2, vocab=32000, dtype="bfloat16", repeats=1),
    "gpu": dict(prompts=64, generations=8, new_tokens=512, prompt=128, layers=4, hidden=896, intermediate=4864,
                heads=14, kv_heads=2, vocab=151936, dtype="bfloat16", repeats=3),
    # More completions than slots, so the paged engine refills its slots as completions end (the regime of the
    # issue's workload, which the "cpu" preset never reaches): about 10 minutes on 2 cores.
    "cpu-refill": dict(prompts=16, generations=8, new_tokens=256, prompt=128, layers=4, hidden=896, intermediate=4864,
                       heads=14, kv_heads=2, vocab=32000, dtype="bfloat16", max_num_seqs=64, repeats=3),
}
END_TOKEN = 2  # tiny_config's eos id; prompts draw ids from 3 up
END_FEATURE = 0  # the hidden dimension that carries the end-token feature
END_FEATURE_VALUE = 2.0  # its value in every embedding row (the other dimensions start at std 0.02)
GOALS = {"paged_vs_static": 2.0, "paged_vs_transformers_generate_batch": 1.5, "paged_long_tail_vs_full_length": 0.6}
SAMPLING = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)  # TRL GRPOConfig's defaults


# --------------------------------------------------------------------------- the checkpoint


CALIBRATION_ROWS = 16


def end_weight(feature: Any, others: Any, steps: int) -> float:
    """The weight ``w`` at which half of the calibration rows would have ended within ``steps`` tokens: the mean
    over rows of ``prod_t (1 - sigmoid(w * feature[r, t] - others[r, t]))`` over their first ``steps`` positions is
    1/2 (bisection). Rows and positions differ in their end probability, so this sets the median length where one
    mean probability per step would not."""
    import torch

    def survival(weight: float) -> float:
        ends = torch.sigmoid(weight * feature[:, :steps] - others[:, :steps]).double()
        return float(torch.exp(torch.log1p(-ends).sum(dim=-1)).mean())

    low, high = 0.0, 1.0
    while survival(high) > 0.5:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if survival(middle) > 0.5 else (low, middle)
    return (low + high) / 2


def build_checkpoint(directory: Path, args: argparse.Namespace) -> dict[str, float]:
    """Saves the random Qwen2 with its end-token feature (see the module docstring) to ``directory``; returns the
    calibration: the end token's ``lm_head`` weight and the per-step end probability aimed at."""
    import torch

    from torchlike.testing import random_model

    config = tiny_qwen2(vars(args), 4096, tie_word_embeddings=False)
    model = random_model(config, seed=0, dtype="float32")
    feature = END_FEATURE
    with torch.no_grad():
        model.model.embed_tokens.weight[:, feature] = END_FEATURE_VALUE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[feature, :] = 0.0
            layer.mlp.down_proj.weight[feature, :] = 0.0
            layer.input_layernorm.weight[feature] = 0.0
            layer.post_attention_layernorm.weight[feature] = 0.0
        model.model.norm.weight[feature] = 1.0
        model.lm_head.weight[:, feature] = 0.0
        model.lm_head.weight[END_TOKEN, :] = 0.0
        # Calibrate on random ids (sampled tokens are near-uniform, so they look alike to the model), at the
        # positions completions take: the feature after the norm drifts with the position. One row at a time:
        # a row's logits at the gpu preset's vocabulary are 300 MB.
        width = args.prompt + args.new_tokens
        ids = torch.from_numpy(np.random.default_rng(1).integers(3, args.vocab, size=(CALIBRATION_ROWS, width)))
        features, others = [], []
        for row in ids:
            hidden = model.model(input_ids=row[None]).last_hidden_state[0, args.prompt:]
            logits = model.lm_head(hidden)
            logits[:, END_TOKEN] = -math.inf
            features.append(hidden[:, feature])
            others.append(torch.logsumexp(logits, dim=-1))
        features, others = torch.stack(features), torch.stack(others)
        quarter = max(args.new_tokens // 4, 1)
        weight = end_weight(features, others, quarter)
        model.lm_head.weight[END_TOKEN, feature] = weight
        mean_end = float(torch.sigmoid(weight * features[:, :quarter] - others[:, :quarter]).mean())
    model.generation_config.eos_token_id = END_TOKEN
    model.to(getattr(torch, args.dtype)).save_pretrained(directory)
    return {"end_token": END_TOKEN, "end_weight": weight, "calibration_rows": CALIBRATION_ROWS,
            "median_length_aimed_at": quarter, "mean_end_probability_per_step": mean_end,
            "feature_after_norm_median": float(torch.median(features))}


# --------------------------------------------------------------------------- the workload


def make_requests(args: argparse.Namespace, seed: int) -> list[RolloutRequest]:
    """``P`` requests of ``G`` samples each: random ids, lengths between 7/8 of ``--prompt`` and ``--prompt``."""
    from torchlike.adapters.rollout import RolloutRequest, request_seed

    rng = np.random.default_rng(seed)
    lengths = rng.integers(args.prompt - args.prompt // 8, args.prompt + 1, size=args.prompts)
    return [RolloutRequest(tuple(rng.integers(3, args.vocab, size=length).tolist()), args.new_tokens,
                           args.generations, request_seed(seed, index)) for index, length in enumerate(lengths)]


def useful_length(tokens: Sequence[int], end_tokens: Sequence[int]) -> int:
    """Tokens up to and including the first end token (all of them without one)."""
    for index, token in enumerate(tokens):
        if token in end_tokens:
            return index + 1
    return len(tokens)


def length_summary(lengths: Sequence[int], limit: int) -> dict[str, Any]:
    """The completions' length distribution: quartiles, how many reach the limit, a histogram in eighths of it."""
    values = np.asarray(lengths)
    edges = np.linspace(0, limit, 9)
    histogram = np.histogram(values, bins=edges)[0]
    return {"completions": int(values.size), "useful_tokens": int(values.sum()), "mean": float(values.mean()),
            "p25": float(np.percentile(values, 25)), "median": float(np.median(values)),
            "p75": float(np.percentile(values, 75)), "p90": float(np.percentile(values, 90)),
            "max": int(values.max()), "reached_limit": int((values >= limit).sum()),
            "histogram_eighths_of_limit": histogram.tolist()}


def describe_lengths(summary: dict[str, Any]) -> str:
    return (f"lengths median {summary['median']:.0f}, p25 {summary['p25']:.0f}, p75 {summary['p75']:.0f}, "
            f"p90 {summary['p90']:.0f}, max {summary['max']}, {summary['reached_limit']}/{summary['completions']} "
            f"reach the limit; histogram by eighths of the limit {summary['histogram_eighths_of_limit']}")


def rate_record(seconds: float, lengths: list[int], limit: int) -> dict[str, Any]:
    lengths_info = length_summary(lengths, limit)
    return {"seconds": seconds, "tokens_per_s": lengths_info["useful_tokens"] / seconds, "lengths": lengths_info}


# --------------------------------------------------------------------------- torchlike engines


def engine_lengths(engine: RolloutEngine, requests: list[RolloutRequest], settings: SamplingSettings) -> list[int]:
    return [len(tokens) for output in engine.generate(requests, settings) for tokens in output.token_ids]


def trace_count() -> int:
    from torchlike.adapters.runtime.tracing import TRACE_COUNTS

    return TRACE_COUNTS["generate"]


def timed_round(engine: Any, requests: list[RolloutRequest], settings: SamplingSettings,
                limit: int, full_length: bool = True) -> dict[str, Any]:
    """One timed long-tailed call (the paged engine's programs timed, see :func:`timed_programs`), then, with
    ``full_length``, one timed full-length call (the same engine with no end token)."""
    traces = trace_count()
    timings: dict[str, list[float]] = {}
    with timed_programs(timings):
        seconds, lengths = timed(lambda: engine_lengths(engine, requests, settings))
    record = {**rate_record(seconds, lengths, limit), "stats": engine_stats(engine),
              "compiles_in_timed_call": trace_count() - traces}
    if timings:
        record["profile"] = where_the_time_goes(engine, seconds, timings)
    if not full_length:
        return record
    end_tokens, engine.eos_token_ids = engine.eos_token_ids, []
    traces = trace_count()
    try:
        seconds, lengths = timed(lambda: engine_lengths(engine, requests, settings))
    finally:
        engine.eos_token_ids = end_tokens
    record["full_length"] = {**rate_record(seconds, lengths, limit), "stats": engine_stats(engine),
                             "compiles_in_timed_call": trace_count() - traces}
    record["long_tail_vs_full_length"] = record["tokens_per_s"] / record["full_length"]["tokens_per_s"]
    return record


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median long-tailed tokens/s (the lower middle one of an even count), with every round's
    tokens/s and long-tailed / full-length ratio listed and that ratio's median (when the rounds ran both)."""
    ordered = sorted(rounds, key=lambda record: record["tokens_per_s"])
    record = dict(ordered[(len(ordered) - 1) // 2])
    record["rounds_tokens_per_s"] = [entry["tokens_per_s"] for entry in rounds]
    if "full_length" not in record:
        return record
    record["rounds_full_length_tokens_per_s"] = [entry["full_length"]["tokens_per_s"] for entry in rounds]
    record["rounds_long_tail_vs_full_length"] = [entry["long_tail_vs_full_length"] for entry in rounds]
    record["long_tail_vs_full_length"] = float(np.median(record["rounds_long_tail_vs_full_length"]))
    return record


def engine_stats(engine: Any) -> dict[str, Any] | None:
    """The paged engine's :class:`EngineStats` of its last call, less the per-step lists; None for the static one."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return None
    return {key: value for key, value in vars(stats).items() if not isinstance(value, list)}


@contextlib.contextmanager
def timed_programs(timings: dict[str, list[float]]) -> Iterator[None]:
    """Times each call of the paged engine's prefill, admit and decode programs into ``timings`` (waiting for their
    results, which the engine reads on the host right after the admit and decode programs anyway; the static
    engine runs none of them)."""
    import jax

    from torchlike.adapters.rollout import paged

    originals = {name: getattr(paged, f"_{name}") for name in ("prefill", "admit", "decode")}

    def wrap(name: str, program: Callable) -> Callable:
        def call(*arguments: Any) -> Any:
            start = time.perf_counter()
            result = jax.block_until_ready(program(*arguments))
            timings.setdefault(name, []).append(time.perf_counter() - start)
            return result
        return call

    for name, program in originals.items():
        setattr(paged, f"_{name}", wrap(name, program))
    try:
        yield
    finally:
        for name, program in originals.items():
            setattr(paged, f"_{name}", program)


def where_the_time_goes(engine: Any, seconds: float, timings: dict[str, list[float]]) -> dict[str, Any]:
    """The paged engine's call in parts: each program's calls and seconds, the rest (scheduler, transfers) on the
    host, and how full its decode steps were."""
    programs = {name: {"calls": len(values), "seconds": sum(values), "mean_ms": 1000 * sum(values) / len(values)}
                for name, values in timings.items()}
    stats = engine.stats
    return {"seconds": seconds, "programs": programs,
            "host_seconds": seconds - sum(entry["seconds"] for entry in programs.values()),
            "decode_steps": stats.decode_steps, "slot_steps": stats.slot_steps, "row_steps": stats.row_steps,
            "mean_live_slots_per_step": stats.slot_steps / stats.decode_steps,
            "live_over_program_rows": stats.slot_steps / stats.row_steps, "prefills": stats.prefills,
            "prefill_programs": stats.prefill_programs}


# --------------------------------------------------------------------------- transformers


def padded_batch(requests: list[RolloutRequest], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Every completion as a row: each prompt repeated ``num_samples`` times, left-padded to the longest."""
    prompts = [request.prompt_ids for request in requests for _ in range(request.num_samples)]
    width = max(len(prompt) for prompt in prompts)
    ids = np.full((len(prompts), width), pad_token_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def run_transformers_generate(reference: Any, requests: list[RolloutRequest], seed: int) -> list[int]:
    import torch

    ids, mask = padded_batch(requests, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = reference.generate(torch.from_numpy(ids).to(reference.device),
                                 attention_mask=torch.from_numpy(mask).to(reference.device), pad_token_id=0,
                                 eos_token_id=END_TOKEN, max_new_tokens=requests[0].max_new_tokens, **SAMPLING)
    return [useful_length(row, [END_TOKEN]) for row in out[:, ids.shape[1]:].tolist()]


def run_generate_batch(reference: Any, requests: list[RolloutRequest], seed: int) -> list[int]:
    """As TRL's ``use_transformers_paged``: the prompts repeated ``num_generations`` times, one ``generate_batch``,
    without its own warm-up (dummy batches at the largest sizes, for CUDA graphs and compilation) that TRL's calls
    also run."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    inputs = [list(request.prompt_ids) for request in requests for _ in range(request.num_samples)]
    config = GenerationConfig(max_new_tokens=requests[0].max_new_tokens, pad_token_id=0, eos_token_id=END_TOKEN,
                              disable_compile=True, **SAMPLING)
    torch.manual_seed(seed)
    with torch.no_grad():
        outputs = reference.generate_batch(inputs, generation_config=config, progress_bar=False, warmup=False,
                                           continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=0.5))
    failed = [output.error for output in outputs.values() if output.error]
    if len(outputs) != len(inputs) or failed:
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} completions; errors: "
                           f"{failed[:3]}")
    return [useful_length(output.generated_tokens, [END_TOKEN]) for output in outputs.values()]


def run_transformers_side(run: Callable, reference: Any, requests: list[RolloutRequest], seed: int,
                          limit: int) -> dict[str, Any]:
    """A small untimed warm-up (two prompts, 8 tokens), then the timed call; an exception becomes ``error``."""
    from dataclasses import replace

    try:
        small = [replace(request, max_new_tokens=8) for request in requests[:2]]
        first_s, _ = timed(lambda: run(reference, small, seed + 1))
        seconds, lengths = timed(lambda: run(reference, requests, seed))
    except Exception:  # noqa: BLE001  (recorded in the JSON, the other sides go on)
        return {"error": traceback.format_exc(limit=4)}
    return {"warmup_s": first_s, **rate_record(seconds, lengths, limit)}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="workload and model shape; the options below override it")
    for name in ("prompts", "generations", "new-tokens", "prompt", "layers", "hidden", "intermediate", "heads",
                 "kv-heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="default: the preset's")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the preset's")
    parser.add_argument("--max-num-seqs", type=int, help="paged engine slots (default: every completion)")
    parser.add_argument("--page-size", type=int, help="paged engine tokens per page (default: the engine's)")
    parser.add_argument("--decode-steps", type=int,
                        help="paged engine tokens per decode call (default: the engine's)")
    parser.add_argument("--kv-cache-tokens", type=int, help="paged engine pool (default: the engine's sizing)")
    parser.add_argument("--repeats", type=int, help="timed rounds of the torchlike engines, taking turns; each "
                        "engine reports its median round (default: the preset's)")
    parser.add_argument("--no-full-length", action="store_true", help="leave out the engines' full-length calls "
                        "(and the long-tailed / full-length ratios): halves a run at the issue's full workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated sides to leave out: paged, static, "
                        "transformers_generate, transformers_generate_batch")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    fill_from_preset(args, PRESETS[args.preset])
    if args.max_num_seqs is None:
        args.max_num_seqs = args.prompts * args.generations
    return args


def ratio(results: dict[str, Any], side: str, other: str) -> float | None:
    mine, theirs = results.get(side, {}).get("tokens_per_s"), results.get(other, {}).get("tokens_per_s")
    return mine / theirs if mine and theirs else None


def kv_memory(results: dict[str, Any], requests: list[RolloutRequest],
              args: argparse.Namespace) -> dict[str, Any] | None:
    """Paged peak pages x page size x bytes per token against the static batch's whole cache."""
    from torchlike.adapters.rollout.sampling import cache_size

    stats = results.get("paged", {}).get("stats")
    if not stats:
        return None
    per_token = stats["kv_bytes_per_token"]
    rows = sum(request.num_samples for request in requests)
    widest = max(len(request.prompt_ids) for request in requests)
    static_tokens = rows * cache_size(widest, args.new_tokens)
    paged_peak = stats["peak_pages_in_use"] * stats["page_size"]
    return {"kv_bytes_per_token": per_token, "paged_peak_bytes": paged_peak * per_token,
            "paged_pool_bytes": stats["pages"] * stats["page_size"] * per_token,
            "static_cache_bytes": static_tokens * per_token, "paged_peak_over_static": paged_peak / static_tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}

    import jax
    import torch
    import transformers

    import torchlike
    from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, StaticEngine
    from torchlike.adapters.rollout.sampling_settings import SamplingSettings

    settings = SamplingSettings(**SAMPLING)
    requests = make_requests(args, args.seed)
    completions = args.prompts * args.generations
    torch_device = "cuda" if args.preset == "gpu" and torch.cuda.is_available() else "cpu"
    if args.preset == "gpu" and torch_device == "cpu":
        print("WARNING: --preset gpu but torch has no CUDA: transformers runs on the CPU; compare with care.")
    print(f"workload: {args.prompts} prompts x {args.generations} generations = {completions} completions, prompts "
          f"{args.prompt - args.prompt // 8}-{args.prompt} tokens, up to {args.new_tokens} new tokens; model: "
          f"{args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, {args.dtype} (preset {args.preset}); "
          f"jax on {jax.default_backend()}, torch on {torch_device} ({torch.get_num_threads()} CPU threads)",
          flush=True)
    if args.preset.startswith("cpu"):
        print("CPU preset: the issue's workload scaled down (64 prompts x 8 generations, 512 new tokens, vocabulary "
              "151936 take hours on 2 cores); --preset gpu runs it", flush=True)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        calibration = build_checkpoint(Path(folder), args)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
        reference = reference.to(torch_device).eval()
        model = torchlike.AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype)
    print(f"checkpoint built and loaded by both libraries in {time.perf_counter() - start:.1f} s", flush=True)

    chosen = {"page_size": args.page_size, "decode_steps": args.decode_steps}
    paged_config = PagedEngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                                     **{name: value for name, value in chosen.items() if value is not None})
    engines = {
        "paged": lambda: PagedEngine(model.module, paged_config, eos_token_ids=[END_TOKEN]),
        "static": lambda: StaticEngine(model.module, eos_token_ids=[END_TOKEN]),
    }
    built = {name: build() for name, build in engines.items() if name not in skipped}
    first_call_s = {}
    for name, engine in built.items():  # compiles every program the timed calls run
        first_call_s[name], _ = timed(lambda engine=engine: engine_lengths(engine, requests, settings))
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in built}
    for round_index in range(args.repeats):  # the engines take turns, so a slow spell of the machine hits both
        for name, engine in built.items():
            record = timed_round(engine, requests, settings, args.new_tokens, full_length=not args.no_full_length)
            rounds[name].append(record)
            full = record.get("full_length")
            full_text = (f"full length {full['tokens_per_s']:.1f} tokens/s in {full['seconds']:.1f} s; " if full
                         else "")
            print(f"{name} (round {round_index + 1}/{args.repeats}): {record['tokens_per_s']:.1f} useful tokens/s in "
                  f"{record['seconds']:.1f} s; {full_text}{describe_lengths(record['lengths'])}", flush=True)
    for name, engine in built.items():
        results[name] = {"first_call_s": first_call_s[name], **median_round(rounds[name])}
        engine.close()
    sides = {"transformers_generate": run_transformers_generate, "transformers_generate_batch": run_generate_batch}
    for name, run in sides.items():
        if name in skipped:
            continue
        results[name] = run_transformers_side(run, reference, requests, args.seed, args.new_tokens)
        if "error" in results[name]:
            print(f"{name} FAILED:\n{results[name]['error']}", flush=True)
        else:
            print(f"{name}: {results[name]['tokens_per_s']:.1f} useful tokens/s in {results[name]['seconds']:.1f} s; "
                  f"{describe_lengths(results[name]['lengths'])}", flush=True)

    ratios = {
        # The median of the rounds' ratios (each round runs both engines back to back).
        "paged_vs_static": (float(np.median([ours["tokens_per_s"] / theirs["tokens_per_s"] for ours, theirs
                                             in zip(rounds["paged"], rounds["static"], strict=True)]))
                            if "paged" in rounds and "static" in rounds else None),
        "paged_vs_transformers_generate_batch": ratio(results, "paged", "transformers_generate_batch"),
        "paged_vs_transformers_generate": ratio(results, "paged", "transformers_generate"),
        "paged_long_tail_vs_full_length": results.get("paged", {}).get("long_tail_vs_full_length"),
        "static_long_tail_vs_full_length": results.get("static", {}).get("long_tail_vs_full_length"),
        "paged_vs_static_full_length": ratio({side: record.get("full_length", {}) for side, record in results.items()},
                                             "paged", "static"),
    }
    memory = kv_memory(results, requests, args)
    report = {
        "settings": {key: value for key, value in vars(args).items() if key != "output"} | {"sampling": SAMPLING},
        "paged_engine_config": dataclasses.asdict(paged_config),
        "machine": machine_info() | {"jax_backend": jax.default_backend(), "torch_threads": torch.get_num_threads(),
                                   "torch_device": torch_device},
        "calibration": calibration, "results": results, "ratios": ratios, "goals": GOALS, "kv_memory": memory,
    }
    print_summary(report)
    print(f"written to {write_json(args.output, report)}")
    return report


def print_summary(report: dict[str, Any]) -> None:
    print("\nratios (useful tokens/s):")
    for name, value in report["ratios"].items():
        goal = report["goals"].get(name)
        shown = "-" if value is None else f"{value:.2f}x"
        verdict = ("" if goal is None or value is None
                   else f" (goal >= {goal:g}x: {'met' if value >= goal else 'MISSED'})")
        print(f"  {name}: {shown}{verdict}")
    memory = report["kv_memory"]
    if memory:
        print(f"KV cache: paged peak {memory['paged_peak_bytes'] / 2**20:.1f} MiB (pool "
              f"{memory['paged_pool_bytes'] / 2**20:.1f} MiB) vs static batch "
              f"{memory['static_cache_bytes'] / 2**20:.1f} MiB: {memory['paged_peak_over_static']:.2f}x "
              f"({memory['kv_bytes_per_token']} bytes per token)")
    profile = report["results"].get("paged", {}).get("profile")
    if profile:
        programs = ", ".join(f"{name} {entry['calls']} calls {entry['seconds']:.2f} s ({entry['mean_ms']:.1f} ms each)"
                             for name, entry in profile["programs"].items())
        print(f"paged engine, where the time goes ({profile['seconds']:.2f} s): {programs}; host (scheduler, "
              f"transfers) {profile['host_seconds']:.2f} s; {profile['decode_steps']} decode steps, "
              f"{profile['mean_live_slots_per_step']:.1f} live slots per step, "
              f"{100 * profile['live_over_program_rows']:.0f}% of program rows live")


if __name__ == "__main__":
    main()
