"""The device mesh a Trainer runs on, and the model moved onto it."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from ..adapters.distributed import mesh as mesh_lib
from .model_interface import TrainableModel

__all__ = ["resolve_mesh"]


def resolve_mesh(args, model: TrainableModel | None) -> Mesh:
    """The mesh to train on: ``args.mesh_shape`` when set, else the model's own mesh, else every device on ``fsdp``.

    When the mesh is not the one the model lives on, the model's parameters are placed on it and ``model.mesh`` is
    updated. That happens even on one device: parameters, optimizer state and batches then share one sharding, so
    the step's outputs come back with its inputs' shardings and the program is traced once.

    Args:
        args: the trainer's :class:`~torchlike.TrainingArguments` (``mesh_shape``, ``mesh_axis_names``, ``use_cpu``).
        model: the trained model, or ``None``.
    """
    model_mesh = model.mesh if model is not None else None
    if args.mesh_shape is None and model_mesh is not None:
        return model_mesh
    devices = jax.devices("cpu") if args.use_cpu else None
    names = tuple(args.mesh_axis_names or mesh_lib.AXIS_NAMES)
    mesh = mesh_lib.make_mesh(args.mesh_shape, names, devices)
    same = model_mesh is not None and model_mesh.shape == mesh.shape and \
        list(model_mesh.devices.flat) == list(mesh.devices.flat)
    if model is not None and not same:
        mesh_lib.shard_module(model.module, mesh)
        model.mesh = mesh
    return mesh
