"""TRL's own ``trl/scripts/{sft,grpo,dpo}.py`` run on torchlike with only their ``from trl`` lines rewritten, and the
script helpers they import (``TrlParser``, ``ModelConfig``, ``get_dataset``...) behave as TRL's."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import transformers
import yaml

from tests.helpers.scripts import (
    assert_hf_loadable,
    port_trl_script,
    preference_rows,
    prompt_completion_rows,
    run_script,
    script_arguments,
    write_jsonl,
)
from torchlike import trl as torchlike_trl

# ----------------------------------------------------------------------------------------------- TRL's scripts


@pytest.mark.parametrize("name, expected_changes", [("sft", 2), ("grpo", 4), ("dpo", 2)])
def test_porting_trl_script_changes_only_its_trl_import_lines(name, expected_changes, tmp_path):
    _, changed = port_trl_script(name, tmp_path)
    assert len(changed) == expected_changes
    for old, new in changed:
        assert old.lstrip().startswith("from trl") and new == old.replace("from trl", "from torchlike.trl", 1)


def test_trl_sft_script_trains_and_saves_from_its_command_line(script_model, tmp_path, monkeypatch, capsys):
    script, _ = port_trl_script("sft", tmp_path)
    run_script(script, script_arguments("sft", script_model, tmp_path), monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_trl_grpo_script_trains_with_registry_and_dotted_path_rewards(script_model, tmp_path, monkeypatch, capsys):
    script, _ = port_trl_script("grpo", tmp_path)
    run_script(script, script_arguments("grpo", script_model, tmp_path), monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_trl_script_use_peft_without_target_modules_adapts_peft_defaults(name, script_model, tmp_path, monkeypatch,
                                                                         capsys):
    import peft

    script, _ = port_trl_script(name, tmp_path)
    run_script(script, [*script_arguments(name, script_model, tmp_path), "--use_peft", "--lora_r", "8"], monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (sorted(saved["target_modules"]), saved["r"]) == (["q_proj", "v_proj"], 8)
    base = transformers.AutoModelForCausalLM.from_pretrained(script_model)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "out")
    lora_modules = {param.split(".")[-4] for param, _ in adapted.named_parameters() if "lora_" in param}
    assert lora_modules == {"q_proj", "v_proj"}


def test_trl_dpo_script_trains_from_a_yaml_config(script_model, tmp_path, monkeypatch, capsys):
    script, _ = port_trl_script("dpo", tmp_path)
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", preference_rows()).parent
    output_dir = tmp_path / "out"
    config = {"env": {"TORCHLIKE_SCRIPT_TEST_ENV": "from-yaml"}, "model_name_or_path": str(script_model),
              "dataset_name": str(dataset_dir), "output_dir": str(tmp_path / "overridden"),
              "per_device_train_batch_size": 2, "max_length": 32, "max_steps": 2, "report_to": "none",
              "save_strategy": "no", "logging_steps": 1, "beta": 0.2}
    config_path = tmp_path / "dpo.yaml"
    config_path.write_text(yaml.safe_dump(config))
    monkeypatch.delenv("TORCHLIKE_SCRIPT_TEST_ENV", raising=False)
    run_script(script, ["--config", str(config_path), "--output_dir", str(output_dir)], monkeypatch)
    assert "Training completed" in capsys.readouterr().out
    assert os.environ["TORCHLIKE_SCRIPT_TEST_ENV"] == "from-yaml"
    assert not (tmp_path / "overridden").exists()  # the command line wins over the file
    assert_hf_loadable(output_dir)


# ----------------------------------------------------------------------------------------------- TrlParser


def _script_parsers(name: str):
    """Our and TRL's parser for one script's dataclasses."""
    import trl

    config = {"sft": "SFTConfig", "grpo": "GRPOConfig", "dpo": "DPOConfig"}[name]
    ours = torchlike_trl.TrlParser((torchlike_trl.ScriptArguments, getattr(torchlike_trl, config),
                                    torchlike_trl.ModelConfig, torchlike_trl.DatasetMixtureConfig))
    theirs = trl.TrlParser((trl.ScriptArguments, getattr(trl, config), trl.ModelConfig, trl.DatasetMixtureConfig))
    return ours, theirs


@pytest.mark.parametrize("name", ["sft", "grpo", "dpo"])
def test_script_parser_accepts_every_flag_trls_does(name):
    ours, theirs = _script_parsers(name)
    flags = {parser: {option for action in parser._actions for option in action.option_strings}
             for parser in (ours, theirs)}
    assert flags[theirs] <= flags[ours]


def test_script_dataclasses_have_trls_fields_and_defaults():
    import trl
    from trl.scripts.utils import DatasetConfig

    for ours, theirs in [(torchlike_trl.ScriptArguments, trl.ScriptArguments),
                         (torchlike_trl.ModelConfig, trl.ModelConfig),
                         (torchlike_trl.DatasetMixtureConfig, trl.DatasetMixtureConfig),
                         (torchlike_trl.DatasetConfig, DatasetConfig)]:
        ours_fields = {f.name: (f.default, f.metadata.get("choices")) for f in dataclasses.fields(ours)}
        theirs_fields = {f.name: (f.default, f.metadata.get("choices")) for f in dataclasses.fields(theirs)}
        assert ours_fields == theirs_fields, ours.__name__


def test_unknown_command_line_flag_is_an_error_naming_the_closest_flag():
    parser = torchlike_trl.TrlParser(torchlike_trl.SFTConfig)
    with pytest.raises(ValueError, match=r"--leraning_rate.*'leraning_rate' -> 'learning_rate'"):
        parser.parse_args_and_config(["--leraning_rate", "1e-4"], fail_with_unknown_args=False)


def test_unknown_command_line_flag_is_an_error_in_trl_too():
    import trl

    with pytest.raises(ValueError, match="not used"):
        trl.TrlParser(trl.ScriptArguments).parse_args_and_config(["--dataset_nme", "x"], fail_with_unknown_args=False)


def test_misspelt_config_key_is_an_error_naming_the_closest_key(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("leraning_rate: 1.0e-4\n")
    with pytest.raises(ValueError, match=r"leraning_rate.*Did you mean.*'learning_rate'"):
        torchlike_trl.TrlParser(torchlike_trl.SFTConfig).parse_args_and_config(["--config", str(config)])


def test_misspelt_config_key_is_ignored_with_a_warning_when_unknown_args_are_allowed(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("leraning_rate: 1.0e-4\nnum_train_epochs: 2\n")
    parser = torchlike_trl.TrlParser(torchlike_trl.SFTConfig)
    with pytest.warns(UserWarning, match="leraning_rate.*ignored"):
        (args,) = parser.parse_args_and_config(["--config", str(config)], fail_with_unknown_args=False)
    assert args.num_train_epochs == 2 and args.learning_rate == 2e-5


def test_config_values_are_defaults_the_command_line_overrides(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("learning_rate: 1.0e-4\nmax_length: 64\ndataset_name: from-file\n")
    parser = torchlike_trl.TrlParser((torchlike_trl.ScriptArguments, torchlike_trl.SFTConfig))
    script_args, args = parser.parse_args_and_config(["--config", str(config), "--max_length", "16"])
    assert (script_args.dataset_name, args.learning_rate, args.max_length) == ("from-file", 1e-4, 16)


def test_remaining_strings_come_back_separately_for_file_and_command_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("num_processes: 2\n")
    parser = torchlike_trl.TrlParser(torchlike_trl.SFTConfig)
    *_, from_file, from_cli = parser.parse_args_and_config(["--config", str(config), "--main_process_port", "1"],
                                                           return_remaining_strings=True,
                                                           separate_remaining_strings=True)
    assert (from_file, from_cli) == (["--num_processes", "2"], ["--main_process_port", "1"])


def test_config_file_must_be_a_mapping(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must contain a YAML mapping"):
        torchlike_trl.TrlParser(torchlike_trl.SFTConfig).parse_args_and_config(["--config", str(config)])


def test_optional_numbers_read_none_from_the_command_line_as_in_trl():
    (args,) = torchlike_trl.TrlParser(torchlike_trl.SFTConfig).parse_args_and_config(
        ["--max_length", "none", "--report_to", "none"])
    assert args.max_length is None and args.report_to == []


def test_a_dataclass_field_named_config_is_refused():
    @dataclasses.dataclass
    class WithConfig:
        config: str = "x"

    with pytest.raises(ValueError, match="reserved for the config file path"):
        torchlike_trl.TrlParser(WithConfig)


def test_dataset_mixture_from_yaml_becomes_dataset_configs(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("datasets:\n  - path: json\n    data_files: a.jsonl\n    columns: [prompt]\n")
    (mixture,) = torchlike_trl.TrlParser(torchlike_trl.DatasetMixtureConfig).parse_args_and_config(
        ["--config", str(config)])
    assert mixture.datasets == [torchlike_trl.DatasetConfig(path="json", data_files="a.jsonl", columns=["prompt"])]


# ------------------------------------------------------------------------------- dataset, LoRA, quantisation


def test_get_dataset_mixes_like_trl(tmp_path):
    import trl
    from trl.scripts.utils import DatasetConfig

    first = write_jsonl(tmp_path / "a.jsonl", prompt_completion_rows(8))
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(4)])
    specs = [dict(path="json", data_files=str(first), columns=["prompt"], fraction=0.5),
             dict(path="json", data_files=str(second), columns=["prompt"], fraction=0.5)]
    ours = torchlike_trl.get_dataset(torchlike_trl.DatasetMixtureConfig(datasets=[dict(s) for s in specs]))
    theirs = trl.get_dataset(trl.DatasetMixtureConfig(datasets=[DatasetConfig(**s) for s in specs]))
    assert ours["train"].to_list() == theirs["train"].to_list()
    assert len(ours["train"]) == 8  # 4 from each: the second file caps the mixture


def test_get_dataset_splits_off_a_test_set(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", prompt_completion_rows(10))
    mixture = torchlike_trl.DatasetMixtureConfig(datasets=[dict(path="json", data_files=str(data))],
                                                 test_split_size=0.2)
    split = torchlike_trl.get_dataset(mixture)
    assert (len(split["train"]), len(split["test"])) == (8, 2)


def test_get_peft_config_builds_torchlike_lora_config_with_trls_mapping():
    from torchlike.peft import LoraConfig

    model_args = torchlike_trl.ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                           lora_target_modules=["q_proj", "v_proj"], use_rslora=True)
    config = torchlike_trl.get_peft_config(model_args)
    assert isinstance(config, LoraConfig)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules, config.use_rslora,
            config.task_type, config.bias) == (4, 8, 0.0, ["q_proj", "v_proj"], True, "CAUSAL_LM", "none")
    assert torchlike_trl.get_peft_config(torchlike_trl.ModelConfig()) is None


def test_single_lora_target_stays_a_string_as_in_trl():
    assert torchlike_trl.ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"


def test_get_peft_config_refuses_what_torchlike_lora_cannot_do():
    with pytest.raises(ValueError, match="lora_target_parameters"):
        torchlike_trl.get_peft_config(torchlike_trl.ModelConfig(use_peft=True, lora_target_parameters=["experts"]))
    with pytest.raises(ValueError, match="use_dora"):
        torchlike_trl.get_peft_config(torchlike_trl.ModelConfig(use_peft=True, use_dora=True))


def test_get_quantization_config_asks_for_what_from_pretrained_reads():
    from torchlike.quantization import requested_quantization

    four_bit = torchlike_trl.get_quantization_config(torchlike_trl.ModelConfig(load_in_4bit=True, dtype="auto"))
    eight_bit = torchlike_trl.get_quantization_config(torchlike_trl.ModelConfig(load_in_8bit=True))
    assert isinstance(four_bit, transformers.BitsAndBytesConfig) and four_bit.load_in_4bit
    assert requested_quantization({"quantization_config": four_bit}) == "nf4"
    assert requested_quantization({"quantization_config": eight_bit}) == "int8"
    assert torchlike_trl.get_quantization_config(torchlike_trl.ModelConfig()) is None


def test_model_config_refuses_4_and_8_bit_together():
    with pytest.raises(ValueError, match="8 bit and 4 bit"):
        torchlike_trl.ModelConfig(load_in_4bit=True, load_in_8bit=True)


def test_get_kbit_device_map_is_none():
    assert torchlike_trl.get_kbit_device_map() is None
