"""The torchlike version, and the behaviour changes of the installed ``transformers`` that torchlike follows.

A module of its own, importing nothing heavy, so that any module can read it without importing the package. Each
function below answers one question about the installed ``transformers`` from its version, so a behaviour that
changed upstream is decided here once; the facade passes the answer to the adapters as an argument.
"""

from __future__ import annotations

import functools
import importlib.metadata

from packaging.version import Version

__version__ = "0.1.0"


@functools.cache
def installed_transformers() -> Version:
    """The installed ``transformers`` version."""
    return Version(importlib.metadata.version("transformers"))


def repetition_penalty_skips_left_padding() -> bool:
    """Whether ``transformers.generate`` leaves each row's left padding out of the repetition penalty.

    From transformers 5.23 ``generate`` builds ``RepetitionPenaltyLogitsProcessor`` with
    ``prompt_ignore_length`` set to each row's leading padding (the index of the first 1 in the attention mask),
    so a pad id is penalised only where it also appears after the first real token; before, every id of
    ``input_ids`` counted, padding included.
    """
    return installed_transformers() >= Version("5.23")


def gradient_checkpointing_is_deprecated() -> bool:
    """Whether ``TrainingArguments`` calls ``gradient_checkpointing`` / ``gradient_checkpointing_kwargs`` deprecated
    aliases of ``activation_checkpointing`` / ``activation_checkpointing_kwargs`` (transformers 5.23 on), warning
    with a ``FutureWarning`` when an alias is given without the new name."""
    return installed_transformers() >= Version("5.23")


def warmup_ratio_and_logging_dir_are_removed() -> bool:
    """Whether ``TrainingArguments`` has dropped ``warmup_ratio`` and ``logging_dir`` (transformers 5.15 on; the
    versions before log a deprecation for each)."""
    return installed_transformers() >= Version("5.15")
