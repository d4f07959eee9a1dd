"""TRL's own ``rloo.py`` and ``kto.py`` (copied from the installed ``trl``, only the import lines rewritten) run to
completion on a tiny local model, and ``torchlike rloo|kto`` parse every flag TRL's scripts do."""

from __future__ import annotations

import pytest

import torchlike.trl as torchlike_trl
from tests.test_trl_scripts import (
    TINY_RUN,
    WORDS,
    assert_hf_loadable,
    port_trl_script,
    run_script,
    write_jsonl,
)
from tests.test_trl_scripts import script_model as script_model  # the module-scoped fixture


@pytest.mark.parametrize("name", ["rloo", "kto"])
def test_porting_new_trl_script_changes_only_its_trl_import_lines(name, tmp_path):
    _, changed = port_trl_script(name, tmp_path)
    assert changed and all(old.lstrip().startswith("from trl") for old, _ in changed)


def test_trl_rloo_script_trains_with_registry_and_dotted_path_rewards(script_model, tmp_path, monkeypatch, capsys):
    script, _ = port_trl_script("rloo", tmp_path)
    rows = [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    run_script(script, ["--model_name_or_path", str(script_model), "--dataset_name", str(dataset_dir),
                        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4",
                        "--num_generations", "2", "--max_completion_length", "8", "--reward_funcs",
                        "tests.script_rewards.completion_length_reward", "think_format_reward", *TINY_RUN],
               monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_trl_kto_script_trains_on_unpaired_data_with_peft(script_model, tmp_path, monkeypatch, capsys):
    import peft
    import transformers

    script, _ = port_trl_script("kto", tmp_path)
    rows = [{"prompt": " ".join(WORDS[i:i + 3]), "completion": " " + WORDS[i + 3], "label": i % 2 == 0}
            for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    run_script(script, ["--model_name_or_path", str(script_model), "--dataset_name", str(dataset_dir),
                        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4",
                        "--max_length", "32", "--use_peft", "--lora_r", "8", *TINY_RUN], monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    base = transformers.AutoModelForCausalLM.from_pretrained(script_model)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "out")
    assert any("lora_" in name for name, _ in adapted.named_parameters())


@pytest.mark.parametrize("name, config, arguments", [("rloo", "RLOOConfig", "RLOOScriptArguments"),
                                                     ("kto", "KTOConfig", "ScriptArguments")])
def test_new_script_parsers_accept_every_flag_trls_do(name, config, arguments):
    import importlib

    import trl

    ours = importlib.import_module(f"torchlike.trl.scripts.{name}").make_parser()
    trl_script = importlib.import_module(f"trl.scripts.{name}")
    theirs = trl.TrlParser((getattr(trl_script, arguments, trl.ScriptArguments), getattr(trl, config),
                            trl.ModelConfig, trl.DatasetMixtureConfig))
    flags = {parser: {option for action in parser._actions for option in action.option_strings}
             for parser in (ours, theirs)}
    assert flags[theirs] <= flags[ours]
    assert hasattr(torchlike_trl, config)
