"""TRL's callbacks from ``torchlike.trl`` do what TRL's do: the same run in each library, with each library's
callbacks, gives the same BEMA weights (``output_dir/bema``), the same completions table and the same synced
reference."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import trl
from safetensors.numpy import load_file

import torchlike
import torchlike.trl
from tests.helpers.data import prompt_completion_data
from tests.helpers.logs import logged, tensorboard_events
from torchlike.trl import SFTConfig, SFTTrainer

CALLBACKS = ("BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback",
             "WeaveCallback")
# float32 on both sides (the comparisons with TRL are in float32; gradient checkpointing stays on); Adam's epsilon
# above float noise, so entries whose gradient is ~0 do not take lr-sized steps of random sign in one library only.
SETTINGS = dict(per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, max_length=32, logging_steps=1,
                seed=0, bf16=False, report_to="none", save_strategy="no", per_device_eval_batch_size=2,
                adam_epsilon=1e-4)
# Updated every step after a snapshot at step 1 (the snapshot path and three updates).
BEMA = dict(update_freq=1, update_after=1, lag=2, ema_power=0.5, bias_power=0.2)
NEW_TOKENS = 4


def _generation_config():
    import transformers

    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """The same SFT run in TRL (with TRL's callbacks) and in torchlike (with torchlike's)."""
    import datasets
    import torch
    import transformers
    from torch.utils.data import SequentialSampler

    path = tiny_checkpoints.path("qwen2")
    data, held_out = prompt_completion_data(16), prompt_completion_data(3, seed=1)
    folder = tmp_path_factory.mktemp("callbacks")
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(folder / "trl"), use_cpu=True, **SETTINGS),
        train_dataset=datasets.Dataset.from_list(data), eval_dataset=datasets.Dataset.from_list(held_out),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
        callbacks=[trl.BEMACallback(**BEMA)])
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference_completions = trl.LogCompletionsCallback(reference, _generation_config(), num_prompts=2, freq=2)
    reference.add_callback(reference_completions)
    reference.train()

    trainer = SFTTrainer(model=str(path), args=SFTConfig(output_dir=str(folder / "ours"),
                                                         train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=data, eval_dataset=held_out,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                         callbacks=[torchlike.trl.BEMACallback(**BEMA)])
    completions = torchlike.trl.LogCompletionsCallback(trainer, _generation_config(), num_prompts=2, freq=2)
    trainer.add_callback(completions)
    trainer.train()
    return {"reference": reference, "trainer": trainer, "reference_completions": reference_completions,
            "completions": completions, "folder": folder}


def test_every_trl_callback_is_importable_with_trls_signature():
    for name in CALLBACKS:
        ours, theirs = getattr(torchlike.trl, name), getattr(trl, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
        ours_defaults = {key: parameter.default for key, parameter in inspect.signature(ours).parameters.items()}
        for key, parameter in inspect.signature(theirs).parameters.items():
            if parameter.default is not inspect.Parameter.empty:  # TRL's defaults, ours the same
                assert ours_defaults[key] == parameter.default, (name, key)


def test_the_runs_train_alike(runs):
    np.testing.assert_allclose(logged(runs["trainer"].state.log_history, "loss"),
                               logged(runs["reference"].state.log_history, "loss"), rtol=1e-4)


def test_bema_saves_trls_averaged_weights(runs):
    import transformers

    folder = runs["folder"]
    theirs = load_file(folder / "trl" / "bema" / "model.safetensors")
    ours = load_file(folder / "ours" / "bema" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    final = {name: value.detach().numpy() for name, value in runs["reference"].model.state_dict().items()}
    moved = 0
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-4, atol=1e-6, err_msg=name)
        moved += not np.allclose(expected, final[name], rtol=1e-4, atol=1e-6)
    assert moved > len(theirs) // 2  # BEMA's weights are not the trained model's
    assert transformers.AutoModelForCausalLM.from_pretrained(folder / "ours" / "bema").config.num_hidden_layers == 2


def test_bema_keeps_the_running_weights_beside_training(runs):
    callback = next(c for c in runs["trainer"].callbacks if isinstance(c, torchlike.trl.BEMACallback))
    running = callback.running_model.state_dict()
    trained = runs["trainer"].model.state_dict()
    assert callback.param_names and set(callback.param_names) <= set(running)
    assert any(not np.allclose(np.asarray(running[name]), np.asarray(trained[name])) for name in callback.param_names)


def test_log_completions_logs_trls_table(runs):
    theirs, ours = runs["reference_completions"].table, runs["completions"].table
    assert [row[0] for row in ours] == ["2", "2", "4", "4"]
    assert ours == [tuple(row) for row in theirs]
    assert all(row[2] for row in ours)  # the completions are not empty


@pytest.fixture(scope="module")
def reported_run(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """A torchlike SFT run reporting to TensorBoard with LogCompletionsCallback and RichProgressCallback, with what the
    rich panel showed at each log."""
    folder = tmp_path_factory.mktemp("reported")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TENSORBOARD_LOGGING_DIR", str(folder / "logs"))
        progress = torchlike.trl.RichProgressCallback()
        trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")),
                             args=SFTConfig(output_dir=str(folder), **{**SETTINGS, "max_steps": 2,
                                                                       "report_to": "tensorboard"}),
                             train_dataset=prompt_completion_data(8), eval_dataset=prompt_completion_data(2, seed=1),
                             processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                             callbacks=[progress])
        completions = torchlike.trl.LogCompletionsCallback(trainer, _generation_config(), freq=2)
        trainer.add_callback(completions)
        shown = {}
        on_log = progress.on_log

        def recording_on_log(args, state, control, logs=None, **kwargs):
            on_log(args, state, control, logs=logs, **kwargs)
            if progress.training_bar is not None:
                from rich.console import Console

                task, console = progress.training_bar.tasks[0], Console(width=200, record=True)
                console.print(progress.training_status.renderable)
                shown[state.global_step] = (task.completed, task.total, console.export_text())

        progress.on_log = recording_on_log
        trainer.train()
    return {"folder": folder, "completions": completions, "progress": progress, "shown": shown}


def test_log_completions_writes_the_table_to_tensorboard(reported_run):
    texts = [(event.step, value.tensor.string_val[0].decode())  # (step, text) of each text summary
             for path in (reported_run["folder"] / "logs").rglob("events.out.tfevents.*")
             for event in tensorboard_events(path) for value in event.summary.value
             if value.tag == "completions/text_summary"]
    assert [step for step, _ in texts] == [2]
    table = reported_run["completions"].table
    assert len(table) == 2
    assert all(prompt in texts[0][1] and completion in texts[0][1] for _, prompt, completion in table)


def test_rich_progress_shows_the_run(reported_run):
    shown = reported_run["shown"]
    assert shown[1][:2] == (1, 2) and shown[2][:2] == (2, 2)
    assert "Step 2" in shown[2][2] and "loss" in shown[2][2]
    assert reported_run["progress"].rich_group is None  # stopped at the end of training


def test_completion_callbacks_refuse_a_trainer_without_eval_prompts(tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = SFTTrainer(model=str(tiny_checkpoints.path("qwen2")), args=SFTConfig(output_dir=str(tmp_path)),
                         train_dataset=prompt_completion_data(4),
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    for name in ("LogCompletionsCallback", "WeaveCallback"):
        with pytest.raises(ValueError, match=f"Trainer must have an evaluation dataset to use the {name}"):
            getattr(torchlike.trl, name)(trainer)
    trainer.eval_dataset = [{"text": "no prompt here"}]
    with pytest.raises(ValueError, match="'prompt' column.*\\['text'\\]"):
        torchlike.trl.LogCompletionsCallback(trainer)


def test_weave_callback_warns_and_logs_nothing_without_weave_as_trl(runs, caplog):
    import importlib.util

    assert importlib.util.find_spec("weave") is None  # not installed here: TRL's behaviour then is the one checked
    callback = torchlike.trl.WeaveCallback(runs["trainer"], num_prompts=1)
    trainer = runs["trainer"]
    with caplog.at_level(logging.WARNING, logger="torchlike"):
        callback.on_evaluate(trainer.args, trainer.state, trainer.control, processing_class=trainer.processing_class)
    assert "Weave is not available" in caplog.text
    assert callback._last_logged_step == -1 and not callback.is_evaluation_mode


def test_sync_ref_model_callback_mixes_a_policy_into_its_reference_as_trl(tiny_checkpoints, tmp_path):
    import torch
    import transformers

    path = tiny_checkpoints.path("qwen2")
    policy, reference = (torchlike.AutoModelForCausalLM.from_pretrained(path) for _ in range(2))
    torch_policy, torch_reference = (transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                                     for _ in range(2))
    with torch.no_grad():
        for parameter in torch_policy.parameters():
            parameter.add_(0.5)
    policy.load_state_dict({name: value.numpy() for name, value in torch_policy.state_dict().items()})

    class Args:
        ref_model_sync_steps, ref_model_mixup_alpha = 2, 0.25

    class State:
        global_step = 2

    torchlike.trl.SyncRefModelCallback(reference, None).on_step_end(Args, State, None, model=policy)
    trl.SyncRefModelCallback(torch_reference, None).on_step_end(Args, State, None, model=torch_policy)
    reference.save_pretrained(tmp_path)
    ours = load_file(tmp_path / "model.safetensors")
    expected = {name: value.numpy() for name, value in torch_reference.state_dict().items()}
    assert not np.allclose(ours["model.embed_tokens.weight"], load_file(
        tiny_checkpoints.path("qwen2") / "model.safetensors")["model.embed_tokens.weight"])
    for name, value in ours.items():
        np.testing.assert_allclose(np.asarray(value), expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
    State.global_step = 3  # not a sync step: nothing moves
    before = {name: np.asarray(value) for name, value in reference.state_dict().items()}
    torchlike.trl.SyncRefModelCallback(reference, None).on_step_end(Args, State, None, model=policy)
    assert all(np.array_equal(before[name], np.asarray(value)) for name, value in reference.state_dict().items())
