"""GRPOConfig / RLOOConfig / DPOConfig take TRL 1.16's defaults and validation, their ignored and refused fields are
explained, and bad settings are refused in TRL's words (the field-for-field walk: test_config_parity.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import transformers
import trl

from tests.helpers.config_fields import (
    FIELD_SUPPORT,
    SFT_FIELD_SUPPORT,
    unsupported_field_warnings,
)
from torchlike import generation
from torchlike.adapters import rollout
from torchlike.adapters.losses import dpo as dpo_losses
from torchlike.adapters.losses import grpo as grpo_losses
from torchlike.adapters.losses import sft as sft_losses
from torchlike.field_support import check_unsupported, field_table
from torchlike.trl import DPOConfig, GRPOConfig, RLOOConfig, SFTConfig
from torchlike.trl.trainer import dpo_config, grpo_config, sft_config
from torchlike.trl.trainer.dpo_fields import DPO_FIELD_SUPPORT
from torchlike.trl.trainer.grpo_fields import GRPO_FIELD_SUPPORT
from torchlike.trl.trainer.rloo_fields import RLOO_FIELD_SUPPORT


def test_rloo_refuses_what_trl_refuses_naming_rloo():
    with pytest.raises(ValueError, match="RLOO requires at least 2 generations"):
        RLOOConfig("out", num_generations=1)
    with pytest.raises(ValueError, match="auto_find_batch_size is not supported by RLOO"):
        RLOOConfig("out", auto_find_batch_size=True)
    with pytest.raises(ValueError, match="reward_clip_range"):
        RLOOConfig("out", reward_clip_range=(1.0, -1.0))


def test_trl_default_changes_are_spelled_out():
    for config in (GRPOConfig(), DPOConfig()):
        assert (config.learning_rate, config.logging_steps, config.gradient_checkpointing, config.bf16) == (
            1e-6, 10, True, True)
    assert GRPOConfig().remove_unused_columns is False and DPOConfig().disable_dropout is True


def test_the_configs_accept_the_loss_modules_own_tables():
    """One list per choice: a config reads the loss module's table rather than keeping a copy."""
    assert grpo_config.LOSS_TYPES is grpo_losses.GRPO_LOSS_TYPES
    assert grpo_config.IMPORTANCE_SAMPLING_LEVELS is grpo_losses.IMPORTANCE_SAMPLING_LEVELS
    assert grpo_config.SCALE_REWARDS is grpo_losses.SCALE_REWARDS
    assert grpo_config.MULTI_OBJECTIVE_AGGREGATIONS is grpo_losses.MULTI_OBJECTIVE_AGGREGATIONS
    assert dpo_config.LOSS_TYPES is dpo_losses.DPO_LOSS_TYPES
    assert dpo_config.F_DIVERGENCE_TYPES is dpo_losses.F_DIVERGENCE_TYPES
    assert dpo_config.F_DIVERGENCE_LOSS_TYPES is dpo_losses.F_DIVERGENCE_LOSS_TYPES
    assert sft_config.LOSS_TYPES is sft_losses.SFT_LOSS_TYPES
    assert generation.ROLLOUT_ENGINES is rollout.BUILT_IN


def test_one_choice_check_serves_the_configs_and_the_loss_settings():
    root = Path(__file__).resolve().parent.parent
    definitions = [str(path.relative_to(root)) for folder in ("torchlike", "adapters")
                   for path in sorted((root / folder).rglob("*.py")) if "def check_choice(" in path.read_text()]
    assert definitions == ["adapters/losses/settings.py"]
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not a recognised value\. Accepted values: 'grpo'"):
        GRPOConfig(loss_type="ppo")
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not a recognised value\. Accepted values: 'grpo'"):
        grpo_losses.GRPOLossSettings(loss_type="ppo")


ISSUE_HONOURED_GRPO = ["num_generations", "num_generations_eval", "max_completion_length", "temperature", "top_p",
                       "top_k", "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs", "beta",
                       "epsilon", "epsilon_high", "importance_sampling_level", "num_iterations", "loss_type",
                       "scale_rewards", "reward_weights", "mask_truncated_completions", "generation_batch_size",
                       "steps_per_generation", "log_completions", "max_prompt_length"]
ISSUE_HONOURED_DPO = ["beta", "loss_type", "label_smoothing", "max_length", "truncation_mode", "loss_weights"]


