"""torchlike's ``Trainer``: the transformers training loop on a JAX device mesh.

``trainer`` is the recipe (constructor, loop, evaluation, logging, saving); the other modules are its components:

- ``model_interface``: what the loop reads from a model; a bare ``flax.nnx.Module`` wrapped to match a ``CausalLM``;
- ``device_mesh``: the mesh a run uses and the model placed on it;
- ``losses``: which step loss runs and which example columns it reads;
- ``lora_step``: LoRA dropout and merged or factored adapted layers in the step;
- ``batches``: examples to fixed-shape global batches on the mesh;
- ``evaluation``: what ``compute_metrics`` receives, built as transformers' ``evaluation_loop`` builds it;
- ``prefetch``: batches prepared ahead in a thread;
- ``step_logs``: step and evaluation outputs as log entries;
- ``checkpoints``: ``checkpoint-<step>`` folders written, rotated and restored;
- ``hub``: ``save_model`` export and Hub uploads;
- ``callbacks``: transformers' callbacks, state and control;
- ``accelerator``: the ``trainer.accelerator`` attributes TRL scripts use.
"""

from .trainer import Trainer, TrainOutput

__all__ = ["TrainOutput", "Trainer"]
