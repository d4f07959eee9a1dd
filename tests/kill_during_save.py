"""Child process for the crash tests: overwrite a checkpoint with ``torchlike.save`` and die with SIGKILL midway.

Usage: python tests/kill_during_save.py PATH STAGE

STAGE is one of ``orbax_store.SAVE_STAGES`` (the process kills itself when ``save`` reaches
it), ``orbax-finalize`` (killed inside Orbax's own save, after the array data is written and
before Orbax commits it) or ``none`` (the save runs to the end). The parent test may also kill
this process from outside at any moment. The states come from ``old_state``/``new_state`` so
that the parent can compare what ``load`` returns bit for bit.
"""

from __future__ import annotations

import os
import signal
import sys

import ml_dtypes
import numpy as np


def old_state() -> dict:
    return {
        "embed.w": np.arange(24, dtype=np.float32).reshape(6, 4),
        "layers.0.attn.q_proj.w": np.arange(8).astype(ml_dtypes.bfloat16),
        "opt": {"step": 1, "mu": {0: np.zeros(3, np.float32)}},
    }


def new_state(big: bool = False) -> dict:
    state = {
        "embed.w": -np.arange(24, dtype=np.float32).reshape(6, 4),
        "layers.0.attn.q_proj.w": (np.arange(8) * 2).astype(ml_dtypes.bfloat16),
        "opt": {"step": 2, "mu": {0: np.ones(3, np.float32), 1: np.full(3, 7, np.int32)}},
    }
    if big:
        # Large enough (16 MB of incompressible data) that Orbax takes a while to write it,
        # so an external kill lands inside the write.
        state["big"] = np.random.default_rng(0).standard_normal(4 * 1024 * 1024).astype(np.float32)
    return state


OLD_METADATA = {"which": "old"}
NEW_METADATA = {"which": "new"}


def _die(stage: str) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(path: str, stage: str, big: bool) -> None:
    import torchlike
    from torchlike.adapters.checkpoint import orbax_store

    if stage == "orbax-finalize":
        import orbax.checkpoint as ocp

        ocp.PyTreeCheckpointHandler.finalize = lambda self, directory: _die(stage)
    elif stage != "none":
        if stage not in orbax_store.SAVE_STAGES:
            raise SystemExit(f"unknown stage {stage!r}; expected one of {orbax_store.SAVE_STAGES}")
        orbax_store._crash_test_hook = lambda reached: _die(reached) if reached == stage else None
    print("saving", flush=True)  # the parent's external kill waits for this line
    torchlike.save(new_state(big), path, metadata=NEW_METADATA)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], big="--big" in sys.argv[3:])
