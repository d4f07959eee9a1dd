"""SFT packing and padding-free batches: TRL 1.16's packed rows, one position count and one attention block per packed
sequence, and the same loss as without packing."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests.helpers.data import WORDS
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.model import tunix_model
from torchlike.trl import SFTConfig, SFTTrainer
from torchlike.trl.data.packing import pack_rows
from torchlike.trl.data.sft_data import collate_sft_batch


def tokenised_rows(count: int, seed: int = 0, longest: int = 40) -> list[dict]:
    """Pre-tokenised rows of 1..longest tokens with some labels off the loss; equal lengths occur (ties in BFD)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        ids = rng.integers(3, 128, int(rng.integers(1, longest + 1))).tolist()
        prompt = int(rng.integers(0, len(ids)))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def prompt_completion_data(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = WORDS.split()
    return [{"prompt": " ".join(rng.choice(words, int(rng.integers(1, 5)))),
             "completion": " " + " ".join(rng.choice(words, int(rng.integers(1, 8))))} for _ in range(count)]


def config(tmp_path, **overrides) -> SFTConfig:
    # bf16 off: these tests compare packed and unpacked losses in float32 (gradient checkpointing stays on).
    values = dict(output_dir=str(tmp_path / "out"), max_length=48, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1, bf16=False,
                  report_to="none", save_strategy="no", train_sampling_strategy="sequential")
    values.update(overrides)
    return SFTConfig(**values)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packed_rows_equal_trl_pack_dataset(strategy):
    import datasets
    import trl

    rows = tokenised_rows(1300)  # more than one of pack_dataset's 1000-example map batches
    expected = trl.pack_dataset(datasets.Dataset.from_list(rows), 16, strategy)[:]
    packed = pack_rows(rows, 16, strategy)
    assert [row["input_ids"] for row in packed] == expected["input_ids"]
    assert [row["labels"] for row in packed] == expected["labels"]
    if strategy == "wrapped":
        assert "seq_lengths" not in expected and all("seq_lengths" not in row for row in packed)
    else:
        assert [row["seq_lengths"] for row in packed] == expected["seq_lengths"]


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_padding_free_batches_have_trl_position_ids_and_labels(strategy):
    import datasets
    import trl
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    packed = trl.pack_dataset(datasets.Dataset.from_list(tokenised_rows(24)), 16, strategy)
    examples = [packed[i] for i in range(4)]
    reference = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    batch = collate_sft_batch(examples, pad_token_id=0, length=16, position_ids=True)
    real = batch["attention_mask"].astype(bool)
    labels = np.where(batch["loss_mask"] == 1, batch["input_ids"], -100)
    np.testing.assert_array_equal(batch["position_ids"][real], reference["position_ids"][0].numpy())
    np.testing.assert_array_equal(labels[real], reference["labels"][0].numpy())  # -100 at each sequence's start
    assert (batch["position_ids"][~real] == 0).all()


def test_a_packed_row_gives_each_sequence_the_logits_it_has_alone(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    rng = np.random.default_rng(1)
    sequences = [rng.integers(3, 128, length).tolist() for length in (7, 12, 5)]
    row = {"input_ids": sum(sequences, []), "labels": sum(sequences, []), "seq_lengths": [7, 12, 5]}
    batch = collate_sft_batch([row], pad_token_id=0, length=28, position_ids=True)
    packed = np.asarray(tunix_model.causal_lm_logits(model.family, model.module, batch))
    start = 0
    for sequence in sequences:
        alone = collate_sft_batch([{"input_ids": sequence, "labels": sequence}], pad_token_id=0, length=len(sequence))
        expected = np.asarray(tunix_model.causal_lm_logits(model.family, model.module, alone))[0]
        np.testing.assert_allclose(packed[0, start:start + len(sequence)], expected, atol=1e-5, rtol=1e-5)
        start += len(sequence)


def test_the_packed_loss_equals_the_unpacked_loss(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    rows = tokenised_rows(12, seed=3, longest=14)
    loss = sft_loss.sft_step_loss(model.family)
    unpacked = collate_sft_batch(rows, pad_token_id=0, length=14)
    packed = collate_sft_batch(pack_rows(rows, 32, "bfd"), pad_token_id=0, length=32, position_ids=True)
    (value, weight, _), (packed_value, packed_weight, _) = (loss(model.module, unpacked), loss(model.module, packed))
    assert float(packed_weight) == float(weight) > 0
    np.testing.assert_allclose(float(packed_value) / float(packed_weight), float(value) / float(weight), rtol=1e-5)


def test_sft_packing_trains_on_trl_packed_rows_and_evaluates_to_the_unpacked_loss(tiny_checkpoints, tokenizer_dir,
                                                                                    tmp_path):
    from torchlike.adapters.runtime import tracing

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = prompt_completion_data(24)
    path = str(tiny_checkpoints.path("qwen2"))
    packed = SFTTrainer(model=path, args=config(tmp_path, packing=True), train_dataset=data, eval_dataset=data,
                        processing_class=tokenizer)
    assert packed.padding_free and packed.train_dataset.column_names == ["input_ids", "labels", "seq_lengths"]
    assert len(packed.train_dataset) < len(data)
    unpacked = SFTTrainer(model=path, args=config(tmp_path, packing=True, eval_packing=False), train_dataset=data,
                          eval_dataset=data, processing_class=tokenizer)
    assert "seq_lengths" not in unpacked.eval_dataset.column_names
    np.testing.assert_allclose(packed.evaluate()["eval_loss"], unpacked.evaluate()["eval_loss"], rtol=1e-5)

    before = tracing.TRACE_COUNTS["train_step"]
    result = packed.train()
    assert result.global_step == 3 and np.isfinite(result.training_loss)
    assert tracing.TRACE_COUNTS["train_step"] == before + 1  # one compilation for every packed batch


def label_nll(prediction) -> dict[str, float]:
    """compute_metrics: the mean NLL of the label tokens under the predicted logits (what eval_loss averages)."""
    logits, labels = np.asarray(prediction.predictions, np.float64)[:, :-1], prediction.label_ids[:, 1:]
    keep = labels != -100
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(log_probs, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return {"label_nll": float(-(picked * keep).sum() / keep.sum())}


def test_compute_metrics_on_packed_eval_rows_sees_each_sequence_alone(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    data, path = prompt_completion_data(12), str(tiny_checkpoints.path("qwen2"))
    metrics = {}
    for eval_packing in (True, False):
        trainer = SFTTrainer(model=path, args=config(tmp_path, packing=True, eval_packing=eval_packing),
                             train_dataset=data, eval_dataset=data, processing_class=tokenizer,
                             compute_metrics=label_nll)
        metrics[eval_packing] = trainer.evaluate()
    for found in metrics.values():
        np.testing.assert_allclose(found["eval_label_nll"], found["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics[True]["eval_label_nll"], metrics[False]["eval_label_nll"], rtol=1e-5)


def test_padding_free_without_packing_equals_padded_training(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = prompt_completion_data(12)
    path = str(tiny_checkpoints.path("qwen2"))

    def losses(**overrides):
        trainer = SFTTrainer(model=path, args=config(tmp_path, max_length=None, **overrides), train_dataset=data,
                             processing_class=tokenizer)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    np.testing.assert_allclose(losses(padding_free=True), losses(), rtol=1e-5)


def test_padding_free_keeps_trl_rules(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    path = str(tiny_checkpoints.path("qwen2"))
    data = prompt_completion_data(4)
    with pytest.raises(ValueError, match="When `padding_free=True` without packing, `max_length` is not enforced"):
        SFTTrainer(model=path, args=config(tmp_path, padding_free=True), train_dataset=data,
                   processing_class=tokenizer)
    with pytest.raises(ValueError, match="custom data collator is not supported when using padding-free"):
        SFTTrainer(model=path, args=config(tmp_path, packing=True), train_dataset=data, processing_class=tokenizer,
                   data_collator=lambda rows: rows)
