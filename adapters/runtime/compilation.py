"""The persistent XLA compilation cache, on by default, so a second run of a script skips compilation.

Where: ``$TORCHLIKE_COMPILATION_CACHE`` if set (``0``/``off``/``false`` turns the cache off),
else a directory the user already gave JAX (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.jax_compilation_cache_dir``), else ``~/.cache/torchlike/<cache_folder_name()>`` (``$XDG_CACHE_HOME``
respected). torchlike's programs are small and many (one per weight shape when loading), so
every compilation is cached, not only those over JAX's default one-second threshold.

Several processes share the folder (two scripts at once, the processes of one host, test workers), and JAX writes
an entry in place without a lock, so one process could read an entry another is still writing and load a truncated
executable (a segmentation fault in ``deserialize_executable``); torchlike makes each write a temporary file renamed
into place (:func:`atomic_cache_writes`, ``adapters/upstream.py``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

_OFF = {"0", "off", "false", "no", "none"}
_enabled: Path | None = None
_decided = False


def cache_folder_name() -> str:
    """``"jax"``, or ``"jax-py3.14"`` from Python 3.14 on: there JAX compresses cache entries with the standard
    library's zstd under the label it gives zlib entries elsewhere, so a folder shared with an older Python fails to
    read (and recompiles) the other's entries."""
    import sys

    major, minor = sys.version_info[:2]
    return "jax" if (major, minor) < (3, 14) else f"jax-py{major}.{minor}"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchlike" / cache_folder_name()


def enable_compilation_cache(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache (idempotent).

    Args:
        cache_dir: where to keep compiled programs; ``None`` picks the default described in the
            module docstring.

    Returns:
        The cache directory, or ``None`` when the cache is turned off.
    """
    global _enabled, _decided
    import jax

    setting = os.environ.get("TORCHLIKE_COMPILATION_CACHE")
    if cache_dir is None and _decided:
        return _enabled
    _decided = True
    if cache_dir is None and setting is not None and setting.strip().lower() in _OFF:
        _enabled = None
        return None
    chosen = cache_dir or setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
    path = Path(chosen).expanduser() if chosen else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    atomic_cache_writes()
    _enabled = path
    return path


def atomic_cache_writes() -> None:
    """Makes JAX's file cache write each new entry to a temporary file in its folder and rename it into place, so a
    reader sees a whole entry or none (see the module docstring); idempotent. A cache with eviction on (JAX locks it)
    or on a remote filesystem keeps JAX's own write."""
    try:
        from jax._src import lru_cache
    except ImportError:  # another JAX layout: nothing to change
        return
    cache_class = getattr(lru_cache, "LRUCache", None)
    if cache_class is None or getattr(cache_class.put, "atomic", False):
        return
    original = cache_class.put
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", "-cache")

    def put(self, key: str, value: bytes) -> None:
        folder = str(self.path)
        if self.eviction_enabled or not key or "://" in folder:
            return original(self, key, value)
        target = os.path.join(folder, f"{key}{suffix}")
        if os.path.exists(target):
            return None
        handle, scratch = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".partial")
        try:
            with os.fdopen(handle, "wb") as stream:
                stream.write(value)
            os.replace(scratch, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch)
            raise
        return None

    put.atomic = True
    cache_class.put = put
