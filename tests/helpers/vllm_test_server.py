"""A local stand-in for a vLLM server: the subset of vLLM's OpenAI-compatible API that
``torchlike.adapters.rollout.vllm_server`` speaks, generating with ``transformers`` (eager attention) and loading PEFT
adapters with ``peft``, on 127.0.0.1 in a thread. It records every request it gets.

- ``GET /health``, ``GET /v1/models`` (the base model, then each loaded adapter with its ``parent``).
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``lora_name``, ``lora_path``).
- ``POST /v1/completions`` with a token-id ``prompt``: ``n`` completions, one token at a time (a full forward per
  token: the prompts are tiny), greedy when ``temperature == 0`` or ``top_k == 1``, else sampled from
  ``softmax(logits / temperature)`` after top-k/top-p with a ``torch.Generator`` seeded by ``seed``; stops on
  ``stop_token_ids`` or the model's end tokens (the end token kept, as vLLM's ``token_ids``). Each choice carries its
  ``token_ids`` and ``logprobs.token_logprobs``: ``log_softmax(logits)`` of each token, vLLM's default
  ``raw_logprobs``.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import peft
import torch
import transformers


class VLLMTestServer:
    """The server over one checkpoint; ``with VLLMTestServer(path) as server:`` serves at ``server.url``.

    Attributes:
        requests: ``(path, body)`` of every request, in order (``body`` None for a GET).
        answers: ``/v1/completions`` answers, in order.
        adapters: the loaded adapters by name.
    """

    def __init__(self, checkpoint: str | Path, model_name: str = "tiny-base"):
        self.model_name = model_name
        self.base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                                      torch_dtype=torch.float32).eval()
        eos = self.base.generation_config.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.adapters: dict[str, peft.PeftModel] = {}
        self.requests: list[tuple[str, dict | None]] = []
        self.answers: list[dict] = []
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> VLLMTestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def completions(self, path: str) -> list[dict]:
        """The ``/v1/completions`` request bodies, in order."""
        return [body for called, body in self.requests if called == path]

    # ------------------------------------------------------------------ endpoints
    def handle(self, path: str, body: dict | None) -> tuple[int, Any]:
        with self._lock:
            self.requests.append((path, body))
            if path == "/health":
                return 200, ""
            if path == "/v1/models":
                models = [{"id": self.model_name, "parent": None}]
                return 200, {"data": models + [{"id": name, "parent": self.model_name} for name in self.adapters]}
            if path == "/v1/load_lora_adapter":
                model = peft.PeftModel.from_pretrained(copy.deepcopy(self.base), body["lora_path"]).eval()
                self.adapters[body["lora_name"]] = model
                return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
            if path == "/v1/unload_lora_adapter":
                if self.adapters.pop(body["lora_name"], None) is None:
                    return 404, {"error": f"The lora adapter '{body['lora_name']}' cannot be found."}
                return 200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
            if path == "/v1/completions":
                answer = self._complete(body)
                self.answers.append(answer)
                return 200, answer
            return 404, {"error": f"no route {path}"}

    def _complete(self, body: dict) -> dict:
        model = self.base if body["model"] == self.model_name else self.adapters[body["model"]]
        stops = set(body.get("stop_token_ids") or []) | set(self.eos_token_ids)
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0))
        choices = []
        for index in range(body.get("n", 1)):
            ids, logprobs = list(body["prompt"]), []
            for _ in range(body["max_tokens"]):
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1].double()
                token = self._choose(logits, body, generator)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                ids.append(token)
                if token in stops:
                    break
            tokens = ids[len(body["prompt"]):]
            choices.append({"index": index, "text": "", "token_ids": tokens,
                            "logprobs": {"token_logprobs": logprobs},
                            "finish_reason": "stop" if tokens[-1] in stops else "length"})
        return {"object": "text_completion", "model": body["model"], "choices": choices}

    @staticmethod
    def _choose(logits: torch.Tensor, body: dict, generator: torch.Generator) -> int:
        temperature, top_k = body.get("temperature", 1.0), body.get("top_k", -1)
        if temperature == 0 or top_k == 1:
            return int(logits.argmax())
        scores = logits / temperature
        if top_k and top_k > 0:
            scores[scores < torch.topk(scores, top_k).values[-1]] = -torch.inf
        probs = torch.softmax(scores, -1)
        top_p = body.get("top_p", 1.0)
        if top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            drop = ordered.cumsum(-1) - ordered > top_p
            probs[order[drop]] = 0.0
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def _handler(server: VLLMTestServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict | None) -> None:
            status, payload = server.handle(self.path, body)
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(None)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            self._answer(json.loads(self.rfile.read(length)))

        def log_message(self, *args: object) -> None:
            """Quiet: the tests read ``server.requests``."""

    return Handler