def test_the_fields_the_issue_requires_are_honoured():
    assert [name for name in ISSUE_HONOURED_GRPO if GRPO_FIELD_SUPPORT[name].status != "honoured"] == []
    assert [name for name in ISSUE_HONOURED_DPO if DPO_FIELD_SUPPORT[name].status != "honoured"] == []


def test_rl_rows_override_sft_rows_only_for_their_configs():
    assert field_table(GRPOConfig)["loss_type"] is GRPO_FIELD_SUPPORT["loss_type"]
    assert field_table(DPOConfig)["loss_type"] is DPO_FIELD_SUPPORT["loss_type"]
    assert field_table(SFTConfig) == {**FIELD_SUPPORT, **SFT_FIELD_SUPPORT}
    assert field_table(GRPOConfig)["remove_unused_columns"] is GRPO_FIELD_SUPPORT["remove_unused_columns"]


# --- ignored fields warn, refused fields raise, defaults are silent -----------------------------------------------

# A non-default value for every ignored or refused field of the RL tables (with what it needs to construct).
NON_DEFAULT = {
    "neftune_noise_alpha": {"neftune_noise_alpha": 5.0},
    "trust_remote_code": {"trust_remote_code": True},
    "ds3_gather_for_generation": {"ds3_gather_for_generation": False},
    "cache_implementation": {"cache_implementation": "static"},
    "vllm_model_impl": {"vllm_model_impl": "transformers"},
    "vllm_enable_sleep_mode": {"vllm_enable_sleep_mode": True},
    "vllm_structured_outputs_regex": {"vllm_structured_outputs_regex": r"\d+"},
    "vllm_group_port": {"vllm_group_port": 5000},
    "vllm_gpu_memory_utilization": {"vllm_gpu_memory_utilization": 0.5},
    "vllm_max_model_length": {"vllm_max_model_length": 2048},
    "vllm_tensor_parallel_size": {"vllm_tensor_parallel_size": 2},
    "log_multimodal": {"log_multimodal": False},
    "log_unique_prompts": {"log_unique_prompts": True},
    "log_completions_hub_repo": {"log_completions_hub_repo": "me/completions", "log_completions": True},
    "use_transformers_continuous_batching": {"use_transformers_continuous_batching": True},
    "transformers_continuous_batching_config": {"transformers_continuous_batching_config": {"max_batch_tokens": 8}},
    "use_transformers_paged": {"use_transformers_paged": True},
    "padding_free": {"padding_free": True},
    "data_seed": {"data_seed": 3},
    "remove_unused_columns": {"remove_unused_columns": False},
    "precompute_ref_batch_size": {"precompute_ref_batch_size": 16},
    "activation_offloading": {"activation_offloading": True},
}


def _with_status(table, status):
    return [name for name, support in table.items() if support.status == status]


def _rows(status):
    return ([(GRPOConfig, name) for name in _with_status(GRPO_FIELD_SUPPORT, status)]
            + [(RLOOConfig, name) for name in _with_status(RLOO_FIELD_SUPPORT, status)]
            + [(DPOConfig, name) for name in _with_status(DPO_FIELD_SUPPORT, status)])


def _applied(config_class, **kwargs):
    """Build a config and run check_unsupported, returning the UserWarnings it emits."""
    return unsupported_field_warnings(config_class, **kwargs)


def test_every_ignored_or_refused_rl_field_has_a_sample_value():
    assert set(NON_DEFAULT) == {name for _, name in _rows("ignored") + _rows("refused")}


@pytest.mark.parametrize(("config_class", "name"), _rows("ignored"))
def test_setting_an_ignored_rl_field_warns_naming_it(config_class, name):
    messages = [m for m in _applied(config_class, **NON_DEFAULT[name]) if m.startswith(f"{name}=")]
    assert len(messages) == 1, messages
    assert "is ignored: " in messages[0] and field_table(config_class)[name].reason in messages[0]


@pytest.mark.parametrize(("config_class", "name"), _rows("refused"))
def test_setting_a_refused_rl_field_raises_naming_it(config_class, name):
    with pytest.raises(ValueError) as error:
        _applied(config_class, **NON_DEFAULT[name])
    message = str(error.value)
    assert f"{name}=" in message and field_table(config_class)[name].reason in message and "the default" in message


@pytest.mark.parametrize("config_class", [GRPOConfig, RLOOConfig, DPOConfig])
def test_defaults_neither_warn_nor_raise(config_class):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unsupported(config_class())


