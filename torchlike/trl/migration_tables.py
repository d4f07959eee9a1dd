"""The "not honoured" tables of MIGRATION.md, generated from the field tables of every configuration class."""

from __future__ import annotations

import dataclasses

from ..field_support import field_table
from ..training_args import TrainingArguments
from .registry import TRAINERS


def unsupported_fields_markdown() -> str:
    """The "not honoured" tables of MIGRATION.md: every ignored or refused field of ``TrainingArguments`` and of
    each TRL config class, with its reason (a test keeps MIGRATION.md equal to it).

    Returns:
        Markdown: one table per config class, rows sorted by status then name.
    """
    sections, shown = [], set()
    for config_class in (TrainingArguments, *(entry.config_class() for entry in TRAINERS)):
        names = {field.name for field in dataclasses.fields(config_class)}
        table = field_table(config_class)
        rows = sorted((support.status, name, support.reason) for name, support in table.items()
                      if name in names and support.status != "honoured"
                      and (name, support) not in shown)
        shown.update((name, table[name]) for _, name, _ in rows)
        if not rows:
            continue
        lines = [f"### {config_class.__name__}", "", "| field | status | why |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {status} | {reason.replace('|', '/')} |" for status, name, reason in rows]
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"
