"""The shape every loss's settings take: a frozen record built from a trainer config by field name.

Each loss module (:mod:`.grpo`, :mod:`.dpo`, ...) declares a frozen dataclass whose fields are named as the config
fields they hold, plus a few runtime values that are not config fields (the sampling temperature, the compute dtype,
the router-loss weight), declared with :func:`runtime_field`. ``Settings.from_config(args, **runtime)`` reads the config
fields by name and takes the runtime values as keyword arguments, so a new loss knob is one config field and one
record field, never a copy in the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Self

#: The ``dataclasses.field`` metadata key that marks a field as a runtime value, not a config field.
RUNTIME = "runtime"


def runtime_field(default: Any) -> Any:
    """A settings field that :meth:`LossSettings.from_config` does not read from the config: the caller passes it."""
    return dataclasses.field(default=default, metadata={RUNTIME: True})


def enum_value(value: Any) -> Any:
    """The plain string behind an enum member with a string ``value`` (transformers' ``IntervalStrategy.STEPS`` ->
    ``"steps"``); any other value as given."""
    inner = getattr(value, "value", None)
    return inner if isinstance(inner, str) else value


def check_choice(name: str, value: object, accepted: Sequence[str], unsupported: dict[str, str] | None = None) -> str:
    """Validates one enumeration setting: the one check of a choice, for the configs and the loss settings alike.

    Args:
        name: the setting's name, as the user wrote it.
        value: its value (a string, or an enum member with a string ``value`` such as transformers'
            ``IntervalStrategy.STEPS``).
        accepted: the values torchlike runs.
        unsupported: values transformers/TRL know but torchlike does not run, with the reason.

    Returns:
        ``value`` as a plain string.

    Raises:
        ValueError: naming the setting, the value, the reason when known, and the accepted values.
    """
    value = enum_value(value)
    accepted_text = ", ".join(repr(v) for v in accepted)
    if value in accepted:
        return value
    if unsupported and value in unsupported:
        raise ValueError(f"{name}={value!r} is not supported by torchlike: {unsupported[value]} "
                         f"Accepted values: {accepted_text}.")
    raise ValueError(f"{name}={value!r} is not a recognised value. Accepted values: {accepted_text}.")


class LossSettings:
    """Base of the loss settings records (frozen dataclasses): :meth:`from_config` by field name."""

    @classmethod
    def config_names(cls) -> tuple[str, ...]:
        """The fields read from the config (every field but the :func:`runtime_field` ones)."""
        return tuple(field.name for field in dataclasses.fields(cls) if not field.metadata.get(RUNTIME))

    @classmethod
    def from_config(cls, args: Any, **runtime: Any) -> Self:
        """The settings of ``args`` (a trainer config with a field for each of :meth:`config_names`), with the
        runtime values given as keyword arguments (defaults for those not given).

        Raises:
            TypeError: a keyword that is not a runtime field of the record.
        """
        runtime_names = {field.name for field in dataclasses.fields(cls) if field.metadata.get(RUNTIME)}
        unknown = sorted(set(runtime) - runtime_names)
        if unknown:
            raise TypeError(f"{cls.__name__}.from_config takes the runtime values {sorted(runtime_names)}; got "
                            f"{unknown}. Config fields are read from args.")
        return cls(**{name: getattr(args, name) for name in cls.config_names()}, **runtime)
