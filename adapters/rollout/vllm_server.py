"""A rollout engine that samples through a vLLM server's OpenAI-compatible API, the policy's LoRA adapter loaded into
it at runtime after each optimizer step (``rollout_engine="vllm_server"``; TRL's ``use_vllm=True,
vllm_mode="server"``).

vLLM is a CUDA/PyTorch engine: it runs as its own process (on its own GPUs, or another host), started with::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve <the base model> --enable-lora --max-lora-rank <r>

What this engine sends, in vLLM's names (``vllm/entrypoints/openai/protocol.py``, ``CompletionRequest``; the runtime
adapter endpoints in ``docs/features/lora.md``, "Dynamically serving LoRA Adapters"):

- ``GET /health``: the server is up (polled until ``server_timeout``, as TRL's ``VLLMClient.check_server_health``).
- ``GET /v1/models``: the served base model's id (the entry without a ``parent``).
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}``: a folder in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``), which the
  server reads from its own file system: the folder (``adapter_dir``) must be one the server can read at the same
  path (the same host, or a shared mount).
- ``POST /v1/completions`` per request: ``prompt`` as token ids, ``n`` (the request's samples), ``max_tokens``,
  ``seed``, ``temperature`` (0: greedy), ``top_p``, ``top_k`` (-1: off), ``min_p``, ``repetition_penalty``,
  ``logprobs: 0`` (the sampled token's log-prob only), ``return_token_ids: true`` (each choice's ``token_ids``,
  vLLM >= 0.10.2), ``stop_token_ids`` (torchlike's end tokens), ``skip_special_tokens: false``; ``model`` is the
  adapter's name (the base model's with the adapter switched off).

Each weights version (the trainer's optimizer steps, :attr:`~.registry.EngineContext.weights_version`) becomes a new
adapter name, ``<engine id>-v<version>``, loaded before the round that samples it; the previous one is unloaded and
its folder removed. Only a LoRA adapter is synced: a fully fine-tuned policy would need its whole weights pushed
into the server (TRL's ``trl vllm-serve`` does that over NCCL), which vLLM's OpenAI API has no endpoint for, so the
engine refuses to be built without an adapter to save.

What comes back differs from the in-process engines in two ways. The log-probs are what vLLM's ``--logprobs-mode``
says: ``raw_logprobs`` (its default) is ``log_softmax(logits)`` before temperature, so it equals the protocol's
``log_softmax(logits / temperature)`` at temperature 1 (TRL's default) only; ``processed_logprobs`` is after
temperature but also after top-k/top-p filtering. The trainers read an engine's log-probs only for TRL's
importance-sampling correction (``max_staleness >= 1``). And vLLM draws its own random numbers: a request's ``seed``
makes its completions reproducible on one server, not equal to torchlike's streams.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..lora import runtime as lora_runtime
from .engine import RequestOutput, RolloutRequest
from .sampling_settings import SamplingSettings

__all__ = ["VLLMServerConfig", "VLLMServerEngine", "VLLMServerError"]

_HOW_TO_START = ("Start one with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve <model> --enable-lora "
                 "--max-lora-rank <r>` on a host that shares this file system, and set vllm_server_base_url (or "
                 "vllm_server_host and vllm_server_port) to it.")


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, or refused a request (the message says which and what to do)."""


@dataclass(frozen=True)
class VLLMServerConfig:
    """Where the server is and where adapters are written for it.

    Args:
        server_base_url: the server's address (TRL's ``vllm_server_base_url``), without ``/v1``.
        server_timeout: seconds to wait for ``/health`` when the engine is built (TRL's ``vllm_server_timeout``),
            and for each request.
        adapter_dir: the folder each weights version's adapter is written under; the server must read it at the same
            path. ``None``: a temporary folder, removed on :meth:`VLLMServerEngine.close`.
    """

    server_base_url: str = "http://0.0.0.0:8000"
    server_timeout: float = 240.0
    adapter_dir: str | None = None

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any], prefix: str = "vllm_") -> VLLMServerConfig:
        """The settings among ``settings``' keys named ``prefix + field`` (an engine context's settings), defaults
        for the rest."""
        return cls(**{item.name: settings[prefix + item.name] for item in fields(cls)
                      if settings.get(prefix + item.name) is not None})

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_base_url", self.server_base_url.rstrip("/").removesuffix("/v1"))
        if not self.server_timeout > 0:
            raise ValueError(f"VLLMServerConfig.server_timeout must be > 0 seconds, got {self.server_timeout!r}.")


