"""Evaluation as transformers and TRL run it: several eval datasets with prefixed metrics, raw data passed to
evaluate() prepared like the train set, and compute_metrics fed the EvalPrediction transformers builds on the same
data (checked against a real ``transformers.Trainer`` and ``trl.SFTTrainer`` on the same tiny checkpoint)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.data import PREFERENCES, prompt_completion_data
from torchlike.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

SFT_DATA = prompt_completion_data(14, seed=3)
EXAMPLES = tiny.padded_examples(12, seed=5)


def trainer_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, report_to="none",
                  save_strategy="no", bf16=False, max_steps=2, logging_steps=1, disable_tqdm=True)
    return torchlike.TrainingArguments(**{**values, **overrides})


def sft_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "sft"), per_device_eval_batch_size=4, max_length=32, report_to="none",
                  save_strategy="no", disable_tqdm=True)
    return SFTConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    """One torchlike model for every trainer that only evaluates (evaluation leaves the weights as they are)."""
    return torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)


def sft_trainer(model, tokenizer, tmp_path, eval_dataset, **overrides):
    # Every example in the train set, so every trainer pads its batches to the same length.
    return SFTTrainer(model=model, args=sft_args(tmp_path, **overrides), train_dataset=SFT_DATA,
                      eval_dataset=eval_dataset, processing_class=tokenizer)


# ------------------------------------------------------------------ several eval datasets, raw data in evaluate()
def test_trainer_evaluates_each_dataset_of_a_dict_under_its_own_prefix(model, tmp_path):
    trainer = torchlike.Trainer(model=model, args=trainer_args(tmp_path),
                                eval_dataset={"short": EXAMPLES[:5], "long": EXAMPLES[5:]})
    metrics = trainer.evaluate()
    for name, rows in (("short", EXAMPLES[:5]), ("long", EXAMPLES[5:])):
        alone = torchlike.Trainer(model=model, args=trainer_args(tmp_path), eval_dataset=rows).evaluate()
        np.testing.assert_allclose(metrics[f"eval_{name}_loss"], alone["eval_loss"], rtol=1e-6)
        assert trainer.evaluate(eval_dataset=name)["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)
        assert {f"eval_{name}_runtime", f"eval_{name}_samples_per_second"} <= set(metrics)
    logged = [entry for entry in trainer.state.log_history if "eval_short_loss" in entry or "eval_long_loss" in entry]
    assert len(logged) == 2


def test_evaluate_by_name_needs_a_name_of_the_dict_of_eval_datasets(model, tmp_path):
    named = torchlike.Trainer(model=model, args=trainer_args(tmp_path), eval_dataset={"a": EXAMPLES[:4]})
    with pytest.raises(KeyError, match=r"a dict of \['a'\]"):
        named.evaluate(eval_dataset="b")
    single = torchlike.Trainer(model=model, args=trainer_args(tmp_path), eval_dataset=EXAMPLES[:4])
    with pytest.raises(KeyError, match="not a dict"):
        single.evaluate(eval_dataset="a")


def test_periodic_evaluation_during_training_evaluates_every_dataset(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    trainer = torchlike.Trainer(model=model, args=trainer_args(tmp_path, eval_strategy="steps", eval_steps=2),
                                train_dataset=EXAMPLES, eval_dataset={"a": EXAMPLES[:4], "b": EXAMPLES[4:8]})
    trainer.train()
    evaluated = [entry for entry in trainer.state.log_history if any(key.endswith("_loss") and key.startswith("eval_")
                                                                      for key in entry)]
    assert [sorted(key for key in entry if key.endswith("_loss")) for entry in evaluated] == [["eval_a_loss"],
                                                                                              ["eval_b_loss"]]
    assert all(entry["step"] == 2 for entry in evaluated)


def test_sft_prepares_every_eval_dataset_and_raw_data_passed_to_evaluate(model, tokenizer, tmp_path):
    import datasets

    first, second = SFT_DATA[:6], SFT_DATA[6:]
    trainer = sft_trainer(model, tokenizer, tmp_path,
                          datasets.DatasetDict({"first": datasets.Dataset.from_list(first),
                                                "second": datasets.Dataset.from_list(second)}))
    metrics = trainer.evaluate()
    for name, rows in (("first", first), ("second", second)):
        alone = sft_trainer(model, tokenizer, tmp_path, rows).evaluate()["eval_loss"]
        np.testing.assert_allclose(metrics[f"eval_{name}_loss"], alone, rtol=1e-6)
        np.testing.assert_allclose(trainer.evaluate(eval_dataset=rows)["eval_loss"], alone, rtol=1e-6)
        streamed = datasets.Dataset.from_list(rows).to_iterable_dataset()
        np.testing.assert_allclose(trainer.evaluate(eval_dataset=streamed)["eval_loss"], alone, rtol=1e-6)
    by_name = trainer.evaluate(eval_dataset={"again": first})
    np.testing.assert_allclose(by_name["eval_again_loss"], metrics["eval_first_loss"], rtol=1e-6)


def test_dpo_prepares_every_eval_dataset_and_raw_data_passed_to_evaluate(model, tokenizer, tmp_path):
    import datasets

    first, second = PREFERENCES[:4], PREFERENCES[4:10]

    def dpo(eval_dataset):
        args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=20, per_device_eval_batch_size=4,
                         report_to="none", save_strategy="no", disable_tqdm=True)
        return DPOTrainer(model=model, args=args, train_dataset=PREFERENCES, eval_dataset=eval_dataset,
                          processing_class=tokenizer)

    trainer = dpo({"first": first, "second": second})
    metrics = trainer.evaluate()
    assert "eval_rewards/accuracies" in metrics  # TRL names its own metrics eval_<metric> whatever the dataset
    for name, rows in (("first", first), ("second", second)):
        alone = dpo(rows).evaluate()["eval_loss"]
        np.testing.assert_allclose(metrics[f"eval_{name}_loss"], alone, rtol=1e-6)
        np.testing.assert_allclose(trainer.evaluate(eval_dataset=rows)["eval_loss"], alone, rtol=1e-6)
        streamed = datasets.Dataset.from_list(rows).to_iterable_dataset()
        np.testing.assert_allclose(trainer.evaluate(eval_dataset=streamed)["eval_loss"], alone, rtol=1e-6)


def test_a_dict_as_train_dataset_is_refused_with_the_split_to_pick(model, tokenizer, tmp_path):
    with pytest.raises(TypeError, match=r"train_dataset is one dataset.*dataset\['train'\]"):
        SFTTrainer(model=model, args=sft_args(tmp_path), train_dataset={"train": SFT_DATA}, processing_class=tokenizer)
    with pytest.raises(TypeError, match="train_dataset is one dataset"):
        DPOTrainer(model=model, args=DPOConfig(output_dir=str(tmp_path / "dpo"), report_to="none"),
                   train_dataset={"train": PREFERENCES}, processing_class=tokenizer)


def test_compute_metrics_is_refused_where_there_are_no_outputs_to_give_it(model, tokenizer, tmp_path):
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self):
            self.layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.layer(x)

    with pytest.raises(ValueError, match="loss_fn does not expose"):
        torchlike.Trainer(model=Linear(), args=trainer_args(tmp_path), compute_metrics=lambda prediction: {},
                          loss_fn=lambda module, batch: module(batch["x"]).mean())


# ------------------------------------------------------------------ compute_metrics against transformers and TRL
class Recorder:
    """A compute_metrics that keeps what it receives (as numpy) and returns a metric of it."""

    def __init__(self):
        self.calls = []

    def __call__(self, prediction, compute_result=None):
        def host(value):
            if value is None:
                return None
            return value.float().numpy() if hasattr(value, "float") and value.is_floating_point() else np.asarray(
                value)

        self.calls.append({"predictions": host(prediction.predictions), "label_ids": host(prediction.label_ids),
                           "inputs": host(prediction.inputs) if not isinstance(prediction.inputs, dict) else
                           {key: host(value) for key, value in prediction.inputs.items()},
                           "losses": host(prediction.losses), "compute_result": compute_result,
                           "types": (type(prediction.predictions), type(prediction.label_ids))})
        return {"rows": len(prediction.label_ids), "first_label": prediction.label_ids[0, -1]}


def argmax(logits, labels):
    return logits.argmax(dim=-1)


def evaluate_both(pair, **settings):
    """``evaluate()`` on the transformers/TRL trainer and on torchlike's with ``settings`` (``args`` fields and
    ``preprocess_logits_for_metrics``) applied to both; the two recorders' calls and torchlike's metrics."""
    runs = []
    for trainer in pair:
        recorder, saved = Recorder(), {}
        trainer.compute_metrics = recorder
        for key, value in settings.items():
            owner = trainer if key == "preprocess_logits_for_metrics" else trainer.args
            saved[key] = getattr(owner, key)
            setattr(owner, key, value)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # TRL: compute_metrics' logits are deprecated
                metrics = trainer.evaluate()
        finally:
            for key, value in saved.items():
                setattr(trainer if key == "preprocess_logits_for_metrics" else trainer.args, key, value)
        runs.append((recorder.calls, metrics))
    return runs


def assert_same_logits(ours, theirs, lengths):
    """Logits agree on every real token (float32 on both sides); positions past a batch's longest example are -100
    in both (transformers pads across batches with -100). Pad tokens inside a batch are not compared: what a model
    computes there is the library's own business."""
    assert ours.shape == theirs.shape
    real = np.arange(ours.shape[1])[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(ours[real], theirs[real], atol=2e-4, rtol=1e-4)
    past = (theirs == -100).all(-1)
    assert past.any() and (ours[past] == -100).all() and not (ours[~past] == -100).all(-1).any()


@pytest.fixture(scope="module")
def sft_pair(tiny_checkpoints, tokenizer_dir, model, tokenizer, tmp_path_factory):
    """trl.SFTTrainer and torchlike's SFTTrainer on the same checkpoint and eval data (10 examples in batches of 4: the
    last is partial, and each batch is padded to its own longest example). bf16 off on both sides: logits are compared
    in float32."""
    import datasets
    import torch
    import transformers
    import trl

    tmp_path = tmp_path_factory.mktemp("sft_pair")
    data = SFT_DATA[:10]
    settings = dict(per_device_eval_batch_size=4, max_length=32, bf16=False, report_to="none", save_strategy="no",
                    disable_tqdm=True)
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(data), eval_dataset=datasets.Dataset.from_list(data),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir), compute_metrics=Recorder())
    ours = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "ours"), **settings), train_dataset=data,
                      eval_dataset=data, processing_class=tokenizer, compute_metrics=Recorder())
    return reference, ours


