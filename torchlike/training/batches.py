"""Examples to fixed-shape global batches on the mesh: the default collator, the epoch order, column selection,
padding of the last batch, and each process's share of the rows.

Every batch of a run has the same shape, so XLA compiles the step once: a partial batch is filled with rows whose
values (masks included) are all zero. Collation runs on each process for the rows it holds
(``adapters.distributed.mesh.local_rows``), and the global batch is assembled on the mesh from those shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..adapters.distributed import mesh as mesh_lib

__all__ = ["as_sequence", "check_single_dataset", "collate_rows", "each_dataset", "epoch_batches", "keep_columns",
           "map_datasets", "ordered_batches", "run_in_batches", "sampler_order", "stack_rows", "steps_per_epoch"]


def stack_rows(rows: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The default data collator: each column of ``rows`` stacked along a new first axis."""
    return {key: np.stack([np.asarray(row[key]) for row in rows]) for key in rows[0]}


def sampler_order(length: int, epoch: int, sequential: bool, seed: int) -> np.ndarray:
    """Example order for ``epoch``: dataset order when ``sequential``, else a permutation seeded by ``seed + epoch``
    (transformers' ``RandomSampler`` draws a new order each epoch)."""
    if sequential:
        return np.arange(length)
    return np.random.default_rng(seed + epoch).permutation(length)


def keep_columns(examples: list, kept: set[str] | None) -> list:
    """``examples`` reduced to the columns in ``kept`` (``None``: all), as transformers' ``RemoveColumnsCollator``
    does before the data collator; examples that are not mappings pass through.

    Raises:
        ValueError: no column of the examples is kept.
    """
    if kept is None or not examples or not isinstance(examples[0], Mapping):
        return examples
    if not kept & set(examples[0]):
        raise ValueError(f"No column of the dataset is read by the training loss: it has {sorted(examples[0])}, "
                         f"the loss reads {sorted(kept)}. Rename the columns, set label_names, or set "
                         "remove_unused_columns=False to give the data collator every column.")
    return [{key: value for key, value in example.items() if key in kept} for example in examples]


def collate_rows(collate: Callable[[list], dict], dataset: Sequence, indices: np.ndarray, mesh: Mesh,
                 what: str) -> dict[str, np.ndarray]:
    """Collates ``dataset[i]`` for ``indices``; ``-1`` entries become all-zero rows (masks 0), so a partial batch
    keeps the compiled shape.

    Args:
        collate: ``list[example] -> {column: array}`` with one row per example.
        dataset: indexable examples.
        indices: example indices, ``-1`` for a padding row.
        mesh: the training mesh (named in the error below).
        what: the batches' purpose (``"training"``, ``"evaluation"``...), for the error message.

    Raises:
        ValueError: the collator returned another number of rows than it was given examples.
    """
    real = indices >= 0
    fill = np.where(real, indices, indices[real][0]) if real.any() else np.zeros_like(indices)
    batch = collate([dataset[int(i)] for i in fill])

    def checked(path, value):
        value = np.asarray(value)
        if value.shape[:1] != (len(indices),):
            key = ".".join(str(getattr(part, "key", part)) for part in path)
            raise ValueError(
                f"the {what} data_collator returned {value.shape[:1] or 'no'} rows for {key!r} but was given "
                f"{len(indices)} examples; the global batch must split evenly over the data-parallel size "
                f"{mesh_lib.data_parallel_size(mesh)} (mesh {dict(mesh.shape)}), so the collator must return one "
                "row per example.")
        if not real.all():
            value = value.copy()
            value[~real] = 0
        return value

    # A column may be a dict of arrays (a vision-language model's images), each with a row per example.
    return jax.tree_util.tree_map_with_path(checked, dict(batch))


def steps_per_epoch(length: int, per_step: int, drop_last: bool) -> int:
    """Optimizer steps in one pass over ``length`` examples taking ``per_step`` each (global batch x accumulation);
    the last partial step counts unless ``drop_last``.

    Raises:
        ValueError: ``drop_last`` leaves no step.
    """
    if not drop_last:
        return math.ceil(length / per_step)
    steps = length // per_step
    if steps == 0:
        raise ValueError(f"dataloader_drop_last=True drops every batch: the dataset has {length} examples and one "
                         f"step takes {per_step} (global batch x gradient_accumulation_steps).")
    return steps


