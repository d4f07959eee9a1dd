"""The rollout engine boundary: what an online trainer or ``generate`` asks of a generation engine, and the records
it gets back.

A :class:`RolloutEngine` takes :class:`RolloutRequest` values (a prompt's token ids, how many completions to
sample from it, the new-token limit and the request's seed) with one :class:`SamplingSettings`, and returns one
:class:`RequestOutput` per request: each completion's tokens, their log-probs under the sampling temperature and
whether it ended on an end token. It takes the policy's new weights after an optimizer step
(:meth:`RolloutEngine.update_weights`) and releases what it holds on :meth:`RolloutEngine.close`.

Every request carries its own PRNG stream: completion ``i`` of a request with seed ``s`` draws token ``t`` with
``fold_in(fold_in(key(s), first_sample + i), t)``, so a completion's tokens do not depend on which other requests
share the call, their order, or how an engine batches them.

Two engines implement the protocol: :class:`StaticEngine` (one left-padded batch decoded to its longest row in one
program: the trainers' default, the fewest programs to compile) and :class:`~.paged.PagedEngine` (paged KV cache,
continuous batching, shared prompts: a fraction of the KV memory, and faster when completion lengths are long-tailed,
as ``benchmarks/rollout.py`` measures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx

from .images import row_of, same_images, stack_rows
from .sampling_settings import SamplingSettings


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to complete.

    Args:
        prompt_ids: the prompt's token ids (no padding), at least one.
        max_new_tokens: the most tokens each completion may have (``>= 1``).
        num_samples: how many completions to sample from this prompt (TRL's ``num_generations``); they share the
            prompt's prefill.
        seed: the request's PRNG seed (its completions' streams derive from it).
        first_sample: the stream index of the first completion: completion ``j`` draws from stream
            ``(seed, first_sample + j)`` (``generate`` numbers the rows of its batch so: row ``i`` draws ``(seed, i)``).
        penalised_ids: ids the repetition penalty counts as seen besides the prompt's own (``generate`` passes a
            row's left padding where the installed ``transformers`` counts it); the model never sees them.
        images: the prompt's images as the model takes them (a model with a vision tower, ``Family.images``' value
            for this row): Gemma 3's ``[N, H, W, C]`` in the order of its image tokens, or a dict of arrays (Qwen-VL's
            patches and positions, zeros as padding; its ``rope_deltas`` is what the positions of the tokens after
            the prompt add); ``None``: a text prompt.
        token_type_ids: the prompt's token types (1 on image tokens), with ``images`` of a model whose image tokens
            see each other both ways (Gemma 3); empty otherwise.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    num_samples: int = 1
    seed: int = 0
    first_sample: int = 0
    penalised_ids: tuple[int, ...] = ()
    images: np.ndarray | None = field(default=None, compare=False, repr=False)
    token_type_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(token) for token in self.prompt_ids))
        object.__setattr__(self, "penalised_ids", tuple(int(token) for token in self.penalised_ids))
        if not self.prompt_ids:
            raise ValueError("RolloutRequest.prompt_ids is empty: a prompt needs at least one token (e.g. BOS).")
        if self.max_new_tokens < 1:
            raise ValueError(f"RolloutRequest.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.num_samples < 1:
            raise ValueError(f"RolloutRequest.num_samples must be >= 1, got {self.num_samples}.")
        if self.first_sample < 0:
            raise ValueError(f"RolloutRequest.first_sample must be >= 0, got {self.first_sample}.")
        object.__setattr__(self, "token_type_ids", tuple(int(kind) for kind in self.token_type_ids))
        if self.token_type_ids and len(self.token_type_ids) != len(self.prompt_ids):
            raise ValueError(f"RolloutRequest.token_type_ids must have one type per prompt token "
                             f"({len(self.prompt_ids)}), got {len(self.token_type_ids)}.")
        if self.token_type_ids and self.images is None:
            raise ValueError("RolloutRequest.token_type_ids were given without images.")

    @property
    def rope_delta(self) -> int:
        """What the positions after the prompt add (a multimodal rope's ``rope_deltas``; 0 for text)."""
        if isinstance(self.images, dict) and "rope_deltas" in self.images:
            return int(self.images["rope_deltas"])
        return 0


@dataclass
class RequestOutput:
    """The completions of one :class:`RolloutRequest`, in sample order.

    Attributes:
        token_ids: one int32 array per completion: its tokens, the end token included when it ended on one.
        logprobs: one float32 array per completion: ``log_softmax(logits / temperature)`` of each token (the raw
            model distribution at the sampling temperature, what TRL's GRPO recomputes).
        ended: one bool per completion: it stopped on an end token (not on ``max_new_tokens``).
        versions: one int32 array per completion, beside its tokens: the weights version that drew each token (a
            paged engine's stream, whose weights change between decode calls: the version given with
            ``update_weights``); empty where the engine does not tag them (one call, one set of weights).
    """

    token_ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)


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


