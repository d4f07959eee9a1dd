"""The transformers flow around the train step: when the Trainer logs, evaluates, saves and reports, the data
it feeds (drop_last, prefetch, collator rows), and SFT's completion-only loss against a hand-computed NLL."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import TrainerCallback

import torchlike
from tests import tiny
from tests.helpers.logs import logged, tensorboard_events
from tests.helpers.training import training_arguments
from torchlike.trl import SFTConfig
from torchlike.trl.trainer.sft_trainer import SFTTrainer


def trainer_for(tiny_checkpoints, tmp_path, examples=None, **overrides):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    examples = tiny.padded_examples(12, seed=11) if examples is None else examples
    args = training_arguments(tmp_path, train_sampling_strategy="sequential", disable_tqdm=True, **overrides)
    return torchlike.Trainer(model=model, args=args, train_dataset=examples, eval_dataset=examples[:6])


class EventRecorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: self.events.append((name, state.global_step))
        return super().__getattribute__(name)


def test_eval_strategy_steps_with_eval_on_start_evaluates_at_0_2_4_6(tiny_checkpoints, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tmp_path, eval_strategy="steps", eval_steps=2, eval_on_start=True)
    trainer.train()
    evaluations = [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [step for step, _ in evaluations] == [0, 2, 4, 6]
    assert evaluations[-1][1] == pytest.approx(trainer.evaluate()["eval_loss"], rel=1e-6)
    assert evaluations[-1][1] < evaluations[0][1]


def test_callbacks_see_transformers_events_in_order(tiny_checkpoints, tmp_path):
    recorder = EventRecorder()
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
                          eval_strategy="steps", eval_steps=2)
    trainer.add_callback(recorder)
    trainer.train()
    names = [name for name, _ in recorder.events]
    assert names[0] == "on_train_begin" and names[-1] == "on_train_end"
    assert names.count("on_step_end") == 2 and names.count("on_save") == 1 and names.count("on_evaluate") == 1
    assert names.index("on_step_begin") < names.index("on_step_end") < names.index("on_log")


def test_logging_first_step_logs_step_1_then_every_logging_steps(tiny_checkpoints, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tmp_path, logging_steps=5, logging_first_step=True, max_steps=6)
    trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 5]
    assert [entry["step"] for entry in trainer.state.log_history if "train_loss" in entry] == [6]


def test_logged_loss_is_the_mean_over_the_logging_window(tiny_checkpoints, tmp_path):
    every = trainer_for(tiny_checkpoints, tmp_path / "a", logging_steps=1)
    every.train()
    windowed = trainer_for(tiny_checkpoints, tmp_path / "b", logging_steps=3)
    windowed.train()
    losses = logged(every.state.log_history, "loss")
    assert logged(windowed.state.log_history, "loss") == pytest.approx([np.mean(losses[:3]), np.mean(losses[3:])],
                                                                       rel=1e-6)


def test_report_to_tensorboard_writes_the_logged_losses(tiny_checkpoints, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tmp_path, report_to="tensorboard")
    trainer.train()
    event_files = list(Path(trainer.args.output_dir).rglob("events.out.tfevents.*"))
    assert event_files, "TensorBoard wrote no event file"
    scalars = read_tensorboard_scalars(event_files[0])
    assert scalars["train/loss"] == pytest.approx(logged(trainer.state.log_history, "loss"), rel=1e-5)


def read_tensorboard_scalars(path: Path) -> dict[str, list[float]]:
    """Scalars of a TensorBoard event file."""
    scalars = {}
    for event in tensorboard_events(path):
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append(value.simple_value)
    return scalars


def test_save_only_model_writes_no_optimizer_state_and_resume_warns(tiny_checkpoints, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
                          save_only_model=True)
    trainer.train()
    folder = Path(trainer.args.output_dir) / "checkpoint-2"
    assert (folder / "model").exists() and not (folder / "optimizer").exists()
    assert (folder / "trainer_state.json").is_file()
    again = trainer_for(tiny_checkpoints, tmp_path, max_steps=3, save_strategy="no")
    with pytest.warns(UserWarning, match="no optimizer state"):
        again.train(resume_from_checkpoint=str(folder))
    assert again.state.global_step == 3


def test_dataloader_drop_last_drops_the_partial_batch(tiny_checkpoints, tmp_path):
    examples = tiny.padded_examples(10, seed=4)  # batches of 4: two full, one of 2
    kept = trainer_for(tiny_checkpoints, tmp_path, examples, max_steps=-1, num_train_epochs=1)
    kept.train()
    dropped = trainer_for(tiny_checkpoints, tmp_path, examples, max_steps=-1, num_train_epochs=1,
                          dataloader_drop_last=True)
    dropped.train()
    assert (kept.state.global_step, dropped.state.global_step) == (3, 2)
    kept_losses = logged(kept.state.log_history, "loss")
    assert logged(dropped.state.log_history, "loss") == pytest.approx(kept_losses[:2], rel=1e-6)


def test_prefetching_batches_gives_the_same_losses(tiny_checkpoints, tmp_path):
    inline = trainer_for(tiny_checkpoints, tmp_path / "a", prefetch_batches=0)
    inline.train()
    ahead = trainer_for(tiny_checkpoints, tmp_path / "b", prefetch_batches=3)
    ahead.train()
    assert logged(ahead.state.log_history, "loss") == logged(inline.state.log_history, "loss")


def test_stopping_before_the_data_ends_leaves_no_prefetch_thread_running(tiny_checkpoints, tmp_path):
    # A thread still placing a batch when the interpreter exits aborts the process ("exception not rethrown").
    trainer = trainer_for(tiny_checkpoints, tmp_path, tiny.padded_examples(40, seed=2), max_steps=2,
                          prefetch_batches=3)
    trainer.train()
    assert trainer.state.global_step == 2
    assert not [thread for thread in threading.enumerate() if thread.name == "torchlike-prefetch"]


def test_a_collator_returning_the_wrong_row_count_names_the_data_parallel_size(tiny_checkpoints, tmp_path):
    trainer = trainer_for(tiny_checkpoints, tmp_path)
    trainer.data_collator = lambda rows: {k: np.stack([r[k] for r in rows[:-1]]) for k in rows[0]}
    with pytest.raises(ValueError, match="returned \\(3,\\) rows.*data-parallel size 1"):
        trainer.train()


def transformers_logged_losses(step_losses: list[float], logging_steps: int, nan_filter: bool) -> list[float]:
    """transformers' _inner_training_loop / _maybe_log_save_evaluate by hand: tr_loss sums the window's step losses; a
    nan/inf one adds tr_loss / (1 + global_step - globalstep_last_logged) instead; each log is tr_loss / steps."""
    logs, tr_loss, last_logged = [], 0.0, 0
    for global_step, loss in enumerate(step_losses):  # global_step: steps done before this one
        if nan_filter and not math.isfinite(loss):
            tr_loss += tr_loss / (1 + global_step - last_logged)
        else:
            tr_loss += loss
        if (global_step + 1) % logging_steps == 0:
            logs.append(tr_loss / (global_step + 1 - last_logged))
            tr_loss, last_logged = 0.0, global_step + 1
    return logs


def test_nan_and_inf_step_losses_are_replaced_by_transformers_window_rule(tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    class Scale(nnx.Module):
        def __init__(self):
            self.weight = nnx.Param(jnp.ones(()))

    def loss_fn(model, batch):  # the step loss is the row's x; the gradient (0) stays finite
        return batch["x"].mean() + 0.0 * model.weight

    # Windows of 3 steps: a nan mid-window, an inf mid-window, a nan first in its window.
    step_losses = [1.0, np.nan, 3.0, 4.0, np.inf, 6.0, np.nan, 8.0, 9.0]
    data = [{"x": np.float32(v)} for v in step_losses]
    for nan_filter in (True, False):
        args = training_arguments(tmp_path, per_device_train_batch_size=1, max_steps=9, logging_steps=3, optim="sgd",
                                  learning_rate=0.0, train_sampling_strategy="sequential",
                                  logging_nan_inf_filter=nan_filter, disable_tqdm=True)
        trainer = torchlike.Trainer(model=Scale(), args=args, train_dataset=data, loss_fn=loss_fn)
        result = trainer.train()
        expected = transformers_logged_losses(step_losses, 3, nan_filter)
        if nan_filter:
            assert expected == pytest.approx([(1 + 0.5 + 3) / 3, (4 + 2 + 6) / 3, (0 + 8 + 9) / 3])
            assert logged(trainer.state.log_history, "loss") == pytest.approx(expected)
            assert result.training_loss == pytest.approx(np.mean(expected))
        else:
            assert all(not math.isfinite(loss) for loss in logged(trainer.state.log_history, "loss"))


def recorded_pushes(monkeypatch) -> list[tuple[str, str, list[str]]]:
    """Replaces the Hub upload (the network) by a record of ``(repo_id, commit message, safetensors files)``."""
    from torchlike.adapters.checkpoint import hf_hub

    pushes = []
    monkeypatch.setattr(hf_hub, "upload_folder", lambda folder, repo_id, commit_message, **kwargs: pushes.append(
        (repo_id, commit_message, sorted(p.name for p in Path(folder).iterdir() if p.suffix == ".safetensors"))))
    return pushes


def test_hub_strategy_every_save_pushes_the_model_at_each_save(tiny_checkpoints, tmp_path, monkeypatch):
    pushes = recorded_pushes(monkeypatch)
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=4, save_strategy="steps", save_steps=2,
                          push_to_hub=True, hub_model_id="me/tiny", hub_strategy="every_save")
    trainer.train()
    assert pushes == [("me/tiny", "Training in progress, step 2", ["model.safetensors"]),
                      ("me/tiny", "Training in progress, step 4", ["model.safetensors"])]


def test_hub_strategy_end_pushes_from_save_model_only(tiny_checkpoints, tmp_path, monkeypatch):
    pushes = recorded_pushes(monkeypatch)
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=4, save_strategy="steps", save_steps=2,
                          push_to_hub=True, hub_model_id="me/tiny", hub_strategy="end")
    trainer.train()
    assert pushes == []  # no push at the checkpoint saves
    trainer.save_model()  # as transformers: save_model pushes when push_to_hub is set
    assert pushes == [("me/tiny", "Model save", ["model.safetensors"])]
    trainer.push_to_hub()  # pushes once more, without a second push from its own save_model
    assert [message for _, message, _ in pushes] == ["Model save", "End of training"]


def test_logging_dir_receives_the_tensorboard_event_files(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=2, report_to="tensorboard",
                          logging_dir=str(tmp_path / "tensorboard"))
    trainer.train()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert not list(Path(trainer.args.output_dir).rglob("events.out.tfevents.*"))


def test_data_seed_orders_the_data_and_seed_then_does_not(tmp_path):
    rows = [{"x": np.float32(i)} for i in range(32)]

    def order(**seeds):
        trainer = torchlike.Trainer(model=None, args=training_arguments(tmp_path, **seeds), train_dataset=rows,
                                    loss_fn=lambda model, batch: 0.0)
        return [trainer._get_train_sampler(epoch).tolist() for epoch in (0, 1)]

    assert order(seed=1, data_seed=7) == order(seed=2, data_seed=7)
    assert order(seed=1, data_seed=7) != order(seed=1, data_seed=8)
    assert order(seed=1, data_seed=0) == order(seed=2, data_seed=0)  # 0 is a seed, not "unset"
    assert order(seed=1) != order(seed=2)  # without data_seed, seed orders the data


def test_completion_only_loss_equals_the_hand_computed_masked_nll(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = [{"prompt": "the quick brown", "completion": " fox jumps"}, {"prompt": "one", "completion": " two three"},
            {"prompt": "hello world, this", "completion": " is tiny"}, {"prompt": "lazy", "completion": " dog"}]
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=24, per_device_train_batch_size=4, max_steps=1,
                     logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                     bf16=False)  # compared with torch in float32 at rel=1e-5
    trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=args, train_dataset=data,
                         processing_class=tokenizer)
    trainer.train()

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype=torch.float32)
    total, count = 0.0, 0
    for row in data:
        prompt = tokenizer(row["prompt"])["input_ids"]
        ids = tokenizer(row["prompt"] + row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].double()
        nll = -torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        total += float(nll[len(prompt) - 1:].sum())  # targets are the completion tokens and the eos
        count += len(ids) - len(prompt)
    assert logged(trainer.state.log_history, "loss")[0] == pytest.approx(total / count, rel=1e-5)


def test_trl_script_attributes_accelerator_hub_model_id_and_end(tiny_checkpoints, tmp_path, capsys):
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=1, report_to="tensorboard")
    trainer.train()
    trainer.accelerator.print("done")
    assert capsys.readouterr().out.endswith("done\n")
    assert trainer.accelerator.is_main_process and trainer.accelerator.num_processes == 1
    assert trainer.hub_model_id == "out"
    trainer.end()
    assert all(getattr(callback, "tb_writer", None) is None for callback in trainer.callbacks)


def test_each_checkpoint_folder_opens_with_from_pretrained_like_transformers_trainers(tiny_checkpoints, tmp_path):
    """transformers' Trainer writes the model (``model.safetensors``, ``config.json``) into every ``checkpoint-N``;
    torchlike writes it beside the Orbax state, equal to the weights of that step, and resuming still reads the
    Orbax state."""
    trainer = trainer_for(tiny_checkpoints, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    trainer.train()
    folder = Path(trainer.args.output_dir) / "checkpoint-2"
    assert {"model.safetensors", "config.json", "generation_config.json", "model", "optimizer",
            "trainer_state.json"} <= {path.name for path in folder.iterdir()}
    stored = torchlike.load(folder / "model")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    exported = torchlike.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert sorted(exported) == sorted(stored.keys())
    for key in stored.keys():
        np.testing.assert_array_equal(np.asarray(exported[key]), np.asarray(stored[key]), err_msg=key)
    ids, mask, _ = tiny.padded_batch()
    with torch.no_grad():
        expected = reference(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = torchlike.AutoModelForCausalLM.from_pretrained(folder)(ids, attention_mask=mask).logits
    np.testing.assert_allclose(np.asarray(ours)[mask.astype(bool)], expected[mask.astype(bool)], atol=1e-4)
    resumed = trainer_for(tiny_checkpoints, tmp_path / "again", max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(folder))
    uninterrupted = logged(trainer.state.log_history, "loss")
    assert logged(resumed.state.log_history, "loss")[-2:] == pytest.approx(uninterrupted[-2:], rel=1e-6)


def test_a_lora_checkpoint_folder_holds_the_peft_adapter_of_that_step_and_the_tokenizer(tiny_checkpoints,
                                                                                        tokenizer_dir, tmp_path):
    """As transformers' Trainer with a peft model: ``checkpoint-N`` holds the adapter of step N in peft's format
    (peft loads it onto the base model and gives the trained model's logits) and the tokenizer's files."""
    import peft
    from safetensors.numpy import load_file

    from torchlike.peft import LoraConfig, get_peft_model

    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    args = training_arguments(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, learning_rate=1e-2,
                              disable_tqdm=True)
    torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(8, seed=3),
                      processing_class=tokenizer).train()
    folder = Path(args.output_dir) / "checkpoint-2"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in folder.iterdir()}
    # The adapter of step 2 (the last): what saving the trained model writes, tensor for tensor.
    model.save_pretrained(tmp_path / "trained")
    saved, trained = load_file(folder / "adapter_model.safetensors"), load_file(tmp_path / "trained" /
                                                                                "adapter_model.safetensors")
    assert sorted(saved) == sorted(trained) and any("lora_B" in name for name in saved)
    for name, value in trained.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    # peft reads it as the trained model: the same logits, which the trained factors move well beyond the tolerance.
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"),
                                                             attn_implementation="eager")
    ids, mask, _ = tiny.padded_batch()
    valid = mask.astype(bool)
    with torch.no_grad():
        base_logits = base(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, folder)
        expected = adapted(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(model(ids, attention_mask=mask).logits)
    np.testing.assert_allclose(ours[valid], expected[valid], atol=1e-4)
    assert np.abs(expected - base_logits)[valid].max() > 1e-2
    reloaded = transformers.AutoTokenizer.from_pretrained(folder)
    text = "the quick brown fox jumps over the lazy dog"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (reloaded.eos_token, reloaded.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)
