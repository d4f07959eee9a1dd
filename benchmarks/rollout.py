"""Rollout throughput on a GRPO-shaped workload: torchlike's paged engine against its static sampler and transformers.

What it measures
----------------
A random decoder (``--family``: Qwen2 by default; built with ``torchlike.testing`` and saved to a temporary
directory) is loaded by both libraries. ``P`` prompts of random ids (lengths drawn between 7/8 of ``--prompt`` and
``--prompt``) each get ``G`` sampled completions (TRL's ``num_generations``) of up to ``N`` new tokens, with GRPO's
default sampling (temperature 1.0, top-p 1.0, top-k 0).

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
    ``--max-num-seqs`` slots (default: every completion), pages of ``--page-size`` tokens, decode attention
    ``--attention`` (default: the backend's, see below; the one that ran is printed).
``static``
    ``StaticEngine``: every completion is a row of one left-padded batch decoded until its longest row ends (the
    sampler torchlike used before the paged engine).
``transformers_generate``
    ``model.generate`` on the same left-padded batch (each prompt repeated ``G`` times), ``do_sample=True``.
``transformers_generate_batch``
    transformers' continuous batching ``model.generate_batch`` on the repeated prompts, with TRL's settings for
    ``use_transformers_paged`` (``max_memory_percent=0.5``); a failure is recorded and the run goes on.

The transformers sides are skipped on a TPU (torch has none). ``--skip`` leaves sides out.

Warm-up and rounds: each torchlike engine first runs untimed on exactly the requests and settings of the timed
rounds, long-tailed and full-length (below), so every program the rounds run is compiled there (``first_call_s``,
``first_call_full_length_s``); each transformers side runs a small untimed warm-up (two prompts, 8 tokens). Then
``--repeats`` rounds each run paged, static, ``transformers_generate`` and ``transformers_generate_batch`` in turn
(this machine's speed drifts by up to 1.5x between minutes, and a slow spell then hits every side). The programs
traced during the timed calls are counted (``traces_during_timed_rounds``): anything but 0 means a timing includes
compilation, and a WARNING is printed. Each side reports *useful* tokens/s: the tokens of every completion up to and
including its end token, summed, over the wall seconds of the call (its median round; every round is listed). In
each round the engines also run the *full-length* variant (no end token, every completion runs ``N`` tokens) and
report the median of their tokens/s ratios long-tailed / full-length. The paged-engine ratios (``paged_vs_static``,
``paged_vs_transformers_generate_batch``, ``paged_vs_transformers_generate``) are the medians of the rounds' ratios.

The paged engine's timed long-tailed call also times its three programs (prefill, admit, decode) and counts its
decode steps and how many of their rows were live, to show where its time goes, and from those estimates the share
of the device's memory bandwidth its decode reached (:func:`decode_bandwidth`: weights plus the live tokens' keys and
values read per decode step, over the decode programs' seconds, against the peak of a known device; on an unknown
one, a CPU included, the achieved bytes/s alone). ``--async-scheduling on|off`` sets the paged engine's
``PagedEngineConfig.async_scheduling`` (default: the backend's; the one that ran is printed, with the decode calls
dispatched ahead and the row steps they ran for completions that had ended); with it on, the decode calls are not
timed one by one (waiting for each would undo the overlap), so the profile's host share holds them.

KV memory, as allocated: the paged engine's peak pages in use x page size x bytes per token (the live tokens);
the pool it allocated (every page, the trash page included: what the device holds for the KV cache); and the dense
view the ``"gather"`` attention builds in each decode call (rows x (bucketed longest row + decode steps) columns x
bytes per token, for the call where that is largest; 0 with a paged kernel, which reads the pages in place; prompts
longer than ``max_num_batched_tokens``, prefilled in chunks through such a view, do not occur in the presets). All
against the static batch's cache (rows x ``cache_size(prompt, N)`` x bytes per token).

``--stream-batches B`` (the ``stream`` preset: 4) adds a *stream*: ``B`` consecutive generation batches (the same
shape, other prompts and seeds) submitted together to one stream of the paged engine
(:meth:`PagedEngine.open_stream`), once per round (warmed up once beforehand): the slots one batch's completions free
take the next batch's (in-flight batching), so only the last batch's long tail runs alone. It reports useful
tokens/s over the ``B`` batches and that over the engine's full-length tokens/s of the same round.

Presets
-------
``cpu`` (the default)
    scaled down to finish in about 10 minutes on 2 cores: 8 prompts x 4 generations, 128 new tokens, Qwen2 of hidden
    896, 4 layers, vocabulary 32000.
``cpu-refill``
    16 prompts x 8, 256 new tokens, 64 slots: more completions than slots, so the paged engine refills its slots as
    completions end (the regime of the issue's workload, which ``cpu`` never reaches); about 10 minutes on 2 cores.
``deep``
    ``cpu``'s workload on a deep, narrow model (24 layers, hidden 256, vocabulary 8192), where the keys and values
    a decode step reads are comparable to the weights it reads, so attention's traffic (and the ``"gather"`` view's
    copy) matters; a Mistral checkpoint (below).
``gpu``
    the issue's workload: 64 prompts x 8 generations, 512 new tokens, Qwen2 of hidden 896, 4 layers, vocabulary
    151936 (the Qwen2.5-0.5B width); transformers on CUDA when torch has it.
``tpu``
    ``gpu``'s workload on a Mistral checkpoint (torchlike's native decoder), the backend's paged kernel by default;
    the transformers sides are skipped on a TPU.
``stream``
    four consecutive batches of 4 prompts x 4, 64 new tokens, on ``cpu``'s model (paged engine only: the static and
    transformers sides are skipped unless ``--skip`` says otherwise); cheap on the CPU.

``--family mistral`` builds a Mistral checkpoint (the Llama layout: Qwen2's sizes without its q/k/v biases, no
sliding window), which torchlike runs on its native decoder; Qwen2 runs on Tunix's decoder. The paged kernels serve
both (the attention that ran is printed). ``--attention pallas_gpu`` or ``pallas_tpu`` off its own backend runs in
Pallas' interpreter (slow; for checking, not timing).

Goals (from the rollout issue): paged tokens/s >= 2x the static sampler and >= 1.5x transformers ``generate_batch``;
paged vs ``transformers.generate`` is reported without a goal; the paged engine's long-tailed tokens/s >= 0.6x its
full-length tokens/s; a stream of batches (in-flight batching) >= 0.6x the full-length tokens/s.

Run (from the repository root)::

    nice -n 10 .venv/bin/python benchmarks/rollout.py                        # CPU preset: 8 x 4, 128 new tokens
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset cpu-refill   # 16 x 8, 256 new tokens, 64 slots
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset deep         # 24 layers
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset stream       # four batches on one stream
    .venv/bin/python benchmarks/rollout.py --preset gpu                      # 64 x 8, 512 new tokens (the issue's)
    .venv/bin/python benchmarks/rollout.py --preset gpu --family mistral     # the same on the native decoder
    .venv/bin/python benchmarks/rollout.py --preset tpu                      # the issue's workload on a TPU
    .venv/bin/python benchmarks/rollout.py --preset deep --family mistral --attention gather   # against the kernel
    # the gpu preset's workload on the CPU, paged (64 slots) against static and generate_batch (about an hour):
    nice -n 10 .venv/bin/python benchmarks/rollout.py --preset gpu --max-num-seqs 64 --repeats 1 --no-full-length \
        --skip transformers_generate

``python -m benchmarks --preset gpu`` (or ``tpu``) runs this with one round among the device's checks.
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
    tiny_decoder_config,
    write_json,
)

if TYPE_CHECKING:
    from torchlike.adapters.rollout import RolloutEngine, RolloutRequest
    from torchlike.adapters.rollout.sampling_settings import SamplingSettings

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "rollout.json"
ISSUE_WORKLOAD = dict(prompts=64, generations=8, new_tokens=512, prompt=128, layers=4, hidden=896, intermediate=4864,
                      heads=14, kv_heads=2, vocab=151936, dtype="bfloat16", repeats=3)
TRANSFORMERS_SIDES = ("transformers_generate", "transformers_generate_batch")
PRESETS: dict[str, dict[str, Any]] = {
    # Scaled down for 2 cores: the 151936-row lm_head is most of a decode step's weights, and the transformers
    # sides take most of the run.
    "cpu": dict(prompts=8, generations=4, new_tokens=128, prompt=128, layers=4, hidden=896, intermediate=4864,
                heads=14, kv_heads=2, vocab=32000, dtype="bfloat16", repeats=1),
    "gpu": ISSUE_WORKLOAD,
    "tpu": ISSUE_WORKLOAD | dict(family="mistral"),
    # More completions than slots, so the paged engine refills its slots as completions end (the regime of the
    # issue's workload, which the "cpu" preset never reaches): about 10 minutes on 2 cores.
    "cpu-refill": dict(prompts=16, generations=8, new_tokens=256, prompt=128, layers=4, hidden=896, intermediate=4864,
                       heads=14, kv_heads=2, vocab=32000, dtype="bfloat16", max_num_seqs=64, repeats=3),
    # Narrow enough that 24 layers keep a round within minutes on 2 cores.
    "deep": dict(prompts=8, generations=4, new_tokens=128, prompt=128, layers=24, hidden=256, intermediate=512,
                 heads=4, kv_heads=2, vocab=8192, dtype="bfloat16", repeats=1, family="mistral"),
    "stream": dict(prompts=4, generations=4, new_tokens=64, prompt=64, layers=4, hidden=896, intermediate=4864,
                   heads=14, kv_heads=2, vocab=32000, dtype="bfloat16", repeats=1, stream_batches=4,
                   skip="static," + ",".join(TRANSFORMERS_SIDES)),
}
DEFAULTS = dict(family="qwen2", skip="", stream_batches=0)  # what a preset leaves unset
FAMILY_FIELDS = {"qwen2": {}, "mistral": {"sliding_window": None}}  # a Mistral attends to every token, as Qwen2 does
END_TOKEN = 2  # tiny_config's eos id; prompts draw ids from 3 up
END_FEATURE = 0  # the hidden dimension that carries the end-token feature
END_FEATURE_VALUE = 2.0  # its value in every embedding row (the other dimensions start at std 0.02)
GOALS = {"paged_vs_static": 2.0, "paged_vs_transformers_generate_batch": 1.5, "paged_long_tail_vs_full_length": 0.6,
         "paged_stream_vs_full_length": 0.6}
SAMPLING = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)  # TRL GRPOConfig's defaults
PEAK_MEMORY_BANDWIDTH: tuple[tuple[str, float, tuple[str, ...]], ...] = (
    ("H200", 4.8e12, ("h200",)),
    ("H100 SXM", 3.35e12, ("h100 80gb hbm3", "h100 sxm")),
    ("A100 80GB", 2.0e12, ("a100-sxm4-80gb", "a100 80gb")),
    ("TPU v5e", 8.2e11, ("tpu v5 lite", "tpu v5e")),
    ("TPU v5p", 2.76e12, ("tpu v5p", "tpu v5")),
    ("TPU v6e", 1.64e12, ("tpu v6 lite", "tpu v6e")),
)
"""``(device, peak memory bytes/s, pieces of JAX's lower-cased ``device_kind`` that name it)``; the first row with a
piece in the device kind is the device (TPU v5e's ``"TPU v5 lite"`` before v5p's ``"TPU v5"``)."""


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
    """Saves the random decoder of ``--family`` with its end-token feature (see the module docstring) to
    ``directory``; returns the calibration: the end token's ``lm_head`` weight and the per-step end probability aimed
    at."""
    import torch

    from torchlike.testing import random_model

    config = tiny_decoder_config(args.family, vars(args), 4096, tie_word_embeddings=False,
                                 **FAMILY_FIELDS[args.family])
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


@contextlib.contextmanager
def without_end_token(engine: RolloutEngine) -> Iterator[None]:
    """The engine with no end token while inside: every completion runs its ``max_new_tokens`` (full length)."""
    end_tokens, engine.eos_token_ids = engine.eos_token_ids, []
    try:
        yield
    finally:
        engine.eos_token_ids = end_tokens


def warm_up(engine: RolloutEngine, requests: list[RolloutRequest], settings: SamplingSettings,
            full_length: bool) -> dict[str, float]:
    """The untimed first calls on exactly the timed rounds' requests and settings, long-tailed and (with
    ``full_length``) full-length: the same calls take the same shapes, so these compile every program the rounds
    run. Returns their wall seconds."""
    first = {"first_call_s": timed(lambda: engine_lengths(engine, requests, settings))[0]}
    if full_length:
        with without_end_token(engine):
            first["first_call_full_length_s"] = timed(lambda: engine_lengths(engine, requests, settings))[0]
    return first


def timed_round(engine: Any, requests: list[RolloutRequest], settings: SamplingSettings, limit: int,
                full_length: bool = True, weight_bytes: int = 0) -> dict[str, Any]:
    """One timed long-tailed call (the paged engine's programs timed, see :func:`timed_programs`, and its KV
    allocation and decode bandwidth recorded), then, with ``full_length``, one timed full-length call (the same
    engine with no end token). ``weight_bytes``: the bytes a decode step reads of the weights
    (:func:`decode_weight_bytes`)."""
    traces = trace_count()
    timings: dict[str, list[float]] = {}
    decode_programs: list[Any] = []
    # Waiting for each decode call would undo async scheduling's overlap: its decode calls are not timed.
    with timed_programs(timings, decode_programs, time_decode=not getattr(engine, "async_scheduling", False)):
        seconds, lengths = timed(lambda: engine_lengths(engine, requests, settings))
    record = {**rate_record(seconds, lengths, limit), "stats": engine_stats(engine),
              "compiles_in_timed_call": trace_count() - traces}
    if timings:
        record["profile"] = where_the_time_goes(engine, seconds, timings)
        record["kv_allocation"] = kv_allocation(engine, decode_programs)
        stats = engine.stats
        record["decode_bandwidth"] = None if "decode" not in timings else decode_bandwidth(
            weight_bytes, stats.kv_bytes_per_token, stats.live_tokens_per_step, engine.config.decode_steps,
            sum(timings["decode"]), device_kind())
    if not full_length:
        return record
    traces = trace_count()
    with without_end_token(engine):
        seconds, lengths = timed(lambda: engine_lengths(engine, requests, settings))
    record["full_length"] = {**rate_record(seconds, lengths, limit), "stats": engine_stats(engine),
                             "compiles_in_timed_call": trace_count() - traces}
    record["long_tail_vs_full_length"] = record["tokens_per_s"] / record["full_length"]["tokens_per_s"]
    return record


def traces_in(record: dict[str, Any]) -> int:
    """Programs traced during a round's timed calls (long-tailed and full-length)."""
    return record["compiles_in_timed_call"] + record.get("full_length", {}).get("compiles_in_timed_call", 0)


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
def timed_programs(timings: dict[str, list[float]], decode_programs: list[Any],
                   time_decode: bool = True) -> Iterator[None]:
    """Times each call of the paged engine's prefill, admit and decode programs into ``timings`` (waiting for their
    results, which the engine reads on the host right after the admit and decode programs anyway; the static
    engine runs none of them), and appends each decode call's static settings (its ``_Programs``: attention, view
    width, steps) to ``decode_programs``. Without ``time_decode`` the decode calls are not waited for (nor timed):
    with async scheduling the engine dispatches one before reading the last."""
    import jax

    from torchlike.adapters.rollout import paged

    originals = {name: getattr(paged, f"_{name}") for name in ("prefill", "admit", "decode")}

    def wrap(name: str, program: Callable) -> Callable:
        def call(*arguments: Any) -> Any:
            if name == "decode":
                decode_programs.append(arguments[0])
                if not time_decode:
                    return program(*arguments)
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
    return {"seconds": seconds, "programs": programs, "decode_timed": "decode" in programs,
            "host_seconds": seconds - sum(entry["seconds"] for entry in programs.values()),
            "decode_steps": stats.decode_steps, "slot_steps": stats.slot_steps, "row_steps": stats.row_steps,
            "mean_live_slots_per_step": stats.slot_steps / stats.decode_steps,
            "live_over_program_rows": stats.slot_steps / stats.row_steps, "prefills": stats.prefills,
            "prefill_programs": stats.prefill_programs}


