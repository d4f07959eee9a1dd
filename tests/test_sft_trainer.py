"""SFTTrainer end to end: TRL's constructor, prompt/completion data, LoRA, save_model."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import SFTConfig
from torchlike.trl.trainer.sft_trainer import SFTTrainer

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


def sft_trainer(tiny_checkpoints, tokenizer, tmp_path, data=DATA, **overrides):
    return SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path, **overrides), train_dataset=data,
                      processing_class=tokenizer)


def test_seed_initialises_the_lora_adapter_the_trainer_creates(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)

    def adapter(seed):
        trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path, seed=seed),
                             train_dataset=DATA, processing_class=tokenizer,
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        return {key: np.asarray(value) for key, value in trainer.model.state_dict().items() if "lora_a" in key}

    first, again, other = adapter(1), adapter(1), adapter(2)
    assert first and first.keys() == again.keys() == other.keys()
    for key in first:
        np.testing.assert_array_equal(again[key], first[key])
        assert not np.allclose(other[key], first[key]), key


def test_pad_to_multiple_of_rounds_the_padded_length_up(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)

    def padded_length(**overrides):
        trainer = sft_trainer(tiny_checkpoints, tokenizer, tmp_path, **overrides)
        return trainer.data_collator([trainer.train_dataset[i] for i in range(2)])["input_ids"].shape[1]

    longest = max(len(e["input_ids"]) for e in sft_trainer(tiny_checkpoints, tokenizer, tmp_path).train_dataset)
    assert padded_length() == longest  # the longest prepared example, not max_length (TRL pads to the longest)
    assert padded_length(pad_to_multiple_of=8) == -(-longest // 8) * 8 != longest
    assert padded_length(max_length=longest - 3) == longest - 3  # examples truncated to max_length
    assert padded_length(max_length=None, pad_to_multiple_of=8) == -(-longest // 8) * 8


def test_chat_template_path_takes_a_jinja_file_or_a_tokenizer(tiny_checkpoints, tokenizer_dir, tmp_path):
    template = ("{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + eos_token }}"
                "{%- endfor %}")
    (tmp_path / "chat.jinja").write_text(template)
    source = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    source.chat_template = template.replace(": ", " says ")
    source.save_pretrained(tmp_path / "source")
    messages = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}] * 4

    for path, expected in ((tmp_path / "chat.jinja", template), (tmp_path / "source", source.chat_template)):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
        trainer = sft_trainer(tiny_checkpoints, tokenizer, tmp_path, messages, chat_template_path=str(path))
        assert tokenizer.chat_template == expected
        assert trainer.train_dataset[0]["input_ids"] == tokenizer.apply_chat_template(
            messages[0]["messages"], tokenize=True, return_dict=True)["input_ids"]

    source.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    source.save_pretrained(tmp_path / "bigger")
    with pytest.raises(ValueError, match=r"tokens \['<\|tool\|>'\].*resizes the model's embeddings"):
        sft_trainer(tiny_checkpoints, torchlike.AutoTokenizer.from_pretrained(tokenizer_dir), tmp_path, messages,
                    chat_template_path=str(tmp_path / "bigger"))


def test_pad_token_sets_the_padding_id_of_the_batches(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.warns(FutureWarning, match="pad_token is deprecated"):
        trainer = sft_trainer(tiny_checkpoints, tokenizer, tmp_path, pad_token="<unk>")
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    assert tokenizer.pad_token == "<unk>" and trainer.pad_token_id == unk
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert (batch["input_ids"][batch["attention_mask"] == 0] == unk).all()
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="pad_token='<nope>' is not in the vocabulary"):
        sft_trainer(tiny_checkpoints, tokenizer, tmp_path, pad_token="<nope>")


def test_skip_prepare_dataset_uses_the_rows_as_given(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [{"input_ids": list(range(3, 43)), "labels": [-100] * 30 + list(range(33, 43)), "text": "unused"},
            {"input_ids": [5, 6, 7]}]
    trainer = sft_trainer(tiny_checkpoints, tokenizer, tmp_path, rows, max_length=32,
                          dataset_kwargs={"skip_prepare_dataset": True})
    assert trainer.train_dataset is rows  # the data as given, as in TRL
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape == (2, 40)  # not truncated to 32
    np.testing.assert_array_equal(batch["loss_mask"][0], [0] * 30 + [1] * 10)
    np.testing.assert_array_equal(batch["loss_mask"][1, :3], [1, 1, 1])  # no eos appended, loss on every token
    assert batch["attention_mask"][1].sum() == 3
    with pytest.raises(ValueError, match="mask columns but no 'labels'"):
        sft_trainer(tiny_checkpoints, tokenizer, tmp_path, [{"input_ids": [5, 6], "completion_mask": [0, 1]}],
                    dataset_kwargs={"skip_prepare_dataset": True})


def test_a_dataset_with_a_transform_needs_skip_prepare_dataset_as_in_trl(tiny_checkpoints, tokenizer_dir, tmp_path):
    import datasets
    import transformers
    import trl

    def transformed():
        return datasets.Dataset.from_dict({"text": ["hello world", "the quick brown fox"] * 4}).with_transform(
            lambda batch: {"text": [text.upper() for text in batch["text"]]})

    path = tiny_checkpoints.path("qwen2")
    with pytest.raises(ValueError) as theirs:
        trl.SFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(path),
                       args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none"),
                       train_dataset=transformed(),
                       processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError) as ours:
        sft_trainer(tiny_checkpoints, tokenizer, tmp_path, transformed())
    assert str(ours.value) == str(theirs.value)
    assert "skip_prepare_dataset" in str(ours.value)