def test_sft_compute_metrics_receives_trl_logits_and_labels(sft_pair):
    (theirs, _), (ours, metrics) = evaluate_both(sft_pair, include_for_metrics=["inputs", "loss"])
    theirs, ours = theirs[0], ours[0]
    assert ours["predictions"].dtype == theirs["predictions"].dtype == np.float32
    assert ours["predictions"].shape == theirs["predictions"].shape == (10, *theirs["predictions"].shape[1:])
    np.testing.assert_array_equal(ours["label_ids"], theirs["label_ids"])
    np.testing.assert_array_equal(ours["inputs"], theirs["inputs"])
    assert ours["label_ids"].dtype == theirs["label_ids"].dtype
    lengths = [len(example["input_ids"]) for example in sft_pair[1].eval_dataset]
    assert_same_logits(ours["predictions"], theirs["predictions"], lengths)
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-4)
    assert metrics["eval_rows"] == 10 and metrics["eval_first_label"] == int(theirs["label_ids"][0, -1])
    assert sft_pair[1].state.log_history[-1]["eval_rows"] == 10


def test_preprocess_logits_for_metrics_runs_per_batch_on_torch_tensors(sft_pair):
    (theirs, _), (ours, _) = evaluate_both(sft_pair, preprocess_logits_for_metrics=argmax)
    theirs, ours = theirs[0], ours[0]
    assert ours["predictions"].shape == theirs["predictions"].shape == ours["label_ids"].shape
    np.testing.assert_array_equal(ours["predictions"] == -100, theirs["predictions"] == -100)
    lengths = [len(example["input_ids"]) for example in sft_pair[1].eval_dataset]
    real = np.arange(ours["predictions"].shape[1])[None, :] < np.asarray(lengths)[:, None]
    assert (ours["predictions"][real] == theirs["predictions"][real]).mean() > 0.99  # argmax of near-equal logits


