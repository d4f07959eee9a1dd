"""Training torchlike's trainer and the real TRL one from the same weights (and the same ``peft`` LoRA adapter) on the
same rows in order, and comparing the runs within what bf16 mixed precision allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests import tiny


def write_lora_adapter(base_path: Path, directory: Path) -> Path:
    """A LoRA adapter (r=4, alpha 8, every linear layer of Llama-style names) written by ``peft``, with its own random
    ``lora_A`` and a non-zero ``lora_B`` (so the adapter changes the outputs from the first step)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                       target_modules=tiny.LLAMA_LORA_TARGETS))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return directory


def trl_model(path: Path, adapter_dir: Path | None = None) -> Any:
    """The float32 transformers model of ``path`` (TRL's autocast computes in bf16 on these fp32 master weights),
    with the trainable adapter of ``adapter_dir`` when given."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model if adapter_dir is None else peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def torchlike_model(path: Path, adapter_dir: Path | None = None) -> Any:
    """torchlike's float32 model of ``path``, with the trainable adapter of ``adapter_dir`` when given."""
    import torchlike
    from torchlike.peft import PeftModel

    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return model if adapter_dir is None else PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def saved_params(model: Any, folder: Path) -> dict[str, np.ndarray]:
    """The arrays ``model.save_pretrained(folder)`` writes (the whole model, or only the adapter of a LoRA model), by
    their names in the files: the same names for transformers/peft and torchlike."""
    from safetensors.numpy import load_file

    model.save_pretrained(folder)
    params = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        params.update(load_file(file))
    return params


def relative_weight_difference(params: dict, expected: dict, initial: dict) -> float:
    """``||w_ours - w_trl|| / ||w_trl - w_initial||`` over every array together: the distance between the two runs'
    final weights as a fraction of how far training moved them."""
    assert set(params) == set(expected) == set(initial)
    gap = sum(float(np.sum((params[name].astype(np.float64) - expected[name]) ** 2)) for name in expected)
    update = sum(float(np.sum((expected[name].astype(np.float64) - initial[name]) ** 2)) for name in expected)
    return (gap / update) ** 0.5

