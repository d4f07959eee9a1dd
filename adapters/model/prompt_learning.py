"""Prompt learning on Tunix decoders: peft's prompt tuning, P-tuning and prefix tuning.

The trained parameters live in a ``prompt_encoder`` submodule of a copy of the Tunix module whose ``__call__`` feeds
them to the decoder the way ``peft.PeftModelForCausalLM.forward`` does (:func:`with_prompt_encoder`), so every caller
of the module (the family's ``forward`` and ``hidden_states``, the trainers' losses and log-probs) sees the adapted
model, and inside ``lora_mode("disabled")`` the base model (``PeftModel.disable_adapter``, an adapter-off reference):

- prompt tuning and P-tuning (``PROMPT_TUNING``, ``P_TUNING``): ``num_virtual_tokens`` embeddings are prepended to the
  input embeddings, the attention mask is extended by ones, and positions count them (``0 .. n-1``, the real tokens
  from ``n``). The outputs cover the real tokens only; inside :func:`virtual_token_placeholders` the first ``k``
  input columns stand for the last ``k`` virtual tokens and their outputs are kept too (peft's logits cover every
  virtual token; TRL's loss scores the first real token from the last virtual one).
- prefix tuning (``PREFIX_TUNING``): every layer attends to ``num_virtual_tokens`` extra keys and values taken
  straight from the encoder output (peft's ``past_key_values``), through the Tunix KV-cache argument: the cache holds
  the prefix, the real tokens are written after it at positions offset by ``num_virtual_tokens``, and the attention
  mask is extended by ones.

Decoding with a KV cache of the caller's (the samplers) is refused: the virtual tokens would be missing from it.

The encoder output is peft's ``prompt_encoder(prompt_tokens)``: the ``embedding`` table itself (prompt tuning, prefix
tuning without projection, any loaded adapter) or that table through an MLP (P-tuning's ``mlp_head``: Linear, ReLU,
Linear, ReLU, Linear; prefix tuning's ``transform``: Linear, tanh, Linear). Its ``[num_virtual_tokens, dim]`` value
is what peft saves as ``prompt_embeddings``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..families import Family, all_families
from ..lora.runtime import adapter_disabled
from . import decoder_contract

PROMPT_TUNING = "PROMPT_TUNING"
P_TUNING = "P_TUNING"
PREFIX_TUNING = "PREFIX_TUNING"
PEFT_TYPES = (PROMPT_TUNING, P_TUNING, PREFIX_TUNING)

ENCODER_NAME = "prompt_encoder"
"""The attribute of the Tunix module that holds the prompt encoder (the first part of its parameters' paths)."""

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"relu": jax.nn.relu, "tanh": jnp.tanh}

_PLACEHOLDERS: contextvars.ContextVar[int] = contextvars.ContextVar("torchlike_virtual_placeholders", default=0)


@dataclass(frozen=True)
class PromptSettings:
    """What the forward pass needs to know about a prompt-learning adapter.

    Args:
        peft_type: ``"PROMPT_TUNING"``, ``"P_TUNING"`` or ``"PREFIX_TUNING"``.
        num_virtual_tokens: virtual tokens (prompt and P-tuning) or prefix positions (prefix tuning).
        num_layers, num_key_value_heads, head_dim: prefix tuning only: the encoder output of one virtual token is
            ``[num_layers * 2, num_key_value_heads, head_dim]`` flattened (peft's ``view``), keys of layer ``l`` at
            ``2 l`` and values at ``2 l + 1``.
    """

    peft_type: str
    num_virtual_tokens: int
    num_layers: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0


