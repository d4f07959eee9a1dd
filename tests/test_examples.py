"""The scripts in examples/ run on the embedded default (a few steps) and do what they say: the task's checker is
right, adapters and exports load back (in torchlike, transformers and peft) with the same outputs, and the
trainers log what the summaries print."""

from __future__ import annotations

import importlib
import math
import re
import sys
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["demo", "distillation", "dpo", "export_for_vllm", "grpo_countdown", "kto", "lora_lenient_load",
           "online_dpo", "reward_model", "rloo_countdown", "sft_lora", "vlm_sft"]


def example(name: str) -> ModuleType:
    """Imports ``examples/<name>.py`` as the scripts import each other (the folder on ``sys.path``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_documents_its_command_line_and_takes_model_max_steps_and_out(name, capsys):
    module = example(name)
    assert f"python examples/{name}.py" in module.__doc__
    with pytest.raises(SystemExit):
        module.main(["--help"])
    assert {"--model", "--max-steps", "--out"} <= set(re.findall(r"--[a-z-]+", capsys.readouterr().out))


@pytest.mark.parametrize(("completion", "numbers", "target", "correct", "well_formed"), [
    (" <answer>3*5-2</answer>", [3, 5, 2], 13, 1.0, 1.0),
    (" <answer>(5-2)*3</answer>", [3, 5, 2], 9, 1.0, 1.0),
    ("<answer>3+5</answer>", [5, 3], 8, 1.0, 1.0),
    (" <answer>3+5</answer> and more", [3, 5], 8, 1.0, 0.0),  # right, but it did not stop
    (" <answer>3-5</answer>", [3, 5], 8, 0.0, 1.0),  # wrong value
    (" <answer>3+3+2</answer>", [3, 5], 8, 0.0, 1.0),  # wrong numbers
    (" <answer>8</answer>", [3, 5], 8, 0.0, 1.0),  # numbers unused
    (" 3+5", [3, 5], 8, 0.0, 0.0),  # no answer tags
    (" <answer>3+</answer>", [3, 5], 8, 0.0, 0.0),  # not an expression
])
def test_countdown_rewards_score_known_answers(completion, numbers, target, correct, well_formed):
    countdown = example("countdown")
    assert countdown.equation_reward([completion], numbers=[numbers], target=[target]) == [correct]
    assert countdown.format_reward([completion]) == [well_formed]


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "2**10", "1/0", "x+1", "[1][0]",
                                        "(lambda: 1)()", "3.5+1", "'a'*3", "(" * 5000 + "1" + ")" * 5000])
def test_the_answer_checker_evaluates_arithmetic_only(expression):
    assert example("countdown").evaluate(expression) is None


def test_the_answer_checker_is_exact():
    evaluate = example("countdown").evaluate
    assert evaluate("(3+5)*2") == 16 and evaluate("7/2") == Fraction(7, 2) and evaluate("-3+1") == -2


def test_countdown_problems_are_solved_by_their_solution_and_pairs_prefer_it():
    countdown = example("countdown")
    problems = countdown.make_problems(50, numbers_per_problem=3)
    assert all(countdown.is_correct(countdown.answer_text(p["solution"]), p["numbers"], p["target"])
               for p in problems)
    pairs = countdown.preference_pairs(problems)
    assert len(pairs) >= 45
    for pair, problem in zip(pairs, problems, strict=False):
        if pair["prompt"] == problem["prompt"]:
            assert countdown.is_correct(pair["chosen"], problem["numbers"], problem["target"])
            assert not countdown.is_correct(pair["rejected"], problem["numbers"], problem["target"])


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_vlm_sft_trains_on_images_saves_the_adapter_and_reloads_it_exactly(family, tmp_path):
    result = example("vlm_sft").main(["--max-steps", "3", "--out", str(tmp_path), "--family", family])
    assert len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["adapter_files"])
    assert result["reload_max_abs_diff"] <= 1e-6
    assert len(result["answers"]) == 4 and all(isinstance(answer, str) for answer in result["answers"])


def test_sft_lora_trains_the_adapter_saves_it_and_reloads_it_exactly(tmp_path):
    result = example("sft_lora").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert 0 < result["trainable_parameters"] < result["total_parameters"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["adapter_files"])
    assert result["reload_max_abs_diff"] <= 1e-6
    assert all(isinstance(sample, str) for sample in result["samples"])


def test_grpo_countdown_logs_rewards_every_step_and_saves_the_model(tmp_path):
    result = example("grpo_countdown").main(["--max-steps", "2", "--warm-up-steps", "2", "--batch-size", "8",
                                            "--out", str(tmp_path)])
    assert len(result["warm_up_losses"]) == 2 and result["warm_up_losses"][-1] < result["warm_up_losses"][0]
    assert len(result["rewards"]) == 2 and all(0.0 <= r <= 1.1 for r in result["rewards"])
    assert len(result["correct"]) == 2 and all(0.0 <= c <= 1.0 for c in result["correct"])
    assert len(result["samples"]) == 3 and all(isinstance(sample, str) for sample in result["samples"])
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_dpo_starts_at_ln2_with_the_adapter_as_reference_and_logs_every_step(tmp_path):
    result = example("dpo").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert result["logging_steps"] == 1 and len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-5)
    assert result["margins"][0] == pytest.approx(0.0, abs=1e-5) and len(result["margins"]) == 3
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["adapter_files"])


def test_kto_starts_at_one_half_with_the_adapter_as_reference_and_logs_every_step(tmp_path):
    result = example("kto").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert result["logging_steps"] == 1 and len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert result["losses"][0] == pytest.approx(0.5, abs=1e-5)
    assert result["chosen_rewards"][0] == pytest.approx(0.0, abs=1e-5) and len(result["chosen_rewards"]) == 3
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["adapter_files"])


def test_online_dpo_starts_at_ln2_with_the_adapter_as_reference_and_logs_every_step(tmp_path):
    result = example("online_dpo").main(["--max-steps", "3", "--warm-up-steps", "2", "--out", str(tmp_path)])
    assert result["logging_steps"] == 1 and len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-4)  # TRL's logged loss has 4 decimals
    assert result["kl"][0] == pytest.approx(0.0, abs=1e-4) and len(result["scores"]) == 3
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["adapter_files"])


def test_rloo_countdown_logs_rewards_and_kl_every_step_and_saves_the_model(tmp_path):
    result = example("rloo_countdown").main(["--max-steps", "2", "--warm-up-steps", "2", "--batch-size", "8",
                                            "--out", str(tmp_path)])
    assert len(result["rewards"]) == 2 and all(0.0 <= r <= 1.1 for r in result["rewards"])
    assert result["kl"][0] == pytest.approx(0.0, abs=1e-5) and len(result["kl"]) == 2
    assert "model.safetensors" in result["model_files"]


def test_reward_model_trains_the_score_head_and_its_export_scores_as_in_transformers(tmp_path):
    result = example("reward_model").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert len(result["losses"]) == 3 and np.isfinite(result["losses"]).all()
    assert len(result["accuracies"]) == 3 and 0.0 <= result["accuracy_after"] <= 1.0
    assert result["export_difference"] < 1e-4


def test_distillation_trains_the_student_on_its_own_completions(tmp_path):
    result = example("distillation").main(["--max-steps", "3", "--warm-up-steps", "2", "--out", str(tmp_path)])
    assert len(result["losses"]) == 3 and np.isfinite(result["losses"]).all() and min(result["losses"]) >= 0


def test_lora_lenient_load_reports_the_lora_keys_missing_and_restores_the_fine_tune(tmp_path):
    result = example("lora_lenient_load").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert result["lora_keys"] and sorted(result["missing_keys"]) == result["lora_keys"]
    assert result["unexpected_keys"] == []
    assert result["strict_error"].startswith("Error(s) in loading state_dict for PeftModel")
    assert "Missing key(s)" in result["strict_error"]
    assert result["max_abs_diff_to_checkpoint"] <= 1e-6 and result["max_abs_diff_to_base"] > 1e-3


def test_export_for_vllm_merged_and_adapter_load_in_transformers_and_peft_with_the_same_outputs(tmp_path):
    result = example("export_for_vllm").main(["--max-steps", "3", "--out", str(tmp_path)])
    assert "model.safetensors" in result["files"]["merged"] and "config.json" in result["files"]["merged"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["files"]["adapter"])
    for check in (result["merged"], result["adapter"]):
        assert check["same_generations"] == result["problems"]
        assert check["max_abs_logit_diff"] < 1e-4
