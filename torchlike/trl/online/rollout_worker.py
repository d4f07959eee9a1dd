"""The rollout worker of an online trainer: where its completions are sampled.

A worker samples from one model: the policy (every online trainer has that worker), or a second model an algorithm
hands in as a worker of its own: XPO's reference, GKD's teacher (``seq_kd``), Nash-MD's policy-reference mixture. It
owns its rollout engine (built on first use; a second model keeps its own engine, as its KV cache differs), hands
the engine the model's weights before each round, and, for the policy, samples generation batches ahead in a
background thread (``max_staleness``). The trainer passes a worker down its generation path (``_generate``, tools
included) instead of switching which model "the" engine samples.
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
        :meth:`sample_ahead` started are taken from there (sampled with the weights of that moment). ``vision``:
        the prompts' ``(images, token types)`` for image prompts."""
        ahead = self._shared.ahead.pop(self.key(prompt_ids, prompt_mask, max_new_tokens, seed), None)
        if ahead is not None:
            places, pending = ahead
            outputs = pending.result()
        else:
            requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed,
                                                          *(vision or ()))
            engine = self.engine
            engine.update_weights(self.model())
            outputs = engine.generate(requests, self.sampling)
        return rollout.rows_from_outputs(outputs, places, self.pad_token_id)

    def sample_ahead(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int, seed: int,
                     vision: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Starts sampling these prompts in a background thread with a snapshot of the model's current weights
        (generation overlapped with training); the :meth:`sample` call with the same arguments takes the result.
        With several processes they are sampled at once, in this thread, with the same snapshot: every process must
        issue JAX's cross-process collectives in the same order, which a second thread would not (only the overlap
        is lost)."""
        state = self._shared
        if state.background_engine is None:
            state.background_engine = self._new_engine()
            state.background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchlike-rollout")
        requests, places = rollout.requests_from_rows(prompt_ids, prompt_mask, max_new_tokens, seed,
                                                      *(vision or ()))
        state.background_engine.update_weights(rollout.weights_snapshot(self.model()))
        if multihost.process_count() > 1:
            pending: concurrent.futures.Future = concurrent.futures.Future()
            pending.set_result(state.background_engine.generate(requests, self.sampling))
        else:
            pending = state.background.submit(state.background_engine.generate, requests, self.sampling)
        state.ahead[self.key(prompt_ids, prompt_mask, max_new_tokens, seed)] = (places, pending)

    def drop_samples_ahead(self) -> None:
        """Waits for the batches sampled ahead that no step will use (training stopped) and drops them."""
        for _, pending in self._shared.ahead.values():
            pending.result()
        self._shared.ahead.clear()


class _EngineState:
    """A worker's engine, its background engine and thread, and the batches sampled ahead."""

    def __init__(self):
        self.engine: rollout.RolloutEngine | None = None
        self.background_engine: rollout.RolloutEngine | None = None
        self.background: concurrent.futures.ThreadPoolExecutor | None = None
        self.ahead: dict[tuple, tuple[list, concurrent.futures.Future]] = {}
