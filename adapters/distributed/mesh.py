"""Device meshes the Tunix models accept: axes ``fsdp`` x ``tp`` with Auto axis types.

``jax.make_mesh`` defaults to Explicit axes, which break the Tunix models' embedding gather
(``adapters.upstream``); Tunix's parameter specs name the axes ``fsdp`` and ``tp``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .multihost import gather_to_host

AXIS_NAMES = ("fsdp", "tp")


def make_mesh(shape: Sequence[int] | None = None, axis_names: Sequence[str] = AXIS_NAMES,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all devices of all processes (default: every device on ``fsdp``, ``tp=1``).

    Args:
        shape: sizes per axis, e.g. ``(4, 2)``; their product must equal the device count.
        axis_names: axis names, ``("fsdp", "tp")`` by default.
        devices: the devices to use (default ``jax.devices()``, after starting the distributed
            runtime when the process was launched as one of several: :func:`initialize_distributed`).

    Returns:
        A ``jax.sharding.Mesh`` with Auto axis types.
    """
    initialize_distributed()
    devices = list(devices) if devices is not None else jax.devices()
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
    return jax.make_mesh(shape, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape), devices=devices)


# ---------------------------------------------------------------- several processes

def initialize_distributed() -> bool:
    """Starts JAX's distributed runtime when this process was launched as one of several.

    Launch settings, in this order:

    - ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0) with ``JAX_NUM_PROCESSES`` and
      ``JAX_PROCESS_ID``: a job started by hand or by any launcher (CPU hosts use gloo collectives);
    - ``TORCHLIKE_DISTRIBUTED=1``: let JAX detect the cluster itself (TPU pod slices, SLURM, Open MPI).

    Idempotent; must run before JAX touches a device (``jax.devices()``, any array), which is why
    ``TrainingArguments``, ``from_pretrained`` and ``make_mesh`` call it first.

    Returns:
        ``True`` when the runtime is (now) initialised, ``False`` for a single-process run.

    Raises:
        RuntimeError: the settings ask for several processes but JAX already started on one.
    """
    import os

    from jax._src import distributed, xla_bridge

    if distributed.global_state.client is not None:
        return True
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    auto = os.environ.get("TORCHLIKE_DISTRIBUTED", "").strip().lower() in {"1", "true", "yes", "on"}
    if not address and not auto:
        return False
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "JAX_COORDINATOR_ADDRESS / TORCHLIKE_DISTRIBUTED ask for a multi-process run, but JAX already started "
            "on this process alone. Create TrainingArguments (or call torchlike.make_mesh) before any other JAX "
            "work in the script.")
    kwargs = {}
    if address:
        missing = [name for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if name not in os.environ]
        if missing:
            raise RuntimeError(f"JAX_COORDINATOR_ADDRESS={address!r} is set but {' and '.join(missing)} "
                               "is not; set both (process count, and this process's index from 0).")
        kwargs = {"coordinator_address": address, "num_processes": int(os.environ["JAX_NUM_PROCESSES"]),
                  "process_id": int(os.environ["JAX_PROCESS_ID"])}
    from .peer_watch import peer_timeout

    # JAX's coordination service aborts a process whose peer misses heartbeats; torchlike's PeerWatch names the
    # silent process first, so the service waits a minute longer.
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=max(100, int(peer_timeout()) + 60))
    return True


# ---------------------------------------------------------------- data parallelism

TENSOR_PARALLEL_AXIS = "tp"
"""The axis attention heads and MLP columns are split over (Tunix's parameter specs name it ``tp``)."""

MODEL_PARALLEL_AXES = (TENSOR_PARALLEL_AXIS,)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a batch is split over: every mesh axis but the tensor-parallel ``tp``."""
    return tuple(name for name in mesh.axis_names if name not in MODEL_PARALLEL_AXES)


def tensor_parallel_size(mesh: Mesh) -> int:
    """The size of the mesh's tensor-parallel axis ``tp`` (1 when the mesh has none)."""
    return int(dict(mesh.shape).get(TENSOR_PARALLEL_AXIS, 1))


def data_parallel_size(mesh: Mesh) -> int:
    """How many batch shards the mesh holds (the product of :func:`data_axes` sizes, over all processes)."""
    size = 1
    for name in data_axes(mesh):
        size *= mesh.shape[name]
    return size