def kv_allocation(engine: Any, decode_programs: list[Any]) -> dict[str, Any]:
    """The paged engine's KV memory as allocated in its last call: the pool it holds (every page, the trash page
    included) and the largest dense view a decode call built (``"gather"``: each program row's tokens copied into
    ``view + steps`` columns, the view being the bucketed longest row; a paged kernel builds none). ``decode_programs``
    are the call's decode settings in call order (:func:`timed_programs`), one per ``stats.decode_rows`` entry."""
    stats = engine.stats
    per_token = stats.kv_bytes_per_token
    views = [(rows, programs.view + programs.steps if programs.attention == "gather" else 0)
             for (_, rows), programs in zip(stats.decode_rows, decode_programs, strict=True)]
    rows, columns = max(views, key=lambda view: view[0] * view[1], default=(0, 0))
    pool_bytes = sum(array.nbytes for entry in engine._pool.values() for array in entry.values())
    return {"attention": engine.kernel["attention"], "pool_pages": engine._pool_pages, "pool_bytes": pool_bytes,
            "decode_view_rows": rows, "decode_view_columns": columns, "decode_view_bytes": rows * columns * per_token}


# --------------------------------------------------------------------------- memory bandwidth


def device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def peak_memory_bandwidth(kind: str) -> tuple[str, float] | None:
    """``(device, peak bytes/s)`` of :data:`PEAK_MEMORY_BANDWIDTH`'s first row that names ``kind`` (JAX's
    ``device_kind``), None for a device not in the table."""
    lowered = kind.lower()
    for device, peak, pieces in PEAK_MEMORY_BANDWIDTH:
        if any(piece in lowered for piece in pieces):
            return device, peak
    return None