class StaticEngine:
    """The static batch as a :class:`RolloutEngine`: every completion of the call is one row of a left-padded batch
    that :func:`~..sampling.generate_tokens` decodes until its longest row ends (each row's own stream, so its
    tokens equal :class:`~.paged.PagedEngine`'s for the same request).

    Args:
        module: the Tunix decoder; eos_token_ids, pad_token_id, lora: as :class:`~.paged.PagedEngine` takes them.
        batch_sharding: spreads the rows over the mesh's data axes when their count divides evenly.
        repetition_penalty_skips_left_padding: ``True`` (the paged engine's rule): the penalty counts each prompt's
            own ids (and its request's ``penalised_ids``); ``False``: also the batch's left padding, as
            ``transformers.generate`` before 5.23 counts it (:func:`~..sampling.generate_tokens`).
    """

    def __init__(self, module: nnx.Module, eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                 lora: str = "eval", batch_sharding=None, data_parallel_size: int = 1,
                 repetition_penalty_skips_left_padding: bool = True):
        self.module = module
        self.repetition_penalty_skips_left_padding = repetition_penalty_skips_left_padding
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.lora = lora
        self.batch_sharding = batch_sharding
        self.data_parallel_size = data_parallel_size

    def update_weights(self, module: nnx.Module) -> None:
        self.module = module

    def close(self) -> None:
        """Holds nothing between calls."""

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[RequestOutput]:
        from . import sampling

        rows = [(index, sample) for index, request in enumerate(requests) for sample in range(request.num_samples)]
        width = max(len(request.penalised_ids) + len(request.prompt_ids) for request in requests)
        prompt_ids = np.full((len(rows), width), self.pad_token_id, np.int32)
        prompt_mask = np.zeros((len(rows), width), np.int32)
        penalised = np.zeros((len(rows), width), bool)
        for row, (index, _) in enumerate(rows):
            request = requests[index]
            prompt, extra = request.prompt_ids, request.penalised_ids
            # The penalised ids sit in the row's left padding: counted by the penalty, masked from the model.
            prompt_ids[row, width - len(prompt) - len(extra):] = extra + prompt
            prompt_mask[row, width - len(prompt):] = 1
            penalised[row, width - len(prompt) - len(extra):width - len(prompt)] = True
        counted = sampling.penalised_prompt_positions(prompt_mask, self.repetition_penalty_skips_left_padding)
        spread = self.batch_sharding is not None and len(rows) % self.data_parallel_size == 0
        images, token_types = request_images([requests[index] for index, _ in rows], width)
        result = sampling.generate_tokens(
            self.module, prompt_ids, prompt_mask, max(request.max_new_tokens for request in requests), settings,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, lora=self.lora, return_logprobs=True,
            penalised_positions=counted | penalised, batch_sharding=self.batch_sharding if spread else None,
            row_streams=(np.array([requests[index].seed for index, _ in rows]),
                         np.array([requests[index].first_sample + sample for index, sample in rows])),
            images=images, token_type_ids=token_types)
        outputs = [RequestOutput() for _ in requests]
        ends = np.asarray(self.eos_token_ids, np.int64)
        for row, (index, _) in enumerate(rows):
            limit = requests[index].max_new_tokens
            tokens, logprobs = result.tokens[row, :limit], result.logprobs[row, :limit]
            hits = np.flatnonzero(np.isin(tokens, ends))
            stop = int(hits[0]) + 1 if hits.size else len(tokens)
            outputs[index].token_ids.append(tokens[:stop].astype(np.int32))
            outputs[index].logprobs.append(logprobs[:stop].astype(np.float32))
            outputs[index].ended.append(bool(hits.size))
        return outputs


def request_images(requests: Sequence[RolloutRequest], width: int) -> tuple[Any, np.ndarray | None]:
    """``(images, token types [R, width])`` of requests laid out as left-padded rows, or ``(None, None)`` when none
    has images. The images stack row by row, each array's first axis padded with zeros to the longest (Gemma 3's
    image slots, Qwen-VL's patches), a request without images all zeros; the token types are ``None`` when no
    request has them."""
    with_images = [request.images for request in requests if request.images is not None]
    if not with_images:
        return None, None
    images = stack_rows([request.images for request in requests])
    token_types = None
    if any(request.token_type_ids for request in requests):
        token_types = np.zeros((len(requests), width), np.int32)
        for row, request in enumerate(requests):
            if request.token_type_ids:
                token_types[row, width - len(request.token_type_ids):] = request.token_type_ids
    return images, token_types


