"""``TRLConfig``: the ``TrainingArguments`` defaults every TRL 1.16 config changes (TRL's ``_BaseConfig``).

TRL's configs log every 10 steps, turn gradient checkpointing on, and default ``bf16`` to ``True`` unless ``fp16``
is set. ``GRPOConfig`` and ``DPOConfig`` build on this class; it also holds the ``pad_to_multiple_of`` rule they share.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchlike.training_args import TrainingArguments


def normalise_pad_to_multiple_of(value: int | str | None) -> int | None:
    """``pad_to_multiple_of`` as TRL normalises it off Neuron: ``"auto"`` -> ``None``, command-line text -> int/None.

    Args:
        value: a positive integer, ``"auto"``, ``None``, or the text of one of them.

    Returns:
        A positive integer or ``None``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "none", "null"):
            return None
        if text.isdigit():
            value = int(text)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"pad_to_multiple_of={value!r}: expected a positive integer, 'auto' or None.")
    return value


def round_up_to_multiple(length: int, multiple: int | None) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (as is when ``multiple`` is ``None``).

    Args:
        length: a padded length.
        multiple: a normalised ``pad_to_multiple_of`` (see :func:`normalise_pad_to_multiple_of`).

    Returns:
        The smallest multiple of ``multiple`` that is at least ``length``.
    """
    return -(-length // multiple) * multiple if multiple else length


@dataclass
class TRLConfig(TrainingArguments):
    """``TrainingArguments`` with TRL 1.16's changed defaults: ``logging_steps=10``, ``gradient_checkpointing=True``,
    ``bf16=None`` (becomes ``True`` unless ``fp16=True``; bf16 compute runs on CPUs too in torchlike)."""

    logging_steps: float = 10
    gradient_checkpointing: bool = True
    bf16: bool | None = None

    def __post_init__(self) -> None:
        self.bf16 = (not self.fp16) if self.bf16 is None else self.bf16
        super().__post_init__()
