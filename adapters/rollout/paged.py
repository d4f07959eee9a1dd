"""The paged rollout engine (``rollout_engine="paged"``): a paged KV cache, continuous batching and prompts shared by
their completions.

The split follows JetStream and vLLM: a scheduler in plain Python owns the requests, the decode slots and the pages
(:class:`~.pages.PagePool`), and four jitted programs only move data:

- **prefill** runs a batch of prompts (left-padded to a bucket, as the static sampler does) through the model once
  per *request*, writes their keys and values into the pool's pages and keeps the last position's logits;
- **prefill chunk** continues prompts longer than ``max_num_batched_tokens`` (chunked prefill, as vLLM's): the
  first chunk is a prefill, each later one feeds its tokens through the decode step's page view (below) between
  two decode calls, so a long prompt does not stall the running completions;
- **admit** puts completions into free slots: each copies its request's last, partly filled prompt page (the full
  pages stay shared by every completion of the request), draws its first token from the request's logits with its
  own stream and starts its repetition-penalty memory;
- **decode** advances every slot by ``decode_steps`` tokens. Each slot's pages are gathered once into a view that
  ends where the slot's tokens end (right-aligned, so a slot's tokens keep consecutive cache slots and the
  sliding-window layers of Gemma 2/3/4 see them as ``transformers`` does), the Tunix decoder runs the steps on that
  view as the static sampler runs its cache, and the new tokens' keys and values are written to the slot's pages
  after the last step.

A hybrid decoder's recurrent layers (gated DeltaNet: a fixed-size state per sequence instead of keys and values, see
``adapters.model.decoder_contract``) keep that state beside the pages: prefill returns each request's state after its
prompt (chunked prefill continues it chunk after chunk), admission copies it into each of the request's completions'
slots (the slot's previous state is overwritten, so a freed slot starts afresh), and decode reads and advances the
slots' states with their pages.

When a completion ends (an end token or its ``max_new_tokens``) its pages go back to the pool and its slot takes the
next waiting completion, whose request is prefilled between two decode calls if it was not already. Admission
reserves a completion's worst case (its prompt's last page plus ``max_new_tokens``) so a running completion never
waits for a page, while pages are handed out only as tokens arrive: the pages in use track the live tokens.

Tokens are drawn with :func:`~..sampling.stream_keys` (a request's seed, its ``first_sample`` plus the completion's
index, the token's index), so they do not depend on the slot count, the order of the requests, the prefill chunks or
the mesh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..distributed import mesh as mesh_lib
from ..distributed.multihost import gather_to_host
from ..lora import runtime as lora_runtime
from ..model import decoder_contract
from ..model.tunix_model import image_blocks, positions_from_mask
from ..runtime.float32_dots import float32_dots, gather_tables
from ..runtime.tracing import record_trace, traced_cheaply
from .engine import RequestOutput, RolloutRequest, request_images
from .images import rope_deltas
from .pages import TRASH_PAGE, PagePool
from .sampling import (
    bucket_length,
    choose_tokens_per_row,
    end_token_array,
    init_cache,
    mark_seen,
    stream_keys,
    token_logprobs,
)
from .sampling_settings import SamplingSettings, SamplingSwitches, SamplingValues


@dataclass(frozen=True)
class PagedEngineConfig:
    """The paged engine's sizes (vLLM's names where vLLM has the knob).

    Args:
        max_num_seqs: decode slots: completions decoded together in one step.
        page_size: tokens per KV page.
        kv_cache_tokens: the pool's size in tokens (shared by every slot and prompt); ``None`` sizes it so every
            slot can hold the longest request of a call at once.
        max_prefill_requests: requests prefilled together in one program.
        decode_steps: tokens each decode program call adds to every live completion (the scheduler frees and
            refills slots between calls): more amortises the call, fewer refills a slot sooner.
        max_num_batched_tokens: the most prompt tokens prefilled between two decode calls (vLLM's chunked-prefill
            budget): a longer prompt is prefilled in chunks with decode calls between them, so the running
            completions keep advancing while it is read.
    """

    max_num_seqs: int = 64
    page_size: int = 16
    kv_cache_tokens: int | None = None
    max_prefill_requests: int = 8
    decode_steps: int = 8
    max_num_batched_tokens: int = 2048

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any], prefix: str = "") -> PagedEngineConfig:
        """The sizes among ``settings``' keys named ``prefix + field`` (a trainer config's ``rollout_*`` fields),
        defaults for the rest."""
        return cls(**{item.name: settings[prefix + item.name] for item in fields(cls)
                      if prefix + item.name in settings})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "page_size", "max_prefill_requests", "decode_steps", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"PagedEngineConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"PagedEngineConfig.kv_cache_tokens={self.kv_cache_tokens} holds less than one page "
                             f"of {self.page_size} tokens.")


@dataclass
class EngineStats:
    """What the last :meth:`PagedEngine.generate` did (for tests and benchmarks).

    Attributes:
        prefills: prompts run through the model (one per request, whatever its ``num_samples``).
        prefill_programs: prefill program calls (whole prompts, first chunks and later chunks).
        prefill_chunks: ``(request index, prompt tokens, decode calls run before it)`` of each prompt chunk
            prefilled, in order; a prompt within ``max_num_batched_tokens`` is one chunk.
        decode_calls: decode program calls; decode_steps: the decode steps they ran (``decode_steps`` per call).
        slot_steps: tokens the decode steps added to live completions.
        row_steps: rows the decode steps ran (live completions, those that ended within the call, and padding to
            the program's row count), summed.
        decode_rows: ``(live completions, program rows)`` of each decode call.
        pages: pages in the pool (the trash page excluded); page_size: tokens per page.
        peak_pages_in_use: the most pages held at once.
        pages_in_use_per_step: pages held after each decode step.
        live_tokens_per_step: tokens held by live completions and their prompts after each decode step.
        kv_bytes_per_token: bytes of keys and values one token takes over all layers.
    """

    prefills: int = 0
    prefill_programs: int = 0
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    decode_calls: int = 0
    decode_steps: int = 0
    slot_steps: int = 0
    row_steps: int = 0
    decode_rows: list[tuple[int, int]] = field(default_factory=list)
    pages: int = 0
    page_size: int = 0
    peak_pages_in_use: int = 0
    pages_in_use_per_step: list[int] = field(default_factory=list)
    live_tokens_per_step: list[int] = field(default_factory=list)
    kv_bytes_per_token: int = 0


@dataclass(frozen=True)
class _Programs:
    """The static part of the engine's compiled programs."""

    switches: SamplingSwitches
    lora: str
    view: int = 0  # decode and prefill chunks: cache slots gathered per row
    steps: int = 1  # decode only: tokens per row and call


@dataclass
class _Group:
    """A request in flight: its prompt pages, prefill progress and logits, and completions not yet admitted."""

    index: int
    request: RolloutRequest
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the pages
    logits: jax.Array | None = None  # the last prompt token's, once the whole prompt is prefilled
    next_sample: int = 0
    promised: int = 0  # pages reserved at prefill for the first completion, so it can always start

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_ids)


    state: dict | None = None  # recurrent layers: the state after the prefilled tokens, one row ``[1, ...]``


