"""Reading what a trainer logged: the per-step values of a metric in ``trainer.state.log_history``,
``evaluate()``'s metrics without the ones that differ from run to run, and the events of a TensorBoard file."""

from __future__ import annotations

import struct
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


def assert_online_preference_run_matches(history: list[dict], expected_history: list[dict], params: dict,
                                         expected_params: dict, metrics: tuple[str, ...]) -> None:
    """An online preference run (Online DPO, XPO, Nash-MD) equal to TRL's, step for step: the same three logged steps
    with the same keys, the loss (TRL and torchlike round it to 4 decimals: equal, or one unit of the 4th apart), grad
    norm, learning rate and ``metrics`` within rtol 1e-4 (atol 1e-6), ``rewards/accuracies`` equal from step 2 (step 1
    scores the initial weights against their copy, where chosen > rejected is decided by float noise), and the final
    parameters within rtol 1e-4 (atol 5e-6)."""
    import numpy as np

    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}
    assert list(ours) == list(expected) == [1, 2, 3]
    assert all(set(ours[step]) == set(expected[step]) for step in ours)
    assert set(metrics) <= set(expected[1])
    np.testing.assert_allclose(logged(history, "loss"), logged(expected_history, "loss"), rtol=1e-4, atol=1.01e-4)
    for key in ("grad_norm", "learning_rate", *metrics):
        if key != "rewards/accuracies":
            np.testing.assert_allclose(logged(history, key), logged(expected_history, key), rtol=1e-4, atol=1e-6,
                                       err_msg=key)
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
