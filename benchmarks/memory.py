"""Peak memory of one SFT and one GRPO step at a real vocabulary: torchlike chunked vs unchunked log-probs vs TRL.

What it measures
----------------
One random Qwen2 at the Qwen2.5-0.5B shape (``torchlike.testing.tiny_config("qwen2", ...)``: 24 layers, hidden 896,
intermediate 4864, 14/2 heads, vocab 151,936, rope theta 1e6, tied embeddings; ``--layers`` etc. shrink it), float32
parameters, and one batch of ``--batch`` rows of ``--seq`` random tokens, no padding. Each case computes the loss
and the gradients of every parameter once (no optimizer update: its state is the same for every case), with
bfloat16 compute and gradient checkpointing (each decoder layer rematerialised), as TRL's defaults on a GPU:

``torchlike-chunked``
    The Tunix module of ``family.build_model`` (random init), ``adapters.losses.sft.sft_step_loss`` (SFT) or
    ``adapters.losses.grpo.grpo_step_loss`` (GRPO, ``loss_type="dapo"``, ``beta=0``) with ``block_size`` ``--block``
    (default ``"auto"``), the parameters cast to bfloat16 inside the program and ``rematerialised``, jitted and
    compiled ahead of the measured call.
``torchlike-unchunked``
    The same with ``block_size=None``: the whole ``[B, T, V]`` float32 logits at once.
``trl``
    ``transformers.Qwen2ForCausalLM`` (same config, its own random init) with ``gradient_checkpointing_enable()``,
    under ``torch.autocast(bfloat16)``: SFT is ``model(input_ids, labels=input_ids).loss.backward()`` (what
    ``trl.SFTTrainer.compute_loss`` differentiates); GRPO is TRL's ``_get_per_token_logps_and_entropies`` path
    (``logits_to_keep``, division by the temperature, ``trl.trainer.utils.selective_log_softmax``) and the DAPO
    loss on the completion tokens (prompt ``seq - completion``, completion ``--completion``).

Each case runs in a fresh Python process. Reported per case: ``peak GB``, the process's peak RSS during the measured
call (``VmHWM`` reset before it, plus a sampling thread: ``benchmarks.harness.PeakRss``); ``step GB``, that peak minus
the RSS before the call (parameters and model already resident: the step's temporaries and gradients); ``block``,
the positions per block of the torchlike sides (the whole scored length when unchunked); the
compiled program's ``temp`` and ``output`` bytes (XLA's ``memory_analysis``, JAX sides); ``device GB``,
``peak_bytes_in_use`` of the first JAX device when it is a GPU; and the step's seconds. Ratios: each side's ``step
GB`` over torchlike-unchunked's and over TRL's, per task.

Run (from the repository root)::

    .venv/bin/python benchmarks/memory.py                       # the Qwen2.5-0.5B shape, batch 1, seq 1024
    .venv/bin/python benchmarks/memory.py --layers 4            # fewer decoder layers (the logits are the same)
    .venv/bin/python benchmarks/memory.py --quick               # 2 layers, seq 512: a few minutes on 2 cores
    .venv/bin/python benchmarks/memory.py --tasks sft --sides torchlike-chunked,torchlike-unchunked --block 64

The table is printed and everything is written to ``benchmarks/results/memory.json`` (``--output``). This is a
script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402  (after the path set-up above)
    Column,
    PeakRss,
    error_summary,
    format_table,
    machine_info,
    print_result,
    run_child_process,
    tiny_qwen2,
    write_json,
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "memory.json"
SIDES = ("torchlike-chunked", "torchlike-unchunked", "trl")
TASKS = ("sft", "grpo")
QWEN25_05B = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151_936, seq=1024, batch=1,
                  completion=512)
GIB = 2**30


def hf_config(shape: dict[str, Any]):
    return tiny_qwen2(shape, max(shape["seq"], 128), rope_theta=1e6)


def batch_arrays(shape: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    rows, seq, completion = shape["batch"], shape["seq"], shape["completion"]
    ids = rng.integers(5, shape["vocab"], (rows, seq)).astype(np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": np.ones_like(ids),
            "completion_mask": np.ones((rows, completion), np.int32),
            "advantages": np.linspace(-1.0, 1.0, rows).astype(np.float32),
            "num_items": np.full((rows,), float(rows * completion), np.float32),
            "step_weight": np.ones((rows,), np.float32)}


# --------------------------------------------------------------------------- one case per process


def run_torchlike(task: str, block_size: Any, shape: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from torchlike.adapters.families import family_for_config
    from torchlike.adapters.losses import grpo as grpo_losses
    from torchlike.adapters.losses import logprobs as chunked_logprobs
    from torchlike.adapters.losses import sft as sft_loss
    from torchlike.adapters.training import train_step

    config = hf_config(shape)
    family = family_for_config(config)
    module = family.build_model(config, jnp.float32, nnx.Rngs(0))
    if task == "sft":
        loss = sft_loss.sft_step_loss(family, block_size=block_size)
        batch = {key: batch_arrays(shape)[key] for key in ("input_ids", "attention_mask", "loss_mask")}
    else:
        settings = grpo_losses.GRPOLossSettings(
            loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, importance_sampling_level="token",
            max_completion_length=shape["completion"], temperature=1.0, use_bias_correction_kl=False)
        loss = grpo_losses.grpo_step_loss(family, settings, block_size=block_size)
        batch = {key: value for key, value in batch_arrays(shape).items() if key != "loss_mask"}
    batch = {key: jnp.asarray(value) for key, value in batch.items()}
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def step(params, batch):
        def value(params):
            module = train_step.cast_floating(nnx.merge(graphdef, params, rest), jnp.bfloat16)
            with train_step.rematerialised(module):
                total, weight, _ = loss(module, batch, None)
            return total / weight

        return jax.value_and_grad(value)(params)

    compiled = jax.jit(step).lower(params, batch).compile()
    analysis = compiled.memory_analysis()
    device = jax.devices()[0]
    with PeakRss() as peak:
        started = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        seconds = time.perf_counter() - started
    scored = shape["seq"] - 1 if task == "sft" else shape["completion"]
    record = {**peak.result(), "step_s": seconds, "xla_temp_bytes": analysis.temp_size_in_bytes,
              "block_positions": chunked_logprobs.block_length(block_size, shape["batch"], scored, shape["vocab"]),
              "xla_output_bytes": analysis.output_size_in_bytes, "device": device.platform}
    if device.platform == "gpu":
        record["device_peak_bytes"] = device.memory_stats()["peak_bytes_in_use"]
    return record


def run_trl(task: str, shape: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from trl.trainer.utils import selective_log_softmax

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config(shape))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    arrays = {key: torch.as_tensor(value) for key, value in batch_arrays(shape).items()}
    ids, mask = arrays["input_ids"].long(), arrays["attention_mask"].long()
    cuda = torch.cuda.is_available()
    if cuda:
        model, ids, mask = model.cuda(), ids.cuda(), mask.cuda()
        arrays = {key: value.cuda() for key, value in arrays.items()}
        torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16):
            if task == "sft":
                loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            else:
                completion = shape["completion"]
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion + 1).logits
                logits = logits[:, :-1, :] / 1.0  # TRL divides by the temperature
                logps = selective_log_softmax(logits, ids[:, -completion:])
                completion_mask = arrays["completion_mask"].float()
                per_token = -torch.exp(logps - logps.detach()) * arrays["advantages"][:, None]
                loss = (per_token * completion_mask).sum() / completion_mask.sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()

    with PeakRss() as peak:
        started = time.perf_counter()
        step()
        seconds = time.perf_counter() - started
    record = {**peak.result(), "step_s": seconds, "device": "gpu" if cuda else "cpu"}
    if cuda:
        record["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return record


def child(side: str, task: str, block: str, shape: dict[str, Any]) -> None:
    block_size = None if side == "torchlike-unchunked" else (block if block == "auto" else int(block))
    started = time.perf_counter()
    record = run_trl(task, shape) if side == "trl" else run_torchlike(task, block_size, shape)
    record.update(side=side, task=task, process_s=time.perf_counter() - started)
    print_result(record)


# --------------------------------------------------------------------------- driver


def run_case(side: str, task: str, block: str, shape: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--task", task, "--block", block,
               "--shape", json.dumps(shape)]
    return run_child_process(command, labels={"side": side, "task": task})


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``step GB`` over torchlike-unchunked's and TRL's of the same task, in place."""
    for record in records:
        for baseline in ("torchlike-unchunked", "trl"):
            base = next((other for other in records if other["side"] == baseline and other["task"] == record["task"]
                         and "error" not in other), None)
            ok = base is not None and "error" not in record
            record[f"step_vs_{baseline}"] = record["peak_rss_increase"] / base["peak_rss_increase"] if ok else None


