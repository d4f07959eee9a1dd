"""Generation speed: ``torchlike`` ``CausalLM.generate`` against ``transformers.generate`` on CPU.

What it measures
----------------
A random Qwen2 (preset ``cpu``, the default: float32, 4 layers, hidden 256, 4 heads / 2 KV heads,
vocabulary 32000; preset ``gpu``: the Qwen2-0.5B shape in bfloat16, on the GPU), built with
``torchlike.testing`` (``tiny_config`` at that shape, ``random_model`` with seed 0) and saved to a
temporary directory, is loaded by both libraries. A
batch of 8 left-padded prompts of unequal length (widest 64 tokens) gets 128 new tokens (``gpu``:
960, so a row reaches 1024), with no end token so every row runs the full length, at equal settings:

``greedy``
    ``do_sample=False``.
``sampling``
    ``do_sample=True, temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1``.

Each side runs once untimed (torchlike compiles its program there; its time is reported as
``first_call_s``), then ``--repeats`` timed runs, alternating between the sides so that load from
other processes hits both alike; tokens/s = batch x new tokens / seconds, from the median run and
from the best run (the best is the steadier figure on a shared machine: torch's threads slow
down sharply when other processes hold the cores). The ratio is torchlike tokens/s over
transformers tokens/s (goal >= 1.5). The greedy outputs are
also compared token for token. ``transformers`` uses its default attention (sdpa) and torch's
default thread count (printed).

Run (from the repository root; about a minute on 2 cores)::

    .venv/bin/python benchmarks/generate.py
    .venv/bin/python benchmarks/generate.py --layers 8 --hidden 512 --batch 16 --repeats 5
    .venv/bin/python benchmarks/generate.py --single-thread   # one core each
    .venv/bin/python benchmarks/generate.py --preset gpu      # Qwen2-0.5B shape, bf16, 64 + 960 tokens

Results are printed and written to ``benchmarks/results/generate.json`` (``--output``).
This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

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

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "generate.json"
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(layers=4, hidden=256, intermediate=None, heads=4, kv_heads=2, vocab=32000, batch=8, prompt=64,
                new_tokens=128, dtype="float32", device="cpu"),
    "gpu": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, batch=8, prompt=64,
                new_tokens=960, dtype="bfloat16", device="gpu"),
}
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.1},
}


def build_checkpoint(directory: Path, args: argparse.Namespace) -> None:
    from torchlike.testing import random_model

    config = tiny_qwen2(vars(args), 4096, intermediate_size=args.intermediate or 4 * args.hidden,
                        tie_word_embeddings=False)
    model = random_model(config, dtype=args.dtype)
    model.generation_config.eos_token_id = None  # every row runs max_new_tokens on both sides
    model.save_pretrained(directory)


def prompts(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded rows whose lengths spread from the full width down to half of it."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, args.vocab, size=(args.batch, args.prompt))
    mask = np.zeros_like(ids)
    lengths = np.linspace(args.prompt, args.prompt // 2, args.batch).astype(int)
    for row, length in enumerate(lengths):
        mask[row, args.prompt - length:] = 1
    ids[mask == 0] = 0
    return ids, mask


def interleaved(runs: dict[str, Any], repeats: int) -> dict[str, tuple[float, list[float], Any]]:
    """``{name: (first-call seconds, timed seconds, output)}``; the timed runs alternate between the
    sides so a load change on a shared machine hits both alike."""
    firsts, outputs, times = {}, {}, {name: [] for name in runs}
    for name, run in runs.items():
        firsts[name], outputs[name] = timed(run)
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(timed(run)[0])
    return {name: (firsts[name], times[name], outputs[name]) for name in runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model shape, dtype and device; the options below override it")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "batch", "prompt", "new-tokens"):
        parser.add_argument(f"--{name}", type=int, help="default: the preset's")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--single-thread", action="store_true",
                        help="one thread each (torch.set_num_threads(1), XLA without its Eigen pool): steadier "
                             "on a machine shared with other processes")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    fill_from_preset(args, PRESETS[args.preset])
    if args.single_thread:  # before jax is imported: XLA reads its flags once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()

    import jax
    import torch
    import transformers

    import torchlike

    if args.single_thread:
        torch.set_num_threads(1)
    ids, mask = prompts(args)
    torch_device = "cuda" if args.device == "gpu" and torch.cuda.is_available() else "cpu"
    if args.device == "gpu" and torch_device == "cpu":
        print("WARNING: --preset gpu but torch has no CUDA: transformers runs on the CPU; compare with care.")
    generated = args.batch * args.new_tokens
    results: dict[str, Any] = {
        "settings": {key: value for key, value in vars(args).items() if key != "output"},
        "machine": machine_info() | {"torch_threads": torch.get_num_threads(), "torch_device": torch_device,
                                     "jax_backend": jax.default_backend()},
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(Path(folder), args)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
        reference = reference.to(torch_device).eval()
        model = torchlike.AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype)

    for mode, knobs in MODES.items():
        def run_transformers(knobs=knobs):
            with torch.no_grad():
                return reference.generate(torch.tensor(ids, device=torch_device),
                                          attention_mask=torch.tensor(mask, device=torch_device), pad_token_id=0,
                                          max_new_tokens=args.new_tokens, **knobs).cpu().numpy()

        def run_torchlike(knobs=knobs):
            return model.generate(ids, mask, pad_token_id=0, max_new_tokens=args.new_tokens, seed=0, **knobs)

        measured = interleaved({"transformers": run_transformers, "torchlike": run_torchlike}, args.repeats)
        hf_first, hf_times, hf_out = measured["transformers"]
        tl_first, tl_times, tl_out = measured["torchlike"]
        assert hf_out.shape == tl_out.shape == (args.batch, args.prompt + args.new_tokens), (hf_out.shape, tl_out.shape)
        hf_rate = generated / statistics.median(hf_times)
        tl_rate = generated / statistics.median(tl_times)
        hf_best, tl_best = generated / min(hf_times), generated / min(tl_times)
        entry = {
            "transformers_tokens_per_s": round(hf_rate, 1),
            "torchlike_tokens_per_s": round(tl_rate, 1),
            "ratio": round(tl_rate / hf_rate, 2),
            "transformers_best_tokens_per_s": round(hf_best, 1),
            "torchlike_best_tokens_per_s": round(tl_best, 1),
            "best_ratio": round(tl_best / hf_best, 2),
            "transformers_seconds": [round(t, 4) for t in hf_times],
            "torchlike_seconds": [round(t, 4) for t in tl_times],
            "transformers_first_call_s": round(hf_first, 3),
            "torchlike_first_call_s": round(tl_first, 3),
        }
        if mode == "greedy":
            entry["greedy_tokens_match"] = bool(np.array_equal(hf_out, tl_out))
        results["modes"][mode] = entry
        print(f"{mode:9s} median: transformers {hf_rate:7.1f} tok/s, torchlike {tl_rate:7.1f} tok/s, "
              f"ratio {tl_rate / hf_rate:5.2f}x | best: {hf_best:7.1f} vs {tl_best:7.1f} tok/s, "
              f"ratio {tl_best / hf_best:5.2f}x | torchlike first call {tl_first:.2f}s"
              + (f" | greedy tokens match: {entry['greedy_tokens_match']}" if mode == "greedy" else ""))

    print(f"written to {write_json(args.output, results)}")
    return results


if __name__ == "__main__":
    main()
