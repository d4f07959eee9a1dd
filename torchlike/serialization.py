"""``torch.save`` / ``torch.load`` for JAX: save state dicts and nested trees with Orbax, load them lazily.

The storage format, the atomic overwrite and the recovery from interrupted saves live in
``torchlike.adapters.checkpoint.orbax_store``; this module adds torchlike's version to the metadata.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .adapters.checkpoint.orbax_store import (
    FORMAT,
    CheckpointCorruptedError,
    LazyCheckpoint,
    open_checkpoint,
    save_tree,
)

__all__ = ["CheckpointCorruptedError", "LazyCheckpoint", "load", "save"]


def save(obj: Mapping, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> None:
    """Saves a state dict (or any nested dict of arrays) to the directory ``path``, like ``torch.save``.

    Overwriting is atomic: a crash at any point leaves either the previous checkpoint or the
    new one, and ``load`` finishes an interrupted overwrite. Sharded ``jax.Array`` values are
    written shard by shard by Orbax, never gathered to the host first.

    Args:
        obj: ``model.state_dict()`` (``{"layers.0.attn.q_proj.w": array}``) or nested
            dicts/lists/tuples (e.g. an optimizer state as dicts) of ``jax.Array``, numpy arrays
            (bfloat16 included), torch tensors and Python ``int``/``float``/``bool``/``None``.
            Keys are ``str`` or ``int`` and come back with their type.
        path: a directory (created; its parent too).
        metadata: a JSON-serialisable dict stored with the checkpoint, e.g.
            ``{"family": "qwen2", "lora": {"r": 8, "alpha": 16}}``. ``torchlike_version`` and
            ``format`` are added (and overwrite keys of those names).

    Raises:
        TypeError: ``obj`` is not dict-like, a key or value has an unsupported type (the message
            names its key path), or ``metadata`` is not JSON-serialisable.
        FileExistsError: ``path`` is a file or a directory that is not a torchlike checkpoint.

    Example::

        torchlike.save(model.state_dict(), "ckpt", metadata={"step": 100})
        state = torchlike.load("ckpt")
    """
    from .version import __version__

    # A model.state_dict() carries its family and LoRA rank/alpha; explicit metadata wins.
    carried = getattr(obj, "metadata", None) or {}
    save_tree(obj, path, {**carried, **dict(metadata or {}), "torchlike_version": __version__, "format": FORMAT})


def load(path: str | os.PathLike) -> LazyCheckpoint:
    """Opens a checkpoint written by ``save``, like ``torch.load`` but lazy: only the manifest is read now.

    Args:
        path: the directory given to ``save``.

    Returns:
        A ``LazyCheckpoint``: a read-only mapping over the saved top-level keys. ``ckpt[key]``
        reads one entry as numpy, ``ckpt.restore({key: sharding})`` reads chosen keys straight into
        device shardings, ``ckpt.to_dict()`` reads everything, ``ckpt.metadata`` is the metadata.

    Raises:
        FileNotFoundError: nothing complete at ``path`` (the message lists leftovers beside it).
        CheckpointCorruptedError: (a ``ValueError``) the checkpoint is damaged or not a torchlike checkpoint.
    """
    return open_checkpoint(path)
