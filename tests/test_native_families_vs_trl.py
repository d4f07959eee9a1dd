"""SFT on every family of the native decoder equals the real ``trl.SFTTrainer`` step for step, full fine-tuning and
LoRA (both libraries start from the same adapter, written by ``peft``).

Completion-only loss on padded prompt-completion rows, gradient accumulation, warmup, weight decay and active
clipping; gradient checkpointing at TRL's default (on), float32 on both sides. Loss and grad norm agree to 1e-4 per
step.
"""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.data import prompt_completion_data
from tests.helpers.logs import logged
from torchlike.peft import PeftModel
from torchlike.trl import SFTConfig, SFTTrainer

STEPS = 4
SETTINGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, adam_epsilon=1e-4,
                max_length=32, logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")
# Below every step's gradient norm, so clipping is active (Granite's logits divisor keeps its gradients small).
MAX_GRAD_NORM = {False: 0.1, True: 0.005}


def _trl_run(path, tokenizer_dir, output_dir, data, settings, adapter_dir=None):
    import datasets
    import peft
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(output_dir), use_cpu=True, **settings),
                             train_dataset=datasets.Dataset.from_list(data),
                             processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    return trainer.state.log_history


def _write_adapter(path, case: str, directory) -> None:
    """A LoRA adapter written by ``peft`` with its own random ``lora_A`` and a non-zero ``lora_B`` (so the adapter
    changes the outputs from the first step)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=tiny.lora_targets(case))
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(directory)


# One case per family (the LongRoPE and sequential GPT-NeoX variants differ in the forward pass, checked against
# transformers in test_native_families.py).
FAMILY_CASES = [case for case in tiny.NATIVE_CASES if case not in ("phi3_longrope", "gpt_neox_sequential")] + [
    "qwen3_5", "qwen3_5_moe", "lfm2"]  # the hybrids (gated DeltaNet and short-convolution layers) too


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_sft_equals_trl_step_for_step(case, lora, tiny_checkpoints, tokenizer_dir, tmp_path):
    path = tiny_checkpoints.path(case)
    data = prompt_completion_data(STEPS * 4)
    adapter_dir = None
    if lora:
        adapter_dir = tmp_path / "adapter"
        _write_adapter(path, case, adapter_dir)
    settings = {**SETTINGS, "max_grad_norm": MAX_GRAD_NORM[lora]}
    expected = _trl_run(path, tokenizer_dir, tmp_path / "trl", data, settings, adapter_dir)

    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    if lora:
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "ours"),
                                                     train_sampling_strategy="sequential", **settings),
                         train_dataset=data, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    ours = trainer.state.log_history
    assert min(logged(expected, "grad_norm")) > settings["max_grad_norm"]  # clipping is active every step
    for key in ("loss", "grad_norm"):
        assert len(logged(expected, key)) == STEPS, key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=f"{case} {key}")
