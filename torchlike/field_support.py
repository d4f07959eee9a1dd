"""Field support: what torchlike does with each field of a configuration class, and the check that applies it.

Every configuration class (``TrainingArguments`` and each TRL config) names its own rows in a ``_FIELD_SUPPORT``
class attribute, kept beside the class (``torchlike/training_args_fields.py``, ``torchlike/trl/<name>_fields.py``);
:func:`field_table` lays a class's rows over those of its bases. Each row is a :class:`FieldSupport`:

- ``"honoured"``: the trainer does what transformers/TRL do with the field (the reason says how).
- ``"ignored"``: the field has no effect in torchlike; setting it to anything but its default warns once, with the
  reason (it only concerns torch, CUDA, Accelerate or a tool torchlike does not use, and ignoring it does not change
  the trained weights).
- ``"refused"``: only the default is supported; any other value raises ``ValueError`` with the reason, because
  ignoring it would change the results the user expects.

:func:`check_unsupported` applies the table to a config; trainers call it when they start. Tests hold the tables
against the fields of the real ``transformers.TrainingArguments`` and TRL configs.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["honoured", "ignored", "refused"]


@dataclass(frozen=True)
class FieldSupport:
    """What torchlike does with one configuration field.

    Args:
        status: ``"honoured"``, ``"ignored"`` (warn when set) or ``"refused"`` (error when set).
        reason: for honoured fields, how torchlike implements it; otherwise why it is ignored or refused and what
            to use instead.
    """

    status: Status
    reason: str


def honoured(reason: str) -> FieldSupport:
    """A field torchlike applies as transformers/TRL do; ``reason`` says how."""
    return FieldSupport("honoured", reason)


def ignored(reason: str) -> FieldSupport:
    """A field with no effect in torchlike (warns when set); ``reason`` says why and what to use instead."""
    return FieldSupport("ignored", reason)


def refused(reason: str) -> FieldSupport:
    """A field only supported at its default (raises when set); ``reason`` says why and what to use instead."""
    return FieldSupport("refused", reason)


def _is_empty(value: object) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple, str)) and len(value) == 0)


def _differs(value: object, default: object) -> bool:
    """Whether a field's value counts as set: unequal to its default (an empty dict/list/string equals None)."""
    if _is_empty(value) and _is_empty(default):
        return False
    try:
        return bool(value != default)
    except Exception:  # values whose comparison is not a plain bool (arrays, odd objects) count as set
        return True


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """Field values of a default-constructed ``cls``, i.e. defaults after ``__post_init__``'s normalisation."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instance = cls()
        return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
    except (TypeError, ValueError):
        values = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
        return values


def _shown(name: str, value: object) -> str:
    return "'<hidden>'" if name == "hub_token" else repr(value)


def field_table(config_class: type) -> dict[str, FieldSupport]:
    """The rows that apply to a config class: the ``_FIELD_SUPPORT`` rows of each class in its MRO, a subclass's
    rows laid over its bases'.

    Args:
        config_class: ``TrainingArguments`` or a subclass.

    Returns:
        Field name -> ``FieldSupport``.
    """
    table: dict[str, FieldSupport] = {}
    for klass in reversed(config_class.__mro__):
        table.update(vars(klass).get("_FIELD_SUPPORT", {}))
    return table


def check_unsupported(args: object) -> None:
    """Warn about ignored fields and reject refused fields that ``args`` sets to a non-default value.

    Each ignored field gets one ``UserWarning`` naming the field, its value and the reason; all refused fields are
    reported together in one ``ValueError``. Fields left at their defaults are silent.

    Args:
        args: a ``torchlike.TrainingArguments`` or subclass (``SFTConfig``...).

    Raises:
        ValueError: a refused field is set; the message names each one with its value, the reason and the fix.
    """
    defaults = _defaults(type(args))
    table = field_table(type(args))
    refused = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        default = defaults.get(f.name)
        if not _differs(value, default):
            continue
        support = table.get(f.name)
        if support is None:
            warnings.warn(f"{f.name}={_shown(f.name, value)} is not in torchlike's field table "
                          "(torchlike.field_support.field_table), so nothing reads it; please report this.",
                          UserWarning, stacklevel=2)
        elif support.status == "ignored":
            warnings.warn(f"{f.name}={_shown(f.name, value)} is ignored: {support.reason}", UserWarning, stacklevel=2)
        elif support.status == "refused":
            refused.append(f"{f.name}={_shown(f.name, value)}: {support.reason} Remove it or set "
                           f"{f.name}={default!r} (the default).")
    if refused:
        raise ValueError(f"{type(args).__name__} sets {len(refused)} argument(s) torchlike does not support:\n  - "
                         + "\n  - ".join(refused))


def fields_with_status(table: dict[str, FieldSupport], status: Status) -> list[str]:
    """Names of the fields of ``table`` with a given status, in table order.

    Args:
        table: field name -> ``FieldSupport`` (e.g. ``field_table(SFTConfig)``).
        status: ``"honoured"``, ``"ignored"`` or ``"refused"``.

    Returns:
        The field names.
    """
    return [name for name, support in table.items() if support.status == status]
