"""A pytest plugin (``tests/conftest.py`` loads it): a worker drops JAX's compiled programs at a file's end once its
memory mappings near the kernel's limit.

Why: each program XLA:CPU compiles keeps about three memory mappings for its code for as long as JAX's caches hold it
(``/proc/self/maps``: one ``r-xp``, one ``r--p`` and one ``rw-p`` anonymous mapping per object; 1,479 of each after
``tests/test_lora_step.py``'s 12 tests). A suite worker that runs hundreds of tests compiles thousands of programs, and
once its mappings reach ``vm.max_map_count`` (65,530 by default) XLA:CPU's next ``mmap`` for code fails and the
compiler segfaults in ``backend_compile_and_load`` instead of raising. That was the one worker crash of every cold run
of the suite (about 80% through, always in a compile, never when the test reran in a new worker); with the limit
lowered to 3,500, ``tests/test_lora_step.py`` alone dies the same way. ``jax.clear_caches()`` then a collection frees
the mappings (6,257 -> 1,840 after that file), so a worker past a third of the limit clears them when a file ends
(the next file recompiles what it uses, as it would in a new worker, without the restart).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default vm.max_map_count


def live_mappings() -> int:
    """The number of memory mappings of this process (lines of ``/proc/self/maps``; 0 where there is no procfs)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def mapping_limit() -> int:
    """The kernel's per-process mapping limit (``vm.max_map_count``)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def release_compiled_programs_if_many(threshold: int) -> bool:
    """Clears JAX's caches of compiled programs (and collects what held them) when this process has more than
    ``threshold`` memory mappings; returns whether it did."""
    if live_mappings() <= threshold:
        return False
    import jax

    jax.clear_caches()
    gc.collect()
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are torn down by now when ``nextitem`` is in another file
    if nextitem is None or nextitem.path != item.path:
        release_compiled_programs_if_many(mapping_limit() // 3)
