"""Array conversions the facade shares: user inputs (lists, numpy, jax or torch tensors) as numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_numpy_2d(values: Any, name: str, dtype=np.int32) -> np.ndarray:
    """Lists, numpy, jax or torch tensors as a 2-D numpy array (a 1-D input becomes a batch of one)."""
    if values is None:
        return None
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch.Tensor, without importing torch
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
    except ValueError:
        raise ValueError(f"{name} must be rectangular (pad the rows to one length and pass attention_mask).") from None
    if array.dtype == object:
        raise ValueError(f"{name} must be rectangular (pad the rows to one length and pass attention_mask).")
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, sequence); got {array.shape}.")
    return array.astype(dtype)
