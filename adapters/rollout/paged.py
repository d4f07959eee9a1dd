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
  after the last step. That is the ``"gather"`` attention (the CPU's). With a paged kernel (``attention``
  ``"pallas_gpu"`` / ``"pallas_tpu"``, a GPU's / TPU's default where the decoder can: Qwen2/3, Llama 3, Gemma 2/3/4, the
  native decoder's families) nothing is gathered: each step's attention layers write the fed token's key and value
  into its page and JAX's Pallas paged-attention kernel reads each row's pages where they lie
  (:mod:`~..model.paged_attention`; the pool is then laid out heads first, as the kernels take it, and chunked
  prefill feeds its tokens through the same kernel step).

A hybrid decoder's recurrent layers (gated DeltaNet: a fixed-size state per sequence instead of keys and values, see
``adapters.model.decoder_contract``) keep that state beside the pages: prefill returns each request's state after its
prompt (chunked prefill continues it chunk after chunk), admission copies it into each of the request's completions'
slots (the slot's previous state is overwritten, so a freed slot starts afresh), and decode reads and advances the
slots' states with their pages.

When a completion ends (an end token or its ``max_new_tokens``) its pages go back to the pool and its slot takes the
next waiting completion, whose request is prefilled between two decode calls if it was not already. Pages are taken
as tokens arrive, and nothing is reserved ahead (vLLM's scheduler): a waiting completion is admitted, in queue
order, when the pool holds what it needs now (its copy of the prompt's last, partly filled page and the pages its
first decode call writes) beside what the running completions' next call writes. When a decode call needs pages the
pool lacks, the prompts prefilled for waiting requests are dropped (prefilled again in their turn), then the most
recently admitted completions are *preempted by recompute* (vLLM's ``PreemptionMode.RECOMPUTE``): their pages are
freed and each goes back to the front of the queue as a request of its own, its prompt followed by the tokens it
drew but the last, which is prefilled again when re-admitted (rebuilding a hybrid decoder's recurrent state, with a
request's images and token types kept) before the completion goes on from its last token with its own stream and
penalty memory. ``EngineStats`` counts the preemptions and the tokens prefilled again. The pool's size is
``kv_cache_tokens``, or what ``gpu_memory_utilization`` leaves of the device's memory; a completion that cannot fit
even alone is refused, naming ``kv_cache_tokens``. On a mesh each device holds every page of its share of the KV
heads (split over ``tp``, as vLLM's tensor parallelism splits its KV cache; see :class:`PagedEngine`).

One scheduler serves two ways of calling it. :meth:`PagedEngine.generate` adds its requests and runs the rounds
(prefill and admit what fits, then one decode call) in the caller's thread until they are done. A
:class:`RolloutStream` (:meth:`PagedEngine.open_stream`) runs the same rounds in a thread of its own while there is
work, and :meth:`RolloutStream.submit` adds requests to the waiting queue at any time (in-flight batching: the slots
one submission's completions free take the next one's, so a batch's long tail does not run alone). Its
:meth:`RolloutStream.update_weights` is applied between two decode calls without draining the running completions:
they are preempted by recompute (their keys and values computed again with the new weights) and go on, and every
token is tagged with the weights version that drew it (``RequestOutput.versions``), its log-prob being that
version's given the whole context.

With ``async_scheduling`` (vLLM's name, :class:`PagedEngineConfig`; a GPU's and TPU's default) a round that finds the
batch unchanged dispatches the next decode call before the host reads the last one's tokens: the decode program also
returns each row's next fed token, length, token count and whether it ended, and the next call takes them where they
lie, so the device decodes while the host records tokens, schedules and uploads. The host takes beforehand the pages
each row would write if it did not end (at most ``decode_steps`` tokens more; those of a row that did end are freed
when its call is read), uploads the page table only when it changed, and a row that ended draws nothing in the call
dispatched after it: the tokens and log-probs are the synchronous rounds'. Where the batch may change (a request
waits to be admitted or prefilled, the pool lacks pages, a weights update, a smaller decode program would do) the
last call is read first and the round goes on synchronously, so the overlap is the steady decode of a long tail.

Tokens are drawn with :func:`~..sampling.stream_keys` (a request's seed, its ``first_sample`` plus the completion's
index, the token's index), so they do not depend on the slot count, the order of the requests, the prefill chunks,
the mesh or preemption.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..distributed import mesh as mesh_lib
from ..distributed.multihost import gather_to_host
from ..lora import runtime as lora_runtime
from ..model import decoder_contract, paged_attention
from ..model.tunix_model import image_blocks, positions_from_mask
from ..runtime.float32_dots import float32_dots, gather_tables
from ..runtime.tracing import record_trace, traced_cheaply
from .engine import RequestOutput, RolloutRequest, request_images
from .images import rope_deltas
from .pages import TRASH_PAGE, PagePool, pages_within_memory
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
        kv_cache_tokens: the pool's size in tokens (shared by every slot and prompt); ``None``: sized by
            ``gpu_memory_utilization`` when given, else so every slot can hold the longest request of a call at once.
        gpu_memory_utilization: with ``kv_cache_tokens=None``, the share of the device's memory the process may
            hold in all (vLLM's name, TRL's ``vllm_gpu_memory_utilization``): the pool takes what that share leaves
            beside the memory in use when a call starts (:func:`~.pages.pages_within_memory`). The programs' working
            memory is not measured, so leave it headroom. A device that reports no memory (the CPU) falls back to
            the ``kv_cache_tokens=None`` sizing, with a warning.
        max_prefill_requests: requests prefilled together in one program.
        decode_steps: tokens each decode program call adds to every live completion (the scheduler frees and
            refills slots between calls): more amortises the call, fewer refills a slot sooner.
        max_num_batched_tokens: the most prompt tokens prefilled between two decode calls (vLLM's chunked-prefill
            budget): a longer prompt is prefilled in chunks with decode calls between them, so the running
            completions keep advancing while it is read.
        attention: how decode reads the pages (:mod:`~..model.paged_attention`): ``"gather"`` copies each row's
            pages into a dense view (the CPU's way), ``"pallas_gpu"``/``"pallas_tpu"`` run JAX's paged-attention
            kernel on the pages where they lie and write each new key and value straight into its page; ``None``:
            the backend's own (:func:`~..model.paged_attention.default_attention`). A kernel asked for on another
            backend runs in Pallas' interpreter (how the CPU tests check it; slow).
        async_scheduling: dispatch each decode call before the host reads the previous one's tokens, while the
            batch stays as it is (vLLM's name; see :class:`PagedEngine`): the next call's fed tokens, lengths and
            which rows ended come from the previous call on the device, and the host schedules and uploads while the
            device decodes. Same tokens and log-probs as without it. ``None``: the backend's default
            (:func:`default_async_scheduling`).
    """

    max_num_seqs: int = 64
    page_size: int = 16
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    max_prefill_requests: int = 8
    decode_steps: int = 8
    max_num_batched_tokens: int = 2048
    attention: str | None = None
    async_scheduling: bool | None = None

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
        if self.attention is not None and self.attention not in paged_attention.ATTENTION_KINDS:
            raise ValueError(f"PagedEngineConfig.attention must be one of {paged_attention.ATTENTION_KINDS} or None "
                             f"(the backend's own), got {self.attention!r}.")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"PagedEngineConfig.kv_cache_tokens={self.kv_cache_tokens} holds less than one page "
                             f"of {self.page_size} tokens.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"PagedEngineConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}.")


@dataclass
class EngineStats:
    """What the last :meth:`PagedEngine.generate` call or stream did (for tests and benchmarks).

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
        decode_tickets: how many submissions (tickets) the live completions of each decode call belong to: above 1
            where one submission's freed slots decode another's completions (a stream's in-flight batching).
        pages: pages in the pool (the trash page excluded); page_size: tokens per page.
        peak_pages_in_use: the most pages held at once.
        pages_in_use_per_step: pages held after each decode step.
        live_tokens_per_step: tokens held by live completions and their prompts after each decode step.
        kv_bytes_per_token: bytes of keys and values one token takes over all layers.
        kv_pool_bytes: bytes of the whole pool (every layer's keys and values, the trash page included);
            kv_pool_bytes_per_device: the part of it one device holds, ``kv_pool_bytes / tp`` where the pool's KV
            heads are split over a mesh's ``tp`` (see :class:`PagedEngine`), all of it otherwise.
        preemptions: completions preempted for want of pages (each time counted).
        recomputed_tokens: tokens prefilled again to resume preempted completions (their prompts and drawn tokens),
            and the running completions a weights update recomputed.
        weight_updates: weights updates a stream applied (:meth:`RolloutStream.update_weights`).
        decode_calls_ahead: decode calls dispatched before the host read the previous call's tokens
            (``async_scheduling``); the others were built on the host from the completions as read.
        ended_row_steps: row steps those calls ran for completions that had ended before the call began (in the
            call before it, unread when it was dispatched): masked on the device, they drew nothing. Counted in
            ``row_steps``.
        page_table_uploads: decode calls that uploaded their page table; the others reused the one on the device
            (unchanged: no page taken or freed since).
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
    kv_pool_bytes: int = 0
    kv_pool_bytes_per_device: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    decode_tickets: list[int] = field(default_factory=list)
    weight_updates: int = 0
    decode_calls_ahead: int = 0
    ended_row_steps: int = 0
    page_table_uploads: int = 0


@dataclass(frozen=True)
class _Programs:
    """The static part of the engine's compiled programs."""

    switches: SamplingSwitches
    lora: str
    view: int = 0  # decode and prefill chunks: cache slots gathered per row
    steps: int = 1  # decode only: tokens per row and call
    attention: str = "gather"  # PagedEngineConfig.attention, resolved
    interpret: bool = False  # a kernel off its own backend runs in Pallas' interpreter
    heads_mesh: Mesh | None = None  # the mesh whose ``tp`` axis splits the pool's KV heads; None: pool not split
    pool_sharding: NamedSharding | None = None  # on a mesh, where the programs keep the pool; None: one device


@dataclass
class _Group:
    """A request in flight: its prompt pages, prefill progress and logits, and completions not yet admitted. A
    preempted completion comes back as a group of its own (``resumed``): its request's prompt plus the tokens it
    drew but the last, prefilled again."""

    index: int  # the request's index in its ticket
    request: RolloutRequest
    ticket: StreamTicket  # where its completions are written
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the pages
    logits: jax.Array | None = None  # the last prompt token's, once the whole prompt is prefilled
    logits_version: int | None = None  # the weights version that computed ``logits``
    next_sample: int = 0
    state: dict | None = None  # recurrent layers: the state after the prefilled tokens, one row ``[1, ...]``
    resumed: _Slot | None = None  # the preempted completion this group brings back

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def drawn(self) -> int:
        """Tokens a completion of this group holds once admitted (admission draws the first)."""
        return len(self.resumed.tokens) if self.resumed is not None else 1


@dataclass
class _Slot:
    """A completion being decoded (or preempted, waiting in its ``_Group.resumed``)."""

    group: _Group
    sample: int
    pages: list[int]
    shared: int  # the first ``shared`` pages are the group's (held, not owned)
    length: int  # tokens in the cache: its prompt's and all its drawn tokens but the last (fed next)
    admitted: int  # when it was last admitted (the scheduler's count): the latest admitted is preempted first
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # the weights version that drew each token

    @property
    def remaining(self) -> int:
        """Tokens it may still draw."""
        return self.group.request.max_new_tokens - len(self.tokens)

    @property
    def source_prompt(self) -> tuple[int, ...]:
        """Its request's own prompt (a resumed completion's group prompt also holds drawn tokens)."""
        return self.group.request.prompt_ids[:self.length + 1 - len(self.tokens)]


# The decode program's per-row arguments, in its order (:func:`_decode_program`).
_ROW_INPUTS = ("slot_index", "fed", "lengths", "page_table", "live", "seeds", "samples", "steps", "limits", "shifts")
# Those a call's outputs give the call that follows it (its ``following``); the others stay.
_CARRIED_INPUTS = ("fed", "lengths", "live", "steps")
#: The fewest cache columns the gathered view holds (``attention="gather"``): rows of fewer tokens share the 64-column
#: program instead of compiling one each for 16 and 32 columns, whose gathers save next to nothing.
MIN_VIEW = 64
#: The fewest columns a prefill program runs: prompts shorter than 64 tokens share one program instead of compiling
#: one each for 16 and 32 columns, for a prefill that is a small share of their rollout.
MIN_PREFILL_WIDTH = 64


@dataclass
class _DecodeCall:
    """A decode program call, dispatched and not yet read."""

    indices: list[int]  # the slot of each row that holds a completion (the rows after them are padding)
    slots: list[_Slot | None]  # each such row's completion when dispatched; None: it had ended (masked)
    rows: int  # the program's rows
    steps: int  # tokens per row
    inputs: dict[str, jax.Array]  # the per-row arguments (_ROW_INPUTS), on the device
    tokens: jax.Array  # [rows, steps], -1 where a row drew nothing
    logprobs: jax.Array
    following: dict[str, jax.Array]  # _CARRIED_INPUTS for the call after this one, on the device
    version: int | None  # the weights version it samples with
    ahead: bool  # dispatched before the previous call was read


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
    heads_first = paged_attention.heads_first(programs.attention)
    pool = {name: {part: _pool_write(pool[name][part], page_index, page_offset, cache[name][part], heads_first)
                   for part in ("k", "v")} for name in pool}
    return logits[:, -1], _placed_pool(programs, pool), states


def _admit_program(programs: _Programs, pool, seen, slot_states, logits, slots, tail_from, tail_to, prompt_ids,
                   counted, seeds, samples, draws, values, states):
    """Admits completions into ``slots [A]`` (``S`` for padding rows): copies page ``tail_from`` to ``tail_to`` and
    each request's recurrent ``states [A, ...]`` into its slot's, draws each first token from ``logits [A, V]`` and
    starts the penalty memory from ``prompt_ids``/``counted``. A row not ``draws [A]`` (a resumed completion, whose
    ``prompt_ids`` hold its drawn tokens) draws nothing: its penalty memory is its ``prompt_ids`` alone and its
    returned token is to be ignored.

    Returns ``(tokens [A], logprobs [A], pool, seen, slot_states)``.
    """
    rows = logits.shape[0]
    record_trace("generate", {"engine program": "admit", "rows": rows, "switches": programs.switches})
    heads_first = paged_attention.heads_first(programs.attention)
    pool = {name: {part: _pool_copy(pool[name][part], tail_to, tail_from, heads_first) for part in ("k", "v")}
            for name in pool}
    row_seen = None
    if programs.switches.repetition_penalty:
        row_index = jnp.broadcast_to(jnp.arange(rows)[:, None], prompt_ids.shape)
        row_seen = jnp.zeros((rows, logits.shape[-1]), bool).at[row_index, prompt_ids].max(counted.astype(bool))
    tokens = choose_tokens_per_row(logits, stream_keys(seeds, samples, 0), programs.switches, values, row_seen)
    temperature = values.temperature if programs.switches.do_sample else 1.0
    logprobs = token_logprobs(logits, tokens, temperature)
    if row_seen is not None:
        seen = seen.at[slots].set(jnp.where(draws[:, None], mark_seen(row_seen, tokens), row_seen), mode="drop")
    slot_states = jax.tree.map(lambda kept, new: kept.at[slots].set(new, mode="drop"), slot_states, states)
    return tokens, logprobs, _placed_pool(programs, pool), seen, slot_states


def _pool_write(pages: jax.Array, page: jax.Array, offset: jax.Array, values: jax.Array,
                heads_first: bool) -> jax.Array:
    """``pages`` (one layer's keys or values) with ``values [..., K, D]`` at ``(page, offset) [...]``, in the pool's
    layout: ``[P, page size, K, D]``, or ``[K, P, page size, D]`` where ``heads_first`` (the kernels')."""
    if heads_first:
        return pages.at[:, page, offset].set(jnp.moveaxis(values, -2, 0).astype(pages.dtype))
    return pages.at[page, offset].set(values.astype(pages.dtype))


def _pool_read(pages: jax.Array, page: jax.Array, offset: jax.Array, heads_first: bool) -> jax.Array:
    """The keys or values at ``(page, offset) [...]``: ``[..., K, D]`` in either layout (:func:`_pool_write`)."""
    return jnp.moveaxis(pages[:, page, offset], 0, -2) if heads_first else pages[page, offset]


def _pool_copy(pages: jax.Array, to: jax.Array, source: jax.Array, heads_first: bool) -> jax.Array:
    """``pages`` with whole pages ``source [A]`` copied to pages ``to [A]``."""
    if heads_first:
        return pages.at[:, to].set(pages[:, source])
    return pages.at[to].set(pages[source])


def _pool_page_size(pool: dict, heads_first: bool) -> int:
    return next(iter(pool.values()))["k"].shape[2 if heads_first else 1]


def _heads_split(mesh: Mesh, heads_first: bool) -> NamedSharding:
    """The pool's arrays (either layout, :func:`_pool_write`) with their KV heads split over ``mesh``'s ``tp`` axis,
    as the key/value projections split theirs, and every page on every data shard (any slot may read any page)."""
    heads = mesh_lib.TENSOR_PARALLEL_AXIS
    return NamedSharding(mesh, PartitionSpec(heads) if heads_first else PartitionSpec(None, None, heads))


def _placed_pool(programs: _Programs, pool: dict) -> dict:
    """``pool`` as a program returns it: on a mesh, held where the engine placed it (``programs.pool_sharding``).
    XLA is otherwise free to return it split another way (gathered whole, or over another axis), and a pool placed
    otherwise than the one taken is not donated in place and compiles every program a second time."""
    if programs.pool_sharding is None:
        return pool
    return jax.lax.with_sharding_constraint(pool, programs.pool_sharding)


def _gather_view(pool, lengths, page_table, view, extra, heads_first=False):
    """Each row's cached tokens gathered from its pages ``page_table [R, W]`` into a cache of ``view + extra``
    columns, right-aligned: row ``r``'s ``lengths[r]`` tokens end at column ``view - 1`` (so its tokens keep
    consecutive columns and the sliding-window layers of Gemma 2/3/4 see them as ``transformers`` does) and Tunix
    writes the next fed tokens at columns ``view``, ``view + 1``... (its ``end_index``, the same for every row).

    Returns ``(cache, cached [R, view + extra] bool: the columns holding the rows' tokens)``.
    """
    rows, width = page_table.shape
    page_size = _pool_page_size(pool, heads_first)
    token_index = jnp.arange(view)[None, :] - (view - lengths)[:, None]
    cached = (token_index >= 0) & (token_index < lengths[:, None])
    safe_index = jnp.clip(token_index, 0, width * page_size - 1)
    page = jnp.where(cached, jnp.take_along_axis(page_table, safe_index // page_size, axis=1), TRASH_PAGE)
    offset = jnp.where(cached, safe_index % page_size, 0)
    padding = ((0, 0), (0, extra), (0, 0), (0, 0))
    cache = {name: {"k": jnp.pad(_pool_read(pool[name]["k"], page, offset, heads_first), padding),
                    "v": jnp.pad(_pool_read(pool[name]["v"], page, offset, heads_first), padding),
                    "end_index": jnp.full((rows,), view, jnp.int32)} for name in pool}
    return cache, jnp.pad(cached, ((0, 0), (0, extra)))


def _write_fed(pool, cache, lengths, page_table, fed, view, heads_first=False):
    """Writes the keys and values of the tokens fed at cache columns ``view + s`` (``s < fed.shape[1]``) to their
    pages: row ``r``'s token ``s`` is at position ``lengths[r] + s``; those not ``fed [R, S]`` go to the trash
    page."""
    width = page_table.shape[1]
    page_size = _pool_page_size(pool, heads_first)
    positions = lengths[:, None] + jnp.arange(fed.shape[1])[None, :]
    page = jnp.take_along_axis(page_table, jnp.minimum(positions // page_size, width - 1), axis=1)
    page = jnp.where(fed, page, TRASH_PAGE)
    offset = jnp.where(fed, positions % page_size, 0)
    columns = slice(view, view + fed.shape[1])
    return {name: {part: _pool_write(pool[name][part], page, offset, cache[name][part][:, columns], heads_first)
                   for part in ("k", "v")} for name in pool}


def _step_on_pages(programs: _Programs, module, tables, pool, states, tokens, lengths, page_table, active,
                   shifts=0):
    """Feeds ``tokens [R]`` at positions ``lengths [R]`` (their rope ``shifts`` further on), row ``r`` attending to
    its first ``lengths[r]`` tokens in its pages ``page_table [R, W]`` and continuing its recurrent ``states``, and
    writes the fed tokens' keys and values to their pages (rows not ``active`` write to the trash page and keep their
    states): through a gathered view of ``programs.view`` columns, or in place with ``programs.attention``'s kernel.
    Returns ``(logits [R, V], pool, states)``."""
    if programs.attention != "gather":
        return _step_in_place(programs, module, tables, pool, states, tokens, lengths, page_table, active, shifts)
    view = programs.view
    cache, cached = _gather_view(pool, lengths, page_table, view, 1)
    cache = _with_states(cache, states, jnp.full(tokens.shape, view, jnp.int32))
    mask = cached.at[:, view].set(True)[:, None, :]
    logits, cache = _forward(module, tables, tokens[:, None], (lengths + shifts)[:, None], cache, mask)
    return logits[:, 0], _write_fed(pool, cache, lengths, page_table, active[:, None], view), _kept_states(
        _states_of(cache, pool), states, active)


def _kept_states(new: dict, old: dict, active: jax.Array) -> dict:
    """The recurrent ``new`` states of the ``active`` rows, the ``old`` ones of the others."""
    return jax.tree.map(lambda new, old: jnp.where(active.reshape(-1, *(1,) * (old.ndim - 1)), new, old), new, old)


def _step_in_place(programs: _Programs, module, tables, pool, states, tokens, lengths, page_table, active, shifts):
    """:func:`_step_on_pages` with a paged kernel (``programs.attention``): each attention layer writes the fed
    token's key and value to its page and reads the row's pages where they lie (:mod:`~..model.paged_attention`);
    nothing is gathered."""
    page_size = _pool_page_size(pool, True)
    width = page_table.shape[1]
    page = jnp.take_along_axis(page_table, jnp.minimum(lengths // page_size, width - 1)[:, None], axis=1)[:, 0]
    page = jnp.where(active, page, TRASH_PAGE)
    offset = jnp.where(active, lengths % page_size, 0)
    start = jnp.zeros(tokens.shape, jnp.int32)
    cache = {name: {"k_pages": pool[name]["k"], "v_pages": pool[name]["v"], "page_table": page_table,
                    "kv_lengths": lengths + 1, "write_page": page, "write_offset": offset, "end_index": start}
             for name in pool}
    cache = _with_states(cache, states, start)
    with paged_attention.using(programs.attention, programs.interpret, programs.heads_mesh):
        logits, cache = _forward(module, tables, tokens[:, None], (lengths + shifts)[:, None], cache,
                                 jnp.ones((tokens.shape[0], 1, 1), bool))
    pool = {name: {"k": cache[name]["k_pages"], "v": cache[name]["v_pages"]} for name in pool}
    return logits[:, 0], pool, _kept_states(_states_of(cache, pool), states, active)


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
        logits, pool, states = _step_on_pages(programs, nnx.merge(graphdef, state), tables, pool, states,
                                              chunk_ids[:, step], starts + step, page_table, step < counts)
        return pool, states, jnp.where((step == counts - 1)[:, None], logits, last)

    pool, states, last = jax.lax.fori_loop(0, jnp.max(counts), one_token,
                                           (pool, states, jnp.zeros((groups, vocab), jnp.float32)))
    return last, _placed_pool(programs, pool), states


def _decode_program(programs: _Programs, module, tables, pool, seen, slot_states, slot_index, tokens, lengths,
                    page_table, live, seeds, samples, steps, limits, shifts, values, end_ids):
    """``programs.steps`` tokens for each of ``R`` rows, row ``r`` being slot ``slot_index[r]`` (``S``, out of
    range, for padding). Each step feeds a row's last token at cache position ``lengths [R]`` plus the step, its
    rope position ``shifts [R]`` further on (a multimodal rope's ``rope_deltas``, 0 for text); a row stops once it
    draws an end token or its ``limits [R]``-th token (``steps [R]`` counts the tokens it had), and a row not
    ``live [R]`` draws nothing (its keys and values go to the trash page).

    With ``"gather"`` attention the rows' pages are gathered once into a right-aligned cache (:func:`_gather_view`)
    that the steps extend as the static sampler's does, and the fed tokens' keys and values go to their pages once,
    after the last step; with a paged kernel each step writes them to their pages and attends in place
    (:func:`_step_in_place`). The slots' recurrent states are read from ``slot_states`` and written back after the
    last step (a row that stopped within the call advanced its state on, but its slot is freed and reset at its next
    admission).

    Returns ``(tokens [R, steps], logprobs [R, steps], pool, seen, slot_states, following)``, ``-1`` after a row
    stopped. ``following`` holds the next call's ``fed`` (each row's last drawn token), ``lengths``, ``steps`` (each
    advanced by the tokens the row drew) and ``live`` (the rows that did not stop), so a call can follow this one
    without the host reading it (``PagedEngineConfig.async_scheduling``): a row that stopped here draws nothing there.
    """
    rows = page_table.shape[0]
    view, count = programs.view, programs.steps
    record_trace("generate", {"engine program": "decode", "slots": rows, "view": view, "steps": count,
                              "switches": programs.switches})
    graphdef, state = nnx.split(module)
    temperature = values.temperature if programs.switches.do_sample else 1.0
    states = jax.tree.map(lambda kept: kept.at[slot_index].get(mode="clip"), slot_states)
    in_place = programs.attention != "gather"
    if in_place:
        memory = (pool, states)
    else:
        cache, cached = _gather_view(pool, lengths, page_table, view, count)
        memory = _with_states(cache, states, jnp.full((rows,), view, jnp.int32))
        columns = jnp.arange(view + count)[None, :]

    def advance(memory, step, tokens, active):
        """One step's logits ``[R, V]`` and the memory (cache view, or pool and states) after it."""
        module = nnx.merge(graphdef, state)
        if in_place:
            pool, states = memory
            logits, pool, states = _step_in_place(programs, module, tables, pool, states, tokens, lengths + step,
                                                  page_table, active, shifts)
            return logits, (pool, states)
        mask = (cached | ((columns >= view) & (columns <= view + step)))[:, None, :]
        logits, memory = _forward(module, tables, tokens[:, None], (lengths + step + shifts)[:, None], memory, mask)
        return logits[:, 0], memory

    def one_step(step, carry):
        memory, seen, tokens, done, out_tokens, out_logprobs = carry
        active = live & ~done
        logits, memory = advance(memory, step, tokens, active)
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
        return memory, seen, jnp.where(active, drawn, tokens), done | (active & ended), out_tokens, out_logprobs

    carry = (memory, seen, tokens, jnp.zeros_like(live), jnp.full((rows, count), -1, jnp.int32),
             jnp.zeros((rows, count), jnp.float32))
    memory, seen, fed, done, out_tokens, out_logprobs = jax.lax.fori_loop(0, count, one_step, carry)
    produced = (out_tokens >= 0).sum(axis=1, dtype=jnp.int32)
    following = {"fed": fed, "lengths": lengths + produced, "live": live & ~done, "steps": steps + produced}
    if in_place:
        pool, states = memory
    else:
        states = _states_of(memory, pool)
        # A step's fed token is kept when the row was active at that step, i.e. drew a token there.
        pool = _write_fed(pool, {name: memory[name] for name in pool}, lengths, page_table, out_tokens >= 0, view)
    slot_states = jax.tree.map(lambda kept, new: kept.at[slot_index].set(new, mode="drop"), slot_states, states)
    return out_tokens, out_logprobs, _placed_pool(programs, pool), seen, slot_states, following


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


def _pool_bytes(pool: dict) -> tuple[int, int]:
    """Bytes of the pool's arrays: whole, and the part one device holds (as their shardings split them)."""
    arrays = [array for entry in pool.values() for array in entry.values()]
    return (sum(array.nbytes for array in arrays),
            sum(math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize for array in arrays))


# --------------------------------------------------------------------------- the engine

#: The JAX platform names of a GPU or TPU (those with a paged kernel of their own), where the engine's accelerator
#: defaults apply.
_ACCELERATORS = frozenset().union(*paged_attention.KERNEL_PLATFORMS.values())


def _on_accelerator(platform: str | None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is a GPU or TPU."""
    return (platform or jax.default_backend()) in _ACCELERATORS


def default_async_scheduling(platform: str | None = None) -> bool:
    """Whether the paged engine dispatches a decode call before reading the previous one on ``platform`` (default:
    JAX's default backend) when ``PagedEngineConfig.async_scheduling`` is ``None``: on a GPU or TPU, whose device
    otherwise idles while the host reads a call's tokens, schedules and uploads the next one. Not on the CPU, where
    the host's part of a round is a small share of it and the rows a call dispatched ahead runs for completions
    that had ended cost more than the overlap saves (``benchmarks/rollout.py --async-scheduling``)."""
    return _on_accelerator(platform)


def min_decode_rows(platform: str | None = None) -> int:
    """The fewest rows a decode program runs on ``platform`` (default: JAX's default backend): a long tail of fewer
    live completions runs on that many rows (or on every slot, where there are fewer).

    8 on a GPU or TPU, as vLLM's TPU runner pads its request count to at least 8 (``MIN_NUM_SEQS``): fewer rows fill
    no less of a TPU's 8-row tiles or a GPU's tensor-core tiles, and each further halving is one more program to
    compile for the tail's few calls. 1 on the CPU, where the rows cost compute: with an 8-row floor the ``cpu``
    preset of ``benchmarks/rollout.py`` (hidden 896) decoded its tail at 358 ms a call against 267 ms, 159 useful
    tokens/s against 236.
    """
    return 8 if _on_accelerator(platform) else 1


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
        mesh: when given, the slots are spread over its data axes (each device decodes its own slots) and the pool's
            KV heads over its tensor-parallel axis ``tp``, as the key/value projections split theirs: each device
            holds every page of its ``K / tp`` heads (:attr:`kv_pool`, ``EngineStats.kv_pool_bytes_per_device``),
            with either attention (a paged kernel runs on each device's heads). Where a layer's KV heads do not
            divide by ``tp`` the pool is whole on every device, with a warning (vLLM refuses such a split, or
            replicates the heads). With several processes every process runs the same scheduler on the same tokens.

    With ``async_scheduling`` (vLLM's name; the GPU's and TPU's default) the next decode call is dispatched before the
    host reads the last one's tokens while the batch stays as it is (nothing waits to be admitted or prefilled, no
    pages are short, the program keeps its rows): its fed tokens, lengths, token counts and which rows ended are the
    last call's outputs, on the device, and the host takes beforehand the pages each row would write if it did not
    end (those of rows that did are freed when the host reads them). Rows that ended draw nothing, so the tokens and
    log-probs are those of the synchronous rounds; any change of the batch (an admission, a prefill chunk, a
    preemption, a weights update, a smaller program) reads the last call first (``EngineStats.decode_calls_ahead``,
    ``EngineStats.ended_row_steps``).

    Example:

    ```python
    >>> mesh = torchlike.make_mesh((4, 2))  # fsdp=4 x tp=2
    >>> model = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh)
    >>> engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=8), eos_token_ids=[2], mesh=mesh)
    >>> outputs = engine.generate(requests, SamplingSettings(do_sample=True, temperature=0.9))
    >>> engine.stats.kv_pool_bytes_per_device * 2 == engine.stats.kv_pool_bytes  # 2 KV heads split over tp=2
    True
    ```
    """

    def __init__(self, module: nnx.Module, config: PagedEngineConfig | None = None, eos_token_ids: Sequence[int] = (),
                 pad_token_id: int = 0, lora: str = lora_runtime.EVAL, mesh: Mesh | None = None):
        self.module = module
        self.config = config or PagedEngineConfig()
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.lora = lora
        self.mesh = mesh
        attention = self.config.attention or paged_attention.default_attention()
        refusal = None if attention == "gather" else decoder_contract.paged_kernel_refusal(module)
        if refusal is not None and self.config.attention is not None:
            raise NotImplementedError(f"PagedEngineConfig.attention={attention!r}: {refusal}. Use attention='gather' "
                                      "(the dense page view; rollout_attention='gather' in a trainer config).")
        if refusal is not None:  # the backend's kernel by default: the dense view where it cannot serve the model
            attention = "gather"
        self.kernel = {"attention": attention, "interpret": paged_attention.interpreted(attention)}
        self.min_decode_rows = min_decode_rows()
        self.async_scheduling = (default_async_scheduling() if self.config.async_scheduling is None
                                 else bool(self.config.async_scheduling))
        # Where the pool lies on a mesh (``_Programs``' fields of the same names, as ``kernel``'s are).
        self._placement = {"heads_mesh": self._heads_mesh()}
        self._placement["pool_sharding"] = None if mesh is None else self._pool_sharding()
        self.stats = EngineStats()
        self._pool: dict | None = None
        self._pool_pages = 0
        self._pool_token_bytes = 0  # the pool's keys and values per token (EngineStats.kv_bytes_per_token)

    # ------------------------------------------------------------------ protocol
    def update_weights(self, module: nnx.Module) -> None:
        """Samples from ``module`` from the next call (or stream opened) on. The engine reads the module's
        parameters at each call (no copy is kept), so a policy updated in place needs no call; a new module object
        does. An open stream changes weights with :meth:`RolloutStream.update_weights`."""
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
            ValueError: a request's completion cannot fit the page pool even alone (the message names
                ``kv_cache_tokens``).
        """
        requests = list(requests)
        if not requests:
            return []
        self.stats = EngineStats(page_size=self.config.page_size)
        scheduler = _Scheduler(self, settings)
        ticket = StreamTicket(requests)
        scheduler.add(requests, ticket)
        try:
            with lora_runtime.lora_mode(self.lora):
                while scheduler.round():
                    pass
        finally:
            scheduler.finish()
        return ticket.result()

    def open_stream(self, settings: SamplingSettings, version: int = 0) -> RolloutStream:
        """A :class:`RolloutStream` on this engine: requests submitted at any time join one running scheduler (the
        freed slots of one submission take the next one's completions), sampled from this engine's module, tagged
        ``version``, until :meth:`RolloutStream.update_weights`. The engine's :attr:`stats` are the stream's until
        its next call. Close it (:meth:`RolloutStream.close`) before opening another."""
        self.stats = EngineStats(page_size=self.config.page_size)
        return RolloutStream(_Scheduler(self, settings, version))

    # ------------------------------------------------------------------ pool
    @property
    def kv_pool(self) -> dict[str, dict[str, jax.Array]] | None:
        """The page pool kept between calls: ``{layer: {"k", "v"}}`` in the attention's layout (``[P, page size, K,
        D]``, or ``[K, P, page size, D]`` for a paged kernel), on a mesh with its KV heads split over ``tp`` (see the
        class docstring); ``None`` before the first call, after :meth:`close` and while a call or stream runs. For
        inspection (placement, memory): the next call donates these arrays to its programs."""
        return self._pool

    def _heads_mesh(self) -> Mesh | None:
        """The mesh whose ``tp`` axis splits the pool's KV heads: :attr:`mesh` when ``tp`` is above 1 and divides
        every attention layer's KV heads; ``None`` otherwise (the pool whole on every device, with a warning where
        ``tp`` is above 1)."""
        tp = 1 if self.mesh is None else mesh_lib.tensor_parallel_size(self.mesh)
        if tp == 1:
            return None
        heads = sorted({shape[0] for shape in decoder_contract.kv_cache_shapes(self.module).values()})
        if all(count % tp == 0 for count in heads):
            return self.mesh
        warnings.warn(
            f"the paged engine's KV pool is whole on every device of the mesh: the model's KV heads per layer "
            f"({', '.join(map(str, heads))}) do not divide by its tensor-parallel size tp={tp}, so the pool takes tp "
            "times the KV memory of a split one. Choose a tp that divides the KV heads to split the pool over it "
            "(vLLM asks the same of tensor_parallel_size).", stacklevel=3)
        return None

    def _pool_split(self) -> int:
        """How many ways the pool's KV heads are split over the devices: the mesh's ``tp`` where
        :meth:`_heads_mesh` splits them, else 1."""
        mesh = self._placement["heads_mesh"]
        return 1 if mesh is None else mesh_lib.tensor_parallel_size(mesh)

    def _pool_sharding(self) -> jax.sharding.Sharding:
        """Where the pool lives: its KV heads split over ``tp`` (:func:`_heads_split`), else as :meth:`_replicated`
        says (the programs keep it there: :func:`_placed_pool`)."""
        mesh = self._placement["heads_mesh"]
        if mesh is None:
            return self._replicated()
        return _heads_split(mesh, paged_attention.heads_first(self.kernel["attention"]))

    def _kv_bytes_per_token(self, shapes: dict | None = None) -> int:
        """Bytes of keys and values one token takes over all layers, from the one-token cache ``shapes`` (traced
        from the module when not given)."""
        shapes = shapes if shapes is not None else jax.eval_shape(lambda: init_cache(self.module, 1, 1))
        return int(sum(entry[part].dtype.itemsize * entry[part].size
                       for entry in shapes.values() if "k" in entry for part in ("k", "v")))

    def _pages_within_memory(self) -> int | None:
        """The pool's usable pages under ``gpu_memory_utilization`` (:func:`~.pages.pages_within_memory`), the pool
        this engine already holds counted as free; ``None``, with a warning, where the device reports no memory."""
        fraction = self.config.gpu_memory_utilization
        device = jax.local_devices()[0]
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats or "bytes_in_use" not in stats:
            warnings.warn(
                f"PagedEngineConfig.gpu_memory_utilization={fraction} needs the device's memory_stats() "
                f"(bytes_limit, bytes_in_use), which {device.platform} does not report; the KV pool is sized as with "
                "kv_cache_tokens=None instead (every slot can hold the call's longest request). Give kv_cache_tokens "
                "to size it yourself.", stacklevel=4)
            return None
        _, held = _pool_bytes(self._pool or {})
        return pages_within_memory(stats["bytes_limit"], stats["bytes_in_use"] - held, fraction,
                                   self._kv_bytes_per_token() // self._pool_split(), self.config.page_size)

    def _take_pool(self, pages: int) -> dict:
        """The page pool of ``pages`` pages, kept from the last call when it has that size. The caller owns it (the
        programs donate it) until it hands the last version back with :meth:`_keep_pool`."""
        if self._pool is None or self._pool_pages != pages:
            shapes = jax.eval_shape(lambda: init_cache(self.module, 1, 1))
            page_size = self.config.page_size

            def zeros():
                def layout(heads, dim):  # the pool's layout (``_pool_write``): the kernels' puts the heads first
                    if paged_attention.heads_first(self.kernel["attention"]):
                        return heads, pages, page_size, dim
                    return pages, page_size, heads, dim

                return {name: {part: jnp.zeros(layout(*entry[part].shape[2:]), entry[part].dtype)
                               for part in ("k", "v")} for name, entry in shapes.items() if "k" in entry}

            self._pool = jax.jit(zeros, out_shardings=self._pool_sharding())()
            self._pool_pages = pages
            self._pool_token_bytes = self._kv_bytes_per_token(shapes)
        self.stats.kv_bytes_per_token = self._pool_token_bytes
        # As placed (the programs keep it there: _placed_pool).
        self.stats.kv_pool_bytes, self.stats.kv_pool_bytes_per_device = _pool_bytes(self._pool)
        pool, self._pool = self._pool, None
        return pool

    def _keep_pool(self, pool: dict, pages: int) -> None:
        self._pool, self._pool_pages = pool, pages

    def _replicated(self) -> jax.sharding.Sharding:
        """Where the engine's own arrays (penalty memory, recurrent states, a pool whose KV heads are not split)
        live: replicated over the mesh, or on the module's device. Made *committed* there, as the programs' outputs
        that replace them are: an uncommitted first version would compile each program that takes it a second
        time."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, PartitionSpec())
        leaf = jax.tree.leaves(nnx.state(self.module))[0]
        return jax.sharding.SingleDeviceSharding(min(leaf.devices(), key=lambda device: device.id))

    def _zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """Zeros placed as :meth:`_replicated` says."""
        return mesh_lib.place_array(np.zeros(shape, dtype), self._replicated())


class StreamTicket:
    """One submission's completions (:meth:`RolloutStream.submit`; :meth:`PagedEngine.generate` uses one too)."""

    def __init__(self, requests: Sequence[RolloutRequest]):
        self._outputs = [RequestOutput() for _ in requests]
        self._remaining = sum(request.num_samples for request in requests)
        self._done = threading.Event()
        self._error: BaseException | None = None
        if not self._remaining:
            self._done.set()

    def done(self) -> bool:
        """Whether every completion is done (or the stream failed)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[RequestOutput]:
        """Waits for every completion of the submission; returns one :class:`~.engine.RequestOutput` per request, in
        order, each token tagged with the weights version that drew it.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            Exception: what the stream's scheduler raised (a request that cannot fit the pool: ``ValueError``), or
                ``RuntimeError`` when the stream was closed first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the rollout stream's submission was not done within {timeout} s.")
        if self._error is not None:
            raise self._error
        return self._outputs

    def _finished(self, index: int, sample: int, tokens: list[int], logprobs: list[float],
                  versions: list[int] | None, ended: bool) -> None:
        """Records completion ``sample`` of request ``index``; the last one makes the ticket done."""
        output = self._outputs[index]
        while len(output.token_ids) <= sample:
            output.token_ids.append(None)
            output.logprobs.append(None)
            output.ended.append(False)
            if versions is not None:
                output.versions.append(None)
        output.token_ids[sample] = np.asarray(tokens, np.int32)
        output.logprobs[sample] = np.asarray(logprobs, np.float32)
        output.ended[sample] = bool(ended)
        if versions is not None:
            output.versions[sample] = np.asarray(versions, np.int32)
        self._remaining -= 1
        if not self._remaining:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()


class RolloutStream:
    """A paged engine's scheduler running in a thread of its own (:meth:`PagedEngine.open_stream`): in-flight
    batching across submissions.

    :meth:`submit` queues requests behind the waiting ones at any time; the thread runs the scheduler's rounds
    (prefill, admit, decode) while there is work, so a submission's completions take the slots another's freed and
    the decode calls never wait for a whole batch to end. :meth:`update_weights` is applied between two decode
    calls: the running completions are not drained, they go on with the new weights (their keys and values
    recomputed, see :meth:`_Scheduler.update_weights`), and each token is tagged with the version that drew it
    (:attr:`~.engine.RequestOutput.versions`). Tokens do not depend on what else was submitted: with unchanged
    weights a submission gets the tokens a :meth:`PagedEngine.generate` call of its requests gets. The stream's
    sizes (slots, and the pool without ``kv_cache_tokens``) are those of its first submission.
    """

    def __init__(self, scheduler: _Scheduler):
        self._scheduler = scheduler
        self.stats = scheduler.stats
        self._condition = threading.Condition()
        self._submitted: list[tuple[list[RolloutRequest], StreamTicket]] = []
        self._update: tuple[nnx.Module, int] | None = None
        self._closing = False
        self._error: BaseException | None = None
        self.version = scheduler.version
        self._thread = threading.Thread(target=self._serve, name="torchlike-rollout-stream", daemon=True)
        self._thread.start()

    def submit(self, requests: Sequence[RolloutRequest]) -> StreamTicket:
        """Queues ``requests`` (sampled with the stream's settings); returns the ticket their completions go to."""
        requests = list(requests)
        ticket = StreamTicket(requests)
        with self._condition:
            self._check_open()
            if requests:
                self._submitted.append((requests, ticket))
                self._condition.notify()
        return ticket

    def update_weights(self, module: nnx.Module, version: int) -> None:
        """Samples from ``module`` from the next decode call on, its tokens tagged ``version`` (a later update
        before then replaces this one)."""
        with self._condition:
            self._check_open()
            self._update = (module, int(version))
            self.version = int(version)
            self._condition.notify()

    def close(self) -> None:
        """Stops the thread after its current round and joins it; submissions not done then fail with
        ``RuntimeError`` in :meth:`StreamTicket.result`. The pool goes back to the engine."""
        with self._condition:
            self._closing = True
            self._condition.notify()
        self._thread.join()
        closed = RuntimeError("the rollout stream was closed before this submission's completions were done.")
        self._scheduler.fail(closed)
        for _, ticket in self._submitted:
            ticket._fail(closed)

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("the rollout stream is closed; open another with PagedEngine.open_stream.")
        if self._error is not None:
            raise RuntimeError("the rollout stream's thread failed; see the error above.") from self._error

    def _serve(self) -> None:
        scheduler = self._scheduler
        try:
            with lora_runtime.lora_mode(scheduler.engine.lora):
                while True:
                    with self._condition:
                        while not (self._closing or self._submitted or self._update is not None
                                   or (scheduler.pages is not None and scheduler.busy)):
                            self._condition.wait()
                        if self._closing:
                            return
                        submitted, self._submitted = self._submitted, []
                        update, self._update = self._update, None
                    if update is not None:
                        scheduler.update_weights(*update)
                    for requests, ticket in submitted:
                        try:
                            scheduler.add(requests, ticket)
                        except ValueError as error:  # this submission cannot run; the others go on
                            ticket._fail(error)
                    if scheduler.pages is not None:
                        scheduler.round()
        except BaseException as error:  # surfaced by every waiting ticket's result()
            with self._condition:
                self._error = error
                pending, self._submitted = self._submitted, []
            scheduler.fail(error)
            for _, ticket in pending:
                ticket._fail(error)
        finally:
            scheduler.finish()


class _Scheduler:
    """The scheduler's state and rounds: requests join its queue whenever they are added (:meth:`add`), and each
    :meth:`round` prefills, admits and decodes once. :meth:`PagedEngine.generate` runs the rounds in the caller's
    thread until the queue is empty; a :class:`RolloutStream` runs them in its own thread while there is work."""

    def __init__(self, engine: PagedEngine, settings: SamplingSettings, version: int | None = None):
        self.engine = engine
        self.stats = engine.stats
        self.module = engine.module
        self.version = version  # the weights version each token is tagged with; None: not tagged
        self.switches = settings.switches()
        self.values = SamplingValues(*(np.float32(value) for value in settings.traced_values()))
        self.waiting: deque[_Group] = deque()
        self.tickets: list[StreamTicket] = []  # added and not yet done
        self.end_ids = set(engine.eos_token_ids)
        self.parallel = 1 if engine.mesh is None else mesh_lib.data_parallel_size(engine.mesh)
        # Where the decode rows' arguments are placed: committed there, as the outputs a call dispatched ahead takes
        # them from are (an uncommitted argument would compile the program a second time).
        self.sharding = engine._replicated() if engine.mesh is None else mesh_lib.batch_sharding(engine.mesh)
        self.programs = _Programs(self.switches, engine.lora, **engine.kernel, **engine._placement)
        self.end_array = end_token_array(engine.eos_token_ids)
        self.prefill_budget = engine.config.max_num_batched_tokens  # prompt tokens left before the next decode
        # The embedding tables' bits for these weights' programs (XLA:CPU only, see ``float32_dots``).
        self.tables = gather_tables(self.module)
        self.table_width = 0
        self.longest_prompt = 0
        self.pages: PagePool | None = None  # sized by the first requests added (:meth:`_size`)
        self.pending: _DecodeCall | None = None  # async scheduling: the decode call dispatched and not yet read
        self.uploaded_table: tuple[np.ndarray, jax.Array] | None = None  # the last page table uploaded, both sides

    def _size(self, requests: list[RolloutRequest]) -> None:
        """Sizes the slots and the pool for the first requests added (the pool as ``kv_cache_tokens``,
        ``gpu_memory_utilization`` or, without either, so every slot holds the longest of these requests)."""
        engine = self.engine
        config = engine.config
        total = sum(request.num_samples for request in requests)
        self.num_slots = -(-min(config.max_num_seqs, _power_of_two(total)) // self.parallel) * self.parallel
        page_size = config.page_size
        longest = max(len(request.prompt_ids) + request.max_new_tokens for request in requests)
        pages = None
        if config.kv_cache_tokens is not None:
            pages = -(-config.kv_cache_tokens // page_size)
        elif config.gpu_memory_utilization is not None:
            pages = engine._pages_within_memory()
        if pages is None:
            longest_prompt = max(len(request.prompt_ids) for request in requests)
            pages = (self.num_slots * -(-longest // page_size)
                     + config.max_prefill_requests * -(-longest_prompt // page_size))
        self.pages = PagePool(pages + 1, page_size)
        self.stats.pages = self.pages.usable
        self.pool = engine._take_pool(self.pages.num_pages)
        vocab = decoder_contract.vocab_size(self.module)
        self.seen = engine._zeros((self.num_slots, vocab if self.switches.repetition_penalty else 1), bool)
        # Recurrent layers: each slot's state (the pool holds only the attention layers' keys and values).
        self.slot_states = {name: {part: engine._zeros((self.num_slots, *shape), kind)
                                   for part, (shape, kind) in entries.items()}
                            for name, entries in decoder_contract.recurrent_state_shapes(self.module).items()}
        self.slots: list[_Slot | None] = [None] * self.num_slots
        self.admissions = 0  # completions admitted so far, resumed ones again: the order preemption undoes
        self.fed = np.zeros(self.num_slots, np.int32)

    def add(self, requests: list[RolloutRequest], ticket: StreamTicket) -> None:
        """Queues ``requests`` behind the waiting ones; their completions are written to ``ticket``.

        Raises:
            ValueError: a request's completion cannot fit the page pool even alone (nothing is queued).
        """
        if self.pages is None:
            self._size(requests)
        page_size = self.engine.config.page_size
        usable = self.pages.usable
        for request in requests:
            # Its prompt's pages (held for the request's other completions) and its own: the most one completion
            # can hold running alone, every other one preempted.
            alone = -(-len(request.prompt_ids) // page_size) + self._own_pages(request)
            if alone > usable:
                raise ValueError(
                    f"a completion of a request of {len(request.prompt_ids)} prompt tokens and max_new_tokens="
                    f"{request.max_new_tokens} needs {alone * page_size} KV cache tokens even alone, more than the "
                    f"pool's kv_cache_tokens={usable * page_size}; raise kv_cache_tokens (or "
                    "gpu_memory_utilization; TRL: vllm_gpu_memory_utilization) or shorten the request.")
        longest = max(len(request.prompt_ids) + request.max_new_tokens for request in requests)
        self.table_width = max(self.table_width, -(-longest // page_size))
        self.longest_prompt = max(self.longest_prompt, *(len(request.prompt_ids) for request in requests))
        self.waiting.extend(_Group(index, request, ticket) for index, request in enumerate(requests))
        self.tickets.append(ticket)

    def _own_pages(self, request: RolloutRequest) -> int:
        """The most pages a completion holds beyond its request's shared full pages (the last new token is never
        fed)."""
        page_size = self.engine.config.page_size
        length = len(request.prompt_ids)
        return -(-(length + request.max_new_tokens - 1) // page_size) - length // page_size

    @property
    def busy(self) -> bool:
        """Whether a completion is waiting or running, or a decode call is to be read."""
        return bool(self.waiting) or any(slot is not None for slot in self.slots) or self.pending is not None

    def round(self) -> bool:
        """One round: prefills and admits what fits, then one decode call for the live completions. With async
        scheduling a round that finds the batch unchanged dispatches the call that follows the pending one and then
        reads the pending one instead (:meth:`_continue_ahead`). Returns whether work remains."""
        if self.pending is not None and self._continue_ahead():
            return True
        progressed = self._admit_waiting()
        live = [index for index, slot in enumerate(self.slots) if slot is not None]
        if not live:
            if not self.waiting:
                return False
            # The first waiting completion does not fit beside the prompts prefilled after it: drop those.
            if not progressed and not self._drop_a_waiting_prefill(spare=self.waiting[0]):
                raise RuntimeError("the rollout engine could not admit a waiting request; this is a bug.")
            return True  # a prompt is still being prefilled chunk by chunk
        self._decode_step(live)
        return True

    def update_weights(self, module: nnx.Module, version: int) -> None:
        """Samples with ``module`` (tagged ``version``) from the next round on. The running completions are
        preempted by recompute and the waiting prompts' prefills dropped, so their keys and values (and a hybrid's
        recurrent states) are computed again with the new weights: every token is then drawn from one version's
        distribution given its whole context, the one its log-prob is taken under."""
        self._read_pending()  # its tokens are the old weights'
        self.module, self.version = module, version
        self.tables = gather_tables(module)
        self.stats.weight_updates += 1
        if self.pages is None:
            return
        running = [index for index, slot in enumerate(self.slots) if slot is not None]
        for index in sorted(running, key=lambda index: self.slots[index].admitted, reverse=True):
            self._preempt(index, for_pages=False)
        while self._drop_a_waiting_prefill():
            pass

    def finish(self) -> None:
        """Hands the pool back to the engine (kept for its next call or stream); a decode call not read is dropped
        (its completions' tickets are failed or done)."""
        self.pending = None
        if self.pages is not None:
            self.engine._keep_pool(self.pool, self.pages.num_pages)
            self.stats.peak_pages_in_use = self.pages.peak_in_use

    def fail(self, error: BaseException) -> None:
        """Fails every ticket not yet done with ``error``."""
        for ticket in self.tickets:
            ticket._fail(error)
        self.tickets.clear()

    # ------------------------------------------------------------------ admission
    def _admit_waiting(self) -> bool:
        """Prefills (within the round's ``max_num_batched_tokens``) and admits waiting completions into free slots,
        in queue order, each when the pool holds what it needs now (:meth:`_pages_to_start`) beside what the
        running completions' next decode call needs; returns whether it prefilled or admitted any."""
        self.prefill_budget = self.engine.config.max_num_batched_tokens
        programs_before = self.stats.prefill_programs
        free = [index for index, slot in enumerate(self.slots) if slot is None]
        admitted: list[tuple[int, _Group, int]] = []
        promised = 0  # pages the completions admitted this round take at admission and in their first decode call
        while free and self.waiting:
            group = self.waiting[0]
            if group.logits is None and not self._prefill_next(len(free), promised):
                break
            need = self._pages_to_start(group)
            if need > self._room() - promised:
                break
            promised += need
            sample = group.resumed.sample if group.resumed is not None else group.next_sample
            group.next_sample += 1
            if group.next_sample == group.request.num_samples:
                self.waiting.popleft()
            admitted.append((free.pop(0), group, sample))
        if admitted:
            self._admit(admitted)
        return bool(admitted) or self.stats.prefill_programs > programs_before

    def _prefill_next(self, free_slots: int, promised: int) -> bool:
        """Prefills the next chunks of the waiting prompts, at most the round's remaining ``max_num_batched_tokens``:
        the prompts already started, then new ones (at least the first waiting, as many as fill ``free_slots``);
        a new prompt only when the pool holds its pages and its first completion's start beside what the
        ``promised`` admissions and every request ahead of it in the queue need to start. Returns whether the first
        waiting request is wholly prefilled."""
        config = self.engine.config
        stats = self.stats
        chosen: list[tuple[_Group, int]] = []
        covered = 0
        room = self._room() - promised
        for group in self.waiting:
            if len(chosen) == config.max_prefill_requests or covered >= free_slots or not self.prefill_budget:
                break
            start = self._pages_to_start(group)
            if group.logits is not None:
                covered += group.request.num_samples - group.next_sample
                room -= start
                continue
            if not group.pages:
                need = self.pages.pages_for(group.prompt_length)
                if need + start > room:
                    break
                group.pages = [self.pages.take() for _ in range(need)]
                room -= need
                stats.prefills += 1
                if group.resumed is not None:
                    stats.recomputed_tokens += group.prompt_length
            room -= start
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
        width = max(MIN_PREFILL_WIDTH, bucket_length(max(count for _, count in chosen)))
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
        logits, self.pool, states = _prefill(self.programs, self.module, self.tables, self.pool, prompt_ids,
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
        # One view for the longest prompt added, so every chunk runs one program per row count.
        programs = replace(self.programs, view=self._view(self.longest_prompt))
        states = _stacked([group.state for group, _ in chosen], rows)
        logits, self.pool, states = _prefill_chunk(programs, self.module, self.tables, self.pool, chunk_ids,
                                                   starts, counts, page_table, states)
        self._prefilled(chosen, logits, states)

    def _prefilled(self, chosen: list[tuple[_Group, int]], logits: jax.Array, states: dict) -> None:
        """Records a prefill program's chunks; each group keeps its recurrent state, and a group whose prompt is
        complete its last token's logits."""
        stats = self.stats
        for row, (group, count) in enumerate(chosen):
            group.state = jax.tree.map(lambda value, row=row: value[row:row + 1], states)
            group.prefilled += count
            if group.prefilled == group.prompt_length:
                group.logits, group.logits_version = logits[row], self.version
            stats.prefill_chunks.append((group.index, count, stats.decode_calls))
        stats.prefill_programs += 1

    def _admit(self, admitted: list[tuple[int, _Group, int]]) -> None:
        engine = self.engine
        page_size = engine.config.page_size
        rows = self.num_slots  # one admission program per call shape: it runs no model layer
        # The penalty memory counts the prompt and, for a resumed completion, every token it drew.
        penalised = [group.request.penalised_ids + group.request.prompt_ids
                     + (tuple(group.resumed.tokens[-1:]) if group.resumed is not None else ())
                     for _, group, _ in admitted]
        prompt_width = bucket_length(max(map(len, penalised)))
        slot_index = np.full(rows, self.num_slots, np.int32)
        tail_from = np.full(rows, TRASH_PAGE, np.int32)
        tail_to = np.full(rows, TRASH_PAGE, np.int32)
        prompt_ids = np.zeros((rows, prompt_width), np.int32)
        counted = np.zeros((rows, prompt_width), np.int32)
        seeds = np.zeros(rows, np.uint32)
        samples = np.zeros(rows, np.int32)
        draws = np.zeros(rows, bool)
        logits = []
        states = []
        finished_groups: list[_Group] = []
        for row, (index, group, sample) in enumerate(admitted):
            request = group.request
            length = group.prompt_length
            shared = length // page_size
            pages = list(group.pages[:shared])
            self.pages.hold(pages)
            if length % page_size:
                if group.resumed is not None or sample == request.num_samples - 1:  # the last takes the page itself
                    tail = group.pages[shared]
                    self.pages.hold([tail])
                else:
                    tail = self.pages.take()
                tail_from[row], tail_to[row] = group.pages[shared], tail
                pages.append(tail)
            if group.resumed is None:
                slot = _Slot(group, sample, pages, shared, length, self.admissions)
            else:  # its drawn tokens but the last are in the pages: it goes on from the last one
                slot = group.resumed
                slot.group, slot.pages, slot.shared, slot.length = group, pages, shared, length
                slot.admitted = self.admissions
                self.fed[index] = slot.tokens[-1]
            self.admissions += 1
            self.slots[index] = slot
            slot_index[row] = index
            draws[row] = group.resumed is None
            prompt_ids[row, :len(penalised[row])] = penalised[row]
            counted[row, :len(penalised[row])] = 1  # a request has no padding: the penalty counts its whole prompt
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
            counted, seeds, samples, draws, self.values, _stacked(states, rows))
        tokens, logprobs = gather_to_host(tokens), gather_to_host(logprobs)
        for row, (index, _, _) in enumerate(admitted):
            if draws[row]:
                self._record(index, int(tokens[row]), float(logprobs[row]), admitted[row][1].logits_version)

    def _release_prompt(self, group: _Group) -> None:
        """The request's own hold on its prompt pages ends once every completion holds what it shares (the logits
        stay referenced by the admission being built)."""
        self.pages.release(group.pages)
        group.pages = []
        group.state = None

    # ------------------------------------------------------------------ pages and preemption
    def _pages_short(self, slot: _Slot, ahead: int = 0) -> int:
        """Pages a running completion lacks for every token its next decode call may feed (the last new token is
        never fed); ``ahead``: that call follows one not yet read, which adds ``ahead`` tokens if the completion does
        not end there."""
        through = slot.length + ahead + min(self.engine.config.decode_steps, slot.remaining - ahead)
        return max(self.pages.pages_for(through) - len(slot.pages), 0)

    def _pages_to_start(self, group: _Group) -> int:
        """Pages the group's next completion takes when admitted and in its first decode call (its prompt's pages
        aside): a copy of the prompt's last, partly filled page (the group's last completion takes the page itself)
        and the pages of the tokens that call feeds."""
        length = group.prompt_length
        copied = bool(length % self.pages.page_size) and group.next_sample < group.request.num_samples - 1
        through = length + min(self.engine.config.decode_steps, group.request.max_new_tokens - group.drawn)
        return int(copied) + self.pages.pages_for(through) - self.pages.pages_for(length)

    def _room(self) -> int:
        """Free pages beyond those the running completions' next decode call takes."""
        return self.pages.free - sum(self._pages_short(slot) for slot in self.slots if slot is not None)

    def _make_room(self, live: list[int]) -> list[int]:
        """Frees pages until the pool holds what the ``live`` slots' next decode call writes: first the prefilled
        prompts still waiting (the latest queued first), then the latest admitted completions, preempted
        (:meth:`_preempt`). Returns the slots left live."""
        live = sorted(live, key=lambda index: self.slots[index].admitted)
        while sum(self._pages_short(self.slots[index]) for index in live) > self.pages.free:
            if self._drop_a_waiting_prefill():
                continue
            if len(live) == 1:  # the pool holds any one completion alone (checked at the start of the call)
                raise RuntimeError("a completion lacks pages with every other one preempted; this is a bug.")
            self._preempt(live.pop())
        return sorted(live)

    def _preempt(self, index: int, for_pages: bool = True) -> None:
        """Preemption by recompute (vLLM's ``RECOMPUTE``): frees the completion's pages and queues it first as a
        request of its own, its prompt followed by the tokens it drew but the last. Prefilled again, it goes on with
        its own stream (``first_sample`` and sample unchanged) from its next token index; the penalty memory counts
        its prompt and drawn tokens, and the prefill rebuilds a recurrent state. ``for_pages``: counted as a
        preemption (a weights update recomputes without counting one)."""
        slot = self.slots[index]
        self.slots[index] = None
        self.pages.release(slot.pages)
        request = slot.group.request
        prompt = slot.source_prompt
        drawn = tuple(slot.tokens[:-1])
        token_types = request.token_type_ids[:len(prompt)] + (0,) * len(drawn) if request.token_type_ids else ()
        resumed = replace(request, prompt_ids=prompt + drawn, num_samples=1, token_type_ids=token_types)
        group = _Group(slot.group.index, resumed, slot.group.ticket, resumed=slot)
        self.waiting.appendleft(group)
        self.stats.preemptions += int(for_pages)

    def _drop_a_waiting_prefill(self, spare: _Group | None = None) -> bool:
        """Frees the prompt pages of the latest queued request (``spare`` aside) that holds any: it is prefilled
        again when its turn comes. Returns whether one was dropped."""
        for group in reversed(self.waiting):
            if group.pages and group is not spare:
                self.pages.release(group.pages)
                group.pages, group.prefilled, group.logits, group.state = [], 0, None, None
                group.logits_version = None
                return True
        return False

    # ------------------------------------------------------------------ decode
    def _record(self, slot_index: int, token: int, logprob: float, version: int | None) -> None:
        """Appends a sampled token to its completion; finishes the completion on an end token or its limit."""
        self._record_many(slot_index, [token], [logprob], version)

    def _record_many(self, slot_index: int, tokens: list[int], logprobs: list[float], version: int | None) -> None:
        """Appends sampled tokens, drawn with weights ``version`` (the decode program stops a row at its end token
        or limit, so only the last can end it); finishes the completion on an end token or its limit."""
        slot = self.slots[slot_index]
        slot.tokens.extend(tokens)
        slot.logprobs.extend(logprobs)
        slot.versions.extend([version] * len(tokens))
        token = tokens[-1]
        if token in self.end_ids or len(slot.tokens) == slot.group.request.max_new_tokens:
            ticket = slot.group.ticket
            ticket._finished(slot.group.index, slot.sample, slot.tokens, slot.logprobs,
                             None if self.version is None else slot.versions, token in self.end_ids)
            if ticket.done():
                self.tickets.remove(ticket)
            self.pages.release(slot.pages)
            self.slots[slot_index] = None
        else:
            self.fed[slot_index] = token

    def _view(self, longest: int) -> int:
        """The cache columns a program gathers for rows of at most ``longest`` tokens: the bucket that holds them
        (at least :data:`MIN_VIEW`), or 0 with a paged kernel (it reads the pages in place, so one program serves
        every length)."""
        return max(MIN_VIEW, bucket_length(longest)) if self.engine.kernel["attention"] == "gather" else 0

    def _decode_rows(self, live: int) -> int:
        """The rows of the decode program for ``live`` completions: the slot count halved while that still holds
        them (and the mesh's data shards) and the backend's floor (:func:`min_decode_rows`), so the rows run are
        never more than twice the live ones (the slot count and that floor aside) and a long tail of few completions
        runs a smaller program."""
        rows = self.num_slots
        floor = max(live, self.parallel, self.engine.min_decode_rows)
        while rows // 2 >= floor and (rows // 2) % self.parallel == 0:
            rows //= 2
        return rows

    def _decode_step(self, live: list[int]) -> None:
        """One decode call for the ``live`` slots, built on the host from their completions once the pool holds its
        pages (:meth:`_make_room`): read at once, or with async scheduling left pending for the next round."""
        call = self._dispatch(self._make_room(live))
        if self.engine.async_scheduling:
            self.pending = call
        else:
            self._read(call)

    def _dispatch(self, live: list[int]) -> _DecodeCall:
        """Dispatches the decode call for the ``live`` slots (each takes the pages it writes), its arguments built on
        the host from their completions."""
        count = self.engine.config.decode_steps
        rows = self._decode_rows(len(live))
        slot_index = np.full(rows, self.num_slots, np.int32)
        fed = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        alive = np.zeros(rows, bool)
        seeds = np.zeros(rows, np.uint32)
        samples = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        limits = np.ones(rows, np.int32)
        shifts = np.zeros(rows, np.int32)
        slots = [self.slots[index] for index in live]
        for row, (index, slot) in enumerate(zip(live, slots, strict=True)):
            request = slot.group.request
            slot.pages.extend(self.pages.take() for _ in range(self._pages_short(slot)))
            slot_index[row] = index
            fed[row] = self.fed[index]
            lengths[row] = slot.length
            alive[row] = True
            seeds[row] = int(request.seed) % (2**32)
            samples[row] = request.first_sample + slot.sample
            steps[row] = len(slot.tokens)
            limits[row] = request.max_new_tokens
            shifts[row] = request.rope_delta
        programs = replace(self.programs, view=self._view(int(lengths.max())), steps=count)
        arrays = {"slot_index": slot_index, "fed": fed, "lengths": lengths, "live": alive, "seeds": seeds,
                  "samples": samples, "steps": steps, "limits": limits, "shifts": shifts}
        inputs = {name: mesh_lib.place_array(array, self.sharding) for name, array in arrays.items()}
        inputs["page_table"] = self._page_table(rows, slots)
        return self._launch(programs, live, slots, rows, inputs, ahead=False)

    def _continue_ahead(self) -> bool:
        """Async scheduling: dispatches the decode call that follows the pending one when the batch may stay as it
        is (:meth:`_following`), then reads the pending one (the host schedules while the device decodes). Returns
        whether it dispatched one; if not, the pending call is read and the round goes on synchronously."""
        pending, self.pending = self.pending, None
        following = self._following(pending)
        self._read(pending)
        self.pending = following
        return following is not None

    def _following(self, call: _DecodeCall) -> _DecodeCall | None:
        """Dispatches the decode call after ``call`` (not read yet) on the same rows, its fed tokens, lengths, token
        counts and live rows being ``call``'s outputs on the device: rows that end in ``call`` draw nothing. Each
        completion that may go on takes the pages it writes if it does not end in ``call``.

        Nothing is dispatched (``None``) where the batch may change at ``call``'s end: a request waits (an admission
        or a prefill chunk comes), the completions that may go on fit a smaller program, none may go on, or the pool
        lacks their pages (a preemption, decided once ``call`` is read).
        """
        if self.waiting:
            return None
        count = self.engine.config.decode_steps
        slots = [slot if slot is not None and self.slots[index] is slot else None
                 for index, slot in zip(call.indices, call.slots, strict=True)]
        going_on = [slot for slot in slots if slot is not None and slot.remaining > count]
        if not going_on or self._decode_rows(len(going_on)) < call.rows:
            return None
        short = [self._pages_short(slot, ahead=count) for slot in going_on]
        if sum(short) > self.pages.free:
            return None
        for slot, pages in zip(going_on, short, strict=True):
            slot.pages.extend(self.pages.take() for _ in range(pages))
        programs = replace(self.programs, view=self._view(max(slot.length + count for slot in going_on)), steps=count)
        inputs = {**call.inputs, **{name: mesh_lib.place_array(call.following[name], self.sharding)
                                    for name in _CARRIED_INPUTS}}
        inputs["page_table"] = self._page_table(call.rows, slots)
        return self._launch(programs, call.indices, slots, call.rows, inputs, ahead=True)

    def _page_table(self, rows: int, slots: list[_Slot | None]) -> jax.Array:
        """The page table ``[rows, table width]`` of a decode call whose rows hold ``slots`` (a row without a
        completion reads the trash page), on the device: the last one uploaded when it is unchanged, as it is for
        most calls."""
        table = np.zeros((rows, self.table_width), np.int32)
        for row, slot in enumerate(slots):
            if slot is not None:
                table[row, :len(slot.pages)] = slot.pages
        last = self.uploaded_table
        if last is None or last[0].shape != table.shape or not np.array_equal(last[0], table):
            self.uploaded_table = (table, mesh_lib.place_array(table, self.sharding))
            self.stats.page_table_uploads += 1
        return self.uploaded_table[1]

    def _launch(self, programs: _Programs, indices: list[int], slots: list[_Slot | None], rows: int,
                inputs: dict[str, jax.Array], ahead: bool) -> _DecodeCall:
        """Dispatches the decode program on ``inputs``; the pool, penalty memory and recurrent states are its
        outputs from then on."""
        tokens, logprobs, self.pool, self.seen, self.slot_states, following = _decode(
            programs, self.module, self.tables, self.pool, self.seen, self.slot_states,
            *(inputs[name] for name in _ROW_INPUTS), self.values, self.end_array)
        return _DecodeCall(indices, slots, rows, programs.steps, inputs, tokens, logprobs, following, self.version,
                           ahead)

    def _read_pending(self) -> None:
        """Reads the decode call dispatched and not yet read, if any."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._read(pending)

    def _read(self, call: _DecodeCall) -> None:
        """Reads a decode call's tokens to the host and records them; completions that end free their slots and
        pages."""
        tokens, logprobs = gather_to_host(call.tokens), gather_to_host(call.logprobs)
        produced = (tokens >= 0).sum(axis=1)
        # The rows whose completion was running when the call began; the others had ended (masked).
        running = [(row, index) for row, (index, slot) in enumerate(zip(call.indices, call.slots, strict=True))
                   if slot is not None and self.slots[index] is slot]
        # Rows dispatched as running whose completion had ended in the call before (unread then).
        ended = sum(slot is not None for slot in call.slots) - len(running)
        if produced.sum() != sum(produced[row] for row, _ in running):
            raise RuntimeError("a decode call drew tokens for a completion that had ended; this is a bug.")
        stats = self.stats
        stats.decode_calls += 1
        stats.decode_calls_ahead += int(call.ahead)
        stats.ended_row_steps += ended * call.steps
        stats.decode_tickets.append(len({id(self.slots[index].group.ticket) for _, index in running}))
        stats.decode_steps += call.steps
        stats.row_steps += call.rows * call.steps
        stats.decode_rows.append((len(running), call.rows))
        stats.slot_steps += int(produced.sum())
        for row, index in running:
            count = int(produced[row])
            self.slots[index].length += count
            self._record_many(index, tokens[row, :count].tolist(), logprobs[row, :count].tolist(), call.version)
        stats.pages_in_use_per_step.append(self.pages.in_use)
        stats.live_tokens_per_step.append(self._live_tokens())

    def _live_tokens(self) -> int:
        """Tokens in the cache for live completions, each shared prompt page counted once."""
        page_size = self.engine.config.page_size
        shared: dict[int, int] = {}
        own = 0
        for slot in self.slots:
            if slot is not None:
                shared[id(slot.group)] = slot.shared * page_size
                own += slot.length - slot.shared * page_size
        return own + sum(shared.values())


__all__ = ["EngineStats", "PagedEngine", "PagedEngineConfig", "RolloutStream", "StreamTicket",
           "default_async_scheduling"]