def epoch_batches(dataset: Sequence, order: np.ndarray, collate: Callable[[list], dict], mesh: Mesh,
                  batch_size: int, accumulation: int, steps: int, skip: int = 0) -> Iterator[dict[str, jax.Array]]:
    """This process's share of the micro-batch groups ``[A, B, ...]`` of one epoch, placed on the mesh.

    Args:
        dataset: indexable examples.
        order: the epoch's example order (:func:`sampler_order`).
        collate: ``list[example] -> {column: array}``.
        mesh: rows are split over its data axes.
        batch_size: the global micro-batch size.
        accumulation: micro-batches per optimizer step.
        steps: optimizer steps in the epoch (:func:`steps_per_epoch`).
        skip: steps already done (a resumed run), whose batches are not built.

    Yields:
        ``{column: jax.Array}`` shaped ``[accumulation, batch_size, ...]``, one per optimizer step; the last partial
        step is padded with all-zero rows.
    """
    per_step = batch_size * accumulation
    sharding = mesh_lib.batch_sharding(mesh, batch_axis=1)
    rows = mesh_lib.local_rows(sharding, (accumulation, batch_size), batch_axis=1)
    for step in range(skip, steps):
        indices = np.full(per_step, -1)
        chosen = order[step * per_step:(step + 1) * per_step]
        indices[:len(chosen)] = chosen
        local = indices.reshape(accumulation, batch_size)[:, rows].reshape(-1)
        batch = collate_rows(collate, dataset, local, mesh, "training")
        batch = jax.tree.map(lambda value: value.reshape(accumulation, rows.stop - rows.start, *value.shape[1:]),
                             batch)
        yield mesh_lib.place_batch(batch, sharding, batch_size, batch_axis=1)


def ordered_batches(examples: Sequence, mesh: Mesh, size: int, collate: Callable[[list], dict],
                    what: str) -> Iterator[tuple[dict[str, jax.Array], int]]:
    """``examples`` in order, as global batches of ``size`` rows placed on ``mesh``; the last one is padded with
    all-zero rows, so one compiled program serves every batch.

    Yields:
        ``(batch, rows)``: the placed batch and how many of its leading rows are real examples.
    """
    sharding = mesh_lib.batch_sharding(mesh)
    local = mesh_lib.local_rows(sharding, (size,))
    for start in range(0, len(examples), size):
        indices = np.full(size, -1)
        chosen = np.arange(start, min(start + size, len(examples)))
        indices[:len(chosen)] = chosen
        batch = collate_rows(collate, examples, indices[local], mesh, what)
        yield mesh_lib.place_batch(batch, sharding, size), len(chosen)


def run_in_batches(examples: Sequence, step: Callable, module, mesh: Mesh, size: int, collate: Callable[[list], dict],
                   what: str) -> list:
    """``step(module, batch)`` over :func:`ordered_batches` of ``examples``; the results, in order, on the host."""
    with mesh_lib.entered(mesh):
        outputs = [step(module, batch) for batch, _ in ordered_batches(examples, mesh, size, collate, what)]
    return mesh_lib.to_host(outputs)


def as_sequence(dataset: Iterable) -> Sequence:
    """``dataset`` as an indexable sequence: a list of its examples when it has no length or indexing (a
    ``datasets.IterableDataset``, a generator), else the dataset itself."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    return list(dataset)


def check_single_dataset(dataset: object, name: str) -> None:
    """Refuses a dict of datasets where transformers takes one dataset (``train_dataset``).

    Raises:
        TypeError: ``dataset`` is a mapping (a dict of datasets, a ``datasets.DatasetDict``).
    """
    if isinstance(dataset, Mapping):
        raise TypeError(f"{name} is one dataset, but a {type(dataset).__name__} of datasets ({list(dataset)}) was "
                        f"passed; pick one split (e.g. {name}=dataset['train']). Only eval_dataset takes a dict: "
                        "each of its datasets is evaluated with its own metric names (eval_<name>_loss).")


def each_dataset(datasets: object) -> list:
    """The datasets of ``eval_dataset``: the values of a dict of datasets, ``[datasets]`` for one, ``[]`` for
    ``None``."""
    if datasets is None:
        return []
    return list(datasets.values()) if isinstance(datasets, Mapping) else [datasets]


def map_datasets(datasets: object, function: Callable) -> object:
    """``function`` applied to each dataset of a dict of datasets (a dict of the results, same keys), or to a single
    dataset; ``None`` stays ``None``. This is how the trainers prepare ``eval_dataset``, which may be either."""
    if datasets is None:
        return None
    if isinstance(datasets, Mapping):
        return {name: function(dataset) for name, dataset in datasets.items()}
    return function(datasets)
