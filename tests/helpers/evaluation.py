"""What ``compute_metrics`` receives, recorded and compared with TRL's (the student-teacher trainers' evaluation on the
dataset's sequences)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def recorded_predictions(store: list) -> Callable:
    """A ``compute_metrics`` that keeps the ``EvalPrediction``'s arrays and returns their sizes."""

    def compute_metrics(prediction):
        store.append((np.asarray(prediction.predictions), np.asarray(prediction.label_ids),
                      np.asarray(prediction.inputs)))
        return {"labelled": float((np.asarray(prediction.label_ids) != -100).sum())}

    return compute_metrics


def assert_student_predictions_match(found: tuple, expected: tuple, pad_token_id: int) -> None:
    """The student's logits, labels and inputs of an evaluation equal TRL's: each batch's rows are left-padded, so the
    logits at a padding position (attention to nothing) are each implementation's own and are left out; the positions
    past a short batch's width are transformers' ``-100`` padding on both sides."""
    (logits, labels, inputs), (expected_logits, expected_labels, expected_inputs) = found, expected
    np.testing.assert_array_equal(labels, expected_labels)
    np.testing.assert_array_equal(inputs, expected_inputs)
    assert logits.shape == expected_logits.shape
    real = np.cumsum((expected_inputs != pad_token_id) & (expected_inputs != -100), axis=1) > 0
    np.testing.assert_allclose(logits[real], expected_logits[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(logits[expected_inputs == -100], -100)
