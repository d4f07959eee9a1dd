"""A suite worker drops JAX's compiled programs when its memory mappings near the kernel's limit
(tests/helpers/memory_maps.py), instead of XLA:CPU segfaulting in its compiler once they reach it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import memory_maps

FIRST_FILE = """
import jax
import jax.numpy as jnp

import probe_state


def test_compiles_a_program():
    probe_state.program = jax.jit(lambda x: x * 3)
    probe_state.program(jnp.ones(3))
    assert probe_state.program._cache_size() == 1
"""

SECOND_FILE = """
import probe_state


def test_sees_whether_the_program_was_dropped():
    assert probe_state.program._cache_size() == probe_state.EXPECTED
"""


def test_compiled_programs_hold_mappings_that_clearing_jaxs_caches_frees():
    before = memory_maps.live_mappings()
    programs = [jax.jit(lambda x, k=k: jnp.sin(x) * k + k) for k in range(40)]
    for program in programs:
        program(jnp.ones(4)).block_until_ready()
    grown = memory_maps.live_mappings()
    assert grown - before >= 40  # at least one mapping a program (about three on XLA:CPU)
    assert not memory_maps.release_compiled_programs_if_many(threshold=grown + 1000)
    assert all(program._cache_size() == 1 for program in programs)
    assert memory_maps.release_compiled_programs_if_many(threshold=before)
    assert all(program._cache_size() == 0 for program in programs)
    assert memory_maps.live_mappings() - before < (grown - before) / 2


def test_the_kernels_limit_is_read():
    assert memory_maps.mapping_limit() >= 1000


@pytest.mark.parametrize(("limit", "expected"), [(3, 0), (10**9, 1)], ids=["near the limit", "far from it"])
def test_a_file_ends_with_the_programs_dropped_only_near_the_limit(pytester, monkeypatch, limit, expected):
    pytester.makepyfile(test_a_first=FIRST_FILE, test_b_second=SECOND_FILE,
                        probe_state=f"program = None\nEXPECTED = {expected}\n")
    monkeypatch.setattr(memory_maps, "mapping_limit", lambda: limit)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.memory_maps", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
