"""SFTTrainer end to end: TRL's constructor, prompt/completion data, LoRA, save_model."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import SFTConfig
from torchlike.trl.sft_trainer import SFTTrainer

DATA = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog"},
        {"prompt": "one two", "completion": " three four five six"}] * 8


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_length=32, per_device_train_batch_size=4, max_steps=12,
                  learning_rate=1e-2, logging_steps=4, report_to="none", save_strategy="no")
    values.update(overrides)
    return SFTConfig(**values)


def test_lora_sft_from_a_model_path_lowers_the_loss_and_saves_a_peft_adapter(tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path), train_dataset=DATA,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert result.global_step == 12 and np.isfinite(losses).all() and losses[-1] < losses[0]
    trainer.save_model()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "out").iterdir()}


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"pad_token": "<|my_pad|>"})
    with pytest.raises(ValueError, match="outside the model's vocab_size=128"):
        SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path), train_dataset=DATA,
                   processing_class=tokenizer)


def test_torch_only_hooks_are_refused(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs is a torch hook"):
        SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path), train_dataset=DATA,
                   processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                   optimizer_cls_and_kwargs=(object, {}))


def test_shuffle_dataset_shuffles_the_prepared_examples_once_by_seed(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = [{"prompt": f"{'one ' * (i + 1)}", "completion": " two"} for i in range(8)]

    def prepared(**overrides):
        trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path, **overrides),
                             train_dataset=data, processing_class=tokenizer)
        return [len(example["input_ids"]) for example in trainer.train_dataset]

    in_order = prepared()
    shuffled = prepared(shuffle_dataset=True, seed=3)
    assert in_order == sorted(in_order) and shuffled != in_order and sorted(shuffled) == in_order
    assert prepared(shuffle_dataset=True, seed=3) == shuffled
