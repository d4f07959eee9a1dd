"""Device meshes the Tunix models accept: axes ``fsdp`` x ``tp`` with Auto axis types.

``jax.make_mesh`` in jax 0.10 defaults to Explicit axes, which breaks the Tunix models'
embedding gather; Tunix's parameter specs name the axes ``fsdp`` and ``tp``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

AXIS_NAMES = ("fsdp", "tp")


def make_mesh(shape: Sequence[int] | None = None, axis_names: Sequence[str] = AXIS_NAMES) -> Mesh:
    """A mesh over all devices (default: every device on ``fsdp``, ``tp=1``).

    Args:
        shape: sizes per axis, e.g. ``(4, 2)``; their product must equal the device count.
        axis_names: axis names, ``("fsdp", "tp")`` by default.

    Returns:
        A ``jax.sharding.Mesh`` with Auto axis types.
    """
    devices = jax.devices()
    if shape is None:
        shape = (len(devices),) + (1,) * (len(axis_names) - 1)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but axis_names {tuple(axis_names)} has "
                         f"{len(axis_names)}.")
    count = 1
    for size in shape:
        count *= size
    if count != len(devices):
        raise ValueError(f"mesh shape {shape} needs {count} devices but {len(devices)} are available; "
                         f"pick sizes whose product is {len(devices)}.")
    return jax.make_mesh(shape, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))