def decode_weight_bytes(module: Any) -> int:
    """The bytes of ``module``'s parameters a decode step reads: all of them but the input embedding table, of which
    a step reads only the fed tokens' rows (the benchmark's checkpoint is untied, so ``lm_head`` is a table of its own
    and counted)."""
    import jax
    from flax import nnx

    total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))
    return total - module.embedder.input_embedding.get_value().nbytes


def decode_bandwidth(weight_bytes: int, kv_bytes_per_token: int, live_tokens_per_call: Sequence[int],
                     steps_per_call: int, decode_seconds: float, kind: str) -> dict[str, Any]:
    """The paged engine's decode programs against the device's peak memory bandwidth.

    Approximation: a decode step reads every weight once and the keys and values of the live tokens once, so the
    bytes read are ``sum over decode calls c of steps_per_call * (weight_bytes + live_tokens[c] * kv_bytes_per_token)``
    and the achieved rate is that over ``decode_seconds`` (the decode programs' wall seconds). ``live_tokens[c]`` is
    counted after call ``c`` (``EngineStats.live_tokens_per_step``), each shared prompt page once; the activations,
    the sampling, the ``"gather"`` view's copy (which reads every row's tokens a second time) and the padding rows
    are not counted, so this is the useful traffic, a lower bound on what moved.

    Args:
        weight_bytes: parameters read per step (:func:`decode_weight_bytes`).
        kv_bytes_per_token: keys and values of one token over all layers.
        live_tokens_per_call: the live tokens after each decode call.
        steps_per_call: decode steps per call (``PagedEngineConfig.decode_steps``).
        decode_seconds: the decode programs' wall seconds, summed.
        kind: the device's ``device_kind`` (:func:`peak_memory_bandwidth`).

    Returns:
        ``bytes_read``, ``bytes_per_s``, ``device_kind``, and ``device``, ``peak_bytes_per_s`` and
        ``share_of_peak`` (None for a device not in :data:`PEAK_MEMORY_BANDWIDTH`).
    """
    bytes_read = sum(steps_per_call * (weight_bytes + live * kv_bytes_per_token) for live in live_tokens_per_call)
    rate = bytes_read / decode_seconds if decode_seconds > 0 else None
    device, peak = peak_memory_bandwidth(kind) or (None, None)
    return {"weight_bytes": weight_bytes, "bytes_read": bytes_read, "decode_seconds": decode_seconds,
            "bytes_per_s": rate, "device_kind": kind, "device": device, "peak_bytes_per_s": peak,
            "share_of_peak": rate / peak if rate is not None and peak else None}


