"""What the loop logs: a logging window's step metrics, an evaluation's results and the run's totals, as the
dicts transformers puts in ``state.log_history``."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["evaluation_metrics", "filtered_losses", "run_metrics", "window_logs", "window_metrics"]


def filtered_losses(values: list[dict], nan_inf_filter: bool) -> list[float]:
    """The step losses of one logging window, with transformers' ``logging_nan_inf_filter`` rule.

    A nan/inf step loss is replaced by the sum of the window's earlier (already filtered) losses divided by one plus
    their count, ``tr_loss / (1 + global_step - _globalstep_last_logged)``; the update itself is not skipped.
    transformers applies the rule per micro-batch; here the unit is the optimizer step.

    Args:
        values: the window's step metrics on the host, each with a scalar ``loss``.
        nan_inf_filter: ``args.logging_nan_inf_filter``.
    """
    losses, window_sum = [], 0.0
    for earlier, value in enumerate(values):
        loss = float(value["loss"])
        if nan_inf_filter and not math.isfinite(loss):
            loss = window_sum / (1 + earlier)
        window_sum += loss
        losses.append(loss)
    return losses


def window_metrics(values: list[dict]) -> dict[str, float]:
    """The mean over a window's steps of each extra metric a loss returned (``aux``); nothing for no steps."""
    if not values:
        return {}
    return {key: float(np.mean([float(value[key]) for value in values]))
            for key in values[-1] if key not in ("loss", "grad_norm", "weight")}


def window_logs(values: list[dict], losses: list[float], learning_rate: float) -> dict[str, float]:
    """One training log entry: the window's mean loss, the last step's gradient norm, the learning rate, and
    :func:`window_metrics`."""
    return {"loss": float(np.mean(losses)), "grad_norm": float(values[-1]["grad_norm"]),
            "learning_rate": learning_rate, **window_metrics(values)}


def evaluation_metrics(values: list[tuple], runtime: float) -> dict[str, float]:
    """``eval_loss`` (summed loss over loss items), ``eval_runtime`` and ``eval_<metric>`` (the mean over batches)
    from the eval step's ``(loss sum, item count, aux)`` per batch."""
    loss = sum(float(value[0]) for value in values)
    items = sum(float(value[1]) for value in values)
    metrics = {"eval_loss": loss / max(items, 1.0), "eval_runtime": runtime}
    for key in values[0][2] if values else ():
        metrics[f"eval_{key}"] = float(np.mean([float(value[2][key]) for value in values]))
    return metrics


def run_metrics(losses: list[float], runtime: float, steps: int, samples_per_step: int) -> dict[str, float]:
    """The totals ``train()`` logs at the end: runtime, mean training loss and throughput."""
    return {"train_runtime": runtime, "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "train_steps_per_second": steps / max(runtime, 1e-9),
            "train_samples_per_second": steps * samples_per_step / max(runtime, 1e-9)}
