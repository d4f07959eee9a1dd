"""``trainer.accelerator``: the ``accelerate.Accelerator`` attributes TRL scripts touch, answered for JAX processes."""

from __future__ import annotations

import jax

from ..adapters.distributed import mesh as mesh_lib

__all__ = ["Accelerator"]


class Accelerator:
    """The ``accelerate.Accelerator`` attributes TRL scripts touch (``trainer.accelerator``), for JAX processes."""

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def is_local_main_process(self) -> bool:
        return jax.process_index() == 0

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across JAX processes."""
        mesh_lib.barrier("torchlike.accelerator.wait_for_everyone")
