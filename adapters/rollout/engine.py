"""The rollout engine boundary: what an online trainer or ``generate`` asks of a generation engine, and the records
it gets back.

A :class:`RolloutEngine` takes :class:`RolloutRequest` values (a prompt's token ids, how many completions to
sample from it, the new-token limit and the request's seed) with one :class:`SamplingSettings`, and returns one
:class:`RequestOutput` per request: each completion's tokens, their log-probs under the sampling temperature and
whether it ended on an end token. It takes the policy's new weights after an optimizer step
(:meth:`RolloutEngine.update_weights`) and releases what it holds on :meth:`RolloutEngine.close`.

Every request carries its own PRNG stream: completion ``i`` of a request with seed ``s`` draws token ``t`` with
``fold_in(fold_in(key(s), i), t)``, so a completion's tokens do not depend on which other requests share the call,
their order, or how an engine batches them.

Two engines implement the protocol: :class:`~.paged.PagedEngine` (paged KV cache, continuous batching, shared
prompts: the default) and :class:`StaticEngine` (one left-padded batch decoded to the longest row, the sampler
``generate`` has always used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
from flax import nnx

from ..sampling_settings import SamplingSettings


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to complete.

    Args:
        prompt_ids: the prompt's token ids (no padding), at least one.
        max_new_tokens: the most tokens each completion may have (``>= 1``).
        num_samples: how many completions to sample from this prompt (TRL's ``num_generations``); they share the
            prompt's prefill.
        seed: the request's PRNG seed (its completions' streams derive from it).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    num_samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(token) for token in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError("RolloutRequest.prompt_ids is empty: a prompt needs at least one token (e.g. BOS).")
        if self.max_new_tokens < 1:
            raise ValueError(f"RolloutRequest.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.num_samples < 1:
            raise ValueError(f"RolloutRequest.num_samples must be >= 1, got {self.num_samples}.")


@dataclass
class RequestOutput:
    """The completions of one :class:`RolloutRequest`, in sample order.

    Attributes:
        token_ids: one int32 array per completion: its tokens, the end token included when it ended on one.
        logprobs: one float32 array per completion: ``log_softmax(logits / temperature)`` of each token (the raw
            model distribution at the sampling temperature, what TRL's GRPO recomputes).
        ended: one bool per completion: it stopped on an end token (not on ``max_new_tokens``).
    """

    token_ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)


@runtime_checkable
class RolloutEngine(Protocol):
    """What torchlike asks of a generation engine (see the module docstring)."""

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[RequestOutput]:
        """Completes every request; returns one :class:`RequestOutput` per request, in order."""
        ...

    def update_weights(self, module: nnx.Module) -> None:
        """Samples from ``module``'s current parameters from the next call on (after an optimizer step)."""
        ...

    def close(self) -> None:
        """Releases the engine's device memory (KV pages, compiled programs it owns)."""
        ...


def sample_key_data(seed: int, sample: int) -> tuple[int, int]:
    """``(seed, sample)`` as the two uint32 words an engine folds into ``key(seed)`` to get a completion's stream."""
    return int(seed) % (2**32), int(sample)


def split_at_end(tokens: np.ndarray, logprobs: np.ndarray, end_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray,
                                                                                                 bool]:
    """A decoded row cut after its first end token: ``(tokens, logprobs, ended)``."""
    hits = np.flatnonzero(np.isin(tokens, np.asarray(list(end_ids), np.int64)))
    if hits.size:
        stop = int(hits[0]) + 1
        return tokens[:stop].astype(np.int32), logprobs[:stop].astype(np.float32), True
    return tokens.astype(np.int32), logprobs.astype(np.float32), False


__all__ = ["RequestOutput", "RolloutEngine", "RolloutRequest", "sample_key_data", "split_at_end"]