# --------------------------------------------------------------------------- a stream of batches


def stream_batches(args: argparse.Namespace) -> list[list[RolloutRequest]]:
    """``--stream-batches`` batches of the workload's shape, each with prompts and seeds of its own."""
    return [make_requests(args, args.seed + 1 + index) for index in range(args.stream_batches)]


def stream_lengths(engine: RolloutEngine, batches: list[list[RolloutRequest]], settings: SamplingSettings) -> list[int]:
    """The batches submitted together to one stream of the engine (in-flight batching); every completion's useful
    length."""
    stream = engine.open_stream(settings)
    try:
        tickets = [stream.submit(batch) for batch in batches]
        return [len(tokens) for ticket in tickets for output in ticket.result() for tokens in output.token_ids]
    finally:
        stream.close()


def timed_stream(engine: RolloutEngine, batches: list[list[RolloutRequest]], settings: SamplingSettings,
                 limit: int) -> dict[str, Any]:
    traces = trace_count()
    seconds, lengths = timed(lambda: stream_lengths(engine, batches, settings))
    return {**rate_record(seconds, lengths, limit), "batches": len(batches),
            "compiles_in_timed_call": trace_count() - traces}


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


def warm_up_transformers(run: Callable, reference: Any, requests: list[RolloutRequest], seed: int) -> float:
    """A small untimed call (two prompts, 8 new tokens) before the rounds; returns its wall seconds."""
    small = [dataclasses.replace(request, max_new_tokens=8) for request in requests[:2]]
    return timed(lambda: run(reference, small, seed + 1))[0]


