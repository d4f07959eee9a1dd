"""TrainingArguments / SFTConfig match transformers 5.12 and TRL 1.16 field for field, and every field is mapped."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import transformers
import trl

import torchlike.training_args as training_args
from torchlike.field_support import check_unsupported
from torchlike.field_support import fields_with_status as table_fields_with_status
from torchlike.training_args import TrainingArguments
from torchlike.training_args_fields import TRAINING_ARGUMENTS_FIELD_SUPPORT
from torchlike.trl import SFTConfig
from torchlike.trl.sft_fields import SFT_FIELD_SUPPORT as SFT_ROWS

#: The TrainingArguments rows SFTConfig lays its own over.
SFT_FIELD_SUPPORT = {name: row for name, row in SFT_ROWS.items() if name in TRAINING_ARGUMENTS_FIELD_SUPPORT}
#: Every field of TrainingArguments and of trl.SFTConfig, each with its base row.
FIELD_SUPPORT = {**TRAINING_ARGUMENTS_FIELD_SUPPORT,
                 **{name: row for name, row in SFT_ROWS.items() if name not in SFT_FIELD_SUPPORT}}


def fields_with_status(status: str) -> list[str]:
    return table_fields_with_status(FIELD_SUPPORT, status)

TORCHLIKE_FIELDS = {"mesh_shape", "mesh_axis_names", "compilation_cache_dir", "prefetch_batches",
                    "lora_step"}

# Values transformers derives in __post_init__ that torchlike deliberately leaves alone.
POST_INIT_DIFFERENCES = {
    # transformers turns None into an accelerate.AcceleratorConfig(); torchlike has no Accelerate and keeps None.
    "accelerator_config",
    # transformers sets dataloader_pin_memory=False when use_cpu=True (the TRL side needs use_cpu=True to accept its
    # bf16 default on this CPU-only machine); torchlike has no torch DataLoader, so the field keeps its value.
    "dataloader_pin_memory",
}


def _raw_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _plain(value):
    """transformers stores enum members (str subclasses); compare their string values."""
    inner = getattr(value, "value", None)
    return inner if isinstance(inner, str) else value


def _quiet(factory, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(**kwargs)


# --- (a), (b), (c): the field walk ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("reference", "ours"), [(trl.SFTConfig, SFTConfig),
                                                 (transformers.TrainingArguments, TrainingArguments)],
                         ids=["trl.SFTConfig", "transformers.TrainingArguments"])
def test_every_reference_field_exists_with_the_same_raw_default(reference, ours):
    our_fields = {f.name: f for f in dataclasses.fields(ours)}
    for f in dataclasses.fields(reference):
        assert f.name in FIELD_SUPPORT, f"{reference.__name__}.{f.name} is missing from FIELD_SUPPORT"
        assert f.name in our_fields, f"{reference.__name__}.{f.name} is missing from torchlike's {ours.__name__}"
        assert _plain(_raw_default(our_fields[f.name])) == _plain(_raw_default(f)), f.name


def test_sft_config_values_after_post_init_match_trl(tmp_path):
    # TRL refuses its own bf16 default without a bf16 GPU unless use_cpu=True; torchlike accepts it (see (g)).
    theirs = _quiet(trl.SFTConfig, output_dir=str(tmp_path), use_cpu=True)
    ours = _quiet(SFTConfig, output_dir=str(tmp_path), use_cpu=True)
    for f in dataclasses.fields(trl.SFTConfig):
        if f.name in POST_INIT_DIFFERENCES:
            continue
        assert _plain(getattr(ours, f.name)) == _plain(getattr(theirs, f.name)), f.name
    # TRL's changed defaults, spelled out.
    assert (ours.learning_rate, ours.logging_steps, ours.gradient_checkpointing, ours.bf16) == (2e-5, 10, True, True)
    assert ours.pad_to_multiple_of is None and ours.report_to == []


def test_training_arguments_values_after_post_init_match_transformers(tmp_path):
    theirs = _quiet(transformers.TrainingArguments, output_dir=str(tmp_path))
    ours = _quiet(TrainingArguments, output_dir=str(tmp_path))
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.name == "accelerator_config":  # see POST_INIT_DIFFERENCES
            continue
        assert _plain(getattr(ours, f.name)) == _plain(getattr(theirs, f.name)), f.name
    assert TrainingArguments().output_dir == "trainer_output"


def test_field_table_has_every_field_and_no_stale_name():
    reference = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    ours = {f.name for f in dataclasses.fields(SFTConfig)}
    assert ours == reference | TORCHLIKE_FIELDS
    assert set(FIELD_SUPPORT) == ours
    assert {f.name for f in dataclasses.fields(TrainingArguments)} == (
        {f.name for f in dataclasses.fields(transformers.TrainingArguments)} | TORCHLIKE_FIELDS)
    for name, support in FIELD_SUPPORT.items():
        assert support.status in ("honoured", "ignored", "refused"), name
        assert len(support.reason) > 20, f"{name} needs a real reason"


# --- (d): ignored fields warn, refused fields raise, defaults are silent ------------------------------------------

# A non-default value for every ignored or refused field.
NON_DEFAULT = {
    "lr_scheduler_kwargs": {"num_cycles": 1},
    "optim_args": "momentum=0.9",
    "optim_target_modules": ["attn"],
    "average_tokens_across_devices": False,
    "label_smoothing_factor": 0.1,
    "bf16_full_eval": True,
    "fp16": True,
    "dataset_num_proc": 2,
    "fp16_full_eval": True,
    "tf32": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "torch_compile": True,
    "torch_compile_backend": "inductor",
    "torch_compile_mode": "max-autotune",
    "use_liger_kernel": True,
    "liger_kernel_config": {"rope": True},
    "use_cache": True,
    "neftune_noise_alpha": 5.0,
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
    "prediction_loss_only": True,
    "eval_do_concat_batches": False,
    "eval_use_gather_object": True,
    "eval_accumulation_steps": 4,
    "include_for_metrics": ["inputs"],
    "batch_eval_metrics": True,
    "save_on_each_node": True,
    "enable_jit_checkpoint": True,
    "hub_always_push": True,
    "hub_revision": "dev",
    "load_best_model_at_end": True,
    "metric_for_best_model": "eval_loss",
    "greater_is_better": False,
    "ignore_data_skip": True,
    "restore_callback_states_from_checkpoint": True,
    "full_determinism": True,
    "accelerator_config": {"split_batches": True},
    "parallelism_config": object(),
    "dataloader_num_workers": 4,
    "dataloader_pin_memory": False,
    "dataloader_persistent_workers": True,
    "dataloader_prefetch_factor": 2,
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
    "router_aux_loss_coef": 0.01,
    "packing": True,
    "packing_strategy": "wrapped",
    "padding_free": True,
    "activation_offloading": True,
}


def _applied(**kwargs):
    """Build an SFTConfig and run check_unsupported, returning the UserWarnings it emits."""
    config = _quiet(SFTConfig, output_dir="out", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_unsupported(config)
    return [str(w.message) for w in caught if w.category is UserWarning]


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
    with pytest.raises(ValueError, match=r"(?s)2 argument\(s\).*neftune_noise_alpha=5\.0.*packing=True.*packing=False"):
        _applied(neftune_noise_alpha=5.0, packing=True)


def test_sft_config_lays_its_own_remove_unused_columns_row_over_the_table():
    messages = _applied(remove_unused_columns=False)
    assert len(messages) == 1 and SFT_FIELD_SUPPORT["remove_unused_columns"].reason in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unsupported(TrainingArguments(remove_unused_columns=False))  # honoured by the base Trainer


def test_empty_containers_count_as_the_default():
    assert _applied(lr_scheduler_kwargs={}, gradient_checkpointing_kwargs={}) == []


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
    ({"lr_scheduler_type": "polynomial"},
     ["lr_scheduler_type='polynomial'", "not supported", "'linear', 'cosine', 'constant', 'constant_with_warmup'"]),
    ({"lr_scheduler_type": "cosine_annealing"}, ["lr_scheduler_type='cosine_annealing'", "'constant_with_warmup'"]),
    ({"report_to": "mlflow"}, ["report_to='mlflow'", "'none', 'all', 'tensorboard', 'wandb'"]),
    ({"report_to": ["tensorboard", "comet"]}, ["report_to='comet'", "'tensorboard', 'wandb'"]),
    ({"report_to": ["none", "tensorboard"]}, ["report_to=", "cannot be combined"]),
    ({"save_strategy": "best"}, ["save_strategy='best'", "'no', 'steps', 'epoch'"]),
    ({"eval_strategy": "sometimes"}, ["eval_strategy='sometimes'", "'no', 'steps', 'epoch'"]),
    ({"logging_strategy": "often"}, ["logging_strategy='often'", "'no', 'steps', 'epoch'"]),
    ({"hub_strategy": "checkpoint"}, ["hub_strategy='checkpoint'", "Orbax", "'end', 'every_save'"]),
    ({"train_sampling_strategy": "group_by_length"}, ["train_sampling_strategy='group_by_length'", "'random'"]),
    ({"loss_type": "dft"}, ["loss_type='dft'", "Dynamic Fine-Tuning", "'nll'"]),
    ({"truncation_mode": "middle"}, ["truncation_mode='middle'", "'keep_start', 'keep_end'"]),
    ({"eval_packing": True}, ["eval_packing=True", "eval_packing=False"]),
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
    args = _quiet(SFTConfig, eval_strategy="steps", logging_steps=7, save_steps=0.25, warmup_ratio=0.1,
                  include_num_input_tokens_seen=True, lr_scheduler_kwargs='{"num_cycles": "1"}')
    assert args.eval_steps == 7 and args.do_eval and args.save_steps == 0.25
    assert args.warmup_steps == 0.1 and args.get_warmup_steps(95) == 10
    assert args.include_num_input_tokens_seen == "all" and args.lr_scheduler_kwargs == {"num_cycles": 1}
    assert TrainingArguments(warmup_steps=3).get_warmup_steps(95) == 3
    with pytest.warns(FutureWarning, match="warmup_ratio is deprecated"):
        TrainingArguments(warmup_ratio=0.1)
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
