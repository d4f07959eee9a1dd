"""The one list of TRL trainers torchlike provides.

``torchlike.trl``'s lazy imports (and those of each ``torchlike.trl.experimental.<name>`` package), the ``torchlike``
command's training subcommands (:mod:`torchlike.cli`, run by ``torchlike.trl.scripts.<name>``) and MIGRATION.md's
"not honoured" tables (:mod:`torchlike.trl.migration_tables`) are all read from :data:`TRAINERS`. A new trainer is one
row here plus its modules (``<name>_config.py``, ``<name>_fields.py``, ``<name>_trainer.py``, and
``scripts/<name>.py`` when it has a command).

Nothing here imports a trainer: the rows name modules and classes, so reading the registry stays cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from importlib import import_module
from typing import Any

__all__ = ["TRAINERS", "TrainerEntry", "entries_in", "lazy_attribute", "package_exports", "script_commands"]


@dataclasses.dataclass(frozen=True)
class TrainerEntry:
    """One TRL trainer as torchlike provides it.

    Args:
        name: the trainer's short name, TRL's module stem (``"grpo"``, ``"orpo"``); the CLI command when it has a
            script.
        config: the config class name (``"GRPOConfig"``).
        trainer: the trainer class name (``"GRPOTrainer"``).
        package: the package the user imports both from, as in TRL (``"torchlike.trl"`` for the stable trainers,
            ``"torchlike.trl.experimental.orpo"`` for ``trl.experimental.orpo``).
        script: whether ``torchlike.trl.scripts.<name>`` exists (``torchlike <name>`` on the command line).
    """

    name: str
    config: str
    trainer: str
    package: str
    script: bool

    @property
    def modules(self) -> str:
        """The package holding the config and trainer modules: ``torchlike.trl.trainer`` for the stable trainers (as
        TRL's ``trl.trainer``), the experimental package itself otherwise."""
        return "torchlike.trl.trainer" if self.package == "torchlike.trl" else self.package

    @property
    def config_module(self) -> str:
        """The module defining the config class (``torchlike.trl.trainer.grpo_config``)."""
        return f"{self.modules}.{self.name}_config"

    @property
    def trainer_module(self) -> str:
        """The module defining the trainer class (``torchlike.trl.trainer.grpo_trainer``)."""
        return f"{self.modules}.{self.name}_trainer"

    @property
    def script_module(self) -> str | None:
        """The module of its ``torchlike <name>`` command, ``None`` without one."""
        return f"torchlike.trl.scripts.{self.name}" if self.script else None

    def config_class(self) -> type:
        """Imports and returns the config class."""
        return getattr(import_module(self.config_module), self.config)

    def trainer_class(self) -> type:
        """Imports and returns the trainer class (this loads transformers and the trainer's adapters)."""
        return getattr(import_module(self.trainer_module), self.trainer)


_STABLE = "torchlike.trl"
_EXPERIMENTAL = "torchlike.trl.experimental"

#: Every trainer, stable ones first in the order of MIGRATION.md's tables.
TRAINERS: tuple[TrainerEntry, ...] = (
    TrainerEntry("sft", "SFTConfig", "SFTTrainer", _STABLE, script=True),
    TrainerEntry("grpo", "GRPOConfig", "GRPOTrainer", _STABLE, script=True),
    TrainerEntry("rloo", "RLOOConfig", "RLOOTrainer", _STABLE, script=True),
    TrainerEntry("dpo", "DPOConfig", "DPOTrainer", _STABLE, script=True),
    TrainerEntry("kto", "KTOConfig", "KTOTrainer", _STABLE, script=True),
    TrainerEntry("reward", "RewardConfig", "RewardTrainer", _STABLE, script=True),
    TrainerEntry("distillation", "DistillationConfig", "DistillationTrainer", _STABLE, script=True),
    TrainerEntry("orpo", "ORPOConfig", "ORPOTrainer", f"{_EXPERIMENTAL}.orpo", script=True),
    TrainerEntry("cpo", "CPOConfig", "CPOTrainer", f"{_EXPERIMENTAL}.cpo", script=True),
    TrainerEntry("gkd", "GKDConfig", "GKDTrainer", f"{_EXPERIMENTAL}.gkd", script=True),
    TrainerEntry("online_dpo", "OnlineDPOConfig", "OnlineDPOTrainer", f"{_EXPERIMENTAL}.online_dpo", script=True),
    TrainerEntry("xpo", "XPOConfig", "XPOTrainer", f"{_EXPERIMENTAL}.xpo", script=True),
    TrainerEntry("bco", "BCOConfig", "BCOTrainer", f"{_EXPERIMENTAL}.bco", script=True),
    TrainerEntry("nash_md", "NashMDConfig", "NashMDTrainer", f"{_EXPERIMENTAL}.nash_md", script=True),
    TrainerEntry("gmpo", "GMPOConfig", "GMPOTrainer", f"{_EXPERIMENTAL}.gmpo", script=True),
    TrainerEntry("async_grpo", "AsyncGRPOConfig", "AsyncGRPOTrainer", f"{_EXPERIMENTAL}.async_grpo", script=False),
    TrainerEntry("tpo", "TPOConfig", "TPOTrainer", f"{_EXPERIMENTAL}.tpo", script=True),
    TrainerEntry("a2po", "A2POConfig", "A2POTrainer", f"{_EXPERIMENTAL}.a2po", script=False),
    TrainerEntry("sdft", "SDFTConfig", "SDFTTrainer", f"{_EXPERIMENTAL}.sdft", script=True),
    TrainerEntry("sdpo", "SDPOConfig", "SDPOTrainer", f"{_EXPERIMENTAL}.sdpo", script=False),
    TrainerEntry("iw_opd", "IWOPDConfig", "IWOPDTrainer", f"{_EXPERIMENTAL}.iw_opd", script=False),
    TrainerEntry("gold", "GOLDConfig", "GOLDTrainer", f"{_EXPERIMENTAL}.gold", script=True),
)


def entries_in(package: str) -> tuple[TrainerEntry, ...]:
    """The trainers a package exports (``"torchlike.trl"``, ``"torchlike.trl.experimental.gkd"``)."""
    return tuple(entry for entry in TRAINERS if entry.package == package)


def script_commands() -> tuple[str, ...]:
    """The ``torchlike`` command's training subcommands, sorted."""
    return tuple(sorted(entry.name for entry in TRAINERS if entry.script))


def lazy_attribute(package: str, name: str) -> Any:
    """A package's ``__getattr__``: the config or trainer class ``name`` among the package's trainers.

    Args:
        package: the package's ``__name__``.
        name: the attribute asked for.

    Returns:
        The class, imported on first use.

    Raises:
        AttributeError: ``name`` is neither a config nor a trainer of the package.
    """
    for entry in entries_in(package):
        if name == entry.trainer:
            return entry.trainer_class()
        if name == entry.config:
            return entry.config_class()
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def package_exports(package: str, extra: tuple[str, ...] = ()) -> tuple[list[str], Callable[[str], Any],
                                                                      Callable[[], list[str]]]:
    """What a package that exports trainers defines: ``__all__``, ``__getattr__`` and ``__dir__``.

    Args:
        package: the package's ``__name__``.
        extra: further names the package's own ``__getattr__`` provides (listed in ``__all__`` only).

    Returns:
        ``(__all__, __getattr__, __dir__)``: the sorted config and trainer names (and ``extra``), the lazy lookup of
        :func:`lazy_attribute`, and the names ``dir(package)`` lists.

    Example:
        ```python
        __all__, __getattr__, __dir__ = package_exports(__name__)
        ```
    """
    names = sorted([name for entry in entries_in(package) for name in (entry.config, entry.trainer)] + list(extra))

    def getattr_(name: str) -> Any:
        return lazy_attribute(package, name)

    def dir_() -> list[str]:
        return sorted(set(names) | set(vars(import_module(package))))

    return names, getattr_, dir_
