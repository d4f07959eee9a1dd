"""Reading what a trainer logged: the per-step values of a metric in ``trainer.state.log_history``,
``evaluate()``'s metrics without the ones that differ from run to run, and the events of a TensorBoard file."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def logged(history: list[dict], key: str) -> list[Any]:
    """The values of ``key`` in the training logs (the entries with a ``loss``) of a ``log_history``, skipping the
    entries without ``key``."""
    return [entry[key] for entry in history if "loss" in entry and key in entry]


def evaluated(trainer: Any) -> dict[str, float]:
    """``trainer.evaluate()``'s metrics without the timings and the epoch (which differ between runs)."""
    return {key: value for key, value in trainer.evaluate().items()
            if key not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")}


#: The preference trainers' logged metrics that are differences of summed log-probabilities (TRL's DPO, Online DPO
#: and XPO; evaluation's with an ``eval_`` prefix): the metric -> whether TRL scales it by ``beta``. (Nash-MD's
#: ``rewards/margins`` is such a difference unscaled; the scaled tolerance it gets is the tighter one.)
LOG_PROBABILITY_DIFFERENCES = {"rewards/chosen": True, "rewards/rejected": True, "rewards/margins": True,
                               "objective/non_score_reward": True, "objective/rlhf_reward": True,
                               "objective/kl": False}


def metric_atol(entry: dict, key: str, beta: float | None = None) -> float:
    """The absolute tolerance of the metric ``key`` in one of TRL's log entries: 1e-6, or for a difference of summed
    log-probabilities (:data:`LOG_PROBABILITY_DIFFERENCES`: the implicit rewards ``beta * (logp - ref_logp)``, their
    margin, the KL and what is made of it) 1e-5 of the sums it subtracts at that step (``|logps/chosen| +
    |logps/rejected|``, times ``beta`` where TRL scales the metric by it), if that is more.

    Such a metric's float32 rounding is that of the sums, not of the small difference: the sums agree to about 4e-7
    of their size, and on one CPU an Online DPO reward of 0.0113 came out 2.1e-6 apart (1.9e-4 of it) that another
    CPU's rounding had kept within 1e-4.

    Args:
        entry: TRL's log entry of the step (its ``logps/chosen``, ``logps/rejected`` and, without ``beta``, ``beta``).
        key: the metric.
        beta: the run's ``beta`` where TRL does not log it (DPO).

    Returns:
        The tolerance.
    """
    prefix = "eval_" if key.startswith("eval_") else ""
    scaled = LOG_PROBABILITY_DIFFERENCES.get(key.removeprefix(prefix))
    if scaled is None:
        return 1e-6
    sums = abs(entry[f"{prefix}logps/chosen"]) + abs(entry[f"{prefix}logps/rejected"])
    return max(1e-6, 1e-5 * sums * ((entry["beta"] if beta is None else beta) if scaled else 1.0))


def assert_steps_close(ours: list[dict], expected: list[dict], keys: Iterable[str], beta: float | None = None,
                       rtol: float = 1e-4) -> None:
    """Each of ``keys`` logged at each step (``ours`` and ``expected``: the log entries, step for step) equal to TRL's
    within ``rtol`` and :func:`metric_atol`."""
    import numpy as np

    for key in keys:
        for entry, expected_entry in zip(ours, expected, strict=True):
            np.testing.assert_allclose(entry[key], expected_entry[key], rtol=rtol,
                                       atol=metric_atol(expected_entry, key, beta),
                                       err_msg=f"{key}, step {expected_entry.get('step')}")


def assert_online_preference_run_matches(history: list[dict], expected_history: list[dict], params: dict,
                                         expected_params: dict, metrics: tuple[str, ...]) -> None:
    """An online preference run (Online DPO, XPO, Nash-MD) equal to TRL's, step for step: the same three logged steps
    with the same keys, the loss (TRL and torchlike round it to 4 decimals: equal, or one unit of the 4th apart), grad
    norm, learning rate and ``metrics`` within rtol 1e-4 (atol: :func:`metric_atol`), ``rewards/accuracies`` equal
    from step 2 (step 1 scores the initial weights against their copy, where chosen > rejected is decided by float
    noise), and the final parameters within rtol 1e-4 (atol 5e-6)."""
    import numpy as np

    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}
    assert list(ours) == list(expected) == [1, 2, 3]
    assert all(set(ours[step]) == set(expected[step]) for step in ours)
    assert set(metrics) <= set(expected[1])
    np.testing.assert_allclose(logged(history, "loss"), logged(expected_history, "loss"), rtol=1e-4, atol=1.01e-4)
    assert_steps_close(list(ours.values()), list(expected.values()),
                       [key for key in ("grad_norm", "learning_rate", *metrics) if key != "rewards/accuracies"])
    assert [ours[step]["rewards/accuracies"] for step in (2, 3)] == \
        [expected[step]["rewards/accuracies"] for step in (2, 3)]
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


def tensorboard_events(path: Path) -> list[Any]:
    """The events of a TensorBoard event file, in order (TFRecord framing: length, crc, payload, crc), as
    ``tensorboardX``'s ``Event`` protos."""
    from tensorboardX.proto import event_pb2

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
        offset += 12 + length + 4
    return events
