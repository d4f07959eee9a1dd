"""Tiny models against their transformers reference: logits on the padded batch, the largest difference over real
tokens, checkpoint copies with a changed config, trained-looking LoRA factors and random sequence classifiers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
import transformers
from flax import nnx

import torchlike
from tests import tiny
from torchlike.testing import tiny_config


def reference_model(path: Path, **config_overrides: Any) -> transformers.PreTrainedModel:
    """The float32 transformers model of a checkpoint, eager attention, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype="float32", attn_implementation="eager", **config_overrides).eval()


def reference_logits(path: Path, **config_overrides: Any) -> np.ndarray:
    """:func:`reference_model`'s logits on :func:`tests.tiny.padded_batch`."""
    return tiny.hf_logits(reference_model(path, **config_overrides), *tiny.padded_batch())


def torchlike_logits(path: Path, **config_overrides: Any) -> np.ndarray:
    """torchlike's float32 logits of a checkpoint on :func:`tests.tiny.padded_batch`."""
    ids, mask, _ = tiny.padded_batch()
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32", **config_overrides)
    return np.asarray(model(ids, attention_mask=mask).logits)


def max_diff_on_real_tokens(a: Any, b: Any, rows: Any = slice(None)) -> float:
    """The largest absolute difference of two logits of :func:`tests.tiny.padded_batch` over its real tokens (of
    ``rows`` only, when given)."""
    valid = tiny.padded_batch()[1].astype(bool)[rows]
    return float(np.abs(np.asarray(a)[rows][valid] - np.asarray(b)[rows][valid]).max())


def valid_max_diff(ours: Any, theirs: Any, mask: np.ndarray) -> float:
    """The largest absolute difference of two logits over the tokens ``mask`` marks real."""
    valid = mask.astype(bool)
    return float(np.abs(np.asarray(ours)[valid] - np.asarray(theirs)[valid]).max())


def with_config(source: Path, destination: Path, **changes: Any) -> Path:
    """A copy of a checkpoint whose config.json has ``changes`` applied."""
    shutil.copytree(source, destination)
    config_file = destination / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return destination


def randomize_lora_(model: Any, seed: int = 0, scale: float = 0.1) -> None:
    """Trained-looking adapters: B is zero at init, so give every factor random values."""
    for index, (_, variable) in enumerate(nnx.to_flat_state(nnx.state(model.module, nnx.LoRAParam))):
        value = variable.get_value()
        noise = jax.random.normal(jax.random.key(seed * 1000 + index), value.shape, value.dtype) * scale
        variable.set_value(jax.device_put(noise, value.sharding))


def hf_classifier(family: str, num_labels: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A transformers *ForSequenceClassification with every parameter random (norms near 1), eager attention."""
    torch.manual_seed(seed)
    config = tiny_config(family, num_labels=num_labels)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.2 * noise if "norm" in name else 0.08 * noise)
    return model.eval()


def lora_export_differences(path: Path, folder: Path) -> tuple[float, float]:
    """A LoRA (r=4, alpha 16, every linear layer, random factors) on torchlike's float32 model of ``path``, saved to
    ``folder`` as a PEFT adapter and merged: the largest differences over real tokens from its logits of ``peft``'s
    model of the adapter and of transformers' model of the merged export."""
    import peft

    from torchlike.peft import LoraConfig, get_peft_model

    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(folder / "adapter")
    ids, mask, positions = tiny.padded_batch()
    lora_logits = model(ids, mask).logits
    reference = peft.PeftModel.from_pretrained(reference_model(path), folder / "adapter").eval()
    adapter_difference = max_diff_on_real_tokens(lora_logits, tiny.hf_logits(reference, ids, mask, positions))
    model.merge_and_unload().save_pretrained(folder / "merged")
    reloaded = reference_model(folder / "merged")
    return adapter_difference, max_diff_on_real_tokens(tiny.hf_logits(reloaded, ids, mask, positions), lora_logits)
