"""Gradient accumulation: what an optimizer step costs to compile and to run as ``gradient_accumulation_steps`` grows.

What it measures
----------------
``torchlike.trl.SFTTrainer`` (full fine-tuning of float32 weights, ``bf16`` and gradient checkpointing at TRL's
defaults) on the random Qwen2 of ``--layers/--hidden/--seq`` (``harness.tiny_qwen2``, word-level tokenizer), rows of
``seq`` random ids, a micro-batch of ``--batch`` rows, for each ``gradient_accumulation_steps`` of ``--accumulation``
(default 1, 2, 4, 8): the first optimizer step's wall time and the XLA compile seconds spent in it (``jax.monitoring``),
and the steady time per micro-batch over ``--steps`` more optimizer steps. Each setting runs in a child process of its
own with the persistent compilation cache off, so every one compiles from nothing.

What it prints
--------------
A row per setting, and each setting's compile seconds and first-step time as a ratio to accumulation 1's: a train
step that compiles one forward and backward pass whatever the accumulation (``adapters.training.train_step``'s scan
over the micro-batches) stays near 1; one that unrolls the micro-batches grows with the accumulation.

Run::

    .venv/bin/python benchmarks/accumulation.py           # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402  (after the path set-up above)
    Column,
    child_environment,
    format_table,
    machine_info,
    print_result,
    record_compilations,
    run_child_process,
    tiny_qwen2,
    write_json,
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "accumulation.json"
NEVER = 10**9


def write_inputs(work: Path, args: argparse.Namespace) -> None:
    """The checkpoint and word-level tokenizer in ``work/model``."""
    from torchlike.testing import build_word_tokenizer, random_model

    shape = dict(vocab=args.vocab, hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers, heads=4,
                 kv_heads=2, rope_theta=1e4)
    random_model(tiny_qwen2(shape, max(args.seq, 512)), dtype="float32").save_pretrained(work / "model")
    build_word_tokenizer(work / "model", args.vocab)


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One setting: the first optimizer step (compiling) and ``args.steps`` more, timed at step boundaries."""
    import jax
    import numpy as np
    import transformers
    from flax import nnx

    import torchlike
    from torchlike.trl import SFTConfig, SFTTrainer

    work, accumulation = Path(args.work), args.child_accumulation
    compilations = record_compilations()
    marks: list[float] = []
    trainer: Any = None

    class Marks(transformers.TrainerCallback):
        def on_step_end(self, *unused: Any, **kwargs: Any) -> None:
            jax.block_until_ready(nnx.state(trainer.model.module))
            marks.append(time.perf_counter())

    steps = 1 + args.steps
    rows = np.random.default_rng(0).integers(5, args.vocab, size=(args.batch * accumulation * steps, args.seq))
    config = SFTConfig(output_dir=str(work / f"out-{accumulation}"), max_length=args.seq,
                       per_device_train_batch_size=args.batch, gradient_accumulation_steps=accumulation,
                       max_steps=steps, learning_rate=1e-4, lr_scheduler_type="constant", max_grad_norm=0.0,
                       logging_steps=NEVER, report_to="none", save_strategy="no", use_cpu=True, seed=0)
    trainer = SFTTrainer(model=str(work / "model"), args=config, train_dataset=[{"input_ids": row.tolist()}
                                                                                 for row in rows],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(work / "model"),
                         callbacks=[Marks()])
    start = time.perf_counter()
    trainer.train()
    first_end = marks[0]
    compile_s = sum(seconds for end, seconds in compilations if end <= first_end)
    return {"accumulation": accumulation, "first_step_s": first_end - start, "compile_s": compile_s,
            "micro_batch_s": (marks[-1] - first_end) / (args.steps * accumulation)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accumulation", default="1,2,4,8", help="comma-separated gradient_accumulation_steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps timed after the first")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT))
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--child-accumulation", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_accumulation is not None:
        print_result(run_child(args))
        return
    with tempfile.TemporaryDirectory() as work:
        write_inputs(Path(work), args)
        records = []
        for accumulation in (int(value) for value in args.accumulation.split(",")):
            command = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]), "--work", work,
                       "--child-accumulation", str(accumulation)]
            environment = {**child_environment(cpu=True), "TORCHLIKE_COMPILATION_CACHE": "0"}  # compile each time
            records.append(run_child_process(command, env=environment, labels={"accumulation": accumulation}))
    base = next((record for record in records if record.get("accumulation") == 1 and "error" not in record), None)
    for record in records:
        if base is not None and "error" not in record:
            record["compile_ratio"] = record["compile_s"] / base["compile_s"]
            record["first_step_ratio"] = record["first_step_s"] / base["first_step_s"]
    columns = [Column("accumulation", 12, "accumulation", "d", "<"),
               Column("compile s", 11, "compile_s", ".2f"), Column("x GA=1", 8, "compile_ratio", ".2f"),
               Column("first step s", 14, "first_step_s", ".2f"), Column("x GA=1", 8, "first_step_ratio", ".2f"),
               Column("ms / micro-batch", 18, lambda record: record.get("micro_batch_s", 0) * 1000, ".1f")]
    print(format_table(columns, records))
    write_json(args.output, {"machine": machine_info(), "settings": vars(args), "records": records})


if __name__ == "__main__":
    main()
