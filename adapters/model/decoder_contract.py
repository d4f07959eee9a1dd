"""The model contract: what every room other than a family's own module may use of a decoder.

Two implementations hold it: Tunix's decoders (Qwen2, Qwen3, Qwen3-MoE, Llama 3, Gemma 2/3/4, as the family modules
build them) and torchlike's native decoder (:mod:`.native_decoder`, the families Tunix lacks). The rollout engines,
the Nash-MD mixture, the losses, NEFTune, prompt learning and sequence classification reach a decoder only through
this surface and the family table's functions (``Family.forward``, ``hidden_states``, ``logits_from_hidden``), so a new
family or a new decoder implementation is one more module that holds it:

- ``embedder``: ``input_embedding`` (an ``nnx.Param`` ``[V, H]``, the table the engines gather from and prompt
  learning reads), ``encode(tokens [B, T]) -> [B, T, H]`` (NEFTune and prompt learning wrap it) and ``decode(hidden)``
  (the tied head);
- ``layers`` (the decoder layers, each rematerialisable: ``adapters.training.train_step.rematerialised``) and
  ``final_norm``, whose output is the head's input (``Family.hidden_states`` records it);
- one call for every pass, training and decoding alike: ``module(tokens [B, T], positions [B, T], cache, mask
  [B, T, S], **inputs) -> (logits [B, T, V], cache)``: ``cache`` is ``None`` (the ``T`` tokens attend to each other
  under ``mask``) or ``{"layer_name": {"k", "v": [B, S, K, D], "end_index": [B]}}``, the new keys and values written
  at slot ``end_index[0]`` and ``end_index`` advanced by ``T``;
- the KV-cache spec: :func:`kv_cache_shapes` (a module's own ``kv_cache_shapes()`` where its layers differ, else one
  ``(num_kv_heads, head_dim)`` for each of ``config.num_layers``), in the embedding table's dtype;
- the recurrent-state spec of a hybrid decoder: :func:`recurrent_state_shapes` (a module's own
  ``recurrent_state_shapes()``; none for a pure transformer). A recurrent layer's cache entry is
  ``{state name: [B, *shape], "end_index": [B]}``, a fixed size per sequence, continued by each call and returned
  (zeros are a fresh sequence: left padding leaves it there);
- ``get_model_input()``: a dummy call's arguments, which Qwix traces to place LoRA factors.

LoRA targets: a target is an NNX module (its ``/``-joined path, what Qwix matches) whose weight (``kernel`` of an
``nnx.Linear``, ``w`` of a Tunix ``Einsum``) the family table maps to an HF ``<module>.weight``; the PEFT adapter names
that HF module (``adapters.lora.targets``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

Cache = Mapping[str, Mapping[str, jax.Array]]
"""``{"layer_i": {"k": [B, S, K, D], "v": [B, S, K, D], "end_index": [B]}}``."""


@runtime_checkable
class Embedder(Protocol):
    """A decoder's token embedding (see the module docstring)."""

    input_embedding: Any

    def encode(self, tokens: jax.Array) -> jax.Array: ...

    def decode(self, hidden: jax.Array) -> jax.Array: ...


@runtime_checkable
class Decoder(Protocol):
    """A decoder as the rest of torchlike uses it (see the module docstring)."""

    config: Any
    embedder: Embedder
    layers: Sequence[Any]
    final_norm: Any

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Cache | None, attention_mask: jax.Array,
                 **inputs: Any) -> tuple[jax.Array, Cache | None]: ...

    def get_model_input(self) -> dict[str, Any]: ...


def embedding_table(module: Decoder) -> jax.Array:
    """The input embedding table ``[V, H]``."""
    return module.embedder.input_embedding.get_value()


def vocab_size(module: Decoder) -> int:
    """The number of rows of the embedding table (the logits' last axis)."""
    return int(embedding_table(module).shape[0])


def kv_cache_shapes(module: Decoder) -> dict[str, tuple[int, ...]]:
    """Each cached layer's ``(kv_heads, head_dim)`` by cache key: the module's own ``kv_cache_shapes()`` (layers with
    their own head sizes, layers without a cache, a mixture of two decoders), else ``config.num_layers`` layers
    ``layer_0``... of ``(config.num_kv_heads, config.head_dim)``."""
    if hasattr(module, "kv_cache_shapes"):
        return dict(module.kv_cache_shapes())
    config = module.config
    return {f"layer_{index}": (config.num_kv_heads, config.head_dim) for index in range(config.num_layers)}


def recurrent_state_shapes(module: Decoder) -> dict[str, dict[str, tuple[tuple[int, ...], Any]]]:
    """Each recurrent layer's state entries ``{name: (shape without the batch axis, dtype)}`` by cache key: the
    module's own ``recurrent_state_shapes()``; empty for a decoder of attention layers only."""
    if hasattr(module, "recurrent_state_shapes"):
        return {name: dict(entries) for name, entries in module.recurrent_state_shapes().items()}
    return {}


def paged_kernel_refusal(module: Decoder) -> str | None:
    """Why ``module``'s attention layers cannot read a paged cache in place (:mod:`.paged_attention`), or ``None``
    when they can: the module's own ``paged_kernel_refusal()``; a Tunix decoder can where every layer's attention says
    it ``reads_paged_cache`` (Qwen2's, Qwen3's, Llama 3's, Gemma 2's, 3's and 4's), not otherwise."""
    if hasattr(module, "paged_kernel_refusal"):
        return module.paged_kernel_refusal()
    layers = getattr(module, "layers", ())
    if layers and all(getattr(getattr(layer, "attn", None), "reads_paged_cache", False) for layer in layers):
        return None  # Tunix's Qwen2/3, Llama 3 and Gemma 2/3/4 attention, made to read pages by their family modules
    return (f"{type(module).__name__}'s attention (Tunix's) reads a dense KV cache only; the paged kernels serve "
            "Qwen2, Qwen3, Qwen3-MoE, Llama 3, Gemma 2/3/4 and the native decoder's families (Mistral, Phi-3, "
            "Qwen3.5, ...)")


def missing_members(module: Any) -> list[str]:
    """The members of :class:`Decoder` (and its embedder) that ``module`` lacks; empty when it holds the contract."""
    missing = [name for name in ("config", "embedder", "layers", "final_norm", "get_model_input")
               if not hasattr(module, name)]
    embedder = getattr(module, "embedder", None)
    if embedder is not None:
        missing += [f"embedder.{name}" for name in ("input_embedding", "encode", "decode")
                    if not hasattr(embedder, name)]
    return missing
