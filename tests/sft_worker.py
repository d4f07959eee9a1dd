"""One short SFT run on a device mesh, shared by the 8-device checks and the 2-process test.

Usage (one of several processes): JAX_COORDINATOR_ADDRESS=... JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
    python -m tests.sft_worker OUT.json CHECKPOINT_DIR OUTPUT_DIR
Writes this process's logged losses as JSON, and a training checkpoint at step 2 into OUTPUT_DIR (shared).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

MESH_SHAPE = (4, 2)
STEPS = 4


def train_losses(checkpoint: Path, mesh_shape: tuple[int, ...] | None, per_device: int, lora: bool = False,
                 output_dir: str | None = None, load_on_mesh: bool = True) -> dict:
    """Losses of ``STEPS`` SFT steps on ``tiny.padded_examples`` with a global batch of
    ``per_device x data-parallel size`` rows, plus the train-step trace count. With ``output_dir``,
    a checkpoint is saved there at step 2. ``load_on_mesh=False`` loads the model without a mesh and
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
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        traces = tracing.TRACE_COUNTS["train_step"]
        trainer = torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(40, seed=7))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return {"losses": losses, "traces": tracing.TRACE_COUNTS["train_step"] - traces,
                "global_batch": trainer.state.train_batch_size}


def main() -> None:
    import jax

    out_path, checkpoint, output_dir = sys.argv[1:]
    # Loaded as TRL scripts load it (no mesh): the Trainer places it on the mesh that spans both processes.
    result = train_losses(Path(checkpoint), MESH_SHAPE, per_device=2, output_dir=output_dir, load_on_mesh=False)
    result.update(process_index=jax.process_index(), process_count=jax.process_count(),
                  local_devices=jax.local_device_count(), devices=jax.device_count())
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
