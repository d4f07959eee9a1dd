"""Decode attention that reads a paged KV cache in place: JAX's own Pallas kernels behind one function.

The paged rollout engine (``adapters.rollout.paged``) keeps keys and values in a pool of pages. Its ``"gather"``
attention (the CPU's) copies each row's pages into a dense, right-aligned cache and runs the decoder on it, as the
static sampler runs its cache: on a CPU that copy is cheap next to the matmuls, but on a GPU or TPU decode is bound by
memory traffic, and the copy reads every row's tokens twice and materialises a view as large as a static cache. The
kernels here read each row's own pages where they lie (the page table says which), and the engine writes each new
token's key and value straight into its page:

- ``"pallas_gpu"``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (grouped-query decode attention over
  ``[kv heads, pages, page size, head dim]`` pages, logit soft-capping included);
- ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` (the same layout, for TPUs).

Both are decode kernels (one query per row). On a mesh the engine's pages hold each device's own KV heads (split over
``tp``); XLA cannot split a kernel call, so the kernel then runs per device on its heads and their query heads
(``shard_map``, :func:`using`'s ``heads_mesh``). A sliding-window layer attends to at most ``window`` keys, which it
gathers from its pages (a bounded view, not the whole sequence); neither kernel takes a window. Prefill runs the
model's own dense attention once per prompt and writes the keys and values to the pages (as vLLM's TPU backend
prefills).

On a CPU the kernels run in Pallas' interpreter (``interpret=True``, :func:`using`), which is how the tests compare
their tokens with the ``"gather"`` path; the interpreter is slower than ``"gather"``, so the CPU keeps ``"gather"``
(:func:`default_attention`). JAX's *ragged* TPU kernel (prefill and decode in one batch, windows, soft caps) is the
next step on a TPU. It is not wired, because no CPU can test it: the TPU interpreter
(``pltpu.force_tpu_interpret_mode``) of JAX 0.10.2 and of 0.12.0.1 (the newest on PyPI, Python 3.13) stops on the
kernel's reshaped ref view (``cur_async_copy_kv.wait().reshape(...)``) with ``'ReshapeTransform' object has no
attribute 'indices'`` (``jax/_src/pallas/mosaic/interpret/utils.py``, ``to_range``).

The native decoder's attention and Tunix's Qwen2 / Qwen3 / Llama 3 / Gemma 2 / Gemma 3 / Gemma 4 attention (made to
by their family modules: :func:`~.rope.reading_pages`, ``families.qwen2`` and ``families.gemma3``'s
``attention_reading_pages``, ``families.gemma4.Gemma4Attention``, whose KV-shared layers read their origin layer's
pages and write none) take the paged path; a decoder whose attention does not is refused by name
(:func:`~.decoder_contract.paged_kernel_refusal`), and the engine keeps the gathered view for it. A decoder layer takes
the paged path when its cache entry is a paged one (:func:`is_paged`): the model contract's
``cache["layer_i"]`` then holds ``k_pages``/``v_pages`` (``[K, P, page size, D]``), the rows' ``page_table``
``[R, W]``, ``kv_lengths`` ``[R]`` (the row's tokens including the one fed now), ``write_page``/``write_offset``
``[R]`` (where the fed token's key and value go; the trash page for rows that are not live) and ``end_index``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from ..distributed import mesh as mesh_lib
from ..runtime.abstract_models import register_derived_class

ATTENTION_KINDS = ("gather", "pallas_gpu", "pallas_tpu")
"""The paged engine's decode attentions: the dense page view (``"gather"``) and JAX's two paged kernels."""

KERNEL_PLATFORMS = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}
"""Each paged kernel and the JAX platforms it runs on natively (anywhere else only in Pallas' interpreter)."""

PAGED_KEYS = frozenset({"k_pages", "v_pages", "page_table", "kv_lengths", "write_page", "write_offset"})

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a traced decode program's attention layers call, whether it runs in Pallas' interpreter, and the
    mesh whose ``tp`` axis splits the pages' KV heads (``None``: the pages are whole on every device)."""

    kind: str
    interpret: bool
    heads_mesh: Mesh | None = None


_CURRENT: contextvars.ContextVar[KernelChoice | None] = contextvars.ContextVar("paged_attention_kernel", default=None)


def default_attention(platform: str | None = None) -> str:
    """The attention the paged engine uses on ``platform`` (default: JAX's default backend): the paged kernel of a
    GPU or TPU, the dense page view on a CPU (where the kernels only run interpreted, and slower)."""
    platform = platform or jax.default_backend()
    return next((kind for kind, platforms in KERNEL_PLATFORMS.items() if platform in platforms), "gather")


def interpreted(kind: str, platform: str | None = None) -> bool:
    """Whether kernel ``kind`` must run in Pallas' interpreter on ``platform`` (it is not the kernel's own)."""
    return (platform or jax.default_backend()) not in KERNEL_PLATFORMS.get(kind, ())


@contextlib.contextmanager
def using(kind: str, interpret: bool, heads_mesh: Mesh | None = None) -> Iterator[None]:
    """Traces the decoder's paged attention with kernel ``kind`` (see the module docstring) while inside.

    Args:
        kind: ``"pallas_gpu"`` or ``"pallas_tpu"``.
        interpret: run the kernel in Pallas' interpreter (off its own backend).
        heads_mesh: the mesh whose ``tp`` axis splits the pages' KV heads (the paged engine's pool on a mesh): the
            kernel then runs per device on its own heads (``shard_map``), since XLA cannot split a kernel call and
            would gather every page to each device first. ``None``: the pages are whole on every device.
    """
    if kind not in ATTENTION_KINDS[1:]:
        raise ValueError(f"paged attention kernel must be one of {ATTENTION_KINDS[1:]}, got {kind!r}.")
    token = _CURRENT.set(KernelChoice(kind, interpret, heads_mesh))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def is_paged(cache: dict | None) -> bool:
    """Whether a layer's cache entry is the paged engine's (its attention must read pages in place)."""
    return cache is not None and PAGED_KEYS <= cache.keys()


def reading_pages_subclass(cls: type, paged_block: Callable, cache_position: int, maker: Callable,
                           maker_args: tuple) -> type:
    """A subclass of the Tunix attention ``cls`` whose ``block`` runs ``paged_block(self, *arguments)`` when its
    cache argument (positional argument ``cache_position``, as Tunix calls ``block``) is a paged entry
    (:func:`is_paged`), and ``cls.block`` otherwise; marked ``reads_paged_cache``
    (:func:`~.decoder_contract.paged_kernel_refusal`).

    Keeps the class name and module (module trees and parameter paths do not change) and registers the class as
    ``maker(*maker_args)`` (cached and importable by name) so abstract models holding it can be pickled.
    """

    def block(self, *arguments, **keywords):
        if is_paged(arguments[cache_position]):
            return paged_block(self, *arguments, **keywords)
        return cls.block(self, *arguments, **keywords)

    derived = type(cls.__name__, (cls,), {"block": block, "reads_paged_cache": True, "__module__": cls.__module__})
    register_derived_class(derived, maker, maker_args)
    return derived


def heads_first(kind: str) -> bool:
    """Whether the pool of attention ``kind`` stores pages as ``[K, P, page size, D]`` (the kernels' layout) rather
    than ``[P, page size, K, D]`` (the gather's)."""
    return kind != "gather"


def attend(q: jax.Array, k: jax.Array | None, v: jax.Array | None, cache: dict, *, scale: float,
           window: int | None = None, soft_cap: float | None = None) -> tuple[jax.Array, dict]:
    """One decode step's attention on a paged cache entry (:func:`is_paged`).

    Args:
        q: ``[R, 1, H, D]`` the fed token's queries (rope applied).
        k: ``[R, 1, K, D]`` its key; v: ``[R, 1, K, D]`` its value; both are written to
            ``(write_page, write_offset)`` before the attention reads the pages. ``None`` (both): the pages hold
            them already and nothing is written (a layer reading an earlier layer's keys and values: Gemma 4's
            KV-shared layers).
        cache: the layer's paged entry.
        scale: the logits' scale (applied to the queries, as the kernels take them).
        window: the layer's sliding window (the keys it sees, the fed one included), ``None``: every key.
        soft_cap: logit soft-capping ``cap * tanh(logits / cap)`` (Gemma 2's), ``None``: none.

    Returns:
        ``(output [R, 1, H, D], the entry with the fed key and value in its pages)``.
    """
    choice = _CURRENT.get()
    if choice is None:
        raise RuntimeError("a paged cache entry reached a decoder layer outside paged_attention.using(...): the paged "
                           "engine's decode program sets the kernel it traces with.")
    if q.shape[1] != 1:
        raise ValueError(f"paged kernel attention decodes one token per row, got {q.shape[1]}.")
    if k is not None:
        page, offset = cache["write_page"], cache["write_offset"]
        cache = {**cache, "k_pages": _written(cache["k_pages"], page, offset, k),
                 "v_pages": _written(cache["v_pages"], page, offset, v)}
    k_pages = cache["k_pages"]
    queries = (q[:, 0].astype(jnp.float32) * scale).astype(k_pages.dtype)
    if window is not None and window < cache["page_table"].shape[1] * k_pages.shape[2]:
        out = _window_attention(queries, cache, window, soft_cap)
    else:
        out = _kernel_attention(choice, queries, cache, soft_cap)
    return out[:, None].astype(q.dtype), cache


def _written(pages: jax.Array, page: jax.Array, offset: jax.Array, fed: jax.Array) -> jax.Array:
    """``pages`` ``[K, P, page size, D]`` with the fed tokens' ``fed [R, 1, K, D]`` at ``(page, offset) [R]``."""
    return pages.at[:, page, offset].set(jnp.swapaxes(fed[:, 0], 0, 1).astype(pages.dtype))


def _kernel_attention(choice: KernelChoice, queries: jax.Array, cache: dict, soft_cap: float | None) -> jax.Array:
    """The kernel's attention ``[R, H, D]``; with ``choice.heads_mesh``, each device's on its own KV heads and
    their query heads (a query head's KV head is ``h // (H // K)``, so splitting both evenly keeps each group on one
    device), and on its own rows where they split evenly over the data axes."""
    arrays = (queries, cache["k_pages"], cache["v_pages"], cache["page_table"], cache["kv_lengths"].astype(jnp.int32))
    mesh = choice.heads_mesh
    if mesh is None:
        return _run_kernel(choice, soft_cap, *arrays)
    rows = mesh_lib.data_axes(mesh) if queries.shape[0] % mesh_lib.data_parallel_size(mesh) == 0 else ()
    rows, heads = rows or None, mesh_lib.TENSOR_PARALLEL_AXIS
    per_device = jax.shard_map(lambda *shards: _run_kernel(choice, soft_cap, *shards), mesh=mesh,
                               in_specs=(PartitionSpec(rows, heads), PartitionSpec(heads), PartitionSpec(heads),
                                         PartitionSpec(rows), PartitionSpec(rows)),
                               out_specs=PartitionSpec(rows, heads), check_vma=False)
    return per_device(*arrays)


def _run_kernel(choice: KernelChoice, soft_cap: float | None, queries: jax.Array, k_pages: jax.Array,
                v_pages: jax.Array, page_table: jax.Array, lengths: jax.Array) -> jax.Array:
    width = page_table.shape[1]
    if choice.kind == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

        splits = math.gcd(width, 16)  # the kernel splits each row's pages into this many partitions
        return gpu_kernel.paged_attention(queries, k_pages, v_pages, page_table, lengths,
                                          k_splits=splits, pages_per_compute_block=_block(width // splits),
                                          interpret=choice.interpret, attn_logits_soft_cap=soft_cap)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as tpu_kernel

    interpreting = pltpu.force_tpu_interpret_mode() if choice.interpret else contextlib.nullcontext()
    with interpreting:
        return tpu_kernel.paged_attention(queries, k_pages, v_pages, lengths, page_table,
                                          pages_per_compute_block=_block(width), attn_logits_soft_cap=soft_cap)


def _block(pages: int) -> int:
    """Pages per compute block: the largest power of two up to 8 that divides ``pages`` (both kernels need one)."""
    block = 8
    while pages % block:
        block //= 2
    return block


def _window_attention(queries: jax.Array, cache: dict, window: int, soft_cap: float | None) -> jax.Array:
    """A sliding-window layer's attention: the row's last ``window`` keys gathered from their pages (a view of
    ``window`` tokens, whatever the row's length), softmax in float32."""
    k_pages, v_pages, page_table = cache["k_pages"], cache["v_pages"], cache["page_table"]
    page_size = k_pages.shape[2]
    lengths = cache["kv_lengths"].astype(jnp.int32)
    token = lengths[:, None] - window + jnp.arange(window)[None, :]  # [R, window]
    seen = token >= 0
    safe = jnp.clip(token, 0, page_table.shape[1] * page_size - 1)
    page = jnp.take_along_axis(page_table, safe // page_size, axis=1)
    offset = safe % page_size
    keys = jnp.moveaxis(k_pages[:, page, offset], 0, 2)  # [R, window, K, D]
    values = jnp.moveaxis(v_pages[:, page, offset], 0, 2)
    rows, heads, dim = queries.shape
    kv_heads = keys.shape[2]
    grouped = queries.reshape(rows, kv_heads, heads // kv_heads, dim)
    logits = jnp.einsum("RKGD,RSKD->RKGS", grouped, keys, preferred_element_type=jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(seen[:, None, None, :], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    return jnp.einsum("RKGS,RSKD->RKGD", probs, values).reshape(rows, heads, dim)


__all__ = ["ATTENTION_KINDS", "attend", "default_attention", "heads_first", "interpreted", "is_paged",
           "reading_pages_subclass", "using"]
