"""The trainer registry is the one list: every trainer module is in it, and the lazy imports, the CLI and the MIGRATION
tables follow it."""

import dataclasses
import importlib
import pathlib

import pytest

import torchlike.trl
from torchlike import cli
from torchlike.trl import migration_tables
from torchlike.trl.registry import TRAINERS, TrainerEntry, entries_in, lazy_attribute, script_commands

TRL_DIR = pathlib.Path(torchlike.trl.__file__).parent


def test_every_trainer_module_on_disk_is_registered():
    on_disk = {f"{'.'.join(('torchlike',) + path.relative_to(TRL_DIR.parent).with_suffix('').parts)}"
               for path in TRL_DIR.rglob("*_trainer.py")}
    # The shared bases and loops, which no user imports as a trainer.
    on_disk -= {"torchlike.trl.trainer.base_trainer", "torchlike.trl.trainer.online_trainer",
                "torchlike.trl.trainer.offline_trainer", "torchlike.trl.trainer.policy_gradient_trainer",
                "torchlike.trl.experimental.pairwise_trainer",
                "torchlike.trl.experimental.self_distillation_trainer"}
    assert on_disk == {entry.trainer_module for entry in TRAINERS}


def test_every_script_on_disk_is_a_registered_command():
    scripts = {path.stem for path in (TRL_DIR / "scripts").glob("*.py")} - {"__init__", "common"}
    assert scripts == set(script_commands()) == set(cli.TRAINING_COMMANDS)


@pytest.mark.parametrize("entry", TRAINERS, ids=lambda entry: entry.name)
def test_each_entry_is_importable_from_its_package_as_in_trl(entry: TrainerEntry):
    package = importlib.import_module(entry.package)
    assert {entry.config, entry.trainer} <= set(package.__all__)
    assert getattr(package, entry.config) is entry.config_class()
    assert getattr(package, entry.trainer) is entry.trainer_class()
    assert dataclasses.is_dataclass(entry.config_class())


def test_stable_package_exports_exactly_the_stable_trainers_and_script_helpers():
    names = {name for entry in entries_in("torchlike.trl") for name in (entry.config, entry.trainer)}
    assert names <= set(torchlike.trl.__all__)
    assert not {entry.trainer for entry in TRAINERS if entry.package != "torchlike.trl"} & set(torchlike.trl.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'ORPOTrainer'"):
        lazy_attribute("torchlike.trl", "ORPOTrainer")


def test_migration_tables_cover_every_registered_config():
    markdown = migration_tables.unsupported_fields_markdown()
    headings = {line.removeprefix("### ") for line in markdown.splitlines() if line.startswith("### ")}
    # A config whose every field is honoured (or shown by an earlier table) has no section; all others do.
    assert headings <= {"TrainingArguments"} | {entry.config for entry in TRAINERS}
    assert {"SFTConfig", "GRPOConfig", "DPOConfig", "ORPOConfig", "GKDConfig"} <= headings