TRANSFORMERS_RUNS = {"transformers_generate": run_transformers_generate,
                     "transformers_generate_batch": run_generate_batch}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from torchlike.adapters.model.paged_attention import ATTENTION_KINDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="workload and model shape (see the module docstring); the options below override it")
    for name in ("prompts", "generations", "new-tokens", "prompt", "layers", "hidden", "intermediate", "heads",
                 "kv-heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="default: the preset's")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the preset's")
    parser.add_argument("--family", choices=sorted(FAMILY_FIELDS),
                        help="the checkpoint's family (default: the preset's, else qwen2): mistral runs on "
                             "torchlike's native decoder, qwen2 on Tunix's")
    parser.add_argument("--max-num-seqs", type=int, help="paged engine slots (default: every completion)")
    parser.add_argument("--page-size", type=int, help="paged engine tokens per page (default: the engine's)")
    parser.add_argument("--decode-steps", type=int,
                        help="paged engine tokens per decode call (default: the engine's)")
    parser.add_argument("--kv-cache-tokens", type=int, help="paged engine pool (default: the engine's sizing)")
    parser.add_argument("--async-scheduling", choices=("on", "off"),
                        help="paged engine: dispatch each decode call before reading the last one's tokens "
                             "(default: the backend's, see PagedEngineConfig.async_scheduling); with it on, the "
                             "decode calls are not timed one by one")
    parser.add_argument("--attention", choices=ATTENTION_KINDS,
                        help="paged engine decode attention (default: the backend's own: a GPU's or TPU's paged "
                             "kernel where the decoder allows it, else gather); a kernel off its backend runs "
                             "interpreted (slow)")
    parser.add_argument("--repeats", type=int, help="timed rounds, each running every side in turn; each side "
                        "reports its median round (default: the preset's)")
    parser.add_argument("--no-full-length", action="store_true", help="leave out the engines' full-length calls "
                        "(and the long-tailed / full-length ratios): halves a run at the issue's full workload")
    parser.add_argument("--stream-batches", type=int, help="consecutive batches run through the paged engine once "
                        "per round (default: the preset's, 0 but for the stream preset's 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", help="comma-separated sides to leave out: paged, static, transformers_generate, "
                        "transformers_generate_batch (default: the preset's, none but for the stream preset's)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    fill_from_preset(args, PRESETS[args.preset])
    fill_from_preset(args, DEFAULTS)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.prompts * args.generations
    return args


def ratio(results: dict[str, Any], side: str, other: str) -> float | None:
    mine, theirs = results.get(side, {}).get("tokens_per_s"), results.get(other, {}).get("tokens_per_s")
    return mine / theirs if mine and theirs else None


def median_ratio(rounds: dict[str, list[dict[str, Any]]], side: str, other: str) -> float | None:
    """The median over rounds of ``side``'s tokens/s over ``other``'s in the same round."""
    if side not in rounds or other not in rounds:
        return None
    return float(np.median([ours["tokens_per_s"] / theirs["tokens_per_s"]
                            for ours, theirs in zip(rounds[side], rounds[other], strict=True)]))


def kv_memory(results: dict[str, Any], requests: list[RolloutRequest],
              args: argparse.Namespace) -> dict[str, Any] | None:
    """The paged engine's KV memory (peak pages in use, the pool allocated, the largest decode view) against the
    static batch's whole cache."""
    from torchlike.adapters.rollout.sampling import cache_size

    paged = results.get("paged", {})
    stats, allocation = paged.get("stats"), paged.get("kv_allocation")
    if not stats or not allocation:
        return None
    per_token = stats["kv_bytes_per_token"]
    rows = sum(request.num_samples for request in requests)
    widest = max(len(request.prompt_ids) for request in requests)
    static_bytes = rows * cache_size(widest, args.new_tokens) * per_token
    peak_bytes = stats["peak_pages_in_use"] * stats["page_size"] * per_token
    allocated = allocation["pool_bytes"] + allocation["decode_view_bytes"]
    return {"kv_bytes_per_token": per_token, "paged_peak_bytes": peak_bytes,
            "paged_pool_bytes": stats["pages"] * stats["page_size"] * per_token,
            "static_cache_bytes": static_bytes, "paged_peak_over_static": peak_bytes / static_bytes,
            "attention": allocation["attention"], "paged_pool_allocated_pages": allocation["pool_pages"],
            "paged_pool_allocated_bytes": allocation["pool_bytes"],
            "paged_decode_view_rows": allocation["decode_view_rows"],
            "paged_decode_view_columns": allocation["decode_view_columns"],
            "paged_decode_view_bytes": allocation["decode_view_bytes"], "paged_allocated_bytes": allocated,
            "paged_allocated_over_static": allocated / static_bytes}


def describe_attention(engine: Any, asked: str | None) -> str:
    """Which decode attention the paged engine runs, and why where the backend's default was not taken."""
    from torchlike.adapters.model import decoder_contract, paged_attention

    attention = engine.kernel["attention"]
    text = f"paged engine attention: {attention}"
    if attention != "gather" and engine.kernel["interpret"]:
        text += " (in Pallas' interpreter, off its own backend: slow, for checking, not timing)"
    default = paged_attention.default_attention()
    if asked is None and attention != default:
        text += (f" (the backend's {default} cannot serve this decoder: "
                 f"{decoder_contract.paged_kernel_refusal(engine.module)})")
    return text


def describe_round(name: str, round_index: int, repeats: int, record: dict[str, Any]) -> str:
    full = record.get("full_length")
    full_text = f"full length {full['tokens_per_s']:.1f} tokens/s in {full['seconds']:.1f} s; " if full else ""
    return (f"{name} (round {round_index + 1}/{repeats}): {record['tokens_per_s']:.1f} useful tokens/s in "
            f"{record['seconds']:.1f} s; {full_text}{describe_lengths(record['lengths'])}")


def warn_traces(name: str, traces: int) -> None:
    if traces:
        print(f"WARNING: {name} traced {traces} program(s) during its timed calls: the untimed first call did not "
              "compile every shape, so those timings include compilation.", flush=True)


STREAM_NOTE = ("the batches are submitted together to one stream of the paged engine: a batch's freed slots take "
               "the next batch's completions (in-flight batching)")


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
    backend = jax.default_backend()
    on_device = args.preset in ("gpu", "tpu")
    torch_device = "cuda" if on_device and torch.cuda.is_available() else "cpu"
    if on_device and torch_device == "cpu" and backend != "tpu":
        print(f"WARNING: --preset {args.preset} but torch has no CUDA: transformers runs on the CPU; compare with "
              "care.")
    print(f"workload: {args.prompts} prompts x {args.generations} generations = {completions} completions, prompts "
          f"{args.prompt - args.prompt // 8}-{args.prompt} tokens, up to {args.new_tokens} new tokens; model: "
          f"{args.family}, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, {args.dtype} (preset "
          f"{args.preset}); jax on {backend} ({device_kind()}), torch on {torch_device} ({torch.get_num_threads()} "
          "CPU threads)", flush=True)
    if args.preset.startswith("cpu"):
        print("CPU preset: the issue's workload scaled down (64 prompts x 8 generations, 512 new tokens, vocabulary "
              "151936 take hours on 2 cores); --preset gpu runs it", flush=True)
    results: dict[str, Any] = {}
    if backend == "tpu":
        for name in TRANSFORMERS_SIDES:
            if name not in skipped:
                results[name] = {"skipped": "torch has no TPU backend"}
                skipped.add(name)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        calibration = build_checkpoint(Path(folder), args)
        reference = None
        if not set(TRANSFORMERS_SIDES) <= skipped:
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
            reference = reference.to(torch_device).eval()
        model = torchlike.AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype)
    print(f"checkpoint built and loaded in {time.perf_counter() - start:.1f} s", flush=True)

    chosen = {"page_size": args.page_size, "decode_steps": args.decode_steps}
    paged_config = PagedEngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                                     attention=args.attention,
                                     async_scheduling=None if args.async_scheduling is None
                                     else args.async_scheduling == "on",
                                     **{name: value for name, value in chosen.items() if value is not None})
    built: dict[str, Any] = {}
    if "paged" not in skipped:
        built["paged"] = PagedEngine(model.module, paged_config, eos_token_ids=[END_TOKEN])
        print(f"{describe_attention(built['paged'], args.attention)}; async scheduling "
              f"{'on' if built['paged'].async_scheduling else 'off'}", flush=True)
    if "static" not in skipped:
        built["static"] = StaticEngine(model.module, eos_token_ids=[END_TOKEN])
    full_length = not args.no_full_length
    first_calls = {name: warm_up(engine, requests, settings, full_length) for name, engine in built.items()}
    batches = stream_batches(args) if "paged" in built else []
    stream_first_s = timed(lambda: stream_lengths(built["paged"], batches, settings))[0] if batches else None
    runs = {name: run for name, run in TRANSFORMERS_RUNS.items() if name not in skipped}
    warmups: dict[str, float] = {}
    for name, run in list(runs.items()):
        try:
            warmups[name] = warm_up_transformers(run, reference, requests, args.seed)
        except Exception:  # noqa: BLE001  (recorded in the JSON, the other sides go on)
            results[name] = {"error": traceback.format_exc(limit=4)}
            print(f"{name} FAILED:\n{results[name]['error']}", flush=True)
            del runs[name]
    weight_bytes = decode_weight_bytes(model.module)

    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in [*built, *runs]}
    stream_rounds: list[dict[str, Any]] = []
    traced = 0
    for round_index in range(args.repeats):  # every side in turn, so a slow spell of the machine hits them all
        for name, engine in built.items():
            record = timed_round(engine, requests, settings, args.new_tokens, full_length, weight_bytes)
            rounds[name].append(record)
            traced += traces_in(record)
            print(describe_round(name, round_index, args.repeats, record), flush=True)
            warn_traces(name, traces_in(record))
        for name, run in list(runs.items()):
            try:
                record = rate_record(*timed(lambda run=run: run(reference, requests, args.seed)), args.new_tokens)
            except Exception:  # noqa: BLE001  (recorded in the JSON, the other sides go on)
                results[name] = {"error": traceback.format_exc(limit=4)}
                print(f"{name} FAILED:\n{results[name]['error']}", flush=True)
                del runs[name], rounds[name]
                continue
            rounds[name].append(record)
            print(describe_round(name, round_index, args.repeats, record), flush=True)
        if batches:
            record = timed_stream(built["paged"], batches, settings, args.new_tokens)
            full = rounds["paged"][-1].get("full_length")
            record["vs_full_length"] = record["tokens_per_s"] / full["tokens_per_s"] if full else None
            stream_rounds.append(record)
            traced += record["compiles_in_timed_call"]
            versus = "" if full is None else f" = {record['vs_full_length']:.2f}x the round's full-length tokens/s"
            print(f"stream of {len(batches)} batches (round {round_index + 1}/{args.repeats}): "
                  f"{record['tokens_per_s']:.1f} useful tokens/s in {record['seconds']:.1f} s{versus}; "
                  f"{STREAM_NOTE}", flush=True)
            warn_traces("the stream", record["compiles_in_timed_call"])
    for name, engine in built.items():
        results[name] = {**first_calls[name], **median_round(rounds[name])}
        engine.close()
    for name in runs:
        results[name] = {"warmup_s": warmups[name], **median_round(rounds[name])}
    stream = None
    if stream_rounds:
        stream = {"first_call_s": stream_first_s, "note": STREAM_NOTE, **median_round(stream_rounds)}
        measured = [record["vs_full_length"] for record in stream_rounds if record["vs_full_length"] is not None]
        stream["rounds_vs_full_length"] = measured
        stream["vs_full_length"] = float(np.median(measured)) if measured else None

    ratios = {
        # The medians of the rounds' ratios (each round runs every side in turn).
        "paged_vs_static": median_ratio(rounds, "paged", "static"),
        "paged_vs_transformers_generate_batch": median_ratio(rounds, "paged", "transformers_generate_batch"),
        "paged_vs_transformers_generate": median_ratio(rounds, "paged", "transformers_generate"),
        "paged_long_tail_vs_full_length": results.get("paged", {}).get("long_tail_vs_full_length"),
        "static_long_tail_vs_full_length": results.get("static", {}).get("long_tail_vs_full_length"),
        "paged_vs_static_full_length": ratio({side: record.get("full_length", {}) for side, record in results.items()},
                                             "paged", "static"),
        "paged_stream_vs_full_length": stream["vs_full_length"] if stream else None,
    }
    print(f"programs traced during the timed rounds: {traced}" + ("" if traced else " (every shape warmed up)"))
    report = {
        "settings": {key: value for key, value in vars(args).items() if key != "output"} | {"sampling": SAMPLING},
        "paged_engine_config": dataclasses.asdict(paged_config),
        "paged_attention": built["paged"].kernel if "paged" in built else None,
        "machine": machine_info() | {"jax_backend": backend, "device_kind": device_kind(),
                                   "torch_threads": torch.get_num_threads(), "torch_device": torch_device},
        "calibration": calibration, "results": results, "ratios": ratios, "goals": GOALS,
        "kv_memory": kv_memory(results, requests, args),
        "decode_bandwidth": results.get("paged", {}).get("decode_bandwidth"), "stream": stream,
        "traces_during_timed_rounds": traced,
    }
    print_summary(report)
    print(f"written to {write_json(args.output, report)}")
    return report


