"""``torchlike orpo|cpo|gkd|xpo|nash_md|bco|gmpo|tpo|sdft|gold``: TRL's experimental trainers from the command line,
taking the flags of TRL's ``examples/scripts/<name>.py``; each trains a tiny model for one step and writes a directory
transformers loads, and what cannot run here (a remote ``--judge``, a quantised ORPO model) is refused in words."""

from __future__ import annotations

import importlib

import pytest

from tests.helpers.data import UNPAIRED as UNPAIRED_ROWS
from tests.helpers.scripts import WORDS, assert_hf_loadable, preference_rows, write_jsonl
from tests.helpers.tokenizers import CHAT_TEMPLATE
from torchlike import cli

# One optimizer step, no checkpoint or report.
ONE_STEP = ["--max_steps", "1", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]

#: Per command, flags of TRL's example script (its config's own fields and the script's) that --help must list.
TRL_SCRIPT_FLAGS = {
    "orpo": ["--beta", "--max_length", "--disable_dropout"],
    "cpo": ["--loss_type", "--cpo_alpha", "--simpo_gamma"],
    "gkd": ["--teacher_model_name_or_path", "--teacher_model_init_kwargs", "--lmbda", "--seq_kd", "--max_new_tokens"],
    "xpo": ["--judge", "--reward_model_path", "--reward_funcs", "--alpha", "--max_new_tokens", "--missing_eos_penalty"],
    "nash_md": ["--judge", "--reward_model_path", "--reward_funcs", "--mixture_coef", "--max_new_tokens",
                "--missing_eos_penalty"],
    "bco": ["--embedding_model_name_or_path", "--embedding_tokenizer_name_or_path", "--trust_remote_code",
            "--prompt_sample_size", "--min_density_ratio", "--max_density_ratio"],
    "gmpo": ["--reward_funcs", "--reward_model_name_or_path", "--epsilon", "--epsilon_high", "--num_generations",
             "--max_completion_length"],
    "tpo": ["--loss_type", "--tpo_alpha", "--tpo_l_gamma", "--beta", "--max_length"],
    "gold": ["--teacher_model_name_or_path", "--teacher_tokenizer_name_or_path", "--use_uld_loss", "--lmbda",
             "--max_completion_length", "--uld_token_merge_strategy", "--num_generations"],
    "sdft": ["--dataset_path", "--privileged_context_column", "--golden_response_column", "--eval_num_prompts",
             "--demonstration_template", "--tool_eval_num_examples", "--tool_eval_max_new_tokens",
             "--teacher_model_kind", "--distillation_mode", "--num_generations"],
}
SHARED_FLAGS = ["--model_name_or_path", "--dataset_name", "--dataset_train_split", "--use_peft", "--lora_r",
                "--output_dir", "--learning_rate"]


def common_arguments(model_dir, dataset_dir, tmp_path) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(dataset_dir),
            "--output_dir", str(tmp_path / "out"), *ONE_STEP]


def prompt_rows(count: int = 8) -> list[dict]:
    return [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(count)]


