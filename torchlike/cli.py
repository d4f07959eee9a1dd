"""The ``torchlike`` command, as TRL's ``trl`` command: ``torchlike sft|grpo|rloo|dpo|kto|reward|distillation
[arguments] [--config file.yaml]`` runs a training script in this process, and ``torchlike
online_dpo|orpo|cpo|gkd|xpo|nash_md|bco`` the trainers of ``trl.experimental`` as TRL's ``examples/scripts`` run
them; ``torchlike env`` prints the versions and devices to quote in a bug report.

Unlike ``trl``, there is no ``accelerate launch`` behind the training commands (the JAX mesh takes the place of its
processes), so every command-line flag and config-file key must be an argument of the script: anything else is an
error naming the closest argument.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections import Counter
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from .trl.registry import TRAINERS, script_commands

__all__ = ["TRAINING_COMMANDS", "environment_report", "main", "run_training_command"]

#: Training subcommands, each run by ``torchlike.trl.scripts.<name>`` (the registry's trainers with a script).
TRAINING_COMMANDS: tuple[str, ...] = script_commands()

# Distributions in the report, in the order printed (label, distribution name).
_PACKAGES = (
    ("JAX", "jax"), ("jaxlib", "jaxlib"), ("Flax", "flax"), ("Optax", "optax"), ("Orbax", "orbax-checkpoint"),
    ("Tunix", "google-tunix"), ("Qwix", "qwix"), ("Transformers", "transformers"), ("Datasets", "datasets"),
    ("HF Hub", "huggingface_hub"), ("safetensors", "safetensors"), ("PyTorch", "torch"), ("PEFT", "peft"),
    ("TRL", "trl"),
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchlike", allow_abbrev=False,
                                     description="TRL's command line on JAX (Tunix, Qwix, Optax, Orbax).")
    subparsers = parser.add_subparsers(help="available commands", dest="command")
    for name in TRAINING_COMMANDS:
        # The script's own parser reads the arguments (and answers --help), so this one takes none.
        subparsers.add_parser(name, help=f"Run the {name} training script", add_help=False)
    subparsers.add_parser("env", help="Print the environment (versions, devices) for bug reports")
    return parser


def _installed_version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, str]:
    """Platform, package versions and the JAX devices, as ``trl env`` reports them for torch.

    Returns:
        Label -> value, in print order.
    """
    import jax

    import torchlike

    from .adapters.runtime import host_memory
    from .adapters.runtime.compilation import enable_compilation_cache

    devices = Counter(f"{device.device_kind} ({device.platform})" for device in jax.devices())
    info = {
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "torchlike version": torchlike.__version__,
        **{f"{label} version": _installed_version(distribution) for label, distribution in _PACKAGES},
        "JAX backend": jax.default_backend(),
        "JAX devices": ", ".join(f"{count} x {kind}" for kind, count in devices.items()),
        "JAX processes": str(jax.process_count()),
        "Compilation cache": str(enable_compilation_cache() or "off"),
        "Host allocator (CPU)": host_memory.status,
    }
    return info


def run_training_command(name: str, arguments: list[str]) -> int:
    """Parse ``arguments`` with the script's parser (config file included) and run its ``main``.

    Args:
        name: a training subcommand (:data:`TRAINING_COMMANDS`).
        arguments: the command line after the subcommand.

    Returns:
        ``0`` once training and saving are done.

    Raises:
        SystemExit: ``--help`` (status 0), or arguments the script does not take (status 2, with the message).
    """
    script = import_module(next(entry.script_module for entry in TRAINERS if entry.name == name and entry.script))
    parser = script.make_parser(prog=f"torchlike {name}")
    try:
        parsed = parser.parse_args_and_config(arguments)
    except ValueError as error:
        parser.error(str(error))
    script.main(*parsed)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``torchlike`` console script.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "env":
        report = "\n".join(f"- {label}: {value}" for label, value in environment_report().items())
        print(f"\nCopy-paste the following information when reporting an issue:\n\n{report}\n")
        return 0
    return run_training_command(args.command, argv[argv.index(args.command) + 1:])


if __name__ == "__main__":
    raise SystemExit(main())