def test_honoured_grpo_settings_never_warn():
    assert _applied(GRPOConfig, num_generations=4, per_device_train_batch_size=4, temperature=0.7, top_p=0.9,
                    top_k=50, min_p=0.05, repetition_penalty=1.1, generation_kwargs={"suppress_tokens": [1]},
                    chat_template_kwargs={"enable_thinking": False}, beta=0.04, epsilon_high=0.28, delta=1.5,
                    importance_sampling_level="sequence", loss_type="grpo", scale_rewards="batch",
                    reward_weights=[1.0, 0.5], mask_truncated_completions=True, steps_per_generation=2,
                    num_iterations=2, log_completions=True, shuffle_dataset=False, disable_dropout=True) == []


def test_vllm_server_fields_are_honoured_not_ignored():
    assert _applied(GRPOConfig, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://server:8000",
                    vllm_server_host="10.0.0.1", vllm_server_port=8001, vllm_server_timeout=10.0) == []
    assert "vllm_mode='colocate'" in GRPO_FIELD_SUPPORT["use_vllm"].reason


# --- GRPO batch semantics and validation ---------------------------------------------------------------------------

def test_generation_batch_defaults_to_one_accumulation_window():
    config = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=6,
                        mesh_shape=(1, 1))
    assert (config.steps_per_generation, config.generation_batch_size) == (3, 12)
    config = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=16, num_generations=8, mesh_shape=(1, 1))
    assert config.steps_per_generation == 4


def test_the_global_batch_counts_data_parallel_shards_but_not_tp():
    config = GRPOConfig(per_device_train_batch_size=2, num_generations=8, mesh_shape=(4, 1))
    assert config.generation_batch_size == 8
    with pytest.raises(ValueError, match=r"generation_batch_size \(4 = per_device_train_batch_size=2 x 2 "):
        GRPOConfig(per_device_train_batch_size=2, num_generations=8, mesh_shape=(2, 2))


@pytest.mark.parametrize("num_generations", [1, 0, None])
def test_fewer_than_two_generations_are_refused(num_generations):
    with pytest.raises(ValueError, match=r"at least 2 generations per prompt.*Set num_generations to 2 or more"):
        GRPOConfig(num_generations=num_generations)


def test_indivisible_generation_batch_names_the_values_that_work():
    with pytest.raises(ValueError) as error:
        GRPOConfig(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=8, mesh_shape=(1, 1))
    message = str(error.value)
    assert "generation_batch_size (6 = per_device_train_batch_size=3 x 1 data-parallel shard(s) x " in message
    assert "must be divisible by num_generations (8)" in message
    assert "Valid num_generations for this batch: 2, 3, 6" in message
    assert "per_device_train_batch_size=4 or steps_per_generation=8" in message


def test_indivisible_explicit_generation_batch_names_the_next_valid_one():
    with pytest.raises(ValueError, match=r"generation_batch_size \(12\) must be divisible by num_generations \(8\).*"
                                         r"2, 3, 4, 6, 12.*set generation_batch_size=16"):
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=12, num_generations=8, mesh_shape=(1, 1))
    with pytest.raises(ValueError, match=r"generation_batch_size \(10\) must be divisible by the global batch size "
                                         r"\(4 = .*Valid values near it: 8, 12"):
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=10, num_generations=2, mesh_shape=(1, 1))
    with pytest.raises(ValueError, match="can not be both configured"):
        GRPOConfig(generation_batch_size=8, steps_per_generation=1)


def test_indivisible_eval_batch_names_the_values_that_work():
    with pytest.raises(ValueError, match=r"global eval batch size \(6 = per_device_eval_batch_size=6 .*\(4\)\. Valid "
                                         r"num_generations_eval for this batch: 2, 3, 6; or set "
                                         r"per_device_eval_batch_size=8"):
        GRPOConfig(per_device_train_batch_size=4, num_generations=4, eval_strategy="steps",
                   per_device_eval_batch_size=6, mesh_shape=(1, 1))


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"loss_type": "ppo"}, ["loss_type='ppo'", "'grpo', 'dr_grpo', 'dapo', 'bnpo', 'cispo', 'sapo', 'luspo', 'vespo'"]),
    ({"importance_sampling_level": "word"}, ["importance_sampling_level='word'", "'token', 'sequence'"]),
    ({"scale_rewards": "global"}, ["scale_rewards='global'", "'group', 'batch', 'none'"]),
    ({"multi_objective_aggregation": "max"}, ["multi_objective_aggregation='max'", "'normalize_then_sum'"]),
    ({"temperature": 0.0}, ["temperature=0.0 must be positive"]),
    ({"max_completion_length": None}, ["max_completion_length=None must be a positive integer"]),
    ({"auto_find_batch_size": True}, ["auto_find_batch_size is not supported by GRPO"]),
    ({"log_completions_hub_repo": "me/c"}, ["log_completions is False"]),
    ({"vllm_importance_sampling_clip_min": 4.0}, ["must be less than vllm_importance_sampling_clip_max (3.0)"]),
])
def test_bad_grpo_values_are_explained(kwargs, needles):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**kwargs)
    for needle in needles:
        assert needle in str(error.value)


