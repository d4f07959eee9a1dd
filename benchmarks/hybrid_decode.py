"""One compiled decode step of a hybrid decoder's linear-attention layers against attention layers, as the sequence
grows: the recurrent state has a fixed size, the KV cache does not.

What it measures
----------------
Two Qwen3.5-shaped models from ``torchlike.testing.tiny_config("qwen3_5", ...)`` (``--hidden`` 256, ``--layers`` 4,
float32), one with every layer gated DeltaNet (``layer_types`` all ``linear_attention``), one with every layer
gated attention (``full_attention``). For each ``--lengths`` value ``L``, one jitted one-token decode step of
``--batch`` rows whose cache holds ``L - 1`` earlier positions (``init_cache`` of ``L`` slots, every key visible);
the step is compiled and run once before timing, then timed ``--repeats`` times (median seconds). Reported: seconds
per step for each model and length, and each model's ratio of the longest length's step to the shortest's (goal for
the linear layers: about 1, i.e. no growth; attention grows with ``L``).

Run (from the repository root; a minute on 2 cores)::

    .venv/bin/python benchmarks/hybrid_decode.py
    .venv/bin/python benchmarks/hybrid_decode.py --lengths 512 2048 8192 --batch 16

This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def decode_step_seconds(kind: str, lengths: list[int], hidden: int, layers: int, batch: int,
                        repeats: int) -> dict[int, float]:
    """Median seconds of one decode step per cache length, for a model whose every layer is ``kind``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import torchlike
    from torchlike.adapters.rollout.sampling import init_cache
    from torchlike.testing import tiny_config

    config = tiny_config("qwen3_5", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=hidden // 8,
                         linear_value_head_dim=hidden // 8, layer_types=[kind] * layers, vocab_size=1024)
    module = torchlike.AutoModelForCausalLM.from_config(config, dtype="float32").module

    @nnx.jit
    def step(module, tokens, positions, cache, mask):
        logits, cache = module(tokens, positions, cache, mask)
        return logits, cache

    seconds = {}
    for length in lengths:
        cache = init_cache(module, batch, length)
        for entry in cache.values():
            entry["end_index"] = jnp.full((batch,), length - 1, jnp.int32)
        tokens = jnp.ones((batch, 1), jnp.int32)
        positions = jnp.full((batch, 1), length - 1, jnp.int32)
        mask = jnp.ones((batch, 1, length), bool)
        jax.block_until_ready(step(module, tokens, positions, cache, mask))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(module, tokens, positions, cache, mask))
            times.append(time.perf_counter() - start)
        seconds[length] = statistics.median(times)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/hybrid_decode.json")
    args = parser.parse_args(argv)
    results = {}
    for kind in ("linear_attention", "full_attention"):
        seconds = decode_step_seconds(kind, args.lengths, args.hidden, args.layers, args.batch, args.repeats)
        growth = seconds[max(args.lengths)] / seconds[min(args.lengths)]
        results[kind] = {"seconds": seconds, f"step {max(args.lengths)} / step {min(args.lengths)}": growth}
        row = "  ".join(f"L={length}: {value * 1e3:7.2f} ms" for length, value in seconds.items())
        print(f"{kind:17s} {row}   longest / shortest = {growth:.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
