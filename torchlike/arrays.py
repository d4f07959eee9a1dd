"""Array conversions the facade shares: user inputs (lists, numpy, jax or torch tensors) as numpy arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from .dtypes import DTypeLike


def to_numpy_2d(values: ArrayLike | None, name: str, dtype: DTypeLike = np.int32) -> np.ndarray | None:
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
