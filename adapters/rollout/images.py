"""Image inputs of rollout requests as trees: a model's images (``Family.images``) are an array of image slots or a
dict of per-row arrays whose zeros are padding, so rows of several requests stack by padding each array's first axis
with zeros, and a multimodal rope's ``rope_deltas`` say how far the positions after a row's prompt move."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["rope_deltas", "row_of", "same_images", "stack_padded", "stack_rows"]


def stack_rows(rows: Sequence[Any]) -> Any:
    """Per-row image trees (arrays, or dicts of arrays) stacked on a new first axis, each array's own first axis
    padded with zeros to the longest; a ``None`` row is all zeros."""
    template = next(row for row in rows if row is not None)

    def stack(*leaves):
        present = [np.asarray(leaf) for leaf in leaves if leaf is not None]
        dtype = np.float32 if np.issubdtype(present[0].dtype, np.floating) else present[0].dtype
        if present[0].ndim == 0:
            return np.asarray([0 if leaf is None else leaf for leaf in leaves], dtype)
        longest = max(leaf.shape[0] for leaf in present)
        out = np.zeros((len(leaves), longest, *present[0].shape[1:]), dtype)
        for row, leaf in enumerate(leaves):
            if leaf is not None:
                out[row, :len(leaf)] = leaf
        return out

    filled = [jax.tree.map(lambda _: None, template) if row is None else row for row in rows]
    return jax.tree.map(stack, *filled, is_leaf=lambda leaf: leaf is None)


def stack_padded(*parts: np.ndarray) -> np.ndarray:
    """Arrays stacked on a new first axis, each zero-padded at the end of every axis to the largest: micro-batches
    whose image arrays were bucketed to different patch counts (zeros are padding) stack into one step; arrays of
    one shape stack as they are."""
    shapes = {np.shape(part) for part in parts}
    if len(shapes) == 1:
        return np.stack(parts)
    largest = tuple(max(sizes) for sizes in zip(*shapes, strict=True))
    return np.stack([np.pad(part, [(0, want - have) for want, have in zip(largest, np.shape(part), strict=True)])
                     for part in parts])


def row_of(images: Any, row: int) -> Any:
    """Row ``row`` of a batch's image tree (:func:`stack_rows`' inverse, padding kept)."""
    return jax.tree.map(lambda array: np.asarray(array[row]), images)


def same_images(first: Any, second: Any) -> bool:
    """Whether two rows' image trees are equal (both ``None`` counts)."""
    if first is None or second is None:
        return first is None and second is None
    pairs = zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
    return all(np.array_equal(a, b) for a, b in pairs)


def rope_deltas(images: Any) -> Any:
    """``images``' ``rope_deltas`` ``[R]`` (a multimodal rope: what the positions after each row's prompt add), or
    ``0``."""
    return images["rope_deltas"] if isinstance(images, dict) and "rope_deltas" in images else 0
