"""GRPO seconds per step (rollout + update): torchlike against ``trl.GRPOTrainer`` (torch) and a raw Tunix loop.

What it measures
----------------
One random Qwen2 (``torchlike.testing.tiny_config("qwen2", ...)`` at the preset's shape, tied embeddings,
``torchlike.testing.random_model`` with seed 0, saved in the preset's dtype) with ``build_word_tokenizer``'s word-level
tokenizer (``<pad>``, ``<s>``, ``</s>``, ``<unk>``, then one word ``t<id>`` per remaining id, split on whitespace,
``<s>`` prepended to every prompt), so every sampled id decodes to a word and the prompt ids are the same on every
side. 16 text prompts of 6-12 random words (``numpy.random.default_rng(0)``). One reward function,
``length_reward(completions, **kwargs)``: minus the distance of a completion's word count from half of
``max_completion_length``. Every side runs GRPO with the same settings:
``num_generations`` 4, 8 completions per step (2 prompts x 4), one optimizer step per rollout (``num_iterations`` 1,
no gradient accumulation), ``max_completion_length`` tokens (EOS, one id in ``vocab``, ends some completions early;
the mean completion length of each side is reported to show how alike the sides' work was), temperature 1.0,
top-p 1.0, no top-k, beta 0 (no reference model), epsilon 0.2, token-mean loss (TRL's default ``loss_type="dapo"``;
Tunix ``loss_agg_mode="token-mean"``), AdamW lr 1e-5, betas 0.9/0.999, eps 1e-8, no weight decay, constant schedule,
no clipping, full fine-tuning, gradient checkpointing (TRL's default: torchlike and TRL leave
``gradient_checkpointing`` at ``True``, raw Tunix rematerialises each decoder layer), the preset's dtype (``bf16`` is
set to whether it is bfloat16: the cpu preset is a float32 comparison):

``torchlike``
    ``torchlike.trl.GRPOTrainer(model=<dir>, args=GRPOConfig(model_init_kwargs={"dtype": ...}, ...))`` on a list of
    ``{"prompt": text}`` rows; its persistent XLA compilation cache points at a fresh, empty directory, so the first
    step compiles (cold).
``trl``
    ``trl.GRPOTrainer`` on ``transformers.AutoModelForCausalLM`` (sdpa) from the same directory, a ``datasets.Dataset``
    of the same prompts, ``trl.GRPOConfig(use_cpu=<cpu preset>, bf16=<bf16 preset>, report_to="none", ...)``;
    generation with ``model.generate`` (``use_vllm=False``).
``torchlike_static``, ``torchlike_paged``, ``torchlike_async``
    torchlike with ``rollout_engine="static"`` (one left-padded batch decoded to its longest row), with
    ``rollout_engine="paged"`` (the paged, continuously batched engine) and with the paged engine and
    ``max_staleness=1`` (the next generation batch sampled while the current one trains); ``vs static`` is a side's
    median over ``torchlike_static``'s (goals: the paged engine <= 0.6x, sampling ahead <= 1 / 1.3 of the synchronous
    paged step).
``tunix``
    The Tunix Qwen2 from ``tunix.models.qwen2.params.create_model_from_safe_tensors`` (same weights,
    ``ModelConfig(remat_config=RematConfig.DECODER)``; the rollout runs the same module), the HF tokenizer
    (Tunix wraps it in its ``TokenizerAdapter``), ``RLCluster`` on a ``tunix.utils.mesh.create_mesh((1, 1),
    ("fsdp", "tp"))`` mesh entered with ``with mesh:``, the vanilla rollout with ``RolloutConfig(kv_cache_size=prompt +
    completion + 64, seed=None)``, ``GRPOLearner(GRPOConfig(num_generations=4, beta=0, loss_agg_mode="token-mean"))``
    fed batch dicts ``{"prompts": np.array([2 prompts])}``, no reference model, no checkpointing. Tunix's sampler
    re-creates the same PRNG key on every rollout (``seed=None`` or an int; a key array breaks on the second rollout),
    so a prompt that recurs gets the same completions: it does not change the work per step.

How it is timed
---------------
Wall-clock marks at three step boundaries, each after waiting for the work dispatched so far
(``jax.block_until_ready`` on the policy's state; ``torch.cuda.synchronize`` for torch on a GPU): the end of step 1,
the end of the last warmup step and the end of the last step. The HF-style trainers mark in
``TrainerCallback.on_step_end``; Tunix marks after each ``GRPOLearner._run_global_step`` (rollout, advantages and the
actor update of one step). Reported per side:

- ``setup s``: building the trainer (torchlike and TRL: ``GRPOTrainer(...)`` with model loading; Tunix: model loading,
  ``RLCluster`` and ``GRPOLearner``);
- ``first s``: from the ``train()`` call to the end of step 1 (tracing and compilation of the sampler and the train
  step included);
- ``warmup s``: from ``train()`` to the end of the last warmup step (a program compiled again on step 2 shows here);
- ``mean s``: (end of last step - end of last warmup step) / ``steps``, the steady state;
- ``median s``: the median time between consecutive step ends after the warmup. Every side waits for its previous
  update before the next rollout, so each interval is one step; the median ignores the few steps that another process
  on a shared machine stretched (torch's spinning threads suffer most: a TRL mean can be many times its median);
- ``vs trl`` / ``vs tunix``: a side's median over theirs, and ``vs trl mean`` the same with means (lower is faster;
  goal for torchlike: <= 0.5 x TRL);
- ``late compiles`` (JAX sides): XLA compilations over 0.1 s after the warmup (should be 0);
- ``tokens``: mean completion length (words, i.e. generated tokens before EOS) over the measured steps.

Each side runs in its own Python process, one after the other; ``--repeats N`` does that N times and reports, per
side, the repeat with the shortest step (all repeats are in the JSON). A side whose packages are missing is skipped with
a message (``--sides`` picks sides); a side that fails is reported with its error.

Run (from the repository root; about a minute for the cpu preset on 2 cores)::

    .venv/bin/python benchmarks/grpo_step.py
    .venv/bin/python benchmarks/grpo_step.py --steps 20 --repeats 3
    .venv/bin/python benchmarks/grpo_step.py --sides torchlike,tunix --steps 3
    .venv/bin/python benchmarks/grpo_step.py --preset gpu        # Qwen2-0.5B shape, bf16, prompt + completion ~1024

Presets: ``cpu`` (2 layers, hidden 128, intermediate 256, 4/2 heads, vocab 384, fp32, completions of up to 64 tokens,
2 warmup + 10 measured steps) and ``gpu`` (Qwen2-0.5B shape: 24 layers, hidden 896, intermediate 4864, 14/2 heads,
vocab 151936, rope theta 1e6, random weights stored and trained in bf16, completions of up to 960 tokens after prompts
padded to 64, 2 + 5 steps). ``--layers/--hidden/--intermediate/--vocab/--completion/--dtype/--steps/--warmup``
override a preset. ``--torch-threads N`` sets TRL's torch threads: torch's default (one per core) spins its threads,
which on a machine where other processes hold the cores can slow TRL several-fold; the threads used are reported.

The table is printed and everything is written to ``benchmarks/results/grpo_step.json`` (``--output``).
This is a script, never part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
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
    record_compilations,
    run_child_process,
    tiny_qwen2,
    tunix_model,
    write_json,
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "grpo_step.json"
SIDES = ("torchlike", "torchlike_static", "torchlike_paged", "torchlike_async", "trl", "tunix")
# torchlike's rollout settings per side: GRPOConfig's defaults, the static batch sampler, the paged engine, and the
# paged engine sampling the next generation batch while the current one trains.
TORCHLIKE_ROLLOUTS: dict[str, dict[str, Any]] = {"torchlike": {}, "torchlike_static": {"rollout_engine": "static"},
                                                 "torchlike_paged": {"rollout_engine": "paged"},
                                                 "torchlike_async": {"rollout_engine": "paged", "max_staleness": 1}}
# build_word_tokenizer's words: ids 0-3 are its special tokens, id i >= 4 is the word t<i>. Not imported from
# torchlike.testing here: importing torchlike tunes the allocator, and the TRL child imports this module.
FIRST_WORD_ID = 4
WORD = re.compile(r"t\d+")
PROMPT_WORDS = (6, 12)
LEARNING_RATE = 1e-5
EPSILON = 0.2
LATE_COMPILE_S = 0.1  # compilations shorter than this after warmup are small helpers, not a re-traced step
NEVER = 10**9
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=384, rope_theta=1e4,
                completion=64, prompt_bucket=16, batch=8, generations=4, prompts=16, dtype="float32", warmup=2,
                steps=10, device="cpu"),
    "gpu": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, rope_theta=1e6,
                completion=960, prompt_bucket=64, batch=8, generations=4, prompts=16, dtype="bfloat16", warmup=2,
                steps=5, device="gpu"),
}
SIDE_PACKAGES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(TORCHLIKE_ROLLOUTS, ("torchlike", "jax", "flax", "tunix", "qwix", "transformers")),
    "trl": ("torch", "transformers", "trl", "datasets"),
    "tunix": ("tunix", "jax", "flax", "optax", "transformers"),
}


# --------------------------------------------------------------------------- model, tokenizer, prompts, reward


def write_inputs(work: Path, spec: dict[str, Any]) -> None:
    """Writes the HF checkpoint (``work/model``), the tokenizer (``work/tokenizer``) and ``work/prompts.json``."""
    import numpy as np

    from torchlike.testing import build_word_tokenizer, random_model

    config = tiny_qwen2(spec, max(2048, 2 * (spec["prompt_bucket"] + spec["completion"])))
    model = random_model(config, dtype=spec["dtype"])
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(work / "model")
    del model
    # Apart from config.json: next to it, transformers 5 rebuilds it as a Qwen2Tokenizer (byte-level BPE).
    build_word_tokenizer(work / "tokenizer", spec["vocab"])
    rng = np.random.default_rng(0)
    longest = min(PROMPT_WORDS[1], spec["prompt_bucket"] - 1)  # + BOS still fits the prompt bucket
    prompts = [" ".join(f"t{i}" for i in rng.integers(FIRST_WORD_ID, spec["vocab"],
                                                          int(rng.integers(PROMPT_WORDS[0], longest + 1))))
               for _ in range(spec["prompts"])]
    (work / "prompts.json").write_text(json.dumps(prompts))


def load_prompts(work: Path) -> list[str]:
    return json.loads((work / "prompts.json").read_text())


def completion_words(completion: str) -> int:
    """Generated tokens before EOS: every id decodes to one whitespace-separated word (specials left out)."""
    return sum(1 for word in completion.split() if WORD.fullmatch(word))


def make_length_reward(spec: dict[str, Any], lengths: list[list[int]]) -> Callable[..., list[float]]:
    """The reward (closer to half of ``max_completion_length`` words is better); records each call's word counts."""
    target = spec["completion"] // 2

    def length_reward(completions, **kwargs):
        counts = [completion_words(text) for text in completions]
        lengths.append(counts)
        return [-abs(count - target) / target for count in counts]

    return length_reward