class PromptEncoder(nnx.Module):
    """peft's prompt encoder: ``embedding [num_virtual_tokens, dim]``, optionally through an MLP.

    Args:
        settings: the adapter's :class:`PromptSettings`.
        embedding: the initial ``embedding`` table.
        mlp: ``(kernel [in, out], bias [out])`` per linear layer (peft's ``Linear.weight`` transposed), with
            ``activation`` between consecutive layers; empty for none.
        activation: a key of :data:`ACTIVATIONS`.
    """

    def __init__(self, settings: PromptSettings, embedding, mlp: list[tuple] = (), activation: str = "relu"):
        self.settings = settings
        self.embedding = nnx.Param(jnp.asarray(embedding, jnp.float32))
        self.mlp_kernels = nnx.List([nnx.Param(jnp.asarray(kernel, jnp.float32)) for kernel, _ in mlp])
        self.mlp_biases = nnx.List([nnx.Param(jnp.asarray(bias, jnp.float32)) for _, bias in mlp])
        self.activation = activation

    def __call__(self) -> jax.Array:
        """The encoder output ``[num_virtual_tokens, dim]`` float32 (peft's ``prompt_encoder(prompt_tokens)[0]``)."""
        hidden = self.embedding.get_value()
        count = len(self.mlp_kernels)
        for index, (kernel, bias) in enumerate(zip(self.mlp_kernels, self.mlp_biases, strict=True)):
            hidden = hidden @ kernel.get_value() + bias.get_value()
            if index < count - 1:
                hidden = ACTIVATIONS[self.activation](hidden)
        return hidden


@dataclass(frozen=True)
class PromptParameters:
    """The NNX filter of what a prompt-learning step trains: the parameters of the prompt encoder; hashable, so a
    jitted step can take it as a static argument."""

    def __call__(self, path, value) -> bool:
        return isinstance(value, nnx.Param) and str(path[0]) == ENCODER_NAME


def linear_init(key: jax.Array, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kernel [fan_in, fan_out], bias [fan_out])`` drawn as torch's ``nn.Linear`` draws them:
    ``Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for both."""
    bound = 1.0 / np.sqrt(fan_in)
    kernel_key, bias_key = jax.random.split(key)
    return (np.asarray(jax.random.uniform(kernel_key, (fan_in, fan_out), jnp.float32, -bound, bound)),
            np.asarray(jax.random.uniform(bias_key, (fan_out,), jnp.float32, -bound, bound)))


def token_embeddings(module: nnx.Module, ids: np.ndarray) -> jax.Array:
    """The rows ``ids`` of the Tunix decoder's input embedding table (peft's ``word_embeddings(ids)`` for the
    supported families, whose embedder does not scale)."""
    return decoder_contract.embedding_table(module)[jnp.asarray(ids)]


def check_family(family: Family) -> None:
    """Raises ``ValueError`` for a family prompt learning is not implemented for (``Family.prompt_learning``)."""
    if not family.prompt_learning:
        supported = sorted(other.name for other in all_families() if other.prompt_learning)
        raise ValueError(f"prompt learning (prompt tuning, P-tuning, prefix tuning) is implemented for "
                         f"{supported}, not {family.name}: its decoder scales the input embeddings or "
                         "derives per-layer inputs from the token ids, so virtual tokens would not be fed as peft "
                         "feeds them. Use a LoraConfig for this model.")


def has_prompt_encoder(module: nnx.Module) -> bool:
    """Whether ``module`` carries a prompt-learning adapter (:func:`with_prompt_encoder`)."""
    return isinstance(getattr(module, ENCODER_NAME, None), PromptEncoder)


def with_prompt_encoder(module: nnx.Module, encoder: PromptEncoder) -> nnx.Module:
    """A copy of the Tunix ``module`` (sharing every array with it) that holds ``encoder`` as ``prompt_encoder`` and
    whose ``__call__`` applies it (see the module docstring)."""
    graphdef, state = nnx.split(module)
    copy = nnx.merge(graphdef, state)
    setattr(copy, ENCODER_NAME, encoder)
    object.__setattr__(copy, "__class__", _prompted_class(type(copy)))
    return copy


@contextlib.contextmanager
def virtual_token_placeholders(count: int) -> Iterator[None]:
    """Within the block, calls of a prompt-tuning or P-tuning module take the first ``count`` input columns as
    placeholders for the last ``count`` virtual tokens (their ids are not read) and return outputs for them too."""
    token = _PLACEHOLDERS.set(count)
    try:
        yield
    finally:
        _PLACEHOLDERS.reset(token)


@functools.cache
def placeholder_forward(forward: Callable, count: int) -> Callable:
    """``forward(module, tokens, positions, attention_mask)`` run inside :func:`virtual_token_placeholders`
    ``(count)``; one function per ``(forward, count)``, so a jitted caller that takes it as a static argument compiles
    once."""

    def run(module, tokens, positions, attention_mask):
        with virtual_token_placeholders(count):
            return forward(module, tokens, positions, attention_mask)

    return run


@functools.cache
def _prompted_class(original: type) -> type:
    """A subclass of the Tunix model class ``original`` whose ``__call__`` applies the module's prompt encoder."""

    def call(self, tokens, positions, cache, attention_mask=None, *args, **kwargs):
        if adapter_disabled():
            return original.__call__(self, tokens, positions, cache, attention_mask, *args, **kwargs)
        if cache is not None:
            raise ValueError("decoding with a KV cache is not supported with a prompt-learning adapter: the cache "
                             "would lack the virtual tokens. Run the model on whole sequences (model(input_ids)).")
        if attention_mask is None:
            batch, length = tokens.shape
            attention_mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
        encoder: PromptEncoder = getattr(self, ENCODER_NAME)
        run = _prefix_call if encoder.settings.peft_type == PREFIX_TUNING else _virtual_token_call
        return run(original, self, encoder, tokens, positions, attention_mask.astype(bool), *args, **kwargs)

    return type(original.__name__, (original,), {"__call__": call, "__module__": original.__module__})


