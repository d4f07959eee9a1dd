"""What the multi-process tests share: a free port for the ``jax.distributed`` coordinator and the ``XLA_FLAGS`` of a
child with simulated CPU devices."""

from __future__ import annotations

import os
import socket


def with_device_count(count: int) -> str:
    """This process's ``XLA_FLAGS`` (the suite's compile settings) plus ``count`` simulated CPU devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


def free_port() -> int:
    """A TCP port free on this host now (for a coordinator address)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