def length_summary(lengths: list[list[int]], warmup: int) -> dict[str, Any]:
    """Mean completion length over the measured steps (rollouts after ``warmup``) and over all of them."""
    measured = [count for counts in lengths[warmup:] for count in counts]
    every = [count for counts in lengths for count in counts]
    return {"completion_tokens_mean": sum(measured) / len(measured) if measured else None,
            "completion_tokens_mean_all": sum(every) / len(every) if every else None,
            "completion_tokens_max": max(every, default=None), "rollouts": len(lengths)}


# --------------------------------------------------------------------------- sides (child process)


def hf_style_config(config_class: Any, work: Path, spec: dict[str, Any], side: str) -> Any:
    """The GRPOConfig both HF-style trainers get (``torchlike.trl.GRPOConfig`` or ``trl.GRPOConfig``)."""
    extra = ({"model_init_kwargs": {"dtype": spec["dtype"]}, **TORCHLIKE_ROLLOUTS[side]} if side in TORCHLIKE_ROLLOUTS
             else {"dataloader_num_workers": 0})
    return config_class(
        output_dir=str(work / f"out-{side}"), per_device_train_batch_size=spec["batch"],
        num_generations=spec["generations"], max_completion_length=spec["completion"],
        max_steps=spec["warmup"] + spec["steps"], learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=EPSILON,
        loss_type="dapo", num_iterations=1, gradient_accumulation_steps=1, bf16=spec["dtype"] == "bfloat16",
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=spec["device"] == "cpu", seed=0,
        disable_tqdm=True, **extra)


