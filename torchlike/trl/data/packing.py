"""TRL 1.16's ``pack_dataset``: rows of token lists packed into rows of at most ``seq_length`` tokens (``"bfd"``,
``"bfd_split"`` and ``"wrapped"``), on a ``datasets.Dataset``/``DatasetDict`` as TRL's, or on a list of rows (SFT's
prepared rows)."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...type_aliases import DatasetLike
from ..trainer.sft_config import PACKING_STRATEGIES

__all__ = ["PACKING_BATCH", "PACKING_STRATEGIES", "pack_dataset", "pack_rows"]

#: How many examples TRL packs together at most: ``pack_dataset`` packs each batch of ``datasets.Dataset.map``
#: (1000 examples) on its own.
PACKING_BATCH = 1000


def _check_strategy(strategy: str, seq_length: int) -> None:
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"Invalid packing strategy '{strategy}', must be one of {PACKING_STRATEGIES}.")
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r}: packing needs a positive number of tokens per row.")


def pack_dataset(dataset: DatasetLike | Sequence[Mapping[str, Any]], seq_length: int, strategy: str = "bfd",
                 map_kwargs: dict[str, Any] | None = None) -> Any:
    """TRL's ``pack_dataset``: packs every column (each a list per row, all of a row's lists of one length) into rows
    of at most ``seq_length`` elements.

    - ``"bfd"`` (Best Fit Decreasing): sequences longer than ``seq_length`` are truncated, then placed, longest first,
      in the fullest row they fit in; a ``seq_lengths`` column lists each row's sequences. Empty rows are dropped.
    - ``"bfd_split"``: as ``"bfd"``, but a long sequence is split into ``seq_length`` pieces that are packed too.
    - ``"wrapped"``: every sequence concatenated and cut every ``seq_length`` elements (no ``seq_lengths``).

    Each batch of the dataset's ``map`` (1000 rows unless ``map_kwargs`` says otherwise) is packed on its own, as in
    TRL; the dataset keeps its format (``with_format``).

    Args:
        dataset (`datasets.Dataset`, `datasets.DatasetDict` or a list of dicts): The rows to pack.
        seq_length (`int`): The packed length.
        strategy (`str`, *optional*, defaults to `"bfd"`): One of [`PACKING_STRATEGIES`].
        map_kwargs (`dict`, *optional*): Keyword arguments for ``datasets.Dataset.map`` (``batch_size``,
            ``num_proc``...); for a list of rows, only ``batch_size``.

    Returns:
        The packed rows, of the kind given (a dataset, a dict of datasets, or a list of dicts).

    Raises:
        TypeError: a column is not a list per row (TRL's message).
        ValueError: an unknown strategy, or a row whose columns differ in length (TRL's messages).

    Example:
        >>> pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]}), 4)[:]
        {'input_ids': [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], 'seq_lengths': [[4], [3, 1], [2]]}
    """
    _check_strategy(strategy, seq_length)
    map_kwargs = dict(map_kwargs or {})
    if isinstance(dataset, Sequence):
        unknown = set(map_kwargs) - {"batch_size"}
        if unknown:
            raise TypeError(f"pack_dataset on a list of rows takes map_kwargs batch_size only; got {sorted(unknown)}.")
        columns = list(dataset[0]) if len(dataset) else []
        return pack_rows(dataset, seq_length, strategy, columns, map_kwargs.get("batch_size", PACKING_BATCH))
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict({name: pack_dataset(split, seq_length, strategy, map_kwargs)
                                     for name, split in dataset.items()})
    kept_format = dict(dataset.format)
    kept_format.update(kept_format.pop("format_kwargs", {}) or {})

    def pack_batch(batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        packed = pack_rows(rows, seq_length, strategy, list(batch), len(rows) or 1)
        names = list(batch) + (["seq_lengths"] if strategy != "wrapped" else [])
        return {name: [row[name] for row in packed] for name in names}

    packed = dataset.with_format(None).map(pack_batch, batched=True, remove_columns=dataset.column_names,
                                           **map_kwargs)
    if strategy != "wrapped" and kept_format.get("columns"):
        kept_format["columns"] = [*kept_format["columns"], "seq_lengths"]
    return packed.with_format(**kept_format)


def pack_rows(rows: Sequence[Mapping[str, Any]], seq_length: int, strategy: str = "bfd",
              columns: Sequence[str] = ("input_ids", "labels"),
              batch_size: int = PACKING_BATCH) -> list[dict[str, Any]]:
    """[`pack_dataset`] on a list of rows: the ``columns`` of each group of ``batch_size`` rows packed on its own
    (other columns are dropped).

    Args:
        rows (`Sequence[dict]`): The rows; each of ``columns`` a list per row.
        seq_length (`int`): The packed length.
        strategy (`str`, *optional*, defaults to `"bfd"`): One of [`PACKING_STRATEGIES`].
        columns (`Sequence[str]`, *optional*): The columns to pack (SFT's ``input_ids`` and ``labels``).
        batch_size (`int`, *optional*): Rows packed together at most (TRL's ``map`` batch).

    Returns:
        `list[dict]`: ``columns`` (and ``seq_lengths`` for the ``"bfd"`` strategies) per packed row.
    """
    _check_strategy(strategy, seq_length)
    packed: list[dict[str, Any]] = []
    for start in range(0, len(rows), batch_size):
        group = [_sequence(row, columns) for row in rows[start:start + batch_size]]
        packed.extend(_pack_wrapped(group, columns, seq_length) if strategy == "wrapped"
                      else _pack_best_fit(group, columns, seq_length, split=strategy == "bfd_split"))
    return packed


def _sequence(row: Mapping[str, Any], columns: Sequence[str]) -> list[list[Any]]:
    """The row's ``columns`` as lists of one length."""
    values = []
    for name in columns:
        value = row[name]
        if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
            raise TypeError("Packing requires all columns to be lists of lists.")
        values.append(list(value))
    if len({len(value) for value in values}) > 1:
        raise ValueError("All columns must have values of the same length.")
    return values


def _pack_wrapped(group: list[list[list[Any]]], columns: Sequence[str], seq_length: int) -> list[dict[str, Any]]:
    joined = [[item for sequence in group for item in sequence[index]] for index in range(len(columns))]
    total = len(joined[0]) if joined else 0
    return [{name: values[start:start + seq_length] for name, values in zip(columns, joined, strict=True)}
            for start in range(0, total, seq_length)]


def _pack_best_fit(group: list[list[list[Any]]], columns: Sequence[str], seq_length: int,
                   split: bool) -> list[dict[str, Any]]:
    sequences = []
    for values in group:
        length = len(values[0])
        if not length:
            continue
        pieces = range(0, length, seq_length) if split else [0]
        sequences.extend([value[at:at + seq_length] for value in values] for at in pieces)
    lengths = np.array([len(values[0]) for values in sequences], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free = _FreeSpaces(seq_length)
    by_space: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    for index in order:
        length = int(lengths[index])
        space = free.best_fit(length)
        if space < seq_length:
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
    return [{**{name: [item for i in chosen for item in sequences[i][column]] for column, name in enumerate(columns)},
             "seq_lengths": [int(lengths[i]) for i in chosen]} for chosen in bins]


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