def gigabytes(value: float) -> str:
    """A table cell: bytes in GiB."""
    return f"{value / GIB:.2f}"


def unless_zero(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    """A table value: the record's value under ``key``, None when it is zero or absent."""
    return lambda record: record.get(key) or None


def times(value: float) -> str:
    """A table cell: a ratio, as ``1.23x``."""
    return f"{value:.2f}x"


TABLE = (
    Column("task", 5, "task", align="<"), Column("side", 20, "side", align="<", gap=" "),
    Column("block", 6, unless_zero("block_positions"), gap=" "), Column("peak GB", 8, "peak_rss", gigabytes, gap=" "),
    Column("step GB", 8, "peak_rss_increase", gigabytes, gap=" "),
    Column("XLA temp GB", 11, "xla_temp_bytes", gigabytes, gap=" "),
    Column("device GB", 9, "device_peak_bytes", gigabytes, gap=" "), Column("step s", 7, "step_s", ".1f", gap=" "),
    Column("vs unchunked", 12, unless_zero("step_vs_torchlike-unchunked"), times, gap=" "),
    Column("vs TRL", 7, unless_zero("step_vs_trl"), times, gap=" "),
)


def error_text(record: Mapping[str, Any]) -> str | None:
    """What a failed case's row shows after its task and side."""
    return f" error: {error_summary(record['error'])}" if "error" in record else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in QWEN25_05B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="2 layers and seq 512 (completion 256)")
    parser.add_argument("--block", default="auto", help="torchlike-chunked's block_size: 'auto' or positions")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=TASKS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.task, args.block, json.loads(args.shape))
        return
    shape = {name: getattr(args, name) for name in QWEN25_05B}
    if args.quick:
        shape.update(layers=2, seq=512, completion=256)
    records = []
    for task in args.tasks.split(","):
        for side in args.sides.split(","):
            print(f"running {task} {side} ...", flush=True)
            records.append(run_case(side, task, args.block, shape))
    add_ratios(records)
    print(f"shape: {shape}")
    print(format_table(TABLE, records, rule=False, labels=2, problem=error_text))
    output = write_json(args.output, {"shape": shape, "block": args.block, "records": records,
                                      "machine": machine_info()})
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