def run_torchlike(work: Path, spec: dict[str, Any], side: str = "torchlike") -> dict[str, Any]:
    import jax
    from flax import nnx

    import torchlike
    from torchlike.trl import GRPOConfig, GRPOTrainer

    lengths: list[list[int]] = []
    trainer: Any = None

    def sync() -> None:
        jax.block_until_ready(nnx.state(getattr(trainer.model, "module", trainer.model)))

    clock = StepClock(sync, spec["warmup"], spec["warmup"] + spec["steps"])
    started = time.perf_counter()
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=make_length_reward(spec, lengths),
                          args=hf_style_config(GRPOConfig, work, spec, side),
                          train_dataset=[{"prompt": prompt} for prompt in load_prompts(work)],
                          processing_class=torchlike.AutoTokenizer.from_pretrained(work / "tokenizer"),
                          callbacks=[hf_callback(clock)])
    setup = time.perf_counter() - started
    clock.start()
    trainer.train()
    return {**clock.result(spec["batch"], spec["completion"]), **length_summary(lengths, spec["warmup"]),
            "setup_s": setup, "backend": jax.default_backend()}


def run_trl(work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl

    if spec.get("torch_threads"):
        torch.set_num_threads(spec["torch_threads"])
    lengths: list[list[int]] = []
    on_cpu = spec["device"] == "cpu"
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() and not on_cpu else (lambda: None)
    clock = StepClock(synchronize, spec["warmup"], spec["warmup"] + spec["steps"])
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=getattr(torch, spec["dtype"]))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[make_length_reward(spec, lengths)],
                              args=hf_style_config(trl.GRPOConfig, work, spec, "trl"),
                              train_dataset=datasets.Dataset.from_dict({"prompt": load_prompts(work)}),
                              processing_class=transformers.AutoTokenizer.from_pretrained(work / "tokenizer"),
                              callbacks=[hf_callback(clock)])
    setup = time.perf_counter() - started
    clock.start()
    trainer.train()
    return {**clock.result(spec["batch"], spec["completion"]), **length_summary(lengths, spec["warmup"]),
            "setup_s": setup, "backend": str(trainer.args.device), "torch_threads": torch.get_num_threads()}


