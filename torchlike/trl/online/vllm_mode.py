"""TRL's vLLM fields (``use_vllm``, ``vllm_mode``, ``vllm_server_*``) as the rollout engine an online trainer builds.

``use_vllm=False`` (TRL's default): the config's ``rollout_engine`` (the backend's default where it is ``None`` or the
config has none: ``adapters.rollout.default_engine``).
``use_vllm=True, vllm_mode="server"``: ``rollout_engine="vllm_server"``
(:mod:`torchlike.adapters.rollout.vllm_server`), which samples the policy through a vLLM server's OpenAI API at
``vllm_server_base_url`` (else ``http://{vllm_server_host}:{vllm_server_port}``) and loads its LoRA adapter into the
server after each optimizer step. ``use_vllm=True, vllm_mode="colocate"``: a warning (:data:`COLOCATE_WARNING`), and
torchlike's own engine samples on the training mesh, as colocate does.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ...type_aliases import TRLArgs

__all__ = ["COLOCATE_WARNING", "VLLM_MODES", "vllm_engine_settings"]

VLLM_MODES = ("server", "colocate")

COLOCATE_WARNING = (
    "use_vllm=True with vllm_mode='colocate': completions are sampled by torchlike's own JAX rollout engine "
    "(rollout_engine: by default the backend's, on the CPU 'paged', vLLM's paged KV cache and continuous batching; "
    "or 'static') on the training mesh, "
    "sharing the devices with training as colocate does. vLLM is a CUDA/PyTorch engine and cannot run inside a JAX "
    "process, and on a TPU host the Tunix vLLM sampler path is not wired into torchlike yet. To sample with a real "
    "vLLM, start a server and set vllm_mode='server'; to silence this, set use_vllm=False.")


def vllm_engine_settings(args: TRLArgs) -> dict[str, Any]:
    """The engine settings a config's vLLM fields give, laid over its ``rollout_*`` ones by the trainer.

    Returns:
        ``{"engine": "vllm_server", "vllm_server_base_url": url, "vllm_server_timeout": seconds}`` with
        ``use_vllm=True, vllm_mode="server"``; the server's address and timeout alone otherwise (read by
        ``rollout_engine="vllm_server"`` set directly); ``{}`` for a config without vLLM fields. Warns
        (:data:`COLOCATE_WARNING`) with ``use_vllm=True, vllm_mode="colocate"``.

    Raises:
        ValueError: ``vllm_mode`` is neither TRL mode, ``rollout_engine`` names another engine than the server
            mode's, or the server mode samples ahead (``max_staleness >= 1``) at a temperature other than 1 (the
            server's log-probs are before temperature).
    """
    names = {item.name for item in dataclasses.fields(args)}
    if "use_vllm" not in names:
        return {}
    settings: dict[str, Any] = {}
    if "vllm_server_base_url" in names:
        settings["vllm_server_base_url"] = (args.vllm_server_base_url
                                            or f"http://{args.vllm_server_host}:{args.vllm_server_port}")
        settings["vllm_server_timeout"] = args.vllm_server_timeout
    if not args.use_vllm:
        return settings
    mode = args.vllm_mode if "vllm_mode" in names else "colocate"
    if mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={mode!r}: expected one of {list(VLLM_MODES)}, as in TRL.")
    if mode == "colocate":
        warnings.warn(COLOCATE_WARNING, UserWarning, stacklevel=3)
        return settings
    chosen = args.rollout_engine if "rollout_engine" in names else None
    if chosen not in (None, "vllm_server"):
        raise ValueError(f"use_vllm=True with vllm_mode='server' samples through the vLLM server "
                         f"(rollout_engine='vllm_server'), but rollout_engine={chosen!r} names another engine. Leave "
                         "rollout_engine at its default, or set use_vllm=False to sample with it.")
    staleness = getattr(args, "max_staleness", 0)
    temperature = getattr(args, "temperature", 1.0)
    if staleness and temperature != 1.0:
        raise ValueError(f"use_vllm=True with vllm_mode='server', max_staleness={staleness} and temperature="
                         f"{temperature}: the sampler correction reads the server's log-probs, which vLLM gives before "
                         "temperature (its default logprobs_mode='raw_logprobs'), so they are not the log-probs the "
                         "tokens were drawn with. Use temperature=1.0 (TRL's default) or max_staleness=0.")
    return {**settings, "engine": "vllm_server"}
