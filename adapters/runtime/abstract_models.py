"""Abstract Tunix models kept on disk, so a new process skips building one under ``eval_shape``.

Building a Tunix decoder under ``nnx.eval_shape`` (shapes only) is pure Python and linear in the layer count:
0.2-0.5 s for a 0.5 GB Qwen2 on 2 cores, as long as reading the weights themselves. What it yields (the
``GraphDef``, the abstract ``State`` and the partition specs) depends only on the family, the config, the dtype and
the code that builds it, so it is pickled (about 100 KB) next to JAX's persistent compilation cache and read back in
about 10 ms by the next process that loads the same config.

- Where: ``<compilation cache>/torchlike-abstract-models/`` (:mod:`.compilation` picks the compilation cache; when
  that cache is off, so is this one).
- The key hashes the family, the config, the dtype, the Python/JAX/Flax/Tunix/torchlike versions and the size and
  modification time of every source file of ``adapters`` (a family's code change makes a new entry).
- Entries are written atomically (a temporary file renamed over the final name), so parallel processes never read a
  half-written one; a broken or unreadable entry is ignored and rebuilt.
- Classes that torchlike derives at run time (:func:`adapters.model.rope.with_rope`'s subclasses, which keep Tunix's
  class names) are pickled as the call that makes them; a model holding any other class that cannot be found by name
  is simply not cached.
- The entries are pickles, read from the user's own cache directory, as JAX's compiled programs are; point
  ``TORCHLIKE_COMPILATION_CACHE`` elsewhere (or to ``off``) where that directory is shared with untrusted users.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FOLDER = "torchlike-abstract-models"
ENTRIES_KEPT = 64
"""Entries kept in the folder; the least recently written beyond this are removed."""

_DERIVED_CLASSES: dict[type, tuple[Callable[..., type], tuple]] = {}
"""Classes made at run time, each with the cached call that makes it again (registered by their makers)."""

_fingerprint: str | None = None


def register_derived_class(cls: type, maker: Callable[..., type], args: tuple) -> None:
    """Records that ``maker(*args)`` returns ``cls`` (``maker`` must be cached and importable by name), so
    abstract models holding ``cls`` can be pickled."""
    _DERIVED_CLASSES[cls] = (maker, args)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, type) and obj in _DERIVED_CLASSES:
            return _DERIVED_CLASSES[obj]
        return NotImplemented


def _code_fingerprint() -> str:
    """The Python and package versions, and the size and modification time of every ``.py`` file of
    ``adapters``, hashed (once per process)."""
    global _fingerprint
    if _fingerprint is None:
        from importlib import metadata

        digest = hashlib.sha256(f"python={sys.version_info[:3]}".encode())
        for module in ("jax", "jaxlib", "flax", "numpy"):
            imported = sys.modules.get(module) or importlib.import_module(module)
            digest.update(f";{module}={getattr(imported, '__version__', '?')}".encode())
        for distribution in ("google-tunix", "torchlike"):
            try:
                digest.update(f";{distribution}={metadata.version(distribution)}".encode())
            except metadata.PackageNotFoundError:
                digest.update(f";{distribution}=?".encode())
        root = Path(__file__).resolve().parent.parent
        for path in sorted(root.rglob("*.py")):
            stat = path.stat()
            digest.update(f";{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        _fingerprint = digest.hexdigest()
    return _fingerprint


def entry_path(key: tuple) -> Path | None:
    """The cache file for ``key`` (a tuple of strings), or ``None`` when the compilation cache is off."""
    from .compilation import enable_compilation_cache

    cache = enable_compilation_cache()
    if cache is None:
        return None
    digest = hashlib.sha256(repr((key, _code_fingerprint())).encode()).hexdigest()[:40]
    return Path(cache) / FOLDER / f"{digest}.pkl"


def load(path: Path | None) -> Any | None:
    """The object stored at ``path``, or ``None`` when there is none or it cannot be read."""
    if path is None or not path.is_file():
        return None
    try:
        with open(path, "rb") as file:
            return pickle.load(file)
    except Exception as error:  # a damaged entry or one from other code: rebuild it
        logger.info("ignoring the abstract model cache entry %s: %s", path, error)
        return None


def store(path: Path | None, value: Any) -> bool:
    """Pickles ``value`` to ``path`` atomically; ``False`` (nothing written) when it cannot be pickled or written."""
    if path is None:
        return False
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as error:  # a class made at run time that no maker registered: not cached
        logger.info("not caching an abstract model: %s", error)
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(buffer.getvalue())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _prune(path.parent)
    except OSError as error:  # a read-only or full cache directory: loading still works
        logger.info("could not write the abstract model cache entry %s: %s", path, error)
        return False
    return True


def _prune(folder: Path) -> None:
    """Removes the entries beyond the :data:`ENTRIES_KEPT` most recently written (another process may be removing
    them too)."""
    entries = list(folder.glob("*.pkl"))
    if len(entries) <= ENTRIES_KEPT:
        return

    def written(entry: Path) -> int:
        try:
            return entry.stat().st_mtime_ns
        except OSError:
            return 0

    for stale in sorted(entries, key=written)[:-ENTRIES_KEPT]:
        stale.unlink(missing_ok=True)
