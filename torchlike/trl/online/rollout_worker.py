"""The rollout worker of an online trainer: where its completions are sampled.

A worker samples from one model: the policy (every online trainer has that worker), or a second model an algorithm
hands in as a worker of its own: XPO's reference, GKD's teacher (``seq_kd``), Nash-MD's policy-reference mixture. It
owns its rollout engine (built on first use; a second model keeps its own engine, as its KV cache differs), hands
the engine the model's weights before each round, and, for the policy, samples generation batches ahead
(``max_staleness``). The trainer passes a worker down its generation path (``_generate``, tools included) instead of
switching which model "the" engine samples.

Sampling ahead takes one of two paths. An engine with streams (the paged engine, ``rollout_engine="paged"``, in one
process) keeps one stream open (:meth:`~...adapters.rollout.paged.PagedEngine.open_stream`): each batch is submitted
to it, so the slots one batch's completions free take the next batch's (in-flight batching), and after each
optimizer step :meth:`RolloutWorker.weights_changed` hands it the new weights, applied between two decode calls; each
token is tagged with the step whose weights drew it (:meth:`RolloutWorker.sampled_versions`). Any other engine (the
static one, or several processes, which must issue JAX's collectives in one order) samples each batch ahead with a
second engine in a background thread, with a snapshot of the weights of the moment it was asked for.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from ...adapters import rollout
from ...adapters.distributed import multihost
from ...adapters.rollout.sampling import SamplingSettings

__all__ = ["RolloutWorker"]


class RolloutWorker:
    """Samples completions from one model with the trainer's sampling settings.

    Args:
        model: returns the NNX module (or decoder-like wrapper, e.g. ``GeometricMixture``) to sample from, read at
            each round, so the engine samples the current weights.
        build_engine: builds the rollout engine for a module (the trainer's ``rollout_engine`` setting).
        sampling: the sampling settings (temperature, top-p/k, ...).
        pad_token_id: the token after a row's end in the sampled arrays.
        lora: the LoRA mode the engine runs the module in (``None``: the engine's default, the adapter on);
            a reference that is the base model of the policy's new adapter samples with it off.
    """

    def __init__(self, model: Callable[[], Any], build_engine: Callable[[Any], rollout.RolloutEngine],
                 sampling: SamplingSettings, pad_token_id: int, *, lora: str | None = None):
        self.model = model
        self.sampling = sampling
        self.pad_token_id = pad_token_id
        self._build_engine = build_engine
        self._lora = lora
        # Shared with the views sampling_from() makes: one engine and one set of batches sampled ahead.
        self._shared = _EngineState()

    def sampling_from(self, module: Any) -> RolloutWorker:  # Any: an NNX module or a decoder-like wrapper
        """This worker (its engine) sampling from ``module`` (e.g. a mixture whose coefficient changes per epoch)."""
        view = copy.copy(self)
        view.model = lambda: module
        return view

    @property
    def engine(self) -> rollout.RolloutEngine:
        """The rollout engine (built on first use)."""
        if self._shared.engine is None:
            self._shared.engine = self._new_engine()
        return self._shared.engine

    def _new_engine(self) -> rollout.RolloutEngine:
        engine = self._build_engine(self.model())
        if self._lora is not None:
            engine.lora = self._lora
        return engine

    @staticmethod
    def key(prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int) -> tuple:
        """What finds a batch sampled ahead again: the prompts, the length and the seed."""
        return (int(seed), int(max_new_tokens), np.asarray(prompt_ids).tobytes(), np.asarray(prompt_mask).tobytes())

    def sample(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int,
               vision: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [N, steps], log-probs [N, steps])`` sampled after left-padded prompts (pad and log-prob 0 after
        a row's end token); the rows of one prompt in a row are one request's samples (one prefill). Prompts
        :meth:`sample_ahead` started are taken from there (sampled with the weights of that moment, or on a stream
        with the weights of each token's decode call: :meth:`sampled_versions`). ``vision``: the prompts'
        ``(images, token types)`` for image prompts."""
        ahead = self._shared.ahead.pop(self.key(prompt_ids, prompt_mask, max_new_tokens, seed), None)
        if ahead is not None:
            places, pending = ahead
            outputs = pending.result()
            versions = rollout.versions_from_outputs(outputs, places)
            if versions is not None:
                self._shared.versions[int(seed)] = versions
        else:
            requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed,
                                                          *(vision or ()))
            engine = self.engine
            engine.update_weights(self.model())
            outputs = engine.generate(requests, self.sampling)
        return rollout.rows_from_outputs(outputs, places, self.pad_token_id)

    def sample_ahead(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int,
                     vision: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Starts sampling these prompts (generation overlapped with training); the :meth:`sample` call with the same
        arguments takes the result. A paged engine submits them to its stream (opened with the model's current
        weights, then changed by :meth:`weights_changed`); another engine samples them in a background thread with a
        snapshot of the model's current weights. With several processes they are sampled at once, in this thread,
        with the same snapshot: every process must issue JAX's cross-process collectives in the same order, which a
        second thread would not (only the overlap is lost)."""
        state = self._shared
        requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed,
                                                      *(vision or ()))
        key = self.key(prompt_ids, prompt_mask, max_new_tokens, seed)
        if isinstance(self.engine, rollout.PagedEngine) and multihost.process_count() == 1:
            if state.stream is None:
                self.engine.update_weights(rollout.weights_snapshot(self.model()))
                state.stream = self.engine.open_stream(self.sampling, state.version)
            state.ahead[key] = (places, state.stream.submit(requests))
            return
        if state.background_engine is None:
            state.background_engine = self._new_engine()
            state.background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchlike-rollout")
        state.background_engine.update_weights(rollout.weights_snapshot(self.model()))
        if multihost.process_count() > 1:
            pending: concurrent.futures.Future = concurrent.futures.Future()
            pending.set_result(state.background_engine.generate(requests, self.sampling))
        else:
            pending = state.background.submit(state.background_engine.generate, requests, self.sampling)
        state.ahead[key] = (places, pending)

    def weights_changed(self, version: int) -> None:
        """The model's weights are now those after optimizer step ``version``: an open stream samples with a
        snapshot of them from its next decode call on, its tokens tagged ``version``."""
        state = self._shared
        state.version = int(version)
        if state.stream is not None:
            state.stream.update_weights(rollout.weights_snapshot(self.model()), state.version)

    @property
    def weights_version(self) -> int:
        """The version :meth:`weights_changed` last gave (0 before it is called)."""
        return self._shared.version

    def sampled_versions(self, seed: int) -> np.ndarray | None:
        """``[N, steps]`` the optimizer step whose weights drew each token of the batch :meth:`sample` took from a
        stream with ``seed`` (``-1`` past a row's end), once; ``None`` for a batch sampled otherwise."""
        return self._shared.versions.pop(int(seed), None)

    def drop_samples_ahead(self) -> None:
        """Waits for the batches sampled ahead that no step will use (training stopped), drops them and closes
        the stream."""
        state = self._shared
        for _, pending in state.ahead.values():
            pending.result()
        state.ahead.clear()
        state.versions.clear()
        if state.stream is not None:
            state.stream.close()
            state.stream = None


class _EngineState:
    """A worker's engine, its stream or background engine and thread, the batches sampled ahead and the weights
    version of the model."""

    def __init__(self):
        self.engine: rollout.RolloutEngine | None = None
        self.stream: rollout.RolloutStream | None = None
        self.version = 0  # the optimizer step of the model's current weights
        self.versions: dict[int, np.ndarray] = {}  # per seed: the versions of a batch taken from the stream
        self.background_engine: rollout.RolloutEngine | None = None
        self.background: concurrent.futures.ThreadPoolExecutor | None = None
        self.ahead: dict[tuple, tuple[list, concurrent.futures.Future | rollout.StreamTicket]] = {}
