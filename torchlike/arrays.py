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


def to_numpy(values: ArrayLike, name: str, ndim: int | None, dtype: DTypeLike = np.float32) -> np.ndarray:
    """Lists, numpy, jax or torch tensors (bfloat16 ones too) as a numpy array of ``ndim`` dimensions (``None``: any).

    Raises:
        ValueError: the array has another number of dimensions (naming ``name`` and the shape).
    """
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch.Tensor, without importing torch
        values = values.detach().cpu().float().numpy()
    array = np.asarray(values, dtype=dtype)
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {array.shape}.")
    return array
