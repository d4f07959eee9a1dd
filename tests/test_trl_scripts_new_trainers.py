"""TRL's own ``rloo.py``, ``kto.py``, ``reward.py`` and ``distillation.py`` (copied from the installed ``trl``, only
the import lines rewritten) run to completion on tiny local models (the distillation teacher another tiny model of the
same tokenizer), and ``torchlike rloo|kto|reward|distillation`` parse every flag TRL's scripts do."""

from __future__ import annotations

import pytest

import torchlike.trl as torchlike_trl
from tests.helpers.scripts import (
    TINY_RUN,
    WORDS,
    assert_hf_loadable,
    build_script_model_dir,
    port_trl_script,
    preference_rows,
    run_script,
    write_jsonl,
)


@pytest.mark.parametrize("name", ["rloo", "kto", "reward", "distillation"])
def test_porting_new_trl_script_changes_only_its_trl_import_lines(name, tmp_path):
    _, changed = port_trl_script(name, tmp_path)
    assert changed and all(old.lstrip().startswith("from trl") for old, _ in changed)


def test_trl_rloo_script_trains_with_registry_dotted_path_and_reward_model_rewards(script_model, tmp_path, monkeypatch,
                                                                                    capsys):
    import transformers

    # --reward_model_name_or_path: a one-label classifier of the script model's vocabulary, with its tokenizer
    reward_model = tmp_path / "tiny-reward-model"
    transformers.AutoModelForSequenceClassification.from_pretrained(script_model, num_labels=1).save_pretrained(
        reward_model)
    transformers.AutoTokenizer.from_pretrained(script_model).save_pretrained(reward_model)
    script, _ = port_trl_script("rloo", tmp_path)
    rows = [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    run_script(script, ["--model_name_or_path", str(script_model), "--dataset_name", str(dataset_dir),
                        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4",
                        "--num_generations", "2", "--max_completion_length", "8", "--reward_funcs",
                        "tests.script_rewards.completion_length_reward", "think_format_reward",
                        "--reward_model_name_or_path", str(reward_model), *TINY_RUN],
               monkeypatch)
    out = capsys.readouterr().out
    assert "Training completed" in out
    assert "rewards/tiny-reward-model/mean" in out  # TRL names a reward model's column after its path
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


def test_trl_reward_script_trains_a_classifier_transformers_loads(script_model, tmp_path, monkeypatch, capsys):
    import transformers

    script, _ = port_trl_script("reward", tmp_path)
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", preference_rows()).parent
    run_script(script, ["--model_name_or_path", str(script_model), "--dataset_name", str(dataset_dir),
                        "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2",
                        "--max_length", "32", *TINY_RUN], monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert classifier.config.num_labels == 1 and type(classifier).__name__ == "Qwen2ForSequenceClassification"


def test_trl_distillation_script_trains_the_student_against_another_teacher(script_model, tiny_checkpoints,
                                                                           tokenizer_dir, tmp_path, monkeypatch,
                                                                           capsys):
    script, _ = port_trl_script("distillation", tmp_path)
    teacher = build_script_model_dir(tiny_checkpoints.path("llama3"), tokenizer_dir, tmp_path / "teacher")
    rows = [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    run_script(script, ["--model_name_or_path", str(script_model), "--teacher_model_name_or_path", str(teacher),
                        "--dataset_name", str(dataset_dir), "--output_dir", str(tmp_path / "out"),
                        "--per_device_train_batch_size", "2", "--max_completion_length", "8", *TINY_RUN],
               monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


@pytest.mark.parametrize("name, config, arguments", [("rloo", "RLOOConfig", "RLOOScriptArguments"),
                                                     ("kto", "KTOConfig", "ScriptArguments"),
                                                     ("reward", "RewardConfig", "ScriptArguments"),
                                                     ("distillation", "DistillationConfig", "ScriptArguments")])
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
