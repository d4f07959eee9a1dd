"""TRL's ``trl.trainer.utils`` helpers that a script may call, for torchlike models."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...modeling import CausalLM

__all__ = ["add_fused_lm_head", "disable_dropout_in_model", "ensure_master_addr_port"]


def disable_dropout_in_model(model: CausalLM) -> None:
    """TRL's ``disable_dropout_in_model``: no dropout when ``model`` trains.

    torchlike's model families have no dropout layers; the one dropout a torchlike model can have is its LoRA
    adapter's (``lora_dropout``), which trainers then leave out of the train step. The adapter's config (what
    ``save_pretrained`` writes) keeps its ``lora_dropout``, as a ``peft`` model's does after TRL's call.

    Args:
        model: a torchlike model (a ``CausalLM``, ``PeftModel`` or classifier).
    """
    model.dropout_disabled = True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ensure_master_addr_port(addr: str | None = None, port: int | None = None) -> None:
    """TRL's ``ensure_master_addr_port``: sets ``MASTER_ADDR`` (kept when set, else ``addr`` or ``localhost``) and
    ``MASTER_PORT`` (``port``, else the set one, else, when unset, ``"0"`` or ``"auto"``, a free port).

    torch's process groups read them; torchlike's JAX processes join through ``JAX_COORDINATOR_ADDRESS`` instead, so
    they matter only to torch code a script runs beside torchlike.

    Args:
        addr (`str`, *optional*): the address when ``MASTER_ADDR`` is unset.
        port (`int`, *optional*): the port (``0``: a free one).
    """
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or addr or "localhost"
    set_port = os.environ.get("MASTER_PORT", "").strip().lower()
    if port is None and set_port not in ("", "0", "auto"):
        try:
            port = int(set_port)
        except ValueError:
            port = None
    os.environ["MASTER_PORT"] = str(_free_port() if port in (None, 0) else port)


def add_fused_lm_head(model: object, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """TRL's ``add_fused_lm_head`` (a fused torch kernel for the output head's log-probs): refused.

    Raises:
        ValueError: always: torchlike's trainers compute the log-probs a block of positions at a time inside their
            jitted step (``torchlike.adapters.losses.logprobs``), with no kernel to patch in.
    """
    raise ValueError("add_fused_lm_head patches a torch model's lm_head with a fused log-prob kernel; torchlike's "
                     "trainers compute log-probs a block of positions at a time inside their jitted step already "
                     "(no [batch, length, vocab] float32 logits are kept). Leave the call out.")