def test_scale_rewards_booleans_map_like_trl():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


def test_max_prompt_length_is_accepted_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="max_prompt_length was removed from TRL's GRPOConfig in 0.28"):
        assert GRPOConfig(max_prompt_length=256).max_prompt_length == 256
    with pytest.raises(TypeError):  # TRL 1.16 no longer knows it
        trl.GRPOConfig(max_prompt_length=256)


def test_grpo_deprecations_are_mapped_like_trl():
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        assert GRPOConfig(use_transformers_paged=True).use_transformers_continuous_batching is True
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        assert GRPOConfig(vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0


# --- DPO validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"loss_type": "orpo"}, ["loss_type='orpo'", "'sigmoid', 'hinge', 'ipo'", "'sigmoid_norm'"]),
    ({"loss_type": ["sigmoid", "dpop"]}, ["loss_type='dpop'"]),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, ["Got 1 weights for 2 loss types"]),
    ({"loss_type": "exo_pair"}, ["'exo_pair'", "greater than 0.0"]),
    ({"loss_type": "nca_pair", "f_divergence_type": "js_divergence"}, ["only supported for the loss types"]),
    ({"f_divergence_type": "tv"}, ["f_divergence_type='tv'", "'alpha_divergence'"]),
    ({"ld_alpha": 1.5}, ["ld_alpha=1.5 must be in [0.0, 1.0]"]),
    ({"truncation_mode": "middle"}, ["truncation_mode='middle'", "'keep_start', 'keep_end'"]),
    ({"max_length": 0}, ["max_length=0"]),
])
def test_bad_dpo_values_are_explained(kwargs, needles):
    with pytest.raises(ValueError) as error:
        DPOConfig(**kwargs)
    for needle in needles:
        assert needle in str(error.value)


def test_dpo_loss_type_string_becomes_a_list():
    assert DPOConfig(loss_type="ipo").loss_type == ["ipo"]


def test_dpo_deprecations_and_removals_are_mapped_like_trl():
    with pytest.warns(FutureWarning, match="pad_token is deprecated"):
        DPOConfig(pad_token="<pad>")
    with pytest.warns(FutureWarning, match="keep_end"):
        DPOConfig(truncation_mode="keep_end")
    with pytest.warns(UserWarning, match=r"\[0.0, 0.5\) for the 'robust' loss"):
        DPOConfig(loss_type="robust", label_smoothing=0.6)
    for name in ("max_prompt_length", "max_completion_length"):
        with pytest.raises(TypeError):
            trl.DPOConfig(**{name: 128})
        with pytest.raises(TypeError, match=f"{name}.*max_length now bounds prompt"):
            DPOConfig(**{name: 128})


# --- command lines ---------------------------------------------------------------------------------------------------

def test_command_lines_parse_like_trl_scripts():
    (grpo,) = transformers.HfArgumentParser(GRPOConfig).parse_args_into_dataclasses([
        "--output_dir", "out", "--num_generations", "4", "--per_device_train_batch_size", "4",
        "--reward_weights", "1.0", "0.5", "--loss_type", "grpo", "--max_completion_length", "64",
        "--generation_kwargs", '{"suppress_tokens": [1]}', "--mesh_shape", "1,1", "--pad_to_multiple_of", "16"])
    assert (grpo.num_generations, grpo.reward_weights, grpo.loss_type) == (4, [1.0, 0.5], "grpo")
    assert grpo.generation_kwargs == {"suppress_tokens": [1]} and grpo.pad_to_multiple_of == 16
    (dpo,) = transformers.HfArgumentParser(DPOConfig).parse_args_into_dataclasses([
        "--output_dir", "out", "--loss_type", "sigmoid", "bco_pair", "--loss_weights", "0.8", "0.2", "--beta", "0.2"])
    assert (dpo.loss_type, dpo.loss_weights, dpo.beta) == (["sigmoid", "bco_pair"], [0.8, 0.2], 0.2)