def test_batch_eval_metrics_calls_compute_metrics_per_batch_with_compute_result(sft_pair):
    (theirs, _), (ours, metrics) = evaluate_both(sft_pair, batch_eval_metrics=True, include_for_metrics=["loss"])
    assert [call["compute_result"] for call in ours] == [call["compute_result"] for call in theirs] == [False,
                                                                                                        False, True]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["types"] == reference["types"]  # torch tensors per batch, as transformers gives them
        assert mine["predictions"].shape == reference["predictions"].shape
        np.testing.assert_array_equal(mine["label_ids"], reference["label_ids"])
        np.testing.assert_allclose(mine["losses"], reference["losses"], rtol=1e-4)
    assert metrics["eval_rows"] == 2  # the last batch's result


def test_trainer_compute_metrics_matches_transformers_trainer(tiny_checkpoints, model, tmp_path):
    """The base Trainer's causal-LM convention (loss_mask) gives the labels transformers reads from ``labels``."""
    import datasets
    import torch
    import transformers

    rows = EXAMPLES[:10]
    hf_rows = [{"input_ids": row["input_ids"], "attention_mask": row["attention_mask"],
                "labels": np.where(row["loss_mask"] == 1, row["input_ids"], -100)} for row in rows]
    settings = dict(per_device_eval_batch_size=4, bf16=False, report_to="none", disable_tqdm=True)
    reference = transformers.Trainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype=torch.float32),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings),
        eval_dataset=datasets.Dataset.from_list(hf_rows), compute_metrics=Recorder())
    ours = torchlike.Trainer(model=model, args=torchlike.TrainingArguments(output_dir=str(tmp_path / "ours"),
                                                                          **settings),
                             eval_dataset=rows, compute_metrics=Recorder())
    (theirs, _), (mine, metrics) = evaluate_both((reference, ours))
    np.testing.assert_array_equal(mine[0]["label_ids"], theirs[0]["label_ids"])
    real = np.stack([row["attention_mask"] for row in rows]).astype(bool)
    assert mine[0]["predictions"].shape == theirs[0]["predictions"].shape == (10, tiny.EXAMPLE_LENGTH, tiny.VOCAB)
    np.testing.assert_allclose(mine[0]["predictions"][real], theirs[0]["predictions"][real], atol=2e-4, rtol=1e-4)
    assert metrics["eval_rows"] == 10