@contextlib.contextmanager
def _method_replaced(target: nnx.Module, name: str, make: Callable[[type], Callable]) -> Iterator[None]:
    """Within the block, ``target.<name>`` is ``make(original class)``: the instance gets a subclass of its own class
    (as ``adapters.model.neftune`` wraps ``encode``), so the module tree and its parameters are untouched."""
    original = type(target)
    replaced = type(original.__name__, (original,), {name: make(original), "__module__": original.__module__})
    object.__setattr__(target, "__class__", replaced)
    try:
        yield
    finally:
        object.__setattr__(target, "__class__", original)


def _virtual_token_call(original, module, encoder, tokens, positions, attention_mask, *args, **kwargs):
    """Prompt tuning and P-tuning: the virtual embeddings in front of the real ones (see the module docstring)."""
    count = encoder.settings.num_virtual_tokens
    given = _PLACEHOLDERS.get()
    if given > count:
        raise ValueError(f"{given} virtual-token placeholders given, but the adapter has {count} virtual tokens.")
    if kwargs.get("segment_ids") is not None:
        raise ValueError("prompt tuning and P-tuning cannot run packed rows (segment_ids): peft drops the positions "
                         "that separate them. Set packing=False and padding_free=False.")
    hidden = count - given  # virtual tokens the input does not hold a column for
    batch, length = tokens.shape
    tokens = jnp.concatenate([jnp.zeros((batch, hidden), tokens.dtype), tokens], axis=1)
    positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(hidden, dtype=positions.dtype), (batch, hidden)),
                                 positions + hidden], axis=1)
    causal = jnp.tril(jnp.ones((hidden, hidden), bool))
    virtual_rows = jnp.concatenate([jnp.broadcast_to(causal, (batch, hidden, hidden)),
                                    jnp.zeros((batch, hidden, length), bool)], axis=2)
    real_rows = jnp.concatenate([jnp.ones((batch, length, hidden), bool), attention_mask], axis=2)
    attention_mask = jnp.concatenate([virtual_rows, real_rows], axis=1)

    def encode_with_virtual_tokens(embedder_class):
        def encode(self, ids, *encode_args, **encode_kwargs):
            real = embedder_class.encode(self, ids[:, count:], *encode_args, **encode_kwargs)
            virtual = encoder().astype(real.dtype)
            return jnp.concatenate([jnp.broadcast_to(virtual[None], (real.shape[0], *virtual.shape)), real], axis=1)

        return encode

    def norm_of_kept_positions(norm_class):
        def call(self, x, *norm_args, **norm_kwargs):
            return norm_class.__call__(self, x[:, hidden:], *norm_args, **norm_kwargs)

        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(_method_replaced(module.embedder, "encode", encode_with_virtual_tokens))
        if hidden:  # the final norm is per position: dropping its input rows drops those outputs
            stack.enter_context(_method_replaced(module.final_norm, "__call__", norm_of_kept_positions))
        return original.__call__(module, tokens, positions, None, attention_mask, *args, **kwargs)


