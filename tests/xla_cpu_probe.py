"""Run as a script: imports torchlike, then compiles a rematerialised SFT step's gradient of a tiny Qwen2 (hidden 64)
with 1 and with 2 layers at sequence length 512, and prints a JSON line with the scheduler status and XLA's temporary
bytes for each depth."""

# ruff: noqa: I001  (torchlike must be imported before JAX starts)
import json

import torchlike  # noqa: F401  (before JAX starts, as a user's script does)
from torchlike.adapters.runtime import xla_cpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from torchlike.adapters.training import train_step
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.families import family_for_config  # noqa: E402
from torchlike.testing import tiny_config  # noqa: E402

SEQ = 512
LAYERS = (1, 2)


def temporaries(layers: int) -> int:
    config = tiny_config("qwen2", num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2)
    family = family_for_config(config)
    module = nnx.eval_shape(lambda: family.build_model(config, jnp.float32, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    loss = sft_loss.sft_step_loss(family)

    def value(params, batch):
        model = nnx.merge(graphdef, params, rest)
        with train_step.rematerialised(model):
            total, weight, _ = loss(model, batch, None)
        return total / weight

    batch = {name: jax.ShapeDtypeStruct((1, SEQ), jnp.int32) for name in ("input_ids", "attention_mask", "loss_mask")}
    return jax.jit(jax.grad(value)).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


print(json.dumps({"status": xla_cpu.status, "temp_bytes": {layers: temporaries(layers) for layers in LAYERS}}))