@dataclass
class _Slot:
    """A completion being decoded."""

    group: _Group
    sample: int
    pages: list[int]
    shared: int  # the first ``shared`` pages are the group's (held, not owned)
    reserved: int  # pages promised but not yet taken
    length: int  # tokens in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- programs


def _forward(module, tables, tokens, positions, cache, mask, **inputs):
    logits, cache = float32_dots(module, tables)(tokens, positions, cache, mask, **inputs)
    return logits.astype(jnp.float32), cache


def _states_of(cache: dict, pool: dict) -> dict:
    """The recurrent layers' entries of ``cache`` (those the KV pool lacks), without their ``end_index``."""
    return {name: {part: value for part, value in entry.items() if part != "end_index"}
            for name, entry in cache.items() if name not in pool}


def _with_states(cache: dict, states: dict, end_index: jax.Array) -> dict:
    """``cache`` (the attention layers' view) with the recurrent layers' ``states`` added at ``end_index``."""
    return {**cache, **{name: {**entry, "end_index": end_index} for name, entry in states.items()}}


def _prefill_program(programs: _Programs, module, tables, pool, prompt_ids, prompt_mask, page_index, page_offset,
                     images=None, token_types=None):
    """Runs left-padded prompts ``[G, P]`` once, writes their keys/values to ``(page_index, page_offset) [G, P]``
    (the trash page for padding) and returns ``(last logits [G, V], pool, the recurrent layers' states [G, ...])``.
    ``images`` (image prompts, :func:`~.engine.request_images`) put the images in place of their tokens, which see
    each other both ways where ``token_types`` ``[G, P]`` are given (Gemma 3); a multimodal rope's last token sits
    its row's ``rope_deltas`` further on."""
    groups, width = prompt_ids.shape
    record_trace("generate", {"engine program": "prefill", "requests": groups, "prompt bucket": width})
    prompt_mask = prompt_mask.astype(bool)
    positions = positions_from_mask(prompt_mask)
    cache = init_cache(module, groups, width)
    # As the static sampler: all but the last token fill the cache (their logits unused), the last one gives logits.
    head = width - 1
    causal = jnp.arange(width)[None, :] <= jnp.arange(head)[:, None]
    attention = causal[None] & prompt_mask[:, None, :]
    inputs = {}
    shift = 0
    if images is not None:
        if token_types is not None:
            attention = attention | image_blocks(token_types)[:, :head]
        inputs = {"images": images}
        shift = jnp.asarray(rope_deltas(images), jnp.int32)[..., None] if isinstance(images, dict) else 0
    _, cache = _forward(module, tables, prompt_ids[:, :head], positions[:, :head], cache, attention, **inputs)
    logits, cache = _forward(module, tables, prompt_ids[:, head:], positions[:, head:] + shift, cache,
                             prompt_mask[:, None, :])
    states = _states_of(cache, pool)
    pool = {name: {part: pool[name][part].at[page_index, page_offset].set(cache[name][part]) for part in ("k", "v")}
            for name in pool}
    return logits[:, -1], pool, states