def rematerialise_decoder_layers(model: Any) -> None:
    """Switches each decoder layer of a Tunix Qwen2 to ``RematConfig.DECODER`` for the train steps traced from now
    on. Called after ``RLCluster`` has built the rollout: Tunix's sampler keeps the graph it was given, and fails with
    ``nnx.remat`` inside its decode loop; the other sides also rematerialise only where gradients are taken."""
    from tunix.models.qwen2 import model as qwen2_model

    for layer in model.layers:
        layer.config = dataclasses.replace(layer.config, remat_config=qwen2_model.RematConfig.DECODER)


def run_tunix(work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    import jax
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.utils import mesh as mesh_lib

    lengths: list[list[int]] = []
    total = spec["warmup"] + spec["steps"]
    prompts_per_step = spec["batch"] // spec["generations"]
    started = time.perf_counter()
    mesh = mesh_lib.create_mesh((1, 1), ("fsdp", "tp"))
    with mesh:  # tunix 0.1.7 reads the legacy mesh context (jax.set_mesh is invisible to it)
        # The sampler takes the model's graph as it is now.
        actor = tunix_model(work / "model", spec, rematerialise=False)
        training = rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
            eval_every_n_steps=NEVER, max_steps=total, checkpoint_root_directory=None)
        rollout = base_rollout.RolloutConfig(
            max_tokens_to_generate=spec["completion"], max_prompt_length=spec["prompt_bucket"],
            # Not derived by Tunix: the sampler refuses prompt + completion >= kv_cache_size.
            kv_cache_size=spec["prompt_bucket"] + spec["completion"] + 64, temperature=1.0, top_p=1.0, top_k=None,
            seed=None)
        cluster = rl_cluster_lib.RLCluster(
            actor=actor, reference=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(work / "tokenizer"),
            cluster_config=rl_cluster_lib.ClusterConfig(
                role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                                      rl_cluster_lib.Role.ROLLOUT)},
                rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout))
        rematerialise_decoder_layers(cluster.actor_trainer.model)
        learner = grpo_learner.GRPOLearner(
            rl_cluster=cluster, reward_fns=[make_length_reward(spec, lengths)],
            algo_config=grpo_learner.GRPOConfig(num_generations=spec["generations"], num_iterations=1, beta=0.0,
                                                epsilon=EPSILON, loss_agg_mode="token-mean"))
        setup = time.perf_counter() - started
        clock = StepClock(lambda: jax.block_until_ready(nnx.state(cluster.actor_trainer.model)), spec["warmup"],
                          total)
        run_global_step = learner._run_global_step  # one rollout + actor update; the only per-step seam
        done = 0

        def timed_global_step(*args: Any, **kwargs: Any) -> None:
            nonlocal done
            run_global_step(*args, **kwargs)
            done += 1
            clock.steps_done(done)

        learner._run_global_step = timed_global_step

        def batches() -> Iterator[dict[str, np.ndarray]]:
            prompts = load_prompts(work)
            for step in range(total):  # numpy arrays, not lists: Tunix repeats each value num_generations times
                start = (step * prompts_per_step) % len(prompts)
                yield {"prompts": np.array([prompts[(start + i) % len(prompts)] for i in range(prompts_per_step)])}

        clock.start()
        learner.train(batches())
    return {**clock.result(spec["batch"], spec["completion"]), **length_summary(lengths, spec["warmup"]),
            "setup_s": setup, "backend": jax.default_backend()}


