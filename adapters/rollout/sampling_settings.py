"""Sampling settings: the ``transformers.GenerationConfig`` settings torchlike's sampler implements, as one value.

``generate`` and ``GRPOTrainer`` build a :class:`SamplingSettings`; the sampler (:mod:`adapters.rollout.sampling`)
compiles its :class:`SamplingSwitches` and traces its :class:`SamplingValues`. This module imports no JAX, so
configuration code (the field tables) can read the names cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen: the ``transformers.GenerationConfig`` settings torchlike's sampler
    implements, with their names, defaults and allowed ranges.

    ``generate`` builds one from its arguments and generation configs, and ``GRPOTrainer`` from its
    config fields and ``generation_kwargs``; both accept exactly :meth:`names`. A new setting is a field
    here (its default, its range check in ``__post_init__``, its place in :meth:`switches` or
    :meth:`traced_values`) and its processor in :func:`choose_tokens`.

    Args:
        do_sample: sample (``True``) or take the argmax after the repetition penalty (``False``,
            greedy; temperature/top-k/top-p/min-p are then ignored, as in ``transformers``).
        temperature: divides the scores before sampling; must be ``> 0`` when sampling.
        top_k: keep the ``k`` best tokens; ``None`` or ``0`` disables.
        top_p: nucleus sampling threshold in ``(0, 1]``; ``None`` or ``1.0`` disables.
        min_p: in ``[0, 1]``; ``None`` or ``0`` disables.
        repetition_penalty: ``> 0``; ``None`` or ``1.0`` disables, ``> 1`` discourages repeats.

    Raises:
        ValueError: a value outside ``transformers``' range, named with the fix.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    min_p: float | None = None
    repetition_penalty: float | None = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature!r}. For greedy "
                             "decoding pass do_sample=False.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}; 1.0 turns nucleus sampling off.")
        if self.top_k is not None and (not isinstance(self.top_k, int | np.integer) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}; 0 turns top-k filtering "
                             "off.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 is no penalty, > 1 discourages repeats), "
                             f"got {self.repetition_penalty!r}.")
        # Plain Python types, whatever the caller passed (numpy scalars, ints for floats).
        for name, cast in (("do_sample", bool), ("temperature", float), ("top_k", int), ("top_p", float),
                           ("min_p", float), ("repetition_penalty", float)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, cast(value))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names (``transformers.GenerationConfig`` fields), in declaration order."""
        return tuple(field.name for field in fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """``{name: default}``: ``transformers``' defaults for these settings."""
        return {field.name: field.default for field in fields(cls)}

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> SamplingSettings:
        """The settings among ``settings``' keys (other keys are the caller's), defaults for the rest."""
        return cls(**{name: settings[name] for name in cls.names() if name in settings})

    def switches(self) -> SamplingSwitches:
        """The part that changes the compiled program; everything else is a :meth:`traced_values` value."""
        sampling = self.do_sample
        return SamplingSwitches(
            do_sample=sampling,
            top_k=(self.top_k or 0) if sampling else 0,
            top_p=sampling and self.top_p is not None and self.top_p < 1.0,
            min_p=sampling and bool(self.min_p),
            repetition_penalty=self.repetition_penalty not in (None, 1.0),
        )

    def traced_values(self) -> SamplingValues:
        """The float settings, each at its neutral value where it is off (the sampler traces them as float32)."""
        return SamplingValues(
            temperature=float(self.temperature if self.do_sample else 1.0),
            top_p=float(1.0 if self.top_p is None else self.top_p),
            min_p=float(self.min_p or 0.0),
            repetition_penalty=float(self.repetition_penalty or 1.0),
        )


@dataclass(frozen=True)
class SamplingSwitches:
    """Which processors a compiled generation program runs, by :class:`SamplingSettings` name.

    Settings with equal switches share one program. ``top_k`` is the candidate count (it sets an
    array shape, so it is compiled in; 0 is off); the others say whether the processor runs.
    """

    do_sample: bool
    top_k: int
    top_p: bool
    min_p: bool
    repetition_penalty: bool


class SamplingValues(NamedTuple):
    """The float settings of :class:`SamplingSettings`, traced (not compiled in) by the sampler."""

    temperature: float
    top_p: float
    min_p: float
    repetition_penalty: float


UNSUPPORTED_GENERATION_SETTINGS: dict[str, Any] = {
    "no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "min_new_tokens": None, "min_length": 0,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "top_h": None,
    "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None, "guidance_scale": None,
    "stop_strings": None, "penalty_alpha": None,
}
"""``transformers.GenerationConfig`` settings whose processors the sampler does not implement, with the
value that turns each off; a setting that moves into :class:`SamplingSettings` leaves this table."""
