"""The training runs shared by the 8-device checks (one process) and the 2-process test (``jax.distributed``).

Usage (one of several processes): JAX_COORDINATOR_ADDRESS=... JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
    python -m tests.distributed_worker OUT.json JOBS.json
``JOBS.json`` names the checkpoint, the tokenizer, the shared output folder and TRL's ported scripts with their
command lines. Each process writes what it measured as JSON to ``OUT.json``; the files the runs save land in the
shared output folder, as on a pod with shared storage.
"""

from __future__ import annotations

import faulthandler
import json
import runpy
import signal
import sys
import tempfile
from pathlib import Path

MESH_SHAPE = (4, 2)
STEPS = 4
GRPO_LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def train_losses(checkpoint: Path, mesh_shape: tuple[int, ...] | None, per_device: int, lora: bool = False,
                 output_dir: str | None = None, load_on_mesh: bool = True,
                 target_modules: str | list[str] = "all-linear") -> dict:
    """Losses of ``STEPS`` SFT steps on ``tiny.padded_examples`` with a global batch of
    ``per_device x data-parallel size`` rows, plus the train-step trace count. With ``output_dir``,
    a checkpoint is saved there at step 2; ``lora`` adapts ``target_modules``.
    ``load_on_mesh=False`` loads the model without a mesh and
    leaves its placement to the Trainer (``mesh_shape`` in the arguments), as TRL scripts do."""
    import torchlike
    from tests import tiny
    from torchlike.adapters.runtime import tracing
    from torchlike.peft import LoraConfig, get_peft_model

    with tempfile.TemporaryDirectory() as scratch:
        args = torchlike.TrainingArguments(
            output_dir=output_dir or scratch, per_device_train_batch_size=per_device, max_steps=STEPS,
            learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none", seed=0, bf16=False,
            save_strategy="steps" if output_dir else "no", save_steps=2, save_total_limit=1,
            gradient_checkpointing=False, weight_decay=0.0, train_sampling_strategy="sequential", disable_tqdm=True,
            mesh_shape=mesh_shape)
        mesh = torchlike.make_mesh(mesh_shape) if mesh_shape else None
        model = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh if load_on_mesh else None)
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
        traces = tracing.TRACE_COUNTS["train_step"]
        trainer = torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(40, seed=7))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return {"losses": losses, "traces": tracing.TRACE_COUNTS["train_step"] - traces,
                "global_batch": trainer.state.train_batch_size}


def grpo_lora_run(checkpoint: Path, tokenizer_dir: Path, output_dir: Path, resume: str | None = None,
                  export: bool = False, max_staleness: int = 0) -> dict:
    """GRPO with LoRA for ``STEPS`` steps on fsdp=4 x tp=2, with a reference policy (``beta``) and two passes over
    each generation batch (``num_iterations=2``, so old-policy log-probs are computed), saving every 2 steps.

    The model is loaded without a mesh, as TRL scripts load it. Returns the losses and the number of completions
    the reward function scored at each call on this process; with ``export``, ``save_model`` writes the adapter
    to ``output_dir/final``. Sampled with the default engine (the CPU's: paged); ``max_staleness=2`` samples each
    generation batch while the one before trains, with the static engine, so both engines run on two processes.
    """
    import torchlike
    from torchlike.peft import LoraConfig
    from torchlike.trl import GRPOConfig, GRPOTrainer

    scored: list[int] = []

    def length_reward(completions, **kwargs):
        scored.append(len(completions))
        return [-abs(len(completion) - 20) / 20 for completion in completions]

    prompts = [{"prompt": p} for p in ("the quick brown", "one two three", "hello world", "lazy dog")]
    args = GRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, num_generations=4,
                      max_completion_length=8, max_steps=STEPS, learning_rate=1e-2, num_iterations=2, beta=0.04,
                      logging_steps=1, save_steps=2, report_to="none", disable_tqdm=True,
                      mesh_shape=MESH_SHAPE, max_staleness=max_staleness,
                      rollout_engine="static" if max_staleness else None,
                      save_strategy="no" if max_staleness else "steps")
    trainer = GRPOTrainer(torchlike.AutoModelForCausalLM.from_pretrained(checkpoint), reward_funcs=length_reward,
                          args=args, train_dataset=prompts,
                          processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                          peft_config=LoraConfig(**GRPO_LORA))
    trainer.train(resume_from_checkpoint=resume)
    if export:
        trainer.save_model(str(output_dir / "final"))
    return {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "scored_per_call": scored}


def run_script(script: str, arguments: list[str]) -> None:
    """Runs a ported TRL script as ``python <script> <arguments>`` would, in this process."""
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks (tests/test_mesh.py asks on timeout)
    import jax

    out_path, jobs_path = sys.argv[1:]
    jobs = json.loads(Path(jobs_path).read_text())
    folder = Path(jobs["output_dir"])
    # Loaded as TRL scripts load it (no mesh): the Trainer places it on the mesh that spans both processes. The
    # TrainingArguments it creates join the processes (no JAX work may come before).
    result = {"sft": train_losses(Path(jobs["checkpoint"]), MESH_SHAPE, per_device=2,
                                  output_dir=str(folder / "sft_two_processes"), load_on_mesh=False)}
    result.update(process_index=jax.process_index(), process_count=jax.process_count(),
                  local_devices=jax.local_device_count(), devices=jax.device_count())
    result["grpo_lora"] = grpo_lora_run(Path(jobs["checkpoint"]), Path(jobs["tokenizer_dir"]), folder / "grpo_lora",
                                        export=True)
    result["grpo_lora_ahead"] = grpo_lora_run(Path(jobs["checkpoint"]), Path(jobs["tokenizer_dir"]),
                                              folder / "grpo_lora_ahead", max_staleness=2)
    for name, (script, arguments) in jobs["scripts"].items():
        run_script(script, arguments)
        result[f"{name}_script"] = "completed"
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