def weights_snapshot(module: nnx.Module) -> nnx.Module:
    """``module`` with its own variable containers around the same arrays: no array is copied, and the snapshot keeps
    the weights of this moment while training puts new arrays into ``module``'s variables (an adapter run changes
    only the LoRA factors, so only those differ later)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda array: array, state))


def derived_seed(*parts: int) -> int:
    """A seed derived from ``parts`` (a parent seed, then where the draw sits: a request, a tool round, a second
    model's completions): distinct parts give independent streams, equal parts the same seed."""
    return int(np.random.SeedSequence([int(part) for part in parts]).generate_state(1)[0])


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a generation round seeded ``seed``: distinct per request, so two prompts'
    first completions do not share a stream."""
    return derived_seed(seed, index)


def requests_from_rows(prompt_ids: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int,
                       seed: int, images: np.ndarray | None = None, token_type_ids: np.ndarray | None = None
                       ) -> tuple[list[RolloutRequest], list[tuple[int, int]]]:
    """Requests for the rows of a left-padded prompt batch, consecutive equal prompts (with equal images) as one
    request's samples (a GRPO generation batch repeats each prompt ``num_generations`` times in a row).

    Args:
        prompt_ids: ``[N, P]`` token ids; prompt_mask: ``[N, P]``, 1 on real tokens.
        max_new_tokens: every completion's limit.
        seed: the round's seed (:func:`request_seed` gives each request its own).
        images: each row's images (:func:`stack_rows`' layout), or ``None``.
        token_type_ids: ``[N, P]`` 1 on image tokens, with ``images`` of a model that needs them.

    Returns:
        ``(requests, places)``: ``places[row] = (request index, sample index)`` of each row.
    """
    requests: list[RolloutRequest] = []
    places: list[tuple[int, int]] = []
    previous = previous_images = None
    for row, (ids, mask) in enumerate(zip(np.asarray(prompt_ids), np.asarray(prompt_mask), strict=True)):
        real = np.asarray(mask).astype(bool)
        prompt = tuple(int(token) for token in ids[real])
        row_images = None if images is None else row_of(images, row)
        vision = {} if row_images is None else {"images": row_images}
        if row_images is not None and token_type_ids is not None:
            vision["token_type_ids"] = np.asarray(token_type_ids[row])[real]
        if prompt == previous and (row_images is None or same_images(row_images, previous_images)):
            last = requests[-1]
            requests[-1] = dataclasses.replace(last, num_samples=last.num_samples + 1)
        else:
            requests.append(RolloutRequest(prompt, max_new_tokens, 1, request_seed(seed, len(requests)), **vision))
            previous, previous_images = prompt, row_images
        places.append((len(requests) - 1, requests[-1].num_samples - 1))
    return requests, places


def rows_from_outputs(outputs: Sequence[RequestOutput], places: Sequence[tuple[int, int]],
                      pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [N, steps], logprobs [N, steps])`` of the completions at ``places`` (see
    :func:`requests_from_rows`), right-padded with ``pad_token_id`` (log-prob 0) to the longest."""
    chosen = [(outputs[request].token_ids[sample], outputs[request].logprobs[sample]) for request, sample in places]
    steps = max(len(tokens) for tokens, _ in chosen)
    tokens = np.full((len(chosen), steps), pad_token_id, np.int32)
    logprobs = np.zeros((len(chosen), steps), np.float32)
    for row, (row_tokens, row_logprobs) in enumerate(chosen):
        tokens[row, :len(row_tokens)] = row_tokens
        logprobs[row, :len(row_logprobs)] = row_logprobs
    return tokens, logprobs


def versions_from_outputs(outputs: Sequence[RequestOutput], places: Sequence[tuple[int, int]]) -> np.ndarray | None:
    """``[N, steps]`` int32: the weights version that drew each token of the completions at ``places`` (see
    :func:`rows_from_outputs`), ``-1`` past a row's end; ``None`` when the engine did not tag them
    (:attr:`RequestOutput.versions`)."""
    if any(not outputs[request].versions for request, _ in places):
        return None
    chosen = [outputs[request].versions[sample] for request, sample in places]
    versions = np.full((len(chosen), max(len(row) for row in chosen)), -1, np.int32)
    for row, row_versions in enumerate(chosen):
        versions[row, :len(row_versions)] = row_versions
    return versions


def completion_mask(tokens: np.ndarray, eos_token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """TRL's completion mask of sampled tokens: 1 up to and including the first end token of each row, 0 after.

    Returns:
        ``(mask [B, C] int32, ended [B] bool)``.
    """
    is_end = np.isin(tokens, np.asarray(eos_token_ids, dtype=tokens.dtype))
    ended = is_end.any(axis=1)
    first_end = np.where(ended, is_end.argmax(axis=1), tokens.shape[1])
    mask = (np.arange(tokens.shape[1])[None, :] <= first_end[:, None]).astype(np.int32)
    return mask, ended


__all__ = ["RequestOutput", "RolloutEngine", "RolloutRequest", "StaticEngine", "completion_mask", "derived_seed",
           "request_images", "request_seed", "requests_from_rows", "rows_from_outputs", "versions_from_outputs",
           "weights_snapshot"]
