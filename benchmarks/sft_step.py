"""SFT step throughput: torchlike against ``trl.SFTTrainer`` (torch) and a raw Tunix ``PeftTrainer`` loop.

What it measures
----------------
One random Qwen2 (``torchlike.testing.tiny_config("qwen2", ...)`` at the preset's shape, tied
embeddings, ``torchlike.testing.random_model`` with seed 0, ``save_pretrained`` to a temporary
directory in the preset's dtype, with ``build_word_tokenizer``'s word-level tokenizer) and one
tokenizer-free data set of ``batch * (warmup + steps)`` rows ``{"input_ids": [...]}``, each exactly
``seq`` random ids in ``[5, vocab)`` (``numpy.random.default_rng(0)``), so no side pads, truncates or
appends EOS. Every side trains on them with AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight
decay, constant schedule, no clipping, no dropout), with gradient checkpointing (TRL's default:
torchlike and TRL leave ``gradient_checkpointing`` at ``True``, raw Tunix rematerialises each
decoder layer) and in the preset's dtype (``bf16`` is set to whether it is bfloat16: the cpu preset
is a float32 comparison), in full fine-tuning (``full``) and LoRA (``lora``: r=16, alpha=32 on
q/k/v/o/gate/up/down, LoRA dropout 0) modes:

``torchlike``
    ``torchlike.trl.SFTTrainer(model=<dir>, args=SFTConfig(model_init_kwargs={"dtype": ...},
    max_length=seq, bf16=<dtype is bf16>, logging_steps=<huge>, ...))``,
    ``peft_config=torchlike.peft.LoraConfig(...)`` for LoRA. The persistent XLA compilation cache
    (on by default in torchlike) points at a fresh, empty directory, so the first step compiles;
    a second, untimed-but-for-its-first-step run on the now warm cache gives ``first step (warm)``.
``trl``
    ``trl.SFTTrainer`` on ``transformers.AutoModelForCausalLM`` (sdpa) loaded from the same directory,
    ``trl.SFTConfig(bf16=..., use_cpu=<cpu preset>, dataloader_num_workers=0, ...)``,
    ``peft_config=peft.LoraConfig(...)`` for LoRA.
``tunix``
    A hand-written loop: the Tunix Qwen2 from ``tunix.models.qwen2.params.create_model_from_safe_tensors``
    (same weights, ``ModelConfig(remat_config=RematConfig.DECODER)``), LoRA through
    ``qwix.LoraProvider`` + ``qwix.apply_lora_to_model`` as Tunix's examples do,
    ``tunix.PeftTrainer(model, optax.adamw(...), TrainingConfig(eval_every_n_steps=<huge>,
    max_steps=...))`` with the default loss and a ``gen_model_input_fn`` building ``positions`` and
    the causal ``attention_mask`` (``tunix.sft.utils``), no checkpoint saving.

How it is timed
---------------
torchlike and Tunix dispatch steps asynchronously, so wall-clock marks are taken at three step
boundaries only, each after waiting for the work dispatched so far (``jax.block_until_ready`` on
the model state; ``torch.cuda.synchronize`` for torch on a GPU): the end of step 1, the end of the
last warmup step and the end of the last step. The HF-style trainers mark in
``TrainerCallback.on_step_end``; Tunix marks in ``TrainingHooks.on_train_step_start`` (steps dispatched
so far) and ``on_train_end``. Reported per side and mode:

- ``first step s``: from the ``train()`` call to the end of the first step (optimizer set-up, tracing
  and compilation included; model loading and LoRA application are not);
- ``warm 1st s`` (torchlike): the same on the compilation cache the first run filled;
- ``warmup s``: from the ``train()`` call to the end of the last warmup step (a step compiled again on
  step 2 shows here: raw Tunix does that, so keep ``--warmup`` at 2 or more);
- ``step ms``: (end of last step - end of last warmup step) / ``steps``;
- ``tokens/s``: ``batch * seq / step``, and its ratio to TRL's and to raw Tunix's in the same mode;
- ``lora/full``: a side's LoRA step time over its full fine-tuning step time (goal for torchlike: <= 1);
- ``host ms``: median time between step marks after warmup, not counting the waits at the three
  synchronised marks (for torchlike, whose dispatch runs ahead: the Python loop's own time per step;
  close to ``step ms`` means the loop, not the device, sets the pace; Tunix keeps at most two steps in
  flight and torch on CPU is synchronous, so theirs track ``step ms``);
- ``compiles`` (JAX sides): XLA compilations over 0.5 s inside ``train()``, i.e. of the train step;
  more than 1 means the step was traced again (their seconds are in the JSON);
- trainable parameters and the mean training loss, to check that the sides do the same work.

Each (side, mode) runs in its own Python process, one after the other (modes outer, sides inner);
``--repeats N`` does that N times and reports, per side and mode, the repeat with the shortest step
(all repeats and the load average at each start are in the JSON). A side whose packages are missing
is skipped with a message (``--sides`` picks sides).

Run (from the repository root; about 3 minutes for the CPU preset on 2 cores)::

    .venv/bin/python benchmarks/sft_step.py
    .venv/bin/python benchmarks/sft_step.py --repeats 3                # less sensitive to a busy machine
    .venv/bin/python benchmarks/sft_step.py --steps 5 --warmup 2 --seq 64 --sides torchlike,tunix --modes lora
    .venv/bin/python benchmarks/sft_step.py --preset gpu                # Qwen2-0.5B shape, bf16, seq 1024
    .venv/bin/python benchmarks/sft_step.py --preset gpu --sides torchlike --profile

Presets: ``cpu`` (4 layers, hidden 256, intermediate 512, 4/2 heads, vocab 384, seq 256, batch 8,
fp32, 5 warmup + 20 measured steps: the model of ``cpu_anchors.md``) and ``gpu`` (Qwen2-0.5B shape:
24 layers, hidden 896, intermediate 4864, 14/2 heads, vocab 151936, rope theta 1e6, random weights
stored and trained in bf16, seq 1024, batch 8, 5 + 20 steps). ``--layers/--hidden/--seq/--batch/
--vocab/--dtype`` override a preset. ``--profile`` adds a cProfile of torchlike's ``train()``.

The table is printed and everything is written to ``benchmarks/results/sft_step.json``
(``--output``). This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402  (after the path set-up above)
    Column,
    StepClock,
    best_of,
    child_environment,
    error_summary,
    format_table,
    hf_callback,
    machine_info,
    missing_packages,
    print_result,
    profiled,
    record_compilations,
    run_child_process,
    tiny_qwen2,
    tunix_model,
    write_json,
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "sft_step.json"
SIDES = ("torchlike", "trl", "tunix")
MODES = ("full", "lora")
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-4
NEVER = 10**9  # a logging / eval interval no run reaches
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=384, rope_theta=1e4, seq=256,
                batch=8, dtype="float32", warmup=5, steps=20, device="cpu"),
    "gpu": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, rope_theta=1e6,
                seq=1024, batch=8, dtype="bfloat16", warmup=5, steps=20, device="gpu"),
}
#: Packages each side imports (``peft`` only for TRL's LoRA mode).
SIDE_PACKAGES: dict[str, tuple[str, ...]] = {
    "torchlike": ("torchlike", "jax", "flax", "tunix", "qwix", "transformers"),
    "trl": ("torch", "transformers", "trl", "datasets"),
    "tunix": ("tunix", "qwix", "jax", "flax", "optax"),
}


# --------------------------------------------------------------------------- model and data


def write_inputs(work: Path, spec: dict[str, Any]) -> None:
    """Writes the HF checkpoint + a word-level tokenizer to ``work/model`` and the token ids to ``work/ids.npy``."""
    import numpy as np

    from torchlike.testing import build_word_tokenizer, random_model

    config = tiny_qwen2(spec, max(spec["seq"], 2048))
    random_model(config, dtype=spec["dtype"]).save_pretrained(work / "model")
    build_word_tokenizer(work / "model", spec["vocab"])
    rows = spec["batch"] * (spec["warmup"] + spec["steps"])
    ids = np.random.default_rng(0).integers(5, spec["vocab"], size=(rows, spec["seq"]), dtype=np.int64)
    np.save(work / "ids.npy", ids)


def load_rows(work: Path) -> list[list[int]]:
    import numpy as np

    return np.load(work / "ids.npy").tolist()


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- sides (child process)


def run_torchlike(work: Path, spec: dict[str, Any], mode: str, first_only: bool, profile: bool) -> dict[str, Any]:
    import jax
    from flax import nnx

    import torchlike
    from torchlike.peft import LoraConfig
    from torchlike.trl import SFTConfig

    try:
        from torchlike.trl import SFTTrainer
    except ImportError:  # torchlike.trl did not export it yet (it lives in torchlike.trl.trainer.sft_trainer)
        from torchlike.trl.trainer.sft_trainer import SFTTrainer

    total = spec["warmup"] + spec["steps"]
    args = SFTConfig(
        output_dir=str(work / "out-torchlike"), model_init_kwargs={"dtype": spec["dtype"]}, max_length=spec["seq"],
        per_device_train_batch_size=spec["batch"], max_steps=total, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, bf16=spec["dtype"] == "bfloat16",
        logging_steps=NEVER, report_to="none", save_strategy="no", use_cpu=spec["device"] == "cpu", seed=0)
    peft_config = None
    if mode == "lora":
        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS),
                                 lora_dropout=0.0)
    trainer: Any = None

    def sync() -> None:
        jax.block_until_ready(nnx.state(getattr(trainer.model, "module", trainer.model)))

    clock = StepClock(sync, spec["warmup"], total)
    rows = [{"input_ids": row} for row in load_rows(work)]
    trainer = SFTTrainer(model=str(work / "model"), args=args, train_dataset=rows,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(work / "model"),
                         peft_config=peft_config, callbacks=[hf_callback(clock, stop_after_first=first_only)])
    clock.start()
    output, profile_text = profiled(profile, trainer.train)
    return {**clock.result(spec["batch"], spec["seq"]), "train_loss": output.training_loss,
            "trainable_params": trainer.model.num_parameters(only_trainable=True), "profile": profile_text,
            "backend": jax.default_backend()}


def run_trl(work: Path, spec: dict[str, Any], mode: str, first_only: bool, profile: bool) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl

    total = spec["warmup"] + spec["steps"]
    on_cpu = spec["device"] == "cpu"
    args = trl.SFTConfig(
        output_dir=str(work / "out-trl"), max_length=spec["seq"], per_device_train_batch_size=spec["batch"],
        max_steps=total, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, bf16=spec["dtype"] == "bfloat16", logging_steps=NEVER, report_to="none",
        save_strategy="no", use_cpu=on_cpu, dataloader_num_workers=0, seed=0, packing=False, padding_free=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=getattr(torch, spec["dtype"]))
    peft_config = None
    if mode == "lora":
        import peft

        peft_config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS),
                                      lora_dropout=0.0, task_type="CAUSAL_LM")
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() and not on_cpu else (lambda: None)
    clock = StepClock(synchronize, spec["warmup"], total)
    rows = datasets.Dataset.from_dict({"input_ids": load_rows(work)})
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows,
                             processing_class=transformers.AutoTokenizer.from_pretrained(work / "model"),
                             peft_config=peft_config, callbacks=[hf_callback(clock, stop_after_first=first_only)])
    clock.start()
    output, profile_text = profiled(profile, trainer.train)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {**clock.result(spec["batch"], spec["seq"]), "train_loss": output.training_loss,
            "trainable_params": trainable, "profile": profile_text, "backend": str(trainer.args.device),
            "torch_threads": torch.get_num_threads()}


def run_tunix(work: Path, spec: dict[str, Any], mode: str, first_only: bool, profile: bool) -> dict[str, Any]:
    import jax
    import numpy as np
    import optax
    import qwix
    from flax import nnx
    from tunix.sft import hooks, peft_trainer
    from tunix.sft import utils as sft_utils

    model = tunix_model(work / "model", spec)
    if mode == "lora":
        provider = qwix.LoraProvider(module_path="|".join(f".*{name}" for name in LORA_TARGETS), rank=LORA_RANK,
                                     alpha=LORA_ALPHA)
        model = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(0))
    total = spec["warmup"] + spec["steps"]
    optimizer = optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=NEVER, max_steps=1 if first_only else total,
                                         checkpoint_root_directory=None)
    trainer = peft_trainer.PeftTrainer(model, optimizer, config)

    def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
        valid = batch["input_mask"]
        return {"input_tokens": batch["input_tokens"], "input_mask": batch["input_mask"],
                "positions": sft_utils.build_positions_from_mask(valid),
                "attention_mask": sft_utils.make_causal_attn_mask(valid)}

    trainer = trainer.with_gen_model_input_fn(model_inputs)
    clock = StepClock(lambda: jax.block_until_ready(nnx.state(trainer.model)), spec["warmup"], total)

    class ClockHooks(hooks.TrainingHooks):
        """Marks the clock with the number of steps dispatched before each new one, and at the end."""

        def __init__(self) -> None:
            self.dispatched = 0

        def on_train_start(self, train_ctx):
            pass

        def on_train_step_start(self, train_ctx):
            clock.steps_done(self.dispatched)
            self.dispatched += 1

        def on_train_step_end(self, train_ctx, train_step, train_loss):
            pass

        def on_train_end(self, train_ctx):
            clock.steps_done(self.dispatched)

        def on_eval_step_start(self, train_ctx):
            pass

        def on_eval_step_end(self, train_ctx, eval_loss):
            pass

    trainer.with_training_hooks(ClockHooks())  # returns None in tunix 0.1.7: not chainable

    def batches() -> Iterator[dict[str, np.ndarray]]:
        ids = np.asarray(load_rows(work), np.int32)
        for start in range(0, len(ids), spec["batch"]):
            tokens = ids[start:start + spec["batch"]]
            yield {"input_tokens": tokens, "input_mask": np.ones(tokens.shape, bool)}

    trainable_filter = nnx.LoRAParam if mode == "lora" else nnx.Param
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, trainable_filter)))
    clock.start()
    _, profile_text = profiled(profile, lambda: trainer.train(batches()))
    try:
        losses = [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]
    except Exception:  # noqa: BLE001  (only a sanity figure; its API moved between Tunix versions)
        losses = []
    return {**clock.result(spec["batch"], spec["seq"]), "train_loss": float(np.mean(losses)) if losses else None,
            "trainable_params": trainable, "profile": profile_text, "backend": jax.default_backend()}


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {"torchlike": run_torchlike, "trl": run_trl, "tunix": run_tunix}


def run_child(args: argparse.Namespace) -> None:
    """Runs one side in one mode and prints its result line (JAX sides: with the compilations inside ``train()``)."""
    work = Path(args.work)
    spec = json.loads((work / "spec.json").read_text())
    compilations = record_compilations() if args.child != "trl" else None
    started = time.perf_counter()
    record = RUNNERS[args.child](work, spec, args.mode, args.first_only, args.profile)
    if compilations is not None:
        during = [seconds for end, seconds in compilations if end >= record["train_called_at"]]
        # Programs over 0.5 s are the train step (its recompilations included); the rest are small helpers.
        record.update(step_compilations=[seconds for seconds in during if seconds >= 0.5],
                      compile_s_in_train=sum(during), compilations_in_train=len(during))
    record.update(side=args.child, mode=args.mode, first_only=args.first_only,
                  child_seconds=time.perf_counter() - started)
    print_result(record)


# --------------------------------------------------------------------------- driver


def add_ratios(rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Adds tokens/s ratios against TRL and raw Tunix (same mode) and LoRA/full step ratios, in place."""
    for by_side in rows.values():
        for record in by_side.values():
            for baseline in ("trl", "tunix"):
                base = by_side.get(baseline, {}).get("tokens_per_s")
                mine = record.get("tokens_per_s")
                record[f"vs_{baseline}"] = mine / base if mine and base else None
    for side, full in rows.get("full", {}).items():
        lora = rows.get("lora", {}).get(side)
        if lora and lora.get("step_s") and full.get("step_s"):
            lora["lora_over_full"] = full["lora_over_full"] = lora["step_s"] / full["step_s"]