def completion_body(request: RolloutRequest, settings: SamplingSettings, model: str,
                    eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """The ``/v1/completions`` body that samples ``request`` with ``settings`` from ``model`` (vLLM's names)."""
    greedy = not settings.do_sample
    return {
        "model": model,
        "prompt": list(request.prompt_ids),
        "n": request.num_samples,
        "max_tokens": request.max_new_tokens,
        "seed": request.seed,
        "temperature": 0.0 if greedy else settings.temperature,
        "top_p": 1.0 if greedy or settings.top_p is None else settings.top_p,
        "top_k": -1 if greedy or not settings.top_k else settings.top_k,
        "min_p": 0.0 if greedy or settings.min_p is None else settings.min_p,
        "repetition_penalty": settings.repetition_penalty or 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": [int(token) for token in eos_token_ids],
        "skip_special_tokens": False,
    }


class VLLMServerEngine:
    """The :class:`~.engine.RolloutEngine` protocol over a vLLM server (see the module docstring).

    Args:
        config: where the server is, its timeout, the adapters' folder.
        save_adapter: writes the policy's current LoRA adapter to a folder in PEFT's layout.
        weights_version: the version of the policy's weights (optimizer steps so far).
        eos_token_ids: the tokens that end a completion (sent as ``stop_token_ids``; a completion ended when its last
            token is one).

    Raises:
        ValueError: no ``save_adapter`` (the policy trains its full weights, which the server cannot take).
        VLLMServerError: the server did not answer ``/health`` within ``config.server_timeout``.
    """

    def __init__(self, config: VLLMServerConfig, save_adapter: Callable[[str], None] | None,
                 weights_version: Callable[[], int] | None, eos_token_ids: Sequence[int] = ()):
        if save_adapter is None:
            raise ValueError(
                "use_vllm=True with vllm_mode='server' (rollout_engine='vllm_server') syncs the policy into the vLLM "
                "server as a LoRA adapter after each optimizer step, and this policy has none (full fine-tuning, a "
                "prompt-learning adapter, or a model that is not the trained policy): vLLM's OpenAI API cannot take "
                "a whole model's new weights. Train a LoRA adapter (peft_config=LoraConfig(...)), or sample with "
                "torchlike's own engine (use_vllm=False, rollout_engine='static' or 'paged').")
        self.config = config
        self.save_adapter = save_adapter
        self.weights_version = weights_version or (lambda: 0)
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self.lora = lora_runtime.EVAL
        self._wait_until_healthy()
        self.base_model = self._served_base_model()
        self._own_dir = config.adapter_dir is None
        self.adapter_dir = Path(config.adapter_dir or tempfile.mkdtemp(prefix="torchlike-vllm-adapters-"))
        self._prefix = f"torchlike-{uuid.uuid4().hex[:8]}"
        self.adapter_name: str | None = None
        self.version: int | None = None

    # ------------------------------------------------------------------ HTTP
    def _call(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """The JSON (or text) answer to ``GET path`` (``body`` None) or ``POST path`` with a JSON ``body``."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.config.server_base_url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.config.server_timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as error:
            raise VLLMServerError(f"The vLLM server at {self.config.server_base_url} refused {path} with HTTP "
                                  f"{error.code}: {error.read().decode(errors='replace')[:500]}") from error
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.config.server_timeout
        while True:
            try:
                self._call("/health", timeout=min(5.0, self.config.server_timeout))
                return
            except (urllib.error.URLError, OSError) as error:
                if time.monotonic() >= deadline:
                    raise VLLMServerError(
                        f"No vLLM server answered at {self.config.server_base_url}/health within "
                        f"vllm_server_timeout={self.config.server_timeout} s ({error}). {_HOW_TO_START}") from error
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _served_base_model(self) -> str:
        models = self._call("/v1/models").get("data", [])
        base = [model["id"] for model in models if not model.get("parent")]
        if not base:
            raise VLLMServerError(f"The vLLM server at {self.config.server_base_url} lists no base model in "
                                  f"/v1/models ({models}).")
        return base[0]

    # ------------------------------------------------------------------ the protocol
    def update_weights(self, module: Any) -> None:  # Any: the protocol's module, not read (the adapter is saved)
        """Loads the policy's adapter into the server as ``<engine id>-v<version>`` when its weights version changed
        since the last load (the trainers hand the policy over before every round), then unloads the previous one."""
        version = int(self.weights_version())
        if version == self.version:
            return
        name = f"{self._prefix}-v{version}"
        folder = self.adapter_dir / name
        self.save_adapter(str(folder))
        self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self._drop_adapter()
        self.adapter_name, self.version = name, version

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[RequestOutput]:
        if any(request.images is not None for request in requests):
            raise ValueError("rollout_engine='vllm_server' (use_vllm=True, vllm_mode='server') sends token ids only; "
                             "prompts with images are not supported. Sample image prompts with torchlike's own "
                             "engine (use_vllm=False).")
        if any(request.penalised_ids for request in requests):
            raise ValueError("rollout_engine='vllm_server' cannot count ids outside the prompt in the repetition "
                             "penalty (RolloutRequest.penalised_ids); vLLM counts the prompt's own.")
        model = self.base_model if self.lora == lora_runtime.DISABLED or self.adapter_name is None \
            else self.adapter_name
        return [self._output(self._call("/v1/completions", completion_body(request, settings, model,
                                                                          self.eos_token_ids)))
                for request in requests]

    def _output(self, answer: dict[str, Any]) -> RequestOutput:
        output = RequestOutput()
        for choice in sorted(answer["choices"], key=lambda choice: choice["index"]):
            if choice.get("token_ids") is None:
                raise VLLMServerError(f"The vLLM server at {self.config.server_base_url} returned no token_ids: "
                                      "return_token_ids needs vLLM >= 0.10.2.")
            tokens = np.asarray(choice["token_ids"], np.int32)
            logprobs = np.asarray((choice.get("logprobs") or {}).get("token_logprobs") or [0.0] * len(tokens),
                                  np.float32)
            output.token_ids.append(tokens)
            output.logprobs.append(logprobs[:len(tokens)])
            output.ended.append(bool(len(tokens)) and int(tokens[-1]) in self.eos_token_ids)
        return output

    def _drop_adapter(self) -> None:
        if self.adapter_name is None:
            return
        self._call("/v1/unload_lora_adapter", {"lora_name": self.adapter_name})
        shutil.rmtree(self.adapter_dir / self.adapter_name, ignore_errors=True)

    def close(self) -> None:
        """Unloads the last adapter from the server and removes the adapters' temporary folder."""
        try:
            self._drop_adapter()
        except (VLLMServerError, urllib.error.URLError, OSError):
            pass  # the server went away first: nothing is left to unload
        self.adapter_name = self.version = None
        if self._own_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
