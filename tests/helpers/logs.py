"""Reading what a trainer logged: the per-step values of a metric in ``trainer.state.log_history``, and
``evaluate()``'s metrics without the ones that differ from run to run."""

from __future__ import annotations

from typing import Any


def logged(history: list[dict], key: str) -> list[Any]:
    """The values of ``key`` in the training logs (the entries with a ``loss``) of a ``log_history``, skipping the
    entries without ``key``."""
    return [entry[key] for entry in history if "loss" in entry and key in entry]


def evaluated(trainer: Any) -> dict[str, float]:
    """``trainer.evaluate()``'s metrics without the timings and the epoch (which differ between runs)."""
    return {key: value for key, value in trainer.evaluate().items()
            if key not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")}
