"""The ``torchlike`` command: ``torchlike sft|grpo|dpo`` train from the command line or a YAML file, ``torchlike env``
reports the environment, and bad inputs fail fast with a message that says what to fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from tests.helpers.scripts import build_script_model_dir, prompt_completion_rows, write_jsonl
from torchlike.cli import main

CONSOLE_SCRIPT = Path(sys.executable).with_name("torchlike")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_torchlike_sft_trains_on_a_jsonl_file_and_writes_an_hf_loadable_directory(tiny_checkpoints, tokenizer_dir,
                                                                                 tmp_path):
    assert CONSOLE_SCRIPT.is_file(), "the console script is missing: pip install -c constraints.txt -e '.[test]'"
    model_dir = build_script_model_dir(tiny_checkpoints.path("qwen2"), tokenizer_dir, tmp_path / "model")
    data_file = write_jsonl(tmp_path / "sft.jsonl", prompt_completion_rows())
    output_dir = tmp_path / "out"
    completed = subprocess.run(
        [str(CONSOLE_SCRIPT), "sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file),
         "--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--max_length", "32",
         "--max_steps", "2", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
         "--dtype", "auto", "--use_peft", "--lora_r", "4",
         "--lora_target_modules", "q_proj", "v_proj"],
        capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE}, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Training completed" in completed.stdout
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = peft.PeftModel.from_pretrained(base, output_dir)
    assert adapted.peft_config["default"].r == 4


def test_torchlike_without_a_command_prints_help(capsys):
    assert main([]) == 0
    assert "sft" in capsys.readouterr().out


def test_torchlike_env_prints_versions_and_devices(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for label in ("torchlike version", "JAX version", "Transformers version", "JAX devices: ", "Compilation cache: ",
                  "Host allocator (CPU): "):
        assert label in out


def test_training_command_help_lists_the_script_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["dpo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "torchlike dpo" in out and "--model_name_or_path" in out and "--beta" in out


def test_unknown_flag_exits_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--model_name_or_path", "m", "--dataset_name", "d", "--num_train_epocs", "1"])
    assert exit_info.value.code == 2
    assert "'num_train_epocs' -> 'num_train_epochs'" in capsys.readouterr().err


def test_misspelt_config_key_exits_with_the_closest_key(tmp_path, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text("model_name_or_path: m\ndataset_name: d\nnum_generation: 4\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--config", str(config)])
    assert exit_info.value.code == 2
    assert "'num_generation' -> 'num_generations'" in capsys.readouterr().err


def test_dataset_missing_offline_fails_fast_saying_what_to_pass(tmp_path, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    connections = []
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: connections.append(address))
    with pytest.raises(FileNotFoundError, match="not a local file or directory.*train.jsonl"):
        main(["sft", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", "no-org/no-such-dataset",
              "--output_dir", str(tmp_path / "out")])
    assert not connections  # fails before any download attempt, not after retries


def test_data_file_of_unknown_type_is_refused(tmp_path):
    data = tmp_path / "data.xml"
    data.write_text("<rows/>")
    with pytest.raises(ValueError, match="cannot tell the format"):
        main(["sft", "--model_name_or_path", str(tmp_path), "--dataset_name", str(data),
              "--output_dir", str(tmp_path / "out")])


def test_runtime_modules_import_neither_trl_nor_optional_packages():
    code = ("import sys, torchlike.cli, torchlike.trl.rewards, torchlike.trl.scripts.sft, torchlike.trl.scripts.grpo, "
            "torchlike.trl.scripts.dpo; from torchlike.trl import TrlParser, ModelConfig; "
            "bad = [m for m in ('trl', 'math_verify', 'accelerate') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
