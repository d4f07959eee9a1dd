"""TrainingArguments / SFTConfig match the installed transformers (5.12 to 5.24) and TRL 1.16 field for field, keep the
fields other versions have, and every field is mapped."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import transformers
import trl

import torchlike
import torchlike.training_args as training_args
from tests import tiny
from tests.helpers.config_fields import (
    FIELD_SUPPORT,
    SFT_FIELD_SUPPORT,
    TORCHLIKE_FIELDS,
    quiet,
    unsupported_field_warnings,
)
from torchlike import version
from torchlike.field_support import check_unsupported
from torchlike.field_support import fields_with_status as table_fields_with_status
from torchlike.training_args import TrainingArguments
from torchlike.trl import SFTConfig


def fields_with_status(status: str) -> list[str]:
    return table_fields_with_status(FIELD_SUPPORT, status)


# --- (a), (b), (c): the field walk (raw defaults and field tables: test_config_parity.py) -----------------------------

def test_sft_config_spells_out_trls_changed_defaults(tmp_path):
    # TRL refuses its own bf16 default without a bf16 GPU unless use_cpu=True; torchlike accepts it (see (g)).
    ours = quiet(SFTConfig, output_dir=str(tmp_path), use_cpu=True)
    assert (ours.learning_rate, ours.logging_steps, ours.gradient_checkpointing, ours.bf16) == (2e-5, 10, True, True)
    assert ours.pad_to_multiple_of is None and ours.report_to == []


def test_training_arguments_output_dir_defaults_to_trainer_output():
    assert TrainingArguments().output_dir == "trainer_output"


def test_field_table_has_every_field_and_no_stale_name():
    reference = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    ours = {f.name for f in dataclasses.fields(SFTConfig)}
    assert ours == reference | TORCHLIKE_FIELDS
    assert set(FIELD_SUPPORT) == ours
    assert {f.name for f in dataclasses.fields(TrainingArguments)} == (
        {f.name for f in dataclasses.fields(transformers.TrainingArguments)} | TORCHLIKE_FIELDS)


def test_the_version_facts_match_the_installed_transformers_fields():
    installed = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    removed_in_5_15 = version.warmup_ratio_and_logging_dir_are_removed()
    renamed_in_5_23 = version.gradient_checkpointing_is_deprecated()
    assert ({"warmup_ratio", "logging_dir"}.isdisjoint(installed)) is removed_in_5_15
    assert ({"dataloader_in_order", "dataloader_multiprocessing_context"} <= installed) is removed_in_5_15
    assert ({"activation_checkpointing", "activation_checkpointing_kwargs"} <= installed) is renamed_in_5_23
    for name, support in FIELD_SUPPORT.items():
        assert support.status in ("honoured", "ignored", "refused"), name
        assert len(support.reason) > 20, f"{name} needs a real reason"


# --- (d): ignored fields warn, refused fields raise, defaults are silent ------------------------------------------

# A non-default value for every ignored or refused field.
NON_DEFAULT = {
    "optim_args": "momentum=0.9",
    "optim_target_modules": ["attn"],
    "average_tokens_across_devices": False,
    "label_smoothing_factor": 0.1,
    "bf16_full_eval": True,
    "fp16": True,
    "dataset_num_proc": 2,
    "fp16_full_eval": True,
    "tf32": True,
    "activation_checkpointing_kwargs": {"use_reentrant": False},
    "torch_compile": True,
    "torch_compile_backend": "inductor",
    "torch_compile_mode": "max-autotune",
    "use_liger_kernel": True,
    "liger_kernel_config": {"rope": True},
    "use_cache": True,
    "torch_empty_cache_steps": 10,
    "auto_find_batch_size": True,
    "log_on_each_node": False,
    "include_num_input_tokens_seen": True,
    "log_level": "info",
    "log_level_replica": "error",
    "project": "mine",
    "trackio_space_id": "me/space",
    "trackio_bucket_id": "bucket",
    "trackio_static_space_id": "me/static",
    "eval_use_gather_object": True,
    "eval_accumulation_steps": 4,
    "save_on_each_node": True,
    "hub_always_push": True,
    "hub_revision": "dev",
    "ignore_data_skip": True,
    "full_determinism": True,
    "accelerator_config": {"split_batches": True},
    "parallelism_config": object(),
    "dataloader_num_workers": 4,
    "dataloader_pin_memory": False,
    "dataloader_persistent_workers": True,
    "dataloader_prefetch_factor": 2,
    "dataloader_multiprocessing_context": "spawn",
    "dataloader_in_order": False,
    "length_column_name": "n_tokens",
    "ddp_find_unused_parameters": False,
    "ddp_bucket_cap_mb": 25,
    "ddp_broadcast_buffers": False,
    "ddp_static_graph": True,
    "ddp_backend": "nccl",
    "ddp_timeout": 60,
    "fsdp": "full_shard",
    "fsdp_config": {"min_num_params": 1},
    "deepspeed": {"zero_optimization": {"stage": 2}},
    "debug": "underflow_overflow",
    "skip_memory_metrics": False,
    "local_rank": 0,
    "trust_remote_code": True,
    "activation_offloading": True,
}


def _applied(**kwargs):
    """Build an SFTConfig and run check_unsupported, returning the UserWarnings it emits."""
    return unsupported_field_warnings(SFTConfig, **kwargs)


def test_every_ignored_or_refused_field_has_a_sample_value():
    assert set(NON_DEFAULT) == set(fields_with_status("ignored")) | set(fields_with_status("refused"))


@pytest.mark.parametrize("name", fields_with_status("ignored"))
def test_setting_an_ignored_field_warns_once_naming_it(name):
    messages = _applied(**{name: NON_DEFAULT[name]})
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{name}=") and "is ignored: " in messages[0]
    assert FIELD_SUPPORT[name].reason in messages[0]


@pytest.mark.parametrize("name", fields_with_status("refused"))
def test_setting_a_refused_field_raises_naming_it(name):
    with pytest.raises(ValueError) as error:
        if name in SFT_FIELD_SUPPORT:  # SFTConfig honours it (its own row); the base TrainingArguments refuses it
            check_unsupported(quiet(TrainingArguments, output_dir="out", **{name: NON_DEFAULT[name]}))
        _applied(**{name: NON_DEFAULT[name]})
    message = str(error.value)
    assert f"{name}=" in message and FIELD_SUPPORT[name].reason in message and "the default" in message


def test_defaults_neither_warn_nor_raise():
    assert _applied() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unsupported(TrainingArguments())
        check_unsupported(SFTConfig())


def test_the_example_message_and_all_refusals_at_once():
    assert _applied(dataloader_num_workers=4) == [
        "dataloader_num_workers=4 is ignored: torchlike has no torch DataLoader: batches are prepared by its "
        "background prefetch thread (see prefetch_batches)."]
    with pytest.raises(ValueError, match=r"(?s)2 argument\(s\).*auto_find_batch_size=True.*save_on_each_node=True"):
        _applied(auto_find_batch_size=True, save_on_each_node=True)


def test_sft_config_lays_its_own_remove_unused_columns_row_over_the_table():
    messages = _applied(remove_unused_columns=False)
    assert len(messages) == 1 and SFT_FIELD_SUPPORT["remove_unused_columns"].reason in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unsupported(TrainingArguments(remove_unused_columns=False))  # honoured by the base Trainer


def test_empty_containers_count_as_the_default():
    assert _applied(lr_scheduler_kwargs={}, gradient_checkpointing_kwargs={}) == []


def test_an_alias_warns_once_under_the_name_it_resolves_to():
    messages = _applied(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert len(messages) == 1 and messages[0].startswith("activation_checkpointing_kwargs=")


def test_honoured_fields_never_warn():
    messages = _applied(per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-4,
                        lr_scheduler_type="cosine", warmup_steps=0.1, weight_decay=0.01, max_grad_norm=0.5,
                        logging_steps=5, save_steps=20, save_total_limit=2, eval_strategy="steps", seed=1,
                        report_to="none", gradient_checkpointing=False, bf16=False, max_length=256,
                        completion_only_loss=True, dataloader_drop_last=True, train_sampling_strategy="sequential",
                        mesh_shape=(1, 1), prefetch_batches=0, use_cpu=True, hub_token="secret")
    assert messages == []


# --- (e): enumeration validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"optim": "adafactor"}, ["optim='adafactor'", "'adamw_torch'", "'adamw_torch_fused'", "'sgd'"]),
    ({"optim": "adamw_8bit"}, ["optim='adamw_8bit'", "not supported", "low-bit", "'adamw_torch'"]),
    ({"optim": "adamw_hf"}, ["optim='adamw_hf'", "transformers 5 removed it"]),
    ({"optim": "nonsense"}, ["optim='nonsense'", "not a recognised value", "'adamw_torch'"]),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"},
     ["lr_scheduler_type='reduce_lr_on_plateau'", "not supported", "evaluation metrics",
      "'linear', 'cosine', 'constant', 'constant_with_warmup'", "'warmup_stable_decay'"]),
    ({"lr_scheduler_type": "cosine_annealing"}, ["lr_scheduler_type='cosine_annealing'", "'constant_with_warmup'"]),
    ({"report_to": "mlflow"}, ["report_to='mlflow'", "'none', 'all', 'tensorboard', 'wandb'"]),
    ({"report_to": ["tensorboard", "comet"]}, ["report_to='comet'", "'tensorboard', 'wandb'"]),
    ({"report_to": ["none", "tensorboard"]}, ["report_to=", "cannot be combined"]),
    ({"save_strategy": "always"}, ["save_strategy='always'", "'no', 'steps', 'epoch', 'best'"]),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 2, "save_steps": 3},
     ["load_best_model_at_end=True", "round multiple of eval_steps", "save_steps=3", "eval_steps=2"]),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch"},
     ["load_best_model_at_end=True", "eval_strategy='epoch'", "save_strategy='steps'"]),
    ({"eval_strategy": "sometimes"}, ["eval_strategy='sometimes'", "'no', 'steps', 'epoch'"]),
    ({"logging_strategy": "often"}, ["logging_strategy='often'", "'no', 'steps', 'epoch'"]),
    ({"hub_strategy": "checkpoint"}, ["hub_strategy='checkpoint'", "Orbax", "'end', 'every_save'"]),
    ({"train_sampling_strategy": "group_by_length"}, ["train_sampling_strategy='group_by_length'", "'random'"]),
    ({"loss_type": "focal"}, ["loss_type='focal'", "'nll', 'dft'"]),
    ({"truncation_mode": "middle"}, ["truncation_mode='middle'", "'keep_start', 'keep_end'"]),
    ({"packing_strategy": "greedy"}, ["packing_strategy='greedy'", "'bfd', 'bfd_split', 'wrapped'"]),
    ({"fp16": True, "bf16": True}, ["fp16=True and bf16=True"]),
    ({"mesh_shape": (4, 2, 1)}, ["mesh_shape=(4, 2, 1)", "mesh_axis_names=('fsdp', 'tp')"]),
])
def test_bad_values_name_the_field_and_the_accepted_values(kwargs, needles):
    with pytest.raises(ValueError) as error:
        SFTConfig(**kwargs)
    for needle in needles:
        assert needle in str(error.value)


def test_a_missing_reporter_package_is_named(monkeypatch):
    monkeypatch.setattr(training_args, "_installed", lambda package: False)
    with pytest.raises(ValueError, match="report_to='wandb' needs the wandb package.*pip install wandb"):
        TrainingArguments(report_to="wandb")
    assert TrainingArguments(report_to="all").report_to == []


def test_enumerations_accept_transformers_enum_members_and_store_plain_strings():
    from transformers.trainer_utils import IntervalStrategy, SchedulerType
    from transformers.training_args import OptimizerNames

    args = TrainingArguments(eval_strategy=IntervalStrategy.EPOCH, lr_scheduler_type=SchedulerType.COSINE,
                             optim=OptimizerNames.ADAMW_TORCH, report_to=["none"])
    assert (args.eval_strategy, args.lr_scheduler_type, args.optim, args.report_to) == ("epoch", "cosine",
                                                                                     "adamw_torch", [])
    assert type(args.eval_strategy) is str and args.do_eval
    assert training_args.OPTIMIZERS[args.optim] == "adamw"


def test_derived_values_follow_transformers():
    args = quiet(SFTConfig, eval_strategy="steps", logging_steps=7, save_steps=0.25, warmup_ratio=0.1,
                 include_num_input_tokens_seen=True, lr_scheduler_kwargs='{"num_cycles": "1"}')
    assert args.eval_steps == 7 and args.do_eval and args.save_steps == 0.25
    assert args.warmup_steps == 0.1 and args.get_warmup_steps(95) == 10
    assert args.include_num_input_tokens_seen == "all" and args.lr_scheduler_kwargs == {"num_cycles": 1}
    assert TrainingArguments(warmup_steps=3).get_warmup_steps(95) == 3
    with pytest.raises(ValueError, match="logging_steps=2.5"):
        TrainingArguments(logging_steps=2.5)


def test_trl_deprecations_are_mapped_like_trl():
    with pytest.warns(FutureWarning, match="chunked_nll"):
        assert SFTConfig(loss_type="chunked_nll").loss_type == "nll"
    with pytest.warns(FutureWarning, match="keep_end"):
        assert SFTConfig(truncation_mode="keep_end").truncation_mode == "keep_end"
    with pytest.warns(FutureWarning, match="pad_token is deprecated"):
        SFTConfig(pad_token="<pad>")
    assert SFTConfig(pad_to_multiple_of="64").pad_to_multiple_of == 64
    with pytest.warns(UserWarning, match="append_concat_token"):
        SFTConfig(dataset_kwargs={"skip_prepare_dataset": True, "append_concat_token": False})


def test_deprecation_warnings_point_at_the_caller():
    with pytest.warns(FutureWarning) as record:
        SFTConfig(loss_type="chunked_nll", warmup_ratio=0.1)
    assert [w.filename for w in record] == [__file__, __file__]


def test_command_lines_parse_like_trl_scripts():
    parser = transformers.HfArgumentParser(SFTConfig)
    (config,) = parser.parse_args_into_dataclasses([
        "--output_dir", "out", "--lr_scheduler_type", "cosine", "--max_length", "64", "--report_to", "none",
        "--model_init_kwargs", '{"dtype": "bfloat16"}', "--gradient_checkpointing", "false", "--mesh_shape", "2,1",
        "--mesh_axis_names", "fsdp,tp", "--eos_token", "<|im_end|>", "--pad_to_multiple_of", "8"])
    assert (config.lr_scheduler_type, config.max_length, config.report_to) == ("cosine", 64, [])
    assert config.model_init_kwargs == {"dtype": "bfloat16"} and config.gradient_checkpointing is False
    assert (config.mesh_shape, config.mesh_axis_names) == ((2, 1), ("fsdp", "tp"))
    assert (config.eos_token, config.pad_to_multiple_of, config.bf16) == ("<|im_end|>", 8, True)


def test_mesh_and_batch_helpers():
    args = TrainingArguments(mesh_shape=[4, 2], per_device_train_batch_size=3, per_device_eval_batch_size=5)
    assert args.mesh_shape == (4, 2)
    assert (args.data_parallel_size, args.train_batch_size, args.eval_batch_size) == (4, 12, 20)
    assert TrainingArguments(mesh_shape="2,1").mesh_shape == (2, 1)
    with pytest.raises(ValueError, match="prefetch_batches=-1"):
        TrainingArguments(prefetch_batches=-1)


def test_hub_token_is_hidden():
    args = TrainingArguments(hub_token="hf_secret")
    assert "hf_secret" not in repr(args) and "hf_secret" not in args.to_json_string()
    assert args.hub_token == "hf_secret"


# --- (f): removed aliases -------------------------------------------------------------------------------------------

def test_max_seq_length_is_refused_like_trl_but_names_its_replacement():
    with pytest.raises(TypeError):  # TRL 1.16 no longer accepts it either
        trl.SFTConfig(max_seq_length=128)
    with pytest.raises(TypeError, match="max_seq_length.*max_length"):
        SFTConfig(max_seq_length=128)
    with pytest.raises(TypeError, match="evaluation_strategy.*eval_strategy"):
        SFTConfig(evaluation_strategy="steps")
    with pytest.raises(TypeError, match="evaluation_strategy.*eval_strategy"):
        TrainingArguments(evaluation_strategy="steps")


# --- (g): bf16 on CPU -----------------------------------------------------------------------------------------------

def test_trl_bf16_default_is_accepted_on_cpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = SFTConfig()
        check_unsupported(config)
    assert config.bf16 is True and config.fp16 is False and config.use_cpu is False
    assert SFTConfig(fp16=True).bf16 is False
    assert SFTConfig(bf16=False).bf16 is False


# --- (h): the names transformers renamed, added and removed between 5.12 and 5.24 ------------------------------

@pytest.mark.parametrize(("kwargs", "resolved"), [
    ({}, False),
    ({"activation_checkpointing": True}, True),
    ({"gradient_checkpointing": True}, True),
    ({"gradient_checkpointing": True, "activation_checkpointing": False}, False),  # the new name wins
    ({"gradient_checkpointing": False, "activation_checkpointing": True}, True),
])
def test_activation_checkpointing_and_its_alias_resolve_to_one_value(kwargs, resolved):
    args = quiet(TrainingArguments, **kwargs)
    assert args.activation_checkpointing is resolved and args.gradient_checkpointing is resolved
    if version.gradient_checkpointing_is_deprecated():  # transformers has both names: the same resolution
        theirs = quiet(transformers.TrainingArguments, output_dir="out", **kwargs)
        assert (theirs.activation_checkpointing, theirs.gradient_checkpointing) == (resolved, resolved)
    kwargs_args = quiet(TrainingArguments, gradient_checkpointing_kwargs='{"use_reentrant": "false"}')
    assert kwargs_args.activation_checkpointing_kwargs == kwargs_args.gradient_checkpointing_kwargs == {
        "use_reentrant": False}


def test_the_old_checkpointing_names_warn_where_transformers_deprecates_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingArguments(gradient_checkpointing=True)
        TrainingArguments(gradient_checkpointing_kwargs={"use_reentrant": False})
        TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
        SFTConfig()  # TRL's own default (gradient_checkpointing=True) is not something the user gave
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    if version.gradient_checkpointing_is_deprecated():
        assert messages == [
            "`gradient_checkpointing` is deprecated and will be removed in v6. Use `activation_checkpointing` instead.",
            "`gradient_checkpointing_kwargs` is deprecated and will be removed in v6. Use "
            "`activation_checkpointing_kwargs` instead."]
        with pytest.warns(FutureWarning) as theirs:
            transformers.TrainingArguments(output_dir="out", gradient_checkpointing=True)
        assert messages[0] in [str(w.message) for w in theirs]
    else:
        assert messages == []


@pytest.mark.parametrize(("name", "value", "replacement"), [("warmup_ratio", 0.1, "warmup_steps"),
                                                             ("logging_dir", "tb", "TENSORBOARD_LOGGING_DIR")])
def test_warmup_ratio_and_logging_dir_still_work_with_a_future_warning(name, value, replacement):
    removed = version.warmup_ratio_and_logging_dir_are_removed()
    with pytest.warns(FutureWarning, match=f"{name}: " + ("transformers 5.15 removed it" if removed else
                                                          "it is deprecated in transformers 5")) as record:
        args = TrainingArguments(**{name: value})
    assert replacement in str(record[0].message) and getattr(args, name) == value
    if removed:  # transformers itself no longer takes it
        with pytest.raises(TypeError, match=name):
            transformers.TrainingArguments(output_dir="out", **{name: value})


def test_the_fields_transformers_5_15_added_are_accepted_and_ignored():
    assert (TrainingArguments().dataloader_in_order, TrainingArguments().dataloader_multiprocessing_context) == (
        True, None)
    assert [message.split(" is ignored")[0] for message in _applied(dataloader_in_order=False,
                                                                    dataloader_multiprocessing_context="spawn")] == [
        "dataloader_multiprocessing_context='spawn'", "dataloader_in_order=False"]


def test_command_lines_take_either_checkpointing_name():
    parser = transformers.HfArgumentParser(TrainingArguments)
    for argv in (["--activation_checkpointing"], ["--gradient_checkpointing", "true"],
                 ["--activation_checkpointing", "true", "--gradient_checkpointing", "false"]):
        (args,) = quiet(parser.parse_args_into_dataclasses, args=["--output_dir", "out", *argv])
        assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "out"])
    assert args.activation_checkpointing is False


def test_the_train_step_rematerialises_under_either_name(tiny_checkpoints, tmp_path, rematerialised_modules):
    entered = rematerialised_modules
    losses = {}
    runs = {"activation": {"activation_checkpointing": True}, "gradient": {"gradient_checkpointing": True},
            "new name wins": {"activation_checkpointing": False, "gradient_checkpointing": True}}
    for name, settings in runs.items():
        args = quiet(TrainingArguments, output_dir=str(tmp_path / name), report_to="none", max_steps=2,
                     logging_steps=1, learning_rate=1e-3, per_device_train_batch_size=4, **settings)
        model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
        trainer = torchlike.Trainer(model=model, args=args, train_dataset=tiny.padded_examples(8, seed=1))
        trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        assert bool(entered) == args.activation_checkpointing, name
        entered.clear()
    np.testing.assert_allclose(losses["activation"], losses["gradient"], rtol=1e-6)
    np.testing.assert_allclose(losses["activation"], losses["new name wins"], rtol=1e-5)