def _prefix_call(original, module, encoder, tokens, positions, attention_mask, *args, **kwargs):
    """Prefix tuning: the prefix keys and values in the KV cache (see the module docstring)."""
    settings = encoder.settings
    batch, length = tokens.shape
    dtype = module.embedder.encode(tokens[:, :1]).dtype  # the keys' dtype (the cache is updated in place)
    cache = prefix_keys_values(settings, encoder(), batch, length, dtype)
    seen = jnp.ones((batch, length, settings.num_virtual_tokens), bool)
    attention_mask = jnp.concatenate([seen, attention_mask], axis=-1)
    logits, _ = original.__call__(module, tokens, positions + settings.num_virtual_tokens, cache, attention_mask,
                                  *args, **kwargs)
    return logits, None


def prefix_keys_values(settings: PromptSettings, prefix: jax.Array, batch: int, length: int, dtype) -> dict:
    """The Tunix KV cache of one batch whose first ``num_virtual_tokens`` slots hold the prefix: ``{"layer_i": {"k",
    "v": [batch, num_virtual_tokens + length, K, H], "end_index": [batch]}}``, the real tokens' slots zero.

    ``prefix [num_virtual_tokens, num_layers * 2 * K * H]`` is split as peft's ``get_prompt`` splits it (keys of layer
    ``l`` at row ``2 l`` of the ``num_layers * 2`` axis, values at ``2 l + 1``); peft's keys are used as they are,
    without rotary embedding, and so are they here.
    """
    count, heads, head_dim = settings.num_virtual_tokens, settings.num_key_value_heads, settings.head_dim
    prefix = prefix.astype(dtype).reshape(count, settings.num_layers * 2, heads, head_dim)
    room = jnp.zeros((batch, length, heads, head_dim), dtype)

    def slots(values):
        return jnp.concatenate([jnp.broadcast_to(values[None], (batch, *values.shape)), room], axis=1)

    end = jnp.full((batch,), count, jnp.int32)
    return {f"layer_{layer}": {"k": slots(prefix[:, 2 * layer]), "v": slots(prefix[:, 2 * layer + 1]),
                               "end_index": end} for layer in range(settings.num_layers)}


def with_virtual_tokens(loss: Callable) -> Callable:
    """A causal-LM step loss (``adapters.losses.sft.sft_step_loss``) on a prompt-tuning or P-tuning module,
    as TRL computes it with a peft model: each row's first token is scored too, predicted from the last virtual token
    (peft prefixes ``num_virtual_tokens`` labels of ``-100``), while the step still divides by the batch's own label
    count over ``labels[:, 1:]`` (transformers counts ``num_items_in_batch`` before peft extends the labels). The
    metrics (``entropy``, ``mean_token_accuracy``) average over every scored token, as TRL's ``label_mask`` does.

    The batch gets one placeholder column in front (``input_ids`` 0, ``attention_mask`` 1, ``loss_mask`` 0) that
    stands for the last virtual token (:func:`virtual_token_placeholders`).

    Raises:
        ValueError: the batch has ``position_ids`` (padding-free packed rows), which peft drops for prompt learning.
    """

    def extended_loss(module, batch, num_items_in_batch=None):
        if "position_ids" in batch:
            raise ValueError("prompt tuning and P-tuning cannot train on padding-free batches: peft drops their "
                             "position_ids, so the packed sequences would attend to each other. Set "
                             "padding_free=False and packing=False (or packing_strategy='wrapped').")
        extended = dict(batch)
        for key, fill in (("input_ids", 0), ("attention_mask", 1), ("loss_mask", 0)):
            front = jnp.full((batch[key].shape[0], 1), fill, batch[key].dtype)
            extended[key] = jnp.concatenate([front, batch[key]], axis=1)
        with virtual_token_placeholders(1):
            value, _, aux = loss(module, extended, num_items_in_batch)
        weight = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).astype(jnp.float32).sum()
        return value, weight, aux

    return extended_loss
