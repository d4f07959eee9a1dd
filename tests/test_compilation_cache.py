"""The persistent compilation cache is on by default, can be moved, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchlike.adapters.runtime import compilation

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import sys, jax, torchlike
from tests import tiny
model = torchlike.AutoModelForCausalLM.from_config(tiny.CASES["qwen2"]())
model([[1, 2, 3]]).logits.block_until_ready()
print(jax.config.jax_compilation_cache_dir)
"""


def _run(env_update: dict, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "TORCHLIKE_COMPILATION_CACHE")}
    env.update(env_update, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    completed = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout.strip().splitlines()[-1]


def test_cache_defaults_to_the_user_cache_dir_and_fills_up(tmp_path):
    folder = tmp_path / "xdg" / "torchlike" / compilation.cache_folder_name()
    assert _run({}, tmp_path) == str(folder)
    assert any(folder.iterdir())


def test_python_314_gets_a_cache_folder_of_its_own(monkeypatch):
    # 3.14's JAX writes zstd entries under the zlib label: a folder shared with an older Python would not read back.
    assert compilation.cache_folder_name() == ("jax" if sys.version_info < (3, 14) else "jax-py3.14")
    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    assert compilation.cache_folder_name() == "jax-py3.14"
    monkeypatch.setattr(sys, "version_info", (3, 13, 5, "final", 0))
    assert compilation.cache_folder_name() == "jax"


def test_environment_variable_moves_or_disables_the_cache(tmp_path):
    assert _run({"TORCHLIKE_COMPILATION_CACHE": str(tmp_path / "mine")}, tmp_path) == str(tmp_path / "mine")
    assert any((tmp_path / "mine").iterdir())
    assert _run({"TORCHLIKE_COMPILATION_CACHE": "0"}, tmp_path) == "None"
    assert not (tmp_path / "xdg" / "torchlike").exists()


def test_a_cache_entry_is_written_whole_to_a_temporary_file_then_renamed_into_place(tmp_path, monkeypatch):
    """JAX writes entries in place; another process could read half of one (a truncated executable crashes)."""
    from jax._src import lru_cache

    compilation.atomic_cache_writes()
    renamed = []
    rename = os.replace
    monkeypatch.setattr(os, "replace", lambda source, target: (renamed.append((source, target)),
                                                               rename(source, target)))
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("entry", b"x" * 1000)
    cache.put("entry", b"y")  # an existing entry is kept, as JAX keeps it
    assert cache.get("entry") == b"x" * 1000
    assert len(renamed) == 1 and Path(renamed[0][1]).name == "entry-cache" and Path(renamed[0][0]).parent == tmp_path
    assert sorted(path.name for path in tmp_path.iterdir()) == ["entry-cache"]  # no temporary file left


def test_the_suite_compiles_into_one_cache_folder_its_workers_and_their_children_share():
    """tests/conftest.py: the session's first process (xdist's controller) makes the folder, every worker and the
    processes they start (through the environment) compile into it, and only programs of 0.2 s or more are written."""
    import jax

    from tests import conftest

    if not conftest.COMPILATION_CACHE:
        assert os.environ["TORCHLIKE_COMPILATION_CACHE"] == "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ
        return
    folder = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_compilation_cache_dir == folder == os.environ["TORCHLIKE_COMPILATION_CACHE"]
    assert compilation.enable_compilation_cache() == Path(folder)  # what from_pretrained turns on agrees
    assert jax.config.jax_persistent_cache_min_compile_time_secs == conftest.MIN_CACHED_COMPILE_SECONDS
    if conftest.CACHE_MODE == "session":
        assert Path(folder).name.startswith("torchlike-test-xla-")
        owner = os.environ["TORCHLIKE_TEST_COMPILATION_CACHE_OWNER"]
        # Under xdist the controller made it (the workers share it); run alone, this process did.
        assert (owner != str(os.getpid())) == ("PYTEST_XDIST_WORKER" in os.environ)