def mebibytes(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


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
        view = ("0 (a paged kernel reads the pages in place)" if memory["attention"] != "gather" else
                f"{mebibytes(memory['paged_decode_view_bytes'])} (largest decode call: "
                f"{memory['paged_decode_view_rows']} rows x {memory['paged_decode_view_columns']} columns)")
        print(f"KV cache ({memory['kv_bytes_per_token']} bytes per token): paged peak in use "
              f"{mebibytes(memory['paged_peak_bytes'])}; allocated: pool "
              f"{mebibytes(memory['paged_pool_allocated_bytes'])} ({memory['paged_pool_allocated_pages']} pages) "
              f"+ {memory['attention']} decode view {view} = {mebibytes(memory['paged_allocated_bytes'])}; static "
              f"batch {mebibytes(memory['static_cache_bytes'])}: peak {memory['paged_peak_over_static']:.2f}x, "
              f"allocated {memory['paged_allocated_over_static']:.2f}x "
              "the static batch")
    profile = report["results"].get("paged", {}).get("profile")
    if profile:
        programs = ", ".join(f"{name} {entry['calls']} calls {entry['seconds']:.2f} s ({entry['mean_ms']:.1f} ms each)"
                             for name, entry in profile["programs"].items())
        rest = "scheduler, transfers" if profile["decode_timed"] else "scheduler, transfers and the decode calls"
        stats = report["results"]["paged"]["stats"]
        print(f"paged engine, where the time goes ({profile['seconds']:.2f} s): {programs}; host ({rest}) "
              f"{profile['host_seconds']:.2f} s; {stats['decode_calls']} decode calls, {stats['decode_calls_ahead']} "
              f"dispatched ahead ({stats['ended_row_steps']} row steps on ended rows); {profile['decode_steps']} "
              "decode steps, "
              f"{profile['mean_live_slots_per_step']:.1f} live slots per step, "
              f"{100 * profile['live_over_program_rows']:.0f}% of program rows live")
    bandwidth = report["decode_bandwidth"]
    if bandwidth and bandwidth["bytes_per_s"] is not None:
        peak = (f"{100 * bandwidth['share_of_peak']:.1f}% of the {bandwidth['device']}'s "
                f"{bandwidth['peak_bytes_per_s'] / 1e9:.0f} GB/s peak" if bandwidth["peak_bytes_per_s"]
                else f"peak unknown for {bandwidth['device_kind']!r}")
        print(f"paged decode memory traffic (weights {mebibytes(bandwidth['weight_bytes'])} + live KV per step, a "
              f"lower bound): {bandwidth['bytes_per_s'] / 1e9:.2f} GB/s, {peak}")


if __name__ == "__main__":
    main()