def side_packages(side: str, mode: str) -> tuple[str, ...]:
    """The packages ``side`` imports in ``mode`` (``peft`` only for TRL's LoRA mode)."""
    return SIDE_PACKAGES[side] + (("peft",) if side == "trl" and mode == "lora" else ())


def run_side(work: Path, spec: dict[str, Any], side: str, mode: str, cache: str, first_only: bool = False,
             profile: bool = False) -> dict[str, Any]:
    """Runs one (side, mode) in a fresh interpreter; returns its record, or one with ``error``.

    ``cache`` names torchlike's compilation-cache directory (``work/jax-cache-<cache>``: fresh unless a warm rerun
    reuses it); CPU is forced for the cpu device.
    """
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--mode", mode, "--work", str(work)]
    command += ["--first-only"] * first_only + ["--profile"] * profile
    environment = child_environment(cpu=spec["device"] == "cpu", compilation_cache=work / f"jax-cache-{cache}")
    return run_child_process(command, environment, labels={"side": side, "mode": mode})


def milliseconds(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A table value: the record's seconds under ``key`` in milliseconds."""
    return lambda r: None if r.get(key) is None else r[key] * 1e3


TABLE = (
    Column("side", 10, "side", align="<"), Column("mode", 6, "mode", align="<"),
    Column("first s", 9, "first_step_s", ".2f"), Column("warm 1st s", 11, "first_step_warm_s", ".2f"),
    Column("warmup s", 9, "warmup_end_s", ".2f"), Column("step ms", 9, milliseconds("step_s"), ".1f"),
    Column("host ms", 9, milliseconds("host_step_s"), ".1f"), Column("tokens/s", 10, "tokens_per_s", ".0f"),
    Column("compiles", 9, lambda r: None if r.get("step_compilations") is None else len(r["step_compilations"]),
           "d"),
    Column("vs trl", 8, "vs_trl", ".2f"), Column("vs tunix", 9, "vs_tunix", ".2f"),
    Column("lora/full", 10, "lora_over_full", ".2f"), Column("trainable", 12, "trainable_params", ","),
    Column("loss", 8, "train_loss", ".3f"),
)


def resolve_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The preset with the command line's overrides applied."""
    spec = dict(PRESETS[args.preset])
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq", "batch", "dtype", "warmup",
                "steps", "device"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if spec["hidden"] % spec["heads"] or spec["heads"] % spec["kv_heads"]:
        raise SystemExit(f"hidden={spec['hidden']} must divide by heads={spec['heads']}, which must divide by "
                         f"kv_heads={spec['kv_heads']}; pass --heads/--kv-heads that fit.")
    if spec["warmup"] < 1 or spec["steps"] < 1:
        raise SystemExit(f"--warmup ({spec['warmup']}) and --steps ({spec['steps']}) must be at least 1.")
    return spec


def print_progress(record: dict[str, Any], repeat: int, repeats: int) -> None:
    where = f"  [{repeat + 1}/{repeats}] {record['side']:<10}{record['mode']:<6}"
    if "error" in record:
        print(f"{where}FAILED: {error_summary(record['error'])}", flush=True)
        return
    warm = record.get("first_step_warm_s")
    print(f"{where}first step {record['first_step_s']:.2f}s{'' if warm is None else f' (warm cache {warm:.2f}s)'}, "
          f"{record['step_s'] * 1e3:.1f} ms/step, {record['tokens_per_s']:.0f} tokens/s "
          f"(on {record.get('backend')}, process {record['process_seconds']:.0f}s, load {record['load_before']:.1f})",
          flush=True)


def run_driver(args: argparse.Namespace) -> None:
    spec = resolve_spec(args)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    for name, chosen, allowed in (("--sides", sides, SIDES), ("--modes", modes, MODES)):
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            raise SystemExit(f"{name}: unknown {unknown}; choose from {','.join(allowed)}.")
    work = Path(tempfile.mkdtemp(prefix="sft_step_", dir=args.workdir))
    try:
        print(f"spec: {spec}", flush=True)
        started = time.perf_counter()
        write_inputs(work, spec)
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"checkpoint, tokenizer and {spec['batch'] * (spec['warmup'] + spec['steps'])} rows written in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
        rows: dict[str, dict[str, dict[str, Any]]] = {mode: {} for mode in modes}
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for repeat in range(args.repeats):
            for mode in modes:
                for side in sides:
                    missing = missing_packages(side_packages(side, mode))
                    if missing:
                        rows[mode][side] = {"side": side, "mode": mode,
                                            "skipped": f"missing package(s) {', '.join(missing)}"}
                        if repeat == 0:
                            print(f"  {side:<10}{mode:<6}skipped: {rows[mode][side]['skipped']}", flush=True)
                        continue
                    cache = f"{side}-{mode}-{repeat}"
                    record = run_side(work, spec, side, mode, cache, profile=args.profile and side == "torchlike")
                    if side == "torchlike" and repeat == 0 and "error" not in record and not args.no_warm_rerun:
                        warm = run_side(work, spec, side, mode, cache, first_only=True)
                        record["first_step_warm_s"] = warm.get("first_step_s")
                        if "error" in warm:
                            record["warm_rerun_error"] = warm["error"]
                    runs.setdefault((mode, side), []).append(record)
                    print_progress(record, repeat, args.repeats)
        rows = {mode: {side: best_of(runs[mode, side]) if (mode, side) in runs else rows[mode][side]
                       for side in sides} for mode in modes}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    add_ratios(rows)
    table = format_table(TABLE, ({**r, "side": side, "mode": mode} for mode, by_side in rows.items()
                                 for side, r in by_side.items()), labels=2)
    machine = machine_info()
    print()
    print(f"machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs, {machine['platform']}")
    print(f"{spec['layers']} layers, hidden {spec['hidden']}, vocab {spec['vocab']}, seq {spec['seq']}, "
          f"batch {spec['batch']}, {spec['dtype']}, {spec['warmup']} warmup + {spec['steps']} measured steps, "
          f"device {spec['device']}")
    print(table)
    backends = {f"{side} {mode}": r.get("backend") for mode, by_side in rows.items() for side, r in by_side.items()
                if r.get("backend")}
    print("backends: " + ", ".join(f"{name}: {backend}" for name, backend in backends.items()))
    if spec["device"] == "gpu" and any("cpu" in str(backend) for backend in backends.values()):
        print("WARNING: --device gpu but some side ran on the CPU (no CUDA jaxlib / torch build?): compare with care.")
    for mode, by_side in rows.items():
        for side, record in by_side.items():
            if record.get("profile"):
                print(f"\n===== cProfile: {side} {mode} train() (profiled run, slower than an unprofiled one) =====")
                print(record["profile"])
    result = {"command": [sys.executable, *sys.argv], "preset": args.preset, "spec": spec, "machine": machine,
              "lora": {"r": LORA_RANK, "alpha": LORA_ALPHA, "targets": list(LORA_TARGETS)},
              "learning_rate": LEARNING_RATE, "results": rows, "table": table}
    print(f"\nwrote {write_json(args.output, result)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ",".join(SIDES))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--steps", type=int, help="measured steps after warmup")
    parser.add_argument("--warmup", type=int, help="steps before the measured window (the first compiles)")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and compute dtype")
    parser.add_argument("--device", choices=("cpu", "gpu"), help="cpu forces JAX_PLATFORMS=cpu and use_cpu=True")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per side and mode, interleaved; the one with the shortest step is reported")
    parser.add_argument("--profile", action="store_true", help="cProfile torchlike's train() (printed and saved)")
    parser.add_argument("--no-warm-rerun", action="store_true",
                        help="skip torchlike's second run on a warm compilation cache")
    parser.add_argument("--workdir", help="where the temporary checkpoint goes (default: the system temp dir)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="JSON results file")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