def batch_sharding(mesh: Mesh, batch_axis: int = 0) -> NamedSharding:
    """Rows (axis ``batch_axis``) split over the data axes, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), data_axes(mesh)))


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """:func:`batch_sharding` for a batch of ``rows`` rows when they split evenly over the data axes, else every row on
    every device (a short last evaluation batch)."""
    return batch_sharding(mesh) if rows % data_parallel_size(mesh) == 0 else NamedSharding(mesh, PartitionSpec())


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...], batch_axis: int = 0) -> slice:
    """The contiguous rows of a global batch that this process's devices hold (all rows on one process)."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    starts, stops = [], []
    for index in index_map.values():
        rows = index[batch_axis]
        starts.append(rows.start or 0)
        stops.append(global_shape[batch_axis] if rows.stop is None else rows.stop)
    covered = slice(min(starts), max(stops))
    if sum(stop - start for start, stop in set(zip(starts, stops, strict=True))) != covered.stop - covered.start:
        raise ValueError(f"this process's devices hold non-contiguous batch rows of the mesh {sharding.mesh.shape}; "
                         "order mesh devices by process (the default of make_mesh).")
    return covered


def place_batch(local: dict[str, np.ndarray], sharding: NamedSharding, global_rows: int,
                batch_axis: int = 0) -> dict[str, jax.Array]:
    """Puts this process's rows of a batch on the mesh as global arrays of ``global_rows`` rows.

    Args:
        local: arrays holding the rows :func:`local_rows` names (every row with one process).
        sharding: from :func:`batch_sharding`.
        global_rows: the batch size across all processes.
    """
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    def placed(value):
        shape = list(value.shape)
        shape[batch_axis] = global_rows
        return jax.make_array_from_process_local_data(sharding, value, tuple(shape))

    return jax.tree.map(placed, local)  # a column may be a dict of arrays (a vision-language model's images)


def barrier(name: str) -> None:
    """Waits until every JAX process reaches the barrier ``name`` (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(tree):
    """Host (numpy) copies of a tree of arrays; values sharded over several processes' devices are gathered, so
    every process must call this with the same tree (:func:`multihost.gather_to_host`)."""
    return jax.tree.map(gather_to_host, tree)


def shard_module(module, mesh: Mesh) -> None:
    """Moves every variable of an NNX ``module`` onto ``mesh`` in place, following its partition
    metadata (Tunix's ``fsdp``/``tp`` specs; replicated where a variable has none)."""
    from flax import nnx

    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)

    def target(spec):
        spec = spec.get_value() if isinstance(spec, nnx.Variable) else spec
        names = set(mesh.axis_names)
        if not isinstance(spec, PartitionSpec) or any(
                axis is not None and not set((axis,) if isinstance(axis, str) else axis) <= names for axis in spec):
            spec = PartitionSpec()
        return NamedSharding(mesh, spec)

    shardings = jax.tree.map(target, specs, is_leaf=lambda x: isinstance(x, (PartitionSpec, nnx.Variable)))
    # The shardings tree ends where each variable begins; a variable's leaves share its sharding.
    placed = jax.tree.map(lambda sharding, variable: jax.tree.map(lambda value: place_array(value, sharding), variable),
                          shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))
    nnx.update(module, placed)


def place_array(value, sharding: NamedSharding) -> jax.Array:
    """``value`` placed with ``sharding``, also when the sharding spans other processes' devices.

    ``jax.device_put`` only reaches this process's devices. A value held whole by each process (a model every
    process loaded from the same checkpoint, or initialised from the same seed, as a launcher runs one script per
    host) is assembled into the global array from this process's copy: each process fills its own shards.
    """
    if sharding.is_fully_addressable or not getattr(value, "is_fully_addressable", True):
        return jax.device_put(value, sharding)
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # e.g. a dropout stream's key: place its data
        return jax.random.wrap_key_data(place_array(jax.random.key_data(value), sharding),
                                        impl=jax.random.key_impl(value))
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@contextlib.contextmanager
def entered(mesh: Mesh):
    """Enters ``mesh`` the way Tunix's models read it (``pxla.thread_resources``, the ``with mesh:``
    context JAX deprecates; ``jax.set_mesh`` does not set it), without the deprecation warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*with mesh:.*", category=DeprecationWarning)
        mesh.__enter__()
    try:
        yield mesh
    finally:
        mesh.__exit__(None, None, None)