RUNNERS: dict[str, Callable[[Path, dict[str, Any]], dict[str, Any]]] = {
    **{side: functools.partial(run_torchlike, side=side) for side in TORCHLIKE_ROLLOUTS}, "trl": run_trl,
    "tunix": run_tunix}


def run_child(args: argparse.Namespace) -> None:
    """Runs one side and prints its result line (JAX sides: with the compilations after the warmup)."""
    work = Path(args.work)
    spec = json.loads((work / "spec.json").read_text())
    compilations = record_compilations() if args.child != "trl" else None
    started = time.perf_counter()
    record = RUNNERS[args.child](work, spec)
    if compilations is not None:
        warmed_at = record["train_called_at"] + (record.get("warmup_end_s") or float("inf"))
        during = [seconds for end, seconds in compilations if end >= record["train_called_at"]]
        record.update(late_compilations=[seconds for end, seconds in compilations
                                         if end > warmed_at and seconds >= LATE_COMPILE_S],
                      compile_s_in_train=sum(during), compilations_in_train=len(during))
    record.pop("tokens_per_s", None)  # StepClock's SFT figure; GRPO steps are compared by seconds
    # A step's rollout waits for the previous update, so the loop's step intervals are whole steps here.
    record["median_step_s"] = record.pop("host_step_s")
    record.update(side=args.child, child_seconds=time.perf_counter() - started)
    print_result(record)


# --------------------------------------------------------------------------- driver


def run_side(work: Path, spec: dict[str, Any], side: str, repeat: int) -> dict[str, Any]:
    """Runs one side in a fresh interpreter (torchlike on an empty compilation cache); its record or ``error``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--work", str(work)]
    environment = child_environment(cpu=spec["device"] == "cpu", compilation_cache=work / f"jax-cache-{side}-{repeat}")
    return run_child_process(command, environment, labels={"side": side})


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Adds each side's median (``vs_<baseline>``) and mean (``vs_<baseline>_mean``) seconds per step over TRL's and
    over raw Tunix's, in place (lower is faster)."""
    for record in rows.values():
        for baseline in ("trl", "tunix", "torchlike_static"):
            for key, suffix in (("median_step_s", ""), ("step_s", "_mean")):
                base, mine = rows.get(baseline, {}).get(key), record.get(key)
                record[f"vs_{baseline}{suffix}"] = mine / base if mine and base else None


TABLE = (
    Column("side", 17, "side", align="<"), Column("setup s", 8, "setup_s", ".2f"),
    Column("first s", 9, "first_step_s", ".2f"), Column("warmup s", 9, "warmup_end_s", ".2f"),
    Column("mean s", 9, "step_s", ".4f"), Column("median s", 9, "median_step_s", ".4f"),
    Column("late comp", 10, lambda r: len(r["late_compilations"]) if "late_compilations" in r else None, "d"),
    Column("tokens", 8, "completion_tokens_mean", ".1f"), Column("vs trl", 8, "vs_trl", ".2f"),
    Column("vs tunix", 9, "vs_tunix", ".2f"), Column("vs trl mean", 12, "vs_trl_mean", ".2f"),
    Column("vs static", 10, "vs_torchlike_static", ".2f"),
)


