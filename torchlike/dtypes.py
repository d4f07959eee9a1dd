"""Turn the dtype spellings users bring (strings, numpy/jax dtypes, torch dtypes, ``"auto"``) into numpy dtypes."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch

#: A dtype as users spell it: a name (``"bfloat16"``, ``"auto"``), a numpy, jax or torch dtype, or ``None``.
DTypeLike: TypeAlias = "str | np.dtype | type | torch.dtype | None"

_NAMES = {
    "float32": np.float32, "fp32": np.float32, "float": np.float32, "f32": np.float32,
    "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
    "float16": np.float16, "fp16": np.float16, "half": np.float16, "f16": np.float16,
}


def resolve_dtype(dtype: DTypeLike, checkpoint_dtype: DTypeLike = None) -> np.dtype:
    """The numpy dtype for a user-supplied ``dtype``.

    Args:
        dtype: ``None``/``"auto"`` (use ``checkpoint_dtype``, float32 if that is unknown), a
            string (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``...), a numpy or jax dtype,
            or a ``torch.dtype``.
        checkpoint_dtype: the checkpoint's own dtype in any of those spellings.

    Returns:
        A floating ``numpy.dtype`` (bfloat16 via ``ml_dtypes``).

    Raises:
        ValueError: an unknown or non-floating dtype, naming the accepted strings.
    """
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return np.dtype(np.float32) if checkpoint_dtype in (None, "auto") else resolve_dtype(checkpoint_dtype)
    if isinstance(dtype, str) or type(dtype).__module__ == "torch":
        name = str(dtype).removeprefix("torch.").lower()
        if name not in _NAMES:
            raise ValueError(f"Unknown dtype {dtype!r}. Use one of {sorted(_NAMES)}, 'auto', "
                             "a numpy/jax dtype or a torch dtype.")
        return np.dtype(_NAMES[name])
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"Unknown dtype {dtype!r}. Use a string such as 'bfloat16', a numpy/jax dtype, "
                         "a torch dtype or 'auto'.") from None
    if resolved not in {np.dtype(value) for value in _NAMES.values()}:
        raise ValueError(f"dtype {resolved} is not supported for model weights; use float32, bfloat16 or float16 "
                         "(JAX runs without 64-bit floats by default).")
    return resolved


def dtype_name(dtype: DTypeLike) -> str:
    """``"bfloat16"``, ``"float32"``... as written in config.json."""
    return np.dtype(dtype).name