def _admit_program(programs: _Programs, pool, seen, slot_states, logits, slots, tail_from, tail_to, prompt_ids,
                   counted, seeds, samples, values, states):
    """Admits completions into ``slots [A]`` (``S`` for padding rows): copies page ``tail_from`` to ``tail_to`` and
    each request's recurrent ``states [A, ...]`` into its slot's, draws each first token from ``logits [A, V]`` and
    starts the penalty memory from ``prompt_ids``/``counted``.

    Returns ``(tokens [A], logprobs [A], pool, seen, slot_states)``.
    """
    rows = logits.shape[0]
    record_trace("generate", {"engine program": "admit", "rows": rows, "switches": programs.switches})
    pool = {name: {part: pool[name][part].at[tail_to].set(pool[name][part][tail_from]) for part in ("k", "v")}
            for name in pool}
    row_seen = None
    if programs.switches.repetition_penalty:
        row_index = jnp.broadcast_to(jnp.arange(rows)[:, None], prompt_ids.shape)
        row_seen = jnp.zeros((rows, logits.shape[-1]), bool).at[row_index, prompt_ids].max(counted.astype(bool))
    tokens = choose_tokens_per_row(logits, stream_keys(seeds, samples, 0), programs.switches, values, row_seen)
    temperature = values.temperature if programs.switches.do_sample else 1.0
    logprobs = token_logprobs(logits, tokens, temperature)
    if row_seen is not None:
        seen = seen.at[slots].set(mark_seen(row_seen, tokens), mode="drop")
    slot_states = jax.tree.map(lambda kept, new: kept.at[slots].set(new, mode="drop"), slot_states, states)
    return tokens, logprobs, pool, seen, slot_states


