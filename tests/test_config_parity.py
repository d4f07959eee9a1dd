"""Every torchlike config matches the transformers/TRL dataclass it mirrors field for field: the same fields (plus
torchlike's own), the same raw defaults, the same values after ``__post_init__``, every field classified in a field
table, and each table naming only real fields with real reasons."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import transformers
import trl
import trl.experimental.a2po as trl_a2po
import trl.experimental.async_grpo as trl_async_grpo
import trl.experimental.cpo as trl_cpo
import trl.experimental.gkd as trl_gkd
import trl.experimental.gmpo as trl_gmpo
import trl.experimental.gold as trl_gold
import trl.experimental.iw_opd as trl_iw_opd
import trl.experimental.online_dpo as trl_online_dpo
import trl.experimental.orpo as trl_orpo
import trl.experimental.sdft as trl_sdft
import trl.experimental.sdpo as trl_sdpo
import trl.experimental.tpo as trl_tpo

from tests.helpers.config_fields import (
    FIELD_SUPPORT,
    NEWER_RAW_DEFAULTS,
    POST_INIT_DIFFERENCES,
    TORCHLIKE_ASYNC_GRPO_FIELDS,
    TORCHLIKE_FIELDS,
    TORCHLIKE_GRPO_FIELDS,
    plain,
    quiet,
    raw_default,
)
from torchlike import version
from torchlike.field_support import field_table
from torchlike.training_args import TrainingArguments
from torchlike.trl import (
    DistillationConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
)
from torchlike.trl.experimental.a2po import A2POConfig
from torchlike.trl.experimental.a2po.a2po_fields import A2PO_FIELD_SUPPORT
from torchlike.trl.experimental.async_grpo import AsyncGRPOConfig
from torchlike.trl.experimental.async_grpo.async_grpo_fields import ASYNC_GRPO_FIELD_SUPPORT
from torchlike.trl.experimental.cpo import CPOConfig
from torchlike.trl.experimental.cpo.cpo_fields import CPO_FIELD_SUPPORT
from torchlike.trl.experimental.gkd import GKDConfig
from torchlike.trl.experimental.gkd.gkd_fields import GKD_FIELD_SUPPORT
from torchlike.trl.experimental.gmpo import GMPOConfig
from torchlike.trl.experimental.gmpo.gmpo_fields import GMPO_FIELD_SUPPORT
from torchlike.trl.experimental.gold import GOLDConfig
from torchlike.trl.experimental.gold.gold_fields import GOLD_FIELD_SUPPORT
from torchlike.trl.experimental.iw_opd import IWOPDConfig
from torchlike.trl.experimental.iw_opd.iw_opd_fields import IW_OPD_FIELD_SUPPORT
from torchlike.trl.experimental.online_dpo import OnlineDPOConfig
from torchlike.trl.experimental.online_dpo.online_dpo_fields import ONLINE_DPO_FIELD_SUPPORT
from torchlike.trl.experimental.orpo import ORPOConfig
from torchlike.trl.experimental.orpo.orpo_fields import ORPO_FIELD_SUPPORT
from torchlike.trl.experimental.sdft import SDFTConfig
from torchlike.trl.experimental.sdft.sdft_fields import SDFT_FIELD_SUPPORT
from torchlike.trl.experimental.sdpo import SDPOConfig
from torchlike.trl.experimental.sdpo.sdpo_fields import SDPO_FIELD_SUPPORT
from torchlike.trl.experimental.tpo import TPOConfig
from torchlike.trl.experimental.tpo.tpo_fields import TPO_FIELD_SUPPORT
from torchlike.trl.trainer.distillation_fields import DISTILLATION_FIELD_SUPPORT
from torchlike.trl.trainer.dpo_fields import DPO_FIELD_SUPPORT
from torchlike.trl.trainer.grpo_fields import GRPO_FIELD_SUPPORT
from torchlike.trl.trainer.kto_fields import KTO_FIELD_SUPPORT
from torchlike.trl.trainer.reward_fields import REWARD_FIELD_SUPPORT
from torchlike.trl.trainer.rloo_fields import RLOO_FIELD_SUPPORT

TRAINING_ARGUMENTS_FIELDS = frozenset(f.name for f in dataclasses.fields(transformers.TrainingArguments))


class ConfigCase(NamedTuple):
    """A torchlike config and the upstream dataclass it mirrors.

    ``table`` must classify every reference field not in ``inherited`` (the fields a base table decides);
    ``extra`` are the fields torchlike has beyond the reference; ``newer_raw_defaults`` are the raw defaults
    torchlike takes from transformers 5.23, allowed to differ (as ``None``) from an older transformers' value.
    After ``__post_init__``, the two built with ``reference_settings`` and ``our_settings`` (TRL's side needs
    ``use_cpu=True`` to accept its bf16 default on this CPU-only machine) agree on every field but
    ``post_init_differences``.
    """

    reference: type
    ours: type
    table: dict[str, Any]
    extra: frozenset[str]
    inherited: frozenset[str] = TRAINING_ARGUMENTS_FIELDS
    newer_raw_defaults: dict[str, Any] | None = None
    reference_settings: dict[str, Any] = {"use_cpu": True}
    our_settings: dict[str, Any] = {"use_cpu": True}
    post_init_differences: frozenset[str] = frozenset(POST_INIT_DIFFERENCES)


CASES = {
    # Built without use_cpu, so dataloader_pin_memory keeps its value on both sides.
    "transformers.TrainingArguments": ConfigCase(transformers.TrainingArguments, TrainingArguments, FIELD_SUPPORT,
                                                 frozenset(TORCHLIKE_FIELDS), frozenset(), NEWER_RAW_DEFAULTS,
                                                 reference_settings={}, our_settings={},
                                                 post_init_differences=frozenset({"accelerator_config"})),
    "trl.SFTConfig": ConfigCase(trl.SFTConfig, SFTConfig, FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS), frozenset(),
                                NEWER_RAW_DEFAULTS),
    "GRPOConfig": ConfigCase(trl.GRPOConfig, GRPOConfig, GRPO_FIELD_SUPPORT, frozenset(TORCHLIKE_GRPO_FIELDS),
                             our_settings={"use_cpu": True, "mesh_shape": (1, 1)}),
    "RLOOConfig": ConfigCase(trl.RLOOConfig, RLOOConfig, RLOO_FIELD_SUPPORT, frozenset(TORCHLIKE_GRPO_FIELDS),
                             our_settings={"use_cpu": True, "mesh_shape": (1, 1)}),
    "DPOConfig": ConfigCase(trl.DPOConfig, DPOConfig, DPO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "KTOConfig": ConfigCase(trl.KTOConfig, KTOConfig, KTO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "RewardConfig": ConfigCase(trl.RewardConfig, RewardConfig, REWARD_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "DistillationConfig": ConfigCase(trl.DistillationConfig, DistillationConfig, DISTILLATION_FIELD_SUPPORT,
                                     frozenset(TORCHLIKE_FIELDS)),
    "ORPOConfig": ConfigCase(trl_orpo.ORPOConfig, ORPOConfig, ORPO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "CPOConfig": ConfigCase(trl_cpo.CPOConfig, CPOConfig, CPO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "GKDConfig": ConfigCase(trl_gkd.GKDConfig, GKDConfig, GKD_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "OnlineDPOConfig": ConfigCase(trl_online_dpo.OnlineDPOConfig, OnlineDPOConfig, ONLINE_DPO_FIELD_SUPPORT,
                                  frozenset(TORCHLIKE_FIELDS)),
    # GMPO's table decides only what it changes; GRPO's decides the rest.
    "GMPOConfig": ConfigCase(trl_gmpo.GMPOConfig, GMPOConfig, GMPO_FIELD_SUPPORT, frozenset(TORCHLIKE_GRPO_FIELDS),
                             inherited=TRAINING_ARGUMENTS_FIELDS | frozenset(GRPO_FIELD_SUPPORT),
                             our_settings={"use_cpu": True, "mesh_shape": (1, 1)}),
    "AsyncGRPOConfig": ConfigCase(trl_async_grpo.AsyncGRPOConfig, AsyncGRPOConfig, ASYNC_GRPO_FIELD_SUPPORT,
                                  frozenset(TORCHLIKE_ASYNC_GRPO_FIELDS),
                                  our_settings={"use_cpu": True, "mesh_shape": (1, 1)}),
    "TPOConfig": ConfigCase(trl_tpo.TPOConfig, TPOConfig, TPO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "A2POConfig": ConfigCase(trl_a2po.A2POConfig, A2POConfig, A2PO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "SDFTConfig": ConfigCase(trl_sdft.SDFTConfig, SDFTConfig, SDFT_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "SDPOConfig": ConfigCase(trl_sdpo.SDPOConfig, SDPOConfig, SDPO_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "IWOPDConfig": ConfigCase(trl_iw_opd.IWOPDConfig, IWOPDConfig, IW_OPD_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
    "GOLDConfig": ConfigCase(trl_gold.GOLDConfig, GOLDConfig, GOLD_FIELD_SUPPORT, frozenset(TORCHLIKE_FIELDS)),
}
#: The tables of the TRL configs' own fields (TrainingArguments and SFTConfig share FIELD_SUPPORT, which
#: test_training_config.py checks against both).
OWN_TABLES = {name: case for name, case in CASES.items() if case.table is not FIELD_SUPPORT}
#: The settings each config is built with to compare its values after __post_init__: its defaults, and settings
#: that __post_init__ derives other fields from.
POST_INIT_SETTINGS = {
    "transformers.TrainingArguments": [{}],
    "trl.SFTConfig": [{}],
    "GRPOConfig": [{}, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
                        "scale_rewards": False, "pad_to_multiple_of": "64"},
                   {"per_device_train_batch_size": 2, "generation_batch_size": 8, "num_generations": 4,
                    "eval_strategy": "steps", "per_device_eval_batch_size": 4, "num_generations_eval": 2,
                    "scale_rewards": True}],
    "RLOOConfig": [{}, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
                        "normalize_advantages": True, "reward_clip_range": (-1.0, 1.0)},
                   {"per_device_train_batch_size": 2, "generation_batch_size": 8, "beta": 0.0}],
    "DPOConfig": [{}, {"loss_type": "ipo", "pad_to_multiple_of": "8", "beta": 0.5},
                  {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}],
    "KTOConfig": [{}, {"loss_type": "apo_zero_unpaired", "pad_to_multiple_of": "8", "beta": 0.5,
                       "train_sampling_strategy": "random"},
                  {"desirable_weight": 1.33, "undesirable_weight": 0.5, "max_length": None}],
    "RewardConfig": [{}, {"pad_to_multiple_of": "8", "max_length": None, "center_rewards_coefficient": 0.01,
                          "eos_token": "</s>"}],
    "DistillationConfig": [{}, {"beta": 0.0, "temperature": 0.7, "pad_to_multiple_of": "64",
                                "teacher_model_init_kwargs": '{"dtype": "bfloat16"}'},
                           {"beta": 0.5, "max_completion_length": 64, "top_k": 20, "min_p": 0.05,
                            "generation_kwargs": {"top_p": 0.9}, "shuffle_dataset": False}],
    "OnlineDPOConfig": [{}, {"beta": [0.3], "loss_type": "ipo"}, {"beta": [0.1, 0.2], "missing_eos_penalty": 1.0}],
    "GMPOConfig": [{}, {"per_device_train_batch_size": 4, "num_generations": 4, "epsilon_high": 0.2, "beta": 0.04}],
    "AsyncGRPOConfig": [{}, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
                             "max_staleness": 0, "max_inflight_tasks": 16, "weight_sync_steps": 2,
                             "epsilon_high": 0.28, "token_budget": 0}],
    "TPOConfig": [{}, {"loss_type": "tpo-l", "truncation_mode": "keep_end", "tpo_alpha": 0.0, "max_length": None}],
    "A2POConfig": [{}, {"num_value_samples": 4, "beta1": 0.1, "top_k": 20, "reward_weights": [1.0, 0.5]}],
    "SDFTConfig": [{}, {"per_device_train_batch_size": 4, "num_generations": 2, "steps_per_generation": 2,
                        "distillation_mode": "sampled_token", "distillation_alpha": 1.0, "teacher_model_kind": "ema"},
                   {"per_device_train_batch_size": 2, "generation_batch_size": 8, "num_generations": 4}],
    "SDPOConfig": [{}, {"per_device_train_batch_size": 4, "num_generations": 2, "scale_rewards": False,
                        "epsilon_high": 0.3, "distillation_weight": 0.5, "loss_type": "grpo"},
                   {"per_device_train_batch_size": 4, "num_generations": 4, "scale_rewards": True}],
    "IWOPDConfig": [{}, {"distillation_objective": "jsd", "lmbda": 0.5, "per_device_train_batch_size": 4,
                         "gradient_accumulation_steps": 2, "num_generations": 2, "max_length": 64,
                         "max_completion_length": 16}],
}
POST_INIT_CASES = [pytest.param(CASES[name], settings, id=f"{name}-{index}")
                   for name, all_settings in POST_INIT_SETTINGS.items() for index, settings in enumerate(all_settings)]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_reference_field_exists_with_the_same_raw_default_and_is_classified(case):
    our_fields = {f.name: f for f in dataclasses.fields(case.ours)}
    assert set(our_fields) == {f.name for f in dataclasses.fields(case.reference)} | case.extra
    applied = field_table(case.ours)
    for f in dataclasses.fields(case.reference):
        ours_default, theirs_default = plain(raw_default(our_fields[f.name])), plain(raw_default(f))
        if case.newer_raw_defaults and f.name in case.newer_raw_defaults \
                and not version.gradient_checkpointing_is_deprecated():
            assert (ours_default, theirs_default) in ((None, case.newer_raw_defaults[f.name]), (theirs_default,) * 2)
        else:
            assert ours_default == theirs_default, f.name
        assert f.name in applied, f"{case.reference.__name__}.{f.name} is not classified"
        if f.name not in case.inherited:
            assert f.name in case.table, f"{case.reference.__name__}.{f.name} must be decided in its own table"


@pytest.mark.parametrize("case", OWN_TABLES.values(), ids=OWN_TABLES.keys())
def test_the_table_has_no_stale_name_and_real_reasons(case):
    assert set(case.table) <= {f.name for f in dataclasses.fields(case.ours)}
    for name, support in case.table.items():
        assert support.status in ("honoured", "ignored", "refused"), name
        assert len(support.reason) > 20, f"{name} needs a real reason"



@pytest.mark.parametrize(("case", "settings"), POST_INIT_CASES)
def test_values_after_post_init_match_the_reference(tmp_path, case, settings):
    theirs = quiet(case.reference, output_dir=str(tmp_path), **case.reference_settings, **settings)
    ours = quiet(case.ours, output_dir=str(tmp_path), **case.our_settings, **settings)
    for f in dataclasses.fields(case.reference):
        if f.name not in case.post_init_differences:
            assert plain(getattr(ours, f.name)) == plain(getattr(theirs, f.name)), f.name