@pytest.mark.parametrize("name", sorted(TRL_SCRIPT_FLAGS))
def test_help_lists_the_config_and_script_flags_of_trls_example_script(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"torchlike {name}" in out
    missing = [flag for flag in SHARED_FLAGS + TRL_SCRIPT_FLAGS[name] if f"{flag} " not in out]
    assert not missing


@pytest.mark.parametrize("name, config", [("orpo", "ORPOConfig"), ("cpo", "CPOConfig"), ("gkd", "GKDConfig"),
                                          ("tpo", "TPOConfig"), ("gold", "GOLDConfig")])
def test_parser_accepts_every_flag_of_trls_parser(name, config, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl

    trl_config = getattr(importlib.import_module(f"trl.experimental.{name}"), config)
    theirs = trl.TrlParser((trl.ScriptArguments, trl_config, trl.ModelConfig, trl.DatasetMixtureConfig))
    ours = importlib.import_module(f"torchlike.trl.scripts.{name}").make_parser()
    flags = {parser: {option for action in parser._actions for option in action.option_strings}
             for parser in (ours, theirs)}
    assert flags[theirs] <= flags[ours]


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_paired_preference_command_trains_and_saves(name, script_model, tmp_path, capsys):
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", preference_rows()).parent
    assert cli.main([name, *common_arguments(script_model, dataset_dir, tmp_path),
                     "--per_device_train_batch_size", "2", "--max_length", "32"]) == 0
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_gkd_command_distils_the_teacher_and_saves(script_model, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": " ".join(WORDS[i:i + 3])},
                          {"role": "assistant", "content": " ".join(WORDS[i + 3:i + 5])}]} for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    template = tmp_path / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    assert cli.main(["gkd", *common_arguments(script_model, dataset_dir, tmp_path),
                     "--teacher_model_name_or_path", str(script_model), "--chat_template_path", str(template),
                     "--per_device_train_batch_size", "2", "--max_length", "32", "--max_new_tokens", "4",
                     "--lmbda", "1.0"]) == 0
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_gold_command_distils_across_tokenizers_evaluates_and_saves(script_model, tmp_path, capsys):
    """TRL's gold.py with --use_uld_loss (the teacher's tokenizer read from its path) and an evaluation of the test
    split, whose completions LogCompletionsCallback logs."""
    rows = [{"prompt": " ".join(WORDS[i:i + 3]), "completion": " " + " ".join(WORDS[i + 3:i + 5])} for i in range(8)]
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
    write_jsonl(dataset_dir / "test.jsonl", rows)  # LogCompletionsCallback samples 8 prompts, as in TRL
    assert cli.main(["gold", *common_arguments(script_model, dataset_dir, tmp_path),
                     "--teacher_model_name_or_path", str(script_model), "--use_uld_loss",
                     "--per_device_train_batch_size", "2", "--max_length", "32", "--max_completion_length", "4",
                     "--eval_strategy", "steps", "--eval_steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "Training completed" in out and "eval_loss" in out
    assert_hf_loadable(tmp_path / "out")


def test_gkd_command_without_a_teacher_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--teacher_model_name_or_path"):
        cli.main(["gkd", "--model_name_or_path", str(tmp_path), "--dataset_name", str(tmp_path),
                  "--output_dir", str(tmp_path / "out")])


def test_xpo_command_ranks_with_a_reward_model_and_saves(script_model, tmp_path, capsys):
    import transformers

    reward_model = tmp_path / "tiny-reward-model"
    transformers.AutoModelForSequenceClassification.from_pretrained(script_model, num_labels=1).save_pretrained(
        reward_model)
    transformers.AutoTokenizer.from_pretrained(script_model).save_pretrained(reward_model)
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", prompt_rows()).parent
    assert cli.main(["xpo", *common_arguments(script_model, dataset_dir, tmp_path), "--reward_model_path",
                     str(reward_model), "--per_device_train_batch_size", "2", "--max_new_tokens", "4"]) == 0
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_nash_md_command_ranks_with_a_reward_function_and_saves(script_model, tmp_path, capsys):
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", prompt_rows()).parent
    assert cli.main(["nash_md", *common_arguments(script_model, dataset_dir, tmp_path), "--reward_funcs",
                     "tests.script_rewards.completion_length_reward", "--per_device_train_batch_size", "2",
                     "--max_new_tokens", "4"]) == 0
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


@pytest.mark.parametrize("name", ["xpo", "nash_md"])
@pytest.mark.parametrize("judge", ["pair_rm", "openai", "hf"])
def test_trls_judges_are_refused_naming_the_reward_options(name, judge, tmp_path):
    with pytest.raises(ValueError, match=f"--judge {judge}: .*--reward_model_path.*--reward_funcs"):
        cli.main([name, "--model_name_or_path", str(tmp_path), "--dataset_name", str(tmp_path),
                  "--output_dir", str(tmp_path / "out"), "--judge", judge])


def test_online_command_with_two_rewards_is_refused(tmp_path):
    with pytest.raises(ValueError, match="XPOTrainer ranks its completions with one reward, got 2"):
        cli.main(["xpo", "--model_name_or_path", str(tmp_path), "--dataset_name", str(tmp_path),
                  "--output_dir", str(tmp_path / "out"), "--reward_model_path", str(tmp_path),
                  "--reward_funcs", "think_format_reward"])


def test_quantised_model_is_refused_for_a_trainer_without_quantization_config(tmp_path):
    with pytest.raises(ValueError, match="--load_in_4bit/--load_in_8bit: ORPOTrainer takes no quantization_config"):
        cli.main(["orpo", "--model_name_or_path", str(tmp_path), "--dataset_name", str(tmp_path),
                  "--output_dir", str(tmp_path / "out"), "--load_in_4bit"])


def test_bco_command_fits_udm_on_the_embedding_models_prompt_embeddings(script_model, tmp_path, capsys):
    bco = importlib.import_module("torchlike.trl.scripts.bco")
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", UNPAIRED_ROWS).parent
    arguments = bco.make_parser(prog="torchlike bco").parse_args_and_config(
        [*common_arguments(script_model, dataset_dir, tmp_path), "--embedding_model_name_or_path", str(script_model),
         "--per_device_train_batch_size", "4", "--max_length", "32"])
    trainer = bco.main(*arguments)
    assert trainer.clf is not None  # the density-ratio classifier UDM fits
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def test_gmpo_command_scores_with_a_reward_function_and_saves(script_model, tmp_path, capsys):
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", prompt_rows()).parent
    assert cli.main(["gmpo", *common_arguments(script_model, dataset_dir, tmp_path), "--reward_funcs",
                     "tests.script_rewards.completion_length_reward", "--per_device_train_batch_size", "4",
                     "--num_generations", "2", "--max_completion_length", "4"]) == 0
    assert "Training completed" in capsys.readouterr().out
    assert_hf_loadable(tmp_path / "out")


def ultrafeedback_rows(count: int) -> list[dict]:
    """Raw UltraFeedback rows: an instruction and scored completions (the last row has too few scored ones)."""
    rows = [{"instruction": " ".join(WORDS[i:i + 3]),
             "completions": [{"response": WORDS[i + 3 + j], "overall_score": float(score)}
                             for j, score in enumerate((3, 9, 1, 5))]} for i in range(count)]
    rows[-1]["completions"] = rows[-1]["completions"][:2] + [{"response": "", "overall_score": 2.0}]
    return rows


def test_tpo_script_turns_ultrafeedback_rows_into_triples_as_trls_script():
    import datasets

    from torchlike.trl.scripts.tpo import prepare_triples

    triples = prepare_triples(datasets.DatasetDict({"train": datasets.Dataset.from_list(ultrafeedback_rows(3))}))
    rows = list(triples["train"])
    assert len(rows) == 2  # the row with two scored non-empty responses is dropped
    first = ultrafeedback_rows(3)[0]
    responses = [completion["response"] for completion in first["completions"]]
    assert rows[0] == {"prompt": [{"role": "user", "content": first["instruction"]}],
                       "reference": [{"role": "assistant", "content": responses[1]}],  # score 9
                       "chosen": [{"role": "assistant", "content": responses[3]}],  # score 5
                       "rejected": [{"role": "assistant", "content": responses[2]}]}  # score 1
    plain = {"prompt": "one two", "chosen": " three", "rejected": " four", "reference": " five"}
    wrapped = next(iter(prepare_triples(datasets.DatasetDict({"train": datasets.Dataset.from_list([plain])}))["train"]))
    assert wrapped == {"prompt": [{"role": "user", "content": "one two"}],
                       **{key: [{"role": "assistant", "content": plain[key]}]
                          for key in ("chosen", "rejected", "reference")}}


def test_tpo_command_trains_on_ultrafeedback_rows_evaluates_and_saves(script_model, tmp_path, capsys):
    import json
    import shutil

    import transformers

    model_dir = shutil.copytree(script_model, tmp_path / "chat-model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE  # the script wraps every triple into a conversation
    tokenizer.save_pretrained(model_dir)
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", ultrafeedback_rows(9)).parent
    write_jsonl(dataset_dir / "test.jsonl", ultrafeedback_rows(3))
    assert cli.main(["tpo", *common_arguments(model_dir, dataset_dir, tmp_path), "--per_device_train_batch_size", "2",
                     "--max_length", "32", "--loss_type", "tpo-l", "--eval_strategy", "steps", "--eval_steps",
                     "1"]) == 0
    out = capsys.readouterr().out
    assert "Training completed" in out and "***** eval metrics *****" in out
    metrics = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert {"eval_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(metrics)
    assert json.loads((tmp_path / "out" / "all_results.json").read_text()) == metrics
    assert_hf_loadable(tmp_path / "out")


def test_sdft_command_builds_the_privileged_context_scores_tool_use_and_saves(script_model, tmp_path, capsys):
    """TRL's SDFT script: demonstrations become the privileged context through the template, the test split's
    ``golden_answer`` is scored with greedy completions before and after training, and the final evaluation saved."""
    import json

    import datasets

    rows = [{"prompt": " ".join(WORDS[i:i + 3]), "golden_response": " ".join(WORDS[i + 3:i + 5])} for i in range(8)]
    test = [{**row, "golden_answer": [{"Action": "search", "Action_Input": '{"q": "fox"}'}]} for row in rows[:2]]
    dataset_dir = tmp_path / "data"  # a save_to_disk folder (--dataset_path): the splits have different columns
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(dataset_dir)
    trainer = cli.main(["sdft", *common_arguments(script_model, "unused", tmp_path), "--dataset_path", str(dataset_dir),
                        "--per_device_train_batch_size", "4", "--num_generations", "2",
                        "--max_completion_length", "4", "--eval_strategy", "steps", "--eval_steps", "1",
                        "--eval_num_prompts", "0", "--tool_eval_max_new_tokens", "4",
                        "--demonstration_template", "Answer: $output_text"])
    assert trainer == 0
    out = capsys.readouterr().out
    assert "***** eval metrics *****" in out
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert {"eval_loss", "eval_sdft/distillation_loss", "tool_eval_before/action_accuracy",
            "tool_eval_after/tool_call_accuracy", "tool_eval_delta/valid_json_rate"} <= set(results)
    samples = json.loads((tmp_path / "out" / "tool_eval_after_samples.json").read_text())
    assert [sample["gold_action"] for sample in samples] == ["search", "search"]
    assert_hf_loadable(tmp_path / "out")


def test_sdft_script_builds_the_privileged_context_as_trls():
    from torchlike.trl.scripts.sdft import SDFTScriptArguments, with_privileged_context

    args = SDFTScriptArguments(demonstration_template="Q: $orig_content / A: $output_text")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert with_privileged_context({"prompt": conversation, "golden_response": ["4", "four"]}, args) == \
        {"prompt": conversation, "privileged_context": "Q: 2 + 2? / A: 4\nfour"}
    assert with_privileged_context({"prompt": "x", "privileged_context": "known", "golden_response": "y"}, args) == \
        {"prompt": "x", "privileged_context": "known"}
    with pytest.raises(ValueError, match="should provide `privileged_context` or `golden_response`, not "
                                         "`teacher_prompt`"):
        with_privileged_context({"prompt": "x", "teacher_prompt": "y"}, args)