def _gather_view(pool, lengths, page_table, view, extra):
    """Each row's cached tokens gathered from its pages ``page_table [R, W]`` into a cache of ``view + extra``
    columns, right-aligned: row ``r``'s ``lengths[r]`` tokens end at column ``view - 1`` (so its tokens keep
    consecutive columns and the sliding-window layers of Gemma 2/3/4 see them as ``transformers`` does) and Tunix
    writes the next fed tokens at columns ``view``, ``view + 1``... (its ``end_index``, the same for every row).

    Returns ``(cache, cached [R, view + extra] bool: the columns holding the rows' tokens)``.
    """
    rows, width = page_table.shape
    page_size = next(iter(pool.values()))["k"].shape[1]
    token_index = jnp.arange(view)[None, :] - (view - lengths)[:, None]
    cached = (token_index >= 0) & (token_index < lengths[:, None])
    safe_index = jnp.clip(token_index, 0, width * page_size - 1)
    page = jnp.where(cached, jnp.take_along_axis(page_table, safe_index // page_size, axis=1), TRASH_PAGE)
    offset = jnp.where(cached, safe_index % page_size, 0)
    padding = ((0, 0), (0, extra), (0, 0), (0, 0))
    cache = {name: {"k": jnp.pad(pool[name]["k"][page, offset], padding),
                    "v": jnp.pad(pool[name]["v"][page, offset], padding),
                    "end_index": jnp.full((rows,), view, jnp.int32)} for name in pool}
    return cache, jnp.pad(cached, ((0, 0), (0, extra)))


def _write_fed(pool, cache, lengths, page_table, fed, view):
    """Writes the keys and values of the tokens fed at cache columns ``view + s`` (``s < fed.shape[1]``) to their
    pages: row ``r``'s token ``s`` is at position ``lengths[r] + s``; those not ``fed [R, S]`` go to the trash
    page."""
    width = page_table.shape[1]
    page_size = next(iter(pool.values()))["k"].shape[1]
    positions = lengths[:, None] + jnp.arange(fed.shape[1])[None, :]
    page = jnp.take_along_axis(page_table, jnp.minimum(positions // page_size, width - 1), axis=1)
    page = jnp.where(fed, page, TRASH_PAGE)
    offset = jnp.where(fed, positions % page_size, 0)
    columns = slice(view, view + fed.shape[1])
    return {name: {part: pool[name][part].at[page, offset].set(cache[name][part][:, columns])
                   for part in ("k", "v")} for name in pool}


def _step_on_pages(module, tables, pool, states, tokens, lengths, page_table, active, view):
    """Feeds ``tokens [R]`` at positions ``lengths [R]``, row ``r`` attending to its first ``lengths[r]`` tokens in
    its pages ``page_table [R, W]`` and continuing its recurrent ``states``, and writes the fed tokens' keys and
    values to their pages (rows not ``active`` write to the trash page and keep their states). Returns
    ``(logits [R, V], pool, states)``."""
    cache, cached = _gather_view(pool, lengths, page_table, view, 1)
    cache = _with_states(cache, states, jnp.full(tokens.shape, view, jnp.int32))
    mask = cached.at[:, view].set(True)[:, None, :]
    logits, cache = _forward(module, tables, tokens[:, None], lengths[:, None], cache, mask)
    advanced = jax.tree.map(lambda new, old: jnp.where(active.reshape(-1, *(1,) * (old.ndim - 1)), new, old),
                            _states_of(cache, pool), states)
    return logits[:, 0], _write_fed(pool, cache, lengths, page_table, active[:, None], view), advanced


def _prefill_chunk_program(programs: _Programs, module, tables, pool, chunk_ids, starts, counts, page_table, states):
    """Continues prompts whose first ``starts [G]`` tokens are in their pages ``page_table [G, W]`` (and in their
    recurrent ``states [G, ...]``): feeds row ``g``'s next ``counts[g]`` tokens ``chunk_ids [G, C]`` one at a time
    through the decode step's page view (:func:`_step_on_pages`: a multi-token call cannot continue a cache in every
    Tunix family, see ``adapters.upstream``) and writes their keys and values to the pages.

    Returns ``(logits of each row's last fed token [G, V], pool, states)``.
    """
    groups, width = chunk_ids.shape
    record_trace("generate", {"engine program": "prefill chunk", "requests": groups, "chunk bucket": width,
                              "view": programs.view})
    graphdef, state = nnx.split(module)
    vocab = decoder_contract.vocab_size(module)

    def one_token(step, carry):
        pool, states, last = carry
        logits, pool, states = _step_on_pages(nnx.merge(graphdef, state), tables, pool, states, chunk_ids[:, step],
                                              starts + step, page_table, step < counts, programs.view)
        return pool, states, jnp.where((step == counts - 1)[:, None], logits, last)

    pool, states, last = jax.lax.fori_loop(0, jnp.max(counts), one_token,
                                           (pool, states, jnp.zeros((groups, vocab), jnp.float32)))
    return last, pool, states


def _decode_program(programs: _Programs, module, tables, pool, seen, slot_states, slot_index, tokens, lengths,
                    page_table, live, seeds, samples, steps, limits, shifts, values, end_ids):
    """``programs.steps`` tokens for each of ``R`` rows, row ``r`` being slot ``slot_index[r]`` (``S``, out of
    range, for padding). Each step feeds a row's last token at cache position ``lengths [R]`` plus the step, its
    rope position ``shifts [R]`` further on (a multimodal rope's ``rope_deltas``, 0 for text); a row stops once it
    draws an end token or its ``limits [R]``-th token (``steps [R]`` counts the tokens it had).

    The rows' pages are gathered once into a right-aligned cache (:func:`_gather_view`) that the steps extend as
    the static sampler's does, and the fed tokens' keys and values go to their pages once, after the last step; the
    slots' recurrent states are read from ``slot_states`` and written back after the last step (a row that stopped
    within the call advanced its state on, but its slot is freed and reset at its next admission).

    Returns ``(tokens [R, steps], logprobs [R, steps], pool, seen, slot_states)``, ``-1`` after a row stopped.
    """
    rows = page_table.shape[0]
    view, count = programs.view, programs.steps
    record_trace("generate", {"engine program": "decode", "slots": rows, "view": view, "steps": count,
                              "switches": programs.switches})
    graphdef, state = nnx.split(module)
    temperature = values.temperature if programs.switches.do_sample else 1.0
    cache, cached = _gather_view(pool, lengths, page_table, view, count)
    states = jax.tree.map(lambda kept: kept.at[slot_index].get(mode="clip"), slot_states)
    cache = _with_states(cache, states, jnp.full((rows,), view, jnp.int32))
    columns = jnp.arange(view + count)[None, :]

    def one_step(step, carry):
        cache, seen, tokens, done, out_tokens, out_logprobs = carry
        active = live & ~done
        mask = (cached | ((columns >= view) & (columns <= view + step)))[:, None, :]
        logits, cache = _forward(nnx.merge(graphdef, state), tables, tokens[:, None],
                                 (lengths + step + shifts)[:, None], cache, mask)
        logits = logits[:, 0]
        row_seen = seen.at[slot_index].get(mode="clip") if programs.switches.repetition_penalty else None
        drawn = choose_tokens_per_row(logits, stream_keys(seeds, samples, steps + step), programs.switches, values,
                                      row_seen)
        logprobs = token_logprobs(logits, drawn, temperature)
        if row_seen is not None:
            marked = jnp.where(active[:, None], mark_seen(row_seen, drawn), row_seen)
            seen = seen.at[slot_index].set(marked, mode="drop")
        out_tokens = out_tokens.at[:, step].set(jnp.where(active, drawn, -1))
        out_logprobs = out_logprobs.at[:, step].set(jnp.where(active, logprobs, 0.0))
        ended = jnp.isin(drawn, end_ids) | (steps + step + 1 >= limits)
        return cache, seen, jnp.where(active, drawn, tokens), done | (active & ended), out_tokens, out_logprobs

    carry = (cache, seen, tokens, jnp.zeros_like(live), jnp.full((rows, count), -1, jnp.int32),
             jnp.zeros((rows, count), jnp.float32))
    cache, seen, _, _, out_tokens, out_logprobs = jax.lax.fori_loop(0, count, one_step, carry)
    # A step's fed token is kept when the row was active at that step, i.e. drew a token there.
    slot_states = jax.tree.map(lambda kept, new: kept.at[slot_index].set(new, mode="drop"), slot_states,
                               _states_of(cache, pool))
    pool = _write_fed(pool, {name: cache[name] for name in pool}, lengths, page_table, out_tokens >= 0, view)
    return out_tokens, out_logprobs, pool, seen, slot_states


_prefill = traced_cheaply(nnx.jit(_prefill_program, static_argnums=(0,), donate_argnums=(3,)))
_prefill_chunk = traced_cheaply(nnx.jit(_prefill_chunk_program, static_argnums=(0,), donate_argnums=(3,)))
_admit = traced_cheaply(jax.jit(_admit_program, static_argnums=(0,), donate_argnums=(1, 2, 3)))
_decode = traced_cheaply(nnx.jit(_decode_program, static_argnums=(0,), donate_argnums=(3, 4, 5)))


def _stacked(states: list[dict | None], rows: int) -> dict:
    """One-row recurrent states stacked into ``rows`` rows (the first repeated as padding); ``{}`` without recurrent
    layers."""
    if not states or states[0] is None or not states[0]:
        return {}
    states = states + [states[0]] * (rows - len(states))
    return jax.tree.map(lambda *values: jnp.concatenate(values), *states)


def _power_of_two(count: int) -> int:
    return 1 << max(count - 1, 0).bit_length()


# --------------------------------------------------------------------------- the engine


class PagedEngine:
    """The paged, continuously batched rollout engine (see the module docstring); a :class:`~.engine.RolloutEngine`.

    Args:
        module: the Tunix decoder to sample from (LoRA-adapted or not); see :meth:`update_weights`.
        config: the engine's sizes.
        eos_token_ids: ids that end a completion (the end token is kept in its tokens).
        pad_token_id: the id prompts are padded with inside the prefill program (masked out).
        lora: :func:`lora_runtime.lora_mode` the adapter runs in (``"eval"`` or ``"disabled"``).
        repetition_penalty_skips_left_padding: kept for the static sampler's signature; requests carry no padding,
            so the penalty counts each prompt's own ids.
        mesh: when given, the slots are spread over its data axes (each device decodes its own slots) and the pool
            is replicated; with several processes every process runs the same scheduler on the same tokens.
    """

    def __init__(self, module: nnx.Module, config: PagedEngineConfig | None = None, eos_token_ids: Sequence[int] = (),
                 pad_token_id: int = 0, lora: str = lora_runtime.EVAL, mesh: Mesh | None = None):
        self.module = module
        self.config = config or PagedEngineConfig()
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.lora = lora
        self.mesh = mesh
        self.stats = EngineStats()
        self._pool: dict | None = None
        self._pool_pages = 0

    # ------------------------------------------------------------------ protocol
    def update_weights(self, module: nnx.Module) -> None:
        """Samples from ``module`` from the next call on. The engine reads the module's parameters at each call
        (no copy is kept), so a policy updated in place needs no call; a new module object does."""
        self.module = module

    def close(self) -> None:
        """Frees the page pool (it is allocated again by the next call)."""
        self._pool = None
        self._pool_pages = 0

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[RequestOutput]:
        """Completes every request (see the module docstring).

        Args:
            requests: the prompts, each with its completions count, token limit and seed.
            settings: how every token is chosen (one compiled program per :meth:`SamplingSettings.switches`).

        Returns:
            One :class:`~.engine.RequestOutput` per request, in order.

        Raises:
            ValueError: a request cannot fit the page pool even alone (the message names ``kv_cache_tokens``).
        """
        requests = list(requests)
        if not requests:
            return []
        self.stats = EngineStats(page_size=self.config.page_size)
        return _Run(self, requests, settings).run()

    # ------------------------------------------------------------------ pool
    def _take_pool(self, pages: int) -> dict:
        """The page pool of ``pages`` pages, kept from the last call when it has that size. The caller owns it (the
        programs donate it) until it hands the last version back with :meth:`_keep_pool`."""
        if self._pool is None or self._pool_pages != pages:
            shapes = jax.eval_shape(lambda: init_cache(self.module, 1, 1))
            page_size = self.config.page_size

            def zeros():
                return {name: {part: jnp.zeros((pages, page_size, *entry[part].shape[2:]), entry[part].dtype)
                               for part in ("k", "v")} for name, entry in shapes.items() if "k" in entry}

            self._pool = jax.jit(zeros, out_shardings=self._replicated())()
            self._pool_pages = pages
        entries = [entry[part] for entry in self._pool.values() for part in ("k", "v")]
        self.stats.kv_bytes_per_token = int(sum(array.dtype.itemsize * np.prod(array.shape[2:]) for array in entries))
        pool, self._pool = self._pool, None
        return pool

    def _keep_pool(self, pool: dict, pages: int) -> None:
        self._pool, self._pool_pages = pool, pages

    def _replicated(self) -> jax.sharding.Sharding:
        """Where the engine's own arrays (pool, penalty memory) live: replicated over the mesh, or on the module's
        device. Made *committed* there, as the programs' outputs that replace them are: an uncommitted first version
        would compile each program that takes it a second time."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, PartitionSpec())
        leaf = jax.tree.leaves(nnx.state(self.module))[0]
        return jax.sharding.SingleDeviceSharding(min(leaf.devices(), key=lambda device: device.id))

    def _zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """Zeros placed as :meth:`_replicated` says."""
        return mesh_lib.place_array(np.zeros(shape, dtype), self._replicated())


class _Run:
    """One :meth:`PagedEngine.generate` call: the scheduler's state and loop."""

    def __init__(self, engine: PagedEngine, requests: list[RolloutRequest], settings: SamplingSettings):
        self.engine = engine
        config = engine.config
        self.switches = settings.switches()
        self.values = SamplingValues(*(np.float32(value) for value in settings.traced_values()))
        self.groups = [_Group(index, request) for index, request in enumerate(requests)]
        self.waiting = deque(self.groups)
        self.outputs = [RequestOutput() for _ in requests]
        self.end_ids = set(engine.eos_token_ids)
        total = sum(request.num_samples for request in requests)
        self.parallel = 1 if engine.mesh is None else mesh_lib.data_parallel_size(engine.mesh)
        self.num_slots = -(-min(config.max_num_seqs, _power_of_two(total)) // self.parallel) * self.parallel
        page_size = config.page_size
        longest = max(len(request.prompt_ids) + request.max_new_tokens for request in requests)
        self.table_width = -(-longest // page_size)
        if config.kv_cache_tokens is None:
            longest_prompt = max(len(request.prompt_ids) for request in requests)
            pages = (self.num_slots * self.table_width
                     + config.max_prefill_requests * -(-longest_prompt // page_size))
        else:
            pages = -(-config.kv_cache_tokens // page_size)
        for request in requests:
            alone = -(-len(request.prompt_ids) // page_size) + self._own_pages(request)
            if alone > pages:
                raise ValueError(
                    f"a request of {len(request.prompt_ids)} prompt tokens and max_new_tokens="
                    f"{request.max_new_tokens} needs {alone * page_size} KV cache tokens, more than the pool's "
                    f"kv_cache_tokens={pages * page_size}; raise kv_cache_tokens (TRL: vllm_gpu_memory_utilization) "
                    "or shorten the request.")
        self.pages = PagePool(pages + 1, page_size)
        engine.stats.pages = self.pages.usable
        self.pool = engine._take_pool(self.pages.num_pages)
        vocab = decoder_contract.vocab_size(engine.module)
        self.seen = engine._zeros((self.num_slots, vocab if self.switches.repetition_penalty else 1), bool)
        # Recurrent layers: each slot's state (the pool holds only the attention layers' keys and values).
        self.slot_states = {name: {part: engine._zeros((self.num_slots, *shape), kind)
                                   for part, (shape, kind) in entries.items()}
                            for name, entries in decoder_contract.recurrent_state_shapes(engine.module).items()}
        self.slots: list[_Slot | None] = [None] * self.num_slots
        self.fed = np.zeros(self.num_slots, np.int32)
        self.sharding = None if engine.mesh is None else mesh_lib.batch_sharding(engine.mesh)
        self.programs = _Programs(self.switches, engine.lora)
        self.prefill_budget = config.max_num_batched_tokens  # prompt tokens left to prefill before the next decode
        self.end_array = end_token_array(engine.eos_token_ids)
        # The embedding tables' bits for this call's programs (XLA:CPU only, see ``float32_dots``).
        self.tables = gather_tables(engine.module)

    def _own_pages(self, request: RolloutRequest) -> int:
        """A completion's worst case beyond its request's shared full pages (the last new token is never fed)."""
        page_size = self.engine.config.page_size
        length = len(request.prompt_ids)
        return -(-(length + request.max_new_tokens - 1) // page_size) - length // page_size

    def run(self) -> list[RequestOutput]:
        with lora_runtime.lora_mode(self.engine.lora):
            while True:
                progressed = self._admit_waiting()
                live = [index for index, slot in enumerate(self.slots) if slot is not None]
                if not live:
                    if self.waiting and not progressed:
                        raise RuntimeError("the rollout engine could not admit a waiting request; this is a bug.")
                    if not self.waiting:
                        break
                    continue  # a prompt is still being prefilled chunk by chunk
                self._decode_step(live)
        self.engine._keep_pool(self.pool, self.pages.num_pages)
        self.engine.stats.peak_pages_in_use = self.pages.peak_in_use
        for output in self.outputs:
            output.ended = [bool(value) for value in output.ended]
        return self.outputs

    # ------------------------------------------------------------------ admission
    def _admit_waiting(self) -> bool:
        """Prefills (within the round's ``max_num_batched_tokens``) and admits waiting completions into free slots;
        returns whether it prefilled or admitted any."""
        self.prefill_budget = self.engine.config.max_num_batched_tokens
        programs_before = self.engine.stats.prefill_programs
        free = [index for index, slot in enumerate(self.slots) if slot is None]
        admitted: list[tuple[int, _Group, int]] = []
        while free and self.waiting:
            group = self.waiting[0]
            if group.logits is None and not self._prefill_next(len(free)):
                break
            if group.promised:
                group.promised = 0
            elif not self.pages.reserve(self._own_pages(group.request)):
                break
            sample = group.next_sample
            group.next_sample += 1
            if group.next_sample == group.request.num_samples:
                self.waiting.popleft()
            admitted.append((free.pop(0), group, sample))
        if admitted:
            self._admit(admitted)
        return bool(admitted) or self.engine.stats.prefill_programs > programs_before

    def _prefill_next(self, free_slots: int) -> bool:
        """Prefills the next chunks of the waiting prompts, at most the round's remaining ``max_num_batched_tokens``:
        the prompts already started, then new ones (at least the first waiting, as many as fill ``free_slots`` and
        the pool allows); returns whether the first waiting request is wholly prefilled."""
        config = self.engine.config
        chosen: list[tuple[_Group, int]] = []
        covered = 0
        for group in self.waiting:
            if len(chosen) == config.max_prefill_requests or covered >= free_slots or not self.prefill_budget:
                break
            if group.logits is not None:
                covered += group.request.num_samples - group.next_sample
                continue
            if not group.pages:
                need = self.pages.pages_for(group.prompt_length)
                # The first completion's pages are promised with the prompt's, or it might never start.
                group.promised = self._own_pages(group.request)
                if not self.pages.reserve(need + group.promised):
                    group.promised = 0
                    break
                group.pages = [self.pages.take() for _ in range(need)]
                self.engine.stats.prefills += 1
            count = min(group.prompt_length - group.prefilled, self.prefill_budget)
            if group.request.images is not None:  # an image prompt is prefilled whole: a chunk could split an image
                count = group.prompt_length - group.prefilled
            self.prefill_budget = max(self.prefill_budget - count, 0)
            chosen.append((group, count))
            covered += group.request.num_samples
        if not chosen:
            return False
        # A prompt's first chunk runs as one multi-token prefill; later chunks continue the cache in the pages.
        starting = [(group, count) for group, count in chosen if not group.prefilled]
        continuing = [(group, count) for group, count in chosen if group.prefilled]
        if starting:
            self._prefill(starting)
        if continuing:
            self._prefill_chunk(continuing)
        return self.waiting[0].logits is not None

    def _prefill(self, chosen: list[tuple[_Group, int]]) -> None:
        """Prefills the first ``count`` tokens of each group's prompt from an empty cache."""
        engine = self.engine
        page_size = engine.config.page_size
        rows = _power_of_two(len(chosen))
        width = bucket_length(max(count for _, count in chosen))
        prompt_ids = np.full((rows, width), engine.pad_token_id, np.int32)
        prompt_mask = np.zeros((rows, width), np.int32)
        page_index = np.full((rows, width), TRASH_PAGE, np.int32)
        page_offset = np.zeros((rows, width), np.int32)
        for row, (group, count) in enumerate(chosen):
            prompt_ids[row, width - count:] = group.request.prompt_ids[:count]
            prompt_mask[row, width - count:] = 1
            token = np.arange(count)
            page_index[row, width - count:] = np.asarray(group.pages)[token // page_size]
            page_offset[row, width - count:] = token % page_size
        images, token_types = request_images([group.request for group, _ in chosen], width)
        if images is not None:  # the padding rows get no images
            images = jax.tree.map(lambda rows_of: np.pad(rows_of, ((0, rows - len(chosen)),)
                                                         + ((0, 0),) * (rows_of.ndim - 1)), images)
        if token_types is not None:
            token_types = np.pad(token_types, ((0, rows - len(chosen)), (0, 0)))
        logits, self.pool, states = _prefill(self.programs, self.engine.module, self.tables, self.pool, prompt_ids,
                                             prompt_mask, page_index, page_offset, images, token_types)
        self._prefilled(chosen, logits, states)

    def _prefill_chunk(self, chosen: list[tuple[_Group, int]]) -> None:
        """Prefills the next ``count`` tokens of each group's started prompt (see :func:`_prefill_chunk_program`)."""
        rows = _power_of_two(len(chosen))
        chunk_ids = np.zeros((rows, bucket_length(max(count for _, count in chosen))), np.int32)
        starts = np.zeros(rows, np.int32)
        counts = np.zeros(rows, np.int32)
        page_table = np.zeros((rows, self.table_width), np.int32)
        for row, (group, count) in enumerate(chosen):
            chunk_ids[row, :count] = group.request.prompt_ids[group.prefilled:group.prefilled + count]
            starts[row], counts[row] = group.prefilled, count
            page_table[row, :len(group.pages)] = group.pages
        # One view for the call's longest prompt, so every chunk of the call runs one program per row count.
        longest = max(group.prompt_length for group in self.groups)
        programs = _Programs(self.switches, self.engine.lora, view=bucket_length(longest))
        states = _stacked([group.state for group, _ in chosen], rows)
        logits, self.pool, states = _prefill_chunk(programs, self.engine.module, self.tables, self.pool, chunk_ids,
                                                   starts, counts, page_table, states)
        self._prefilled(chosen, logits, states)

    def _prefilled(self, chosen: list[tuple[_Group, int]], logits: jax.Array, states: dict) -> None:
        """Records a prefill program's chunks; each group keeps its recurrent state, and a group whose prompt is
        complete its last token's logits."""
        stats = self.engine.stats
        for row, (group, count) in enumerate(chosen):
            group.state = jax.tree.map(lambda value, row=row: value[row:row + 1], states)
            group.prefilled += count
            if group.prefilled == group.prompt_length:
                group.logits = logits[row]
            stats.prefill_chunks.append((group.index, count, stats.decode_calls))
        stats.prefill_programs += 1

    def _admit(self, admitted: list[tuple[int, _Group, int]]) -> None:
        engine = self.engine
        page_size = engine.config.page_size
        rows = self.num_slots  # one admission program per call shape: it runs no model layer
        prompt_width = bucket_length(max(len(group.request.penalised_ids) + group.prompt_length
                                         for _, group, _ in admitted))
        slot_index = np.full(rows, self.num_slots, np.int32)
        tail_from = np.full(rows, TRASH_PAGE, np.int32)
        tail_to = np.full(rows, TRASH_PAGE, np.int32)
        prompt_ids = np.zeros((rows, prompt_width), np.int32)
        counted = np.zeros((rows, prompt_width), np.int32)
        seeds = np.zeros(rows, np.uint32)
        samples = np.zeros(rows, np.int32)
        logits = []
        states = []
        finished_groups: list[_Group] = []
        for row, (slot, group, sample) in enumerate(admitted):
            request = group.request
            length = group.prompt_length
            shared = length // page_size
            pages = list(group.pages[:shared])
            self.pages.hold(pages)
            reserved = self._own_pages(request)
            if length % page_size:
                own_tail = self.pages.take()
                reserved -= 1
                tail_from[row], tail_to[row] = group.pages[shared], own_tail
                pages.append(own_tail)
            self.slots[slot] = _Slot(group, sample, pages, shared, reserved, length)
            slot_index[row] = slot
            penalised = request.penalised_ids + request.prompt_ids
            prompt_ids[row, :len(penalised)] = penalised
            counted[row, :len(penalised)] = 1  # a request has no padding: the penalty counts its whole prompt
            seeds[row], samples[row] = int(request.seed) % (2**32), request.first_sample + sample
            logits.append(group.logits)
            states.append(group.state)
            if group.next_sample == request.num_samples and group not in finished_groups:
                finished_groups.append(group)
        for group in finished_groups:
            self._release_prompt(group)
        logits = jnp.stack(logits + [logits[0]] * (rows - len(admitted)))
        tokens, logprobs, self.pool, self.seen, self.slot_states = _admit(
            self.programs, self.pool, self.seen, self.slot_states, logits, slot_index, tail_from, tail_to, prompt_ids,
            counted, seeds, samples, self.values, _stacked(states, rows))
        tokens, logprobs = gather_to_host(tokens), gather_to_host(logprobs)
        for row, (slot, _, _) in enumerate(admitted):
            self._record(slot, int(tokens[row]), float(logprobs[row]))

    def _release_prompt(self, group: _Group) -> None:
        """The request's own hold on its prompt pages ends once every completion holds what it shares (the logits
        stay referenced by the admission being built)."""
        self.pages.release(group.pages)
        group.pages = []
        group.state = None

    # ------------------------------------------------------------------ decode
    def _record(self, slot_index: int, token: int, logprob: float) -> None:
        """Appends a sampled token to its completion; finishes the completion on an end token or its limit."""
        self._record_many(slot_index, [token], [logprob])

    def _record_many(self, slot_index: int, tokens: list[int], logprobs: list[float]) -> None:
        """Appends sampled tokens (the decode program stops a row at its end token or limit, so only the last can
        end it); finishes the completion on an end token or its limit."""
        slot = self.slots[slot_index]
        slot.tokens.extend(tokens)
        slot.logprobs.extend(logprobs)
        token = tokens[-1]
        if token in self.end_ids or len(slot.tokens) == slot.group.request.max_new_tokens:
            output = self.outputs[slot.group.index]
            while len(output.token_ids) <= slot.sample:
                output.token_ids.append(None)
                output.logprobs.append(None)
                output.ended.append(False)
            output.token_ids[slot.sample] = np.asarray(slot.tokens, np.int32)
            output.logprobs[slot.sample] = np.asarray(slot.logprobs, np.float32)
            output.ended[slot.sample] = token in self.end_ids
            self.pages.release(slot.pages, unused_reservation=slot.reserved)
            self.slots[slot_index] = None
        else:
            self.fed[slot_index] = token

    def _decode_rows(self, live: int) -> int:
        """The rows of the decode program for ``live`` completions: the slot count halved while that still holds
        them (and the mesh's data shards), so the rows run are never more than twice the live ones (the slot count
        aside) and a long tail of few completions runs a small program."""
        rows = self.num_slots
        while rows // 2 >= max(live, self.parallel) and (rows // 2) % self.parallel == 0:
            rows //= 2
        return rows

    def _decode_step(self, live: list[int]) -> None:
        engine = self.engine
        page_size = engine.config.page_size
        count = engine.config.decode_steps
        rows = self._decode_rows(len(live))
        slot_index = np.full(rows, self.num_slots, np.int32)
        fed = np.zeros(rows, np.int32)
        page_table = np.zeros((rows, self.table_width), np.int32)
        lengths = np.zeros(rows, np.int32)
        alive = np.zeros(rows, bool)
        seeds = np.zeros(rows, np.uint32)
        samples = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        limits = np.ones(rows, np.int32)
        shifts = np.zeros(rows, np.int32)
        for row, index in enumerate(live):
            slot = self.slots[index]
            request = slot.group.request
            # Pages for every token this call may feed (the last new token is never fed).
            last_fed = min(slot.length + count - 1, slot.group.prompt_length + request.max_new_tokens - 2)
            while len(slot.pages) * page_size <= last_fed:
                slot.pages.append(self.pages.take())
                slot.reserved -= 1
            slot_index[row] = index
            fed[row] = self.fed[index]
            page_table[row, :len(slot.pages)] = slot.pages
            lengths[row] = slot.length
            alive[row] = True
            seeds[row] = int(request.seed) % (2**32)
            samples[row] = request.first_sample + slot.sample
            steps[row] = len(slot.tokens)
            limits[row] = request.max_new_tokens
            shifts[row] = request.rope_delta
        programs = _Programs(self.switches, engine.lora, bucket_length(int(lengths.max())), count)
        arrays = (slot_index, fed, lengths, page_table, alive, seeds, samples, steps, limits, shifts)
        if self.sharding is not None:
            arrays = tuple(mesh_lib.place_array(array, self.sharding) for array in arrays)
        tokens, logprobs, self.pool, self.seen, self.slot_states = _decode(
            programs, engine.module, self.tables, self.pool, self.seen, self.slot_states, *arrays, self.values,
            self.end_array)
        tokens, logprobs = gather_to_host(tokens), gather_to_host(logprobs)
        stats = engine.stats
        stats.decode_calls += 1
        stats.decode_steps += count
        stats.row_steps += rows * count
        stats.decode_rows.append((len(live), rows))
        produced = (tokens[:len(live)] >= 0).sum(axis=1)
        stats.slot_steps += int(produced.sum())
        for row, index in enumerate(live):
            count = int(produced[row])
            self.slots[index].length += count
            self._record_many(index, tokens[row, :count].tolist(), logprobs[row, :count].tolist())
        stats.pages_in_use_per_step.append(self.pages.in_use)
        stats.live_tokens_per_step.append(self._live_tokens())

    def _live_tokens(self) -> int:
        """Tokens in the cache for live completions, each shared prompt page counted once."""
        page_size = self.engine.config.page_size
        shared: dict[int, int] = {}
        own = 0
        for slot in self.slots:
            if slot is not None:
                shared[slot.group.index] = slot.shared * page_size
                own += slot.length - slot.shared * page_size
        return own + sum(shared.values())


__all__ = ["EngineStats", "PagedEngine", "PagedEngineConfig"]
