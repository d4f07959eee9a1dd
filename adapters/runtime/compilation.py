"""The persistent XLA compilation cache, on by default, so a second run of a script skips compilation.

Where: ``$TORCHLIKE_COMPILATION_CACHE`` if set (``0``/``off``/``false`` turns the cache off),
else a directory the user already gave JAX (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.jax_compilation_cache_dir``), else ``~/.cache/torchlike/<cache_folder_name()>`` (``$XDG_CACHE_HOME``
respected). torchlike's programs are small and many (one per weight shape when loading), so
every compilation is cached, not only those over JAX's default one-second threshold.
"""

from __future__ import annotations

import os
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
    _enabled = path
    return path
