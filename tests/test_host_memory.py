"""torchlike keeps freed host buffers mapped on CPU-only JAX (adapters.runtime.host_memory), unless told not to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("host_memory_probe.py")


def probe(**env) -> dict:
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("MALLOC_") and key not in ("TORCHLIKE_HOST_MALLOC", "LD_PRELOAD")}
    environment.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **env})
    out = subprocess.run([sys.executable, str(PROBE)], env=environment, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_64mib_temporary_is_reused_instead_of_faulted_in_again():
    tuned, untuned = probe(), probe(TORCHLIKE_HOST_MALLOC="0")
    assert tuned["status"] == "applied"
    assert untuned["status"] == "turned off by TORCHLIKE_HOST_MALLOC"
    assert untuned["faults_per_call"] > 12000  # 64 MiB of fresh 4 KiB pages every call
    # Mostly reused (0-5,000 faults seen: which buffers a call frees before the next allocates varies).
    assert tuned["faults_per_call"] < untuned["faults_per_call"] / 2


def test_an_allocator_the_user_configured_is_left_alone():
    assert probe(MALLOC_ARENA_MAX="4")["status"] == "glibc malloc is configured by the environment"
    assert probe(JAX_PLATFORMS="cuda,cpu")["status"] == "JAX_PLATFORMS=cuda,cpu is not CPU first"