def resolve_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The preset with the command line's overrides applied."""
    spec = dict(PRESETS[args.preset])
    for key in ("layers", "hidden", "intermediate", "vocab", "completion", "dtype", "warmup", "steps", "device",
                "torch_threads"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if spec["hidden"] % spec["heads"]:
        raise SystemExit(f"hidden={spec['hidden']} must divide by heads={spec['heads']}; pass another --hidden.")
    if spec["warmup"] < 1 or spec["steps"] < 1:
        raise SystemExit(f"--warmup ({spec['warmup']}) and --steps ({spec['steps']}) must be at least 1.")
    if spec["vocab"] <= FIRST_WORD_ID + 1:
        raise SystemExit(f"--vocab {spec['vocab']} leaves no words after the {FIRST_WORD_ID} special tokens.")
    return spec


def print_progress(record: dict[str, Any], repeat: int, repeats: int) -> None:
    where = f"  [{repeat + 1}/{repeats}] {record['side']:<10}"
    if "error" in record:
        print(f"{where}FAILED: {error_summary(record['error'])}", flush=True)
        return
    print(f"{where}setup {record['setup_s']:.2f}s, first step {record['first_step_s']:.2f}s, "
          f"{record['step_s']:.4f} s/step (median {record['median_step_s']:.4f}), "
          f"{record['completion_tokens_mean']:.1f} tokens per completion "
          f"(on {record.get('backend')}, process {record['process_seconds']:.0f}s, load {record['load_before']:.1f})",
          flush=True)


def run_driver(args: argparse.Namespace) -> None:
    spec = resolve_spec(args)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; choose from {','.join(SIDES)}.")
    work = Path(tempfile.mkdtemp(prefix="grpo_step_", dir=args.workdir))
    try:
        print(f"spec: {spec}", flush=True)
        started = time.perf_counter()
        write_inputs(work, spec)
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"checkpoint, tokenizer and {spec['prompts']} prompts written in {time.perf_counter() - started:.1f}s",
              flush=True)
        skipped: dict[str, dict[str, Any]] = {}
        runs: dict[str, list[dict[str, Any]]] = {}
        for side in sides:
            missing = missing_packages(SIDE_PACKAGES[side])
            if missing:
                skipped[side] = {"side": side, "skipped": f"missing package(s) {', '.join(missing)}"}
                print(f"  {side:<10}skipped: {skipped[side]['skipped']}", flush=True)
        for repeat in range(args.repeats):
            for side in sides:
                if side not in skipped:
                    record = run_side(work, spec, side, repeat)
                    runs.setdefault(side, []).append(record)
                    print_progress(record, repeat, args.repeats)
        rows = {side: skipped[side] if side in skipped else best_of(runs[side]) for side in sides}
        for record in rows.values():
            record.pop("first_step_warm_s", None)  # best_of's SFT-only field
    finally:
        shutil.rmtree(work, ignore_errors=True)

    add_ratios(rows)
    table = format_table(TABLE, ({**r, "side": side} for side, r in rows.items()))
    machine = machine_info()
    print()
    print(f"machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs, {machine['platform']}")
    print(f"{spec['layers']} layers, hidden {spec['hidden']}, vocab {spec['vocab']}, {spec['dtype']}, "
          f"{spec['batch']} completions/step ({spec['generations']} per prompt), up to {spec['completion']} tokens, "
          f"{spec['warmup']} warmup + {spec['steps']} measured steps, device {spec['device']}")
    print(table)
    backends = {side: r.get("backend") for side, r in rows.items() if r.get("backend")}
    threads = rows.get("trl", {}).get("torch_threads")
    print("backends: " + ", ".join(f"{side}: {backend}" for side, backend in backends.items())
          + (f"; TRL torch threads: {threads}" if threads else ""))
    if spec["device"] == "gpu" and any("cpu" in str(backend) for backend in backends.values()):
        print("WARNING: --device gpu but some side ran on the CPU (no CUDA jaxlib / torch build?): compare with care.")
    result = {"command": [sys.executable, *sys.argv], "preset": args.preset, "spec": spec, "machine": machine,
              "learning_rate": LEARNING_RATE, "results": rows, "table": table}
    print(f"\nwrote {write_json(args.output, result)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ",".join(SIDES))
    parser.add_argument("--steps", type=int, help="measured steps after warmup")
    parser.add_argument("--warmup", type=int, help="steps before the measured window (the first ones compile)")
    for name in ("layers", "hidden", "intermediate", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--completion", type=int, help="max_completion_length")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and compute dtype")
    parser.add_argument("--device", choices=("cpu", "gpu"), help="cpu forces JAX_PLATFORMS=cpu and use_cpu=True")
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads for TRL (default: torch's own, one per core); on a machine other "
                             "processes keep busy, 1 can be much faster than 2")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per side, interleaved; the one with the shortest step is reported")
    parser.add_argument("--workdir", help="where the temporary checkpoint goes (default: the system temp dir)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="JSON results file")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
