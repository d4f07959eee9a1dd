"""SFT packing: prepared ``input_ids``/``labels`` rows packed into rows of at most ``max_length`` tokens, as TRL 1.16's
``pack_dataset`` packs them (``"bfd"``, ``"bfd_split"`` and ``"wrapped"``)."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .sft_config import PACKING_STRATEGIES

__all__ = ["PACKING_BATCH", "PACKING_STRATEGIES", "pack_dataset"]

#: How many examples TRL packs together at most: ``pack_dataset`` packs each batch of ``datasets.Dataset.map``
#: (1000 examples) on its own.
PACKING_BATCH = 1000


def pack_dataset(rows: Sequence[Mapping[str, Any]], max_length: int, strategy: str = "bfd") -> list[dict[str, Any]]:
    """Packs ``input_ids``/``labels`` rows into rows of at most ``max_length`` tokens, as TRL 1.16's ``pack_dataset``
    does on a ``datasets.Dataset`` (each group of [`PACKING_BATCH`] rows on its own, like its batched ``map``).

    - ``"bfd"`` (Best Fit Decreasing): sequences longer than ``max_length`` are truncated, then placed, longest first,
      in the fullest row they fit in; ``seq_lengths`` lists each row's sequences.
    - ``"bfd_split"``: as ``"bfd"``, but a long sequence is split into ``max_length`` pieces that are packed too.
    - ``"wrapped"``: every sequence concatenated and cut every ``max_length`` tokens (no ``seq_lengths``: TRL treats
      each cut as one sequence).

    Args:
        rows (`Sequence[dict]`): ``{"input_ids": list[int], "labels": list[int]}`` per example (other columns are
            ignored).
        max_length (`int`): The packed length.
        strategy (`str`, *optional*, defaults to `"bfd"`): One of [`PACKING_STRATEGIES`].

    Returns:
        `list[dict]`: ``{"input_ids", "labels"[, "seq_lengths"]}`` per packed row.
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"Invalid packing strategy '{strategy}', must be one of {PACKING_STRATEGIES}.")
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r}: packing needs a positive number of tokens per row.")
    packed: list[dict[str, Any]] = []
    for start in range(0, len(rows), PACKING_BATCH):
        group = [(list(row["input_ids"]), list(row["labels"])) for row in rows[start:start + PACKING_BATCH]]
        packed.extend(_pack_wrapped(group, max_length) if strategy == "wrapped"
                      else _pack_best_fit(group, max_length, split=strategy == "bfd_split"))
    return packed


def _pack_wrapped(group: list[tuple[list[int], list[int]]], max_length: int) -> list[dict[str, Any]]:
    ids = [token for row_ids, _ in group for token in row_ids]
    labels = [label for _, row_labels in group for label in row_labels]
    return [{"input_ids": ids[start:start + max_length], "labels": labels[start:start + max_length]}
            for start in range(0, len(ids), max_length)]


def _pack_best_fit(group: list[tuple[list[int], list[int]]], max_length: int, split: bool) -> list[dict[str, Any]]:
    sequences = []
    for ids, labels in group:
        if not ids:
            continue
        if split:
            sequences.extend((ids[at:at + max_length], labels[at:at + max_length])
                             for at in range(0, len(ids), max_length))
        else:
            sequences.append((ids[:max_length], labels[:max_length]))
    lengths = np.array([len(ids) for ids, _ in sequences], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free = _FreeSpaces(max_length)
    by_space: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    for index in order:
        length = int(lengths[index])
        space = free.best_fit(length)
        if space < max_length:
            chosen = by_space[space].popleft()
            if not by_space[space]:
                free.remove(space)
        else:
            chosen = []
            bins.append(chosen)
        chosen.append(int(index))
        space -= length
        by_space[space].append(chosen)
        if space > 0:
            free.add(space)
    packed = []
    for chosen in bins:
        packed.append({"input_ids": [token for i in chosen for token in sequences[i][0]],
                       "labels": [label for i in chosen for label in sequences[i][1]],
                       "seq_lengths": [int(lengths[i]) for i in chosen]})
    return packed


class _FreeSpaces:
    """The free spaces of the open rows, in ``1..max_length``, with the smallest one that fits a length found in
    ``O(log max_length)`` (TRL's ``_SegmentTree``: a max-tree over space values; ``max_length`` is always free, as a
    new row)."""

    def __init__(self, max_length: int):
        self.size = 1 << (max_length - 1).bit_length()
        self.tree = [0] * (2 * self.size)
        self.add(max_length)

    def _set(self, space: int, value: int) -> None:
        node = self.size + space - 1
        self.tree[node] = value
        while node > 1:
            node >>= 1
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def add(self, space: int) -> None:
        self._set(space, space)

    def remove(self, space: int) -> None:
        self._set(space, 0)

    def best_fit(self, length: int) -> int:
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= length else 2 * node + 1
        return self.tree[node]
