"""MXFP4 checkpoints (GPT-OSS as OpenAI publishes it) read as plain bfloat16 tensors.

A tensor ``<name>`` is stored as ``<name>_blocks`` (uint8 ``[..., rows, groups, 16]``: two 4-bit codes a byte, the
low nibble first, 32 values a group) and ``<name>_scales`` (uint8 ``[..., rows, groups]``: each group's power of two,
biased by 127). A code indexes the FP4 (E2M1) values :data:`FP4_VALUES`. Dequantised, the ``[..., rows, groups * 32]``
values are transposed to ``[..., groups * 32, rows]``: ``transformers``' ``convert_moe_packed_tensors``
(``integrations/mxfp4.py``) gives GPT-OSS's stacked experts this layout, and the same values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The bfloat16 tensor of an MXFP4 pair (see the module docstring): ``[..., groups * 32, rows]``.

    Raises:
        ValueError: the shapes do not pair (``scales`` is ``blocks`` without its last axis).
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {blocks.shape} and scales of shape {scales.shape} do not pair: the "
                         "scales must be the blocks' shape without its last axis.")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    values = values.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)
    return np.swapaxes(values, -1, -2).astype(ml_dtypes.bfloat16)


def dequantized(tensors: Iterable[tuple[str, np.ndarray, Path | str]]) -> Iterator[tuple[str, np.ndarray, Path | str]]:
    """``tensors`` with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by ``<name>`` (:func:`dequantize`);
    other tensors pass through. One half of a pair is held until its partner arrives.

    Raises:
        ValueError: a half whose partner never arrives, naming it.
    """
    waiting: dict[str, tuple[str, np.ndarray]] = {}
    for name, array, origin in tensors:
        suffix = BLOCKS if name.endswith(BLOCKS) else SCALES if name.endswith(SCALES) else None
        if suffix is None:
            yield name, array, origin
            continue
        base = name[:-len(suffix)]
        if base not in waiting:
            waiting[base] = (suffix, np.array(array))
            continue
        other_suffix, other = waiting.pop(base)
        blocks, scales = (array, other) if suffix == BLOCKS else (other, array)
        yield base, dequantize(blocks, scales), origin
    if waiting:
        names = [base + suffix for base, (suffix, _) in waiting.items()]
        raise ValueError(f"MXFP4 tensors without their partner: {names[:4]} (each <name>_blocks needs <name>_scales "
                         "and the reverse); the checkpoint is incomplete.")
