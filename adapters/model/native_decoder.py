"""torchlike's own NNX decoder for the families Tunix lacks: one generic block with per-family switches.

MaxText's design (``layers/decoders.py``): one decoder block, the differences between families as fields of a frozen
:class:`DecoderSpec` (norm kind, residual wiring, fused projections, partial rotary, sliding layers, multipliers,
QK norms), and a thin family module that builds the spec from a ``transformers`` config and lists the weight table.
No JAX library fits the pins for this (ARCHITECTURE.md says which were checked), so it is written once, here.

The module keeps the surface every other room uses of a decoder (:mod:`.decoder_contract`): ``embedder`` with
``input_embedding``/``encode``/``decode``, ``layers``, ``final_norm``, the call
``(tokens [B, T], positions [B, T], cache | None, mask [B, T, S]) -> (float32 logits, cache)`` with the cache
``{"layer_i": {"k", "v": [B, S, K, D], "end_index": [B]}}`` written at ``end_index[0]``, and
:meth:`NativeDecoder.kv_cache_shapes`. Every projection is an ``nnx.Linear`` named as the Hugging Face module it holds
(a fused ``qkv_proj`` stays one module), so Qwix's LoRA adapts it as PEFT adapts the HF module and the PEFT adapter
round-trips tensor for tensor.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import paged_attention
from .attention_masks import sliding_window_mask
from .experts import routed_experts, softmax_top_k
from .linear_attention import GatedDeltaNet, GatedDeltaNetSpec
from .nnx_state import Buffer

MASKED = -2.3819763e38  # what Tunix's attention writes for hidden keys: a finite lowest value, so no row is NaN

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}
"""``transformers``' ``ACT2FN`` names the decoder computes, with the same formula (exact or tanh GELU)."""

NORMS = ("rms", "layer")
BLOCKS = ("sequential", "post_norm", "parallel", "parallel_shared_norm", "single")
QKV_LAYOUTS = ("split", "fused", "fused_per_head")
MLPS = ("gated", "gated_fused", "plain", "gpt_oss_experts")
QK_NORMS = ("none", "head", "projection")
LAYER_TYPES = ("attention", "linear_attention", "mlp")
"""Layer types the decoder builds itself; a spec's ``recurrent_mixers`` add their own."""


class Remat(enum.Enum):
    """Whether a decoder layer recomputes its activations in the backward pass (``gradient_checkpointing``);
    ``adapters.training.train_step.rematerialised`` sets ``BLOCK`` while a train step is traced."""

    NONE = "none"
    BLOCK = "block"


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of a layer, as ``transformers`` computes it.

    Args:
        inv_freq: inverse frequencies, one per rotated pair (``rotary_dim // 2``): the first ``rotary_dim`` features of
            each head rotate (half-split, ``rotate_half``), the rest pass through.
        attention_factor: multiplies ``cos`` and ``sin`` (YaRN's and LongRoPE's ``attention_scaling``).
        long_inv_freq: LongRoPE's frequencies for a call whose largest position reaches
            ``original_max_position_embeddings`` (``transformers`` switches per forward call); ``()`` for one set.
        original_max_position_embeddings: LongRoPE's switch point.
        interleaved: pairs are neighbouring features ``(2i, 2i + 1)`` (Cohere's ``rotate_half``) instead of
            ``(i, i + rotary_dim / 2)``.
        mrope_section: multimodal rope (Qwen2-VL's M-RoPE): how many of the frequencies, in order, rotate by the
            temporal, height and width position (``transformers``' ``rope_parameters["mrope_section"]``, summing to
            ``rotary_dim // 2``); positions then come as ``[3, B, T]``, and ``[B, T]`` ones serve all three (text).
            ``()``: one position per token.
        mrope_interleaved: the sections' frequencies interleave (Qwen3-VL, Qwen3.5; :meth:`mrope_axes`).
    """

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0
    long_inv_freq: tuple[float, ...] = ()
    original_max_position_embeddings: int = 0
    interleaved: bool = False
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False

    def __post_init__(self):
        if self.mrope_section and not self.mrope_interleaved and sum(self.mrope_section) != len(self.inv_freq):
            raise ValueError(f"Rope: mrope_section {list(self.mrope_section)} must sum to rotary_dim // 2 = "
                             f"{len(self.inv_freq)}.")

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``cos, sin`` of ``[B, T, rotary_dim // 2]`` in float32 for ``positions [B, T]`` (or, with
        :attr:`mrope_section`, ``[3, B, T]``: each frequency takes the angle of its section's axis)."""
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        if self.long_inv_freq:
            longest = jnp.max(positions) + 1
            inv_freq = jnp.where(longest > self.original_max_position_embeddings,
                                 jnp.asarray(self.long_inv_freq, jnp.float32), inv_freq)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        if positions.ndim == 3:
            if not self.mrope_section:
                raise ValueError("Rope: positions [3, B, T] need mrope_section (a multimodal rope).")
            axis = jnp.asarray(self.mrope_axes())
            angles = jnp.where(axis == 0, angles[0], jnp.where(axis == 1, angles[1], angles[2]))
        return jnp.cos(angles) * self.attention_factor, jnp.sin(angles) * self.attention_factor

    def mrope_axes(self) -> np.ndarray:
        """Which position axis (0 time, 1 rows, 2 columns) rotates each frequency: ``mrope_section[a]`` frequencies
        in turn per axis, or, :attr:`mrope_interleaved` (Qwen3-VL), frequency ``j`` by axis ``j % 3`` while that
        axis has frequencies left (``transformers``' ``apply_interleaved_mrope``), time otherwise."""
        if not self.mrope_interleaved:
            return np.repeat(np.arange(len(self.mrope_section)), self.mrope_section)
        axes = np.zeros(len(self.inv_freq), np.int32)
        for axis in (1, 2):
            axes[axis:3 * self.mrope_section[axis]:3] = axis
        return axes

    def apply(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Rotates the first :attr:`rotary_dim` features of ``x [B, T, N, D]`` (``transformers``' ``rotate_half``, or
        Cohere's interleaved one)."""
        rotated, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
        if self.interleaved:
            even, odd = rotated[..., 0::2], rotated[..., 1::2]
            out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rotated.shape)
        else:
            first, second = jnp.split(rotated, 2, axis=-1)
            out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return jnp.concatenate([out, passed], axis=-1) if passed.shape[-1] else out


@dataclass(frozen=True)
class RoutedSpec:
    """DeepSeek-V3's mixture of experts (GLM-4 MoE has the same): a float32 router whose sigmoid scores, plus a
    per-expert correction bias, choose ``num_experts_per_tok`` of ``num_experts`` experts within the ``topk_group``
    best of ``n_group`` groups (a group scores as the sum of its two best experts); the chosen scores, renormalised
    when ``norm_topk_prob``, times ``routed_scaling_factor``, weigh the experts' gated MLPs; a shared gated MLP of
    ``n_shared_experts`` experts' width is added.

    Args:
        layers: which layers hold experts (the others keep the dense MLP).
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    layers: tuple[bool, ...]


@dataclass(frozen=True)
class LatentAttentionSpec:
    """DeepSeek-V3's multi-head latent attention: queries through a low-rank ``q_a_proj`` / norm / ``q_b_proj``
    (or one ``q_proj`` when ``q_lora_rank`` is ``None``); keys and values from a ``kv_lora_rank`` latent
    (``kv_a_proj_with_mqa``, norm, ``kv_b_proj``) whose last ``qk_rope_head_dim`` features are one rotary key shared
    by every head. Each head's query and key are ``qk_nope_head_dim`` features without position plus
    ``qk_rope_head_dim`` rotated ones; its value has ``v_head_dim``.

    Args:
        latent_norm_eps: the epsilon of the two latent norms (``transformers`` leaves them at its default, 1e-6).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class SparseMoeSpec:
    """Qwen's mixture of experts (``transformers``' ``Qwen3NextSparseMoeBlock``, Qwen3.5-MoE's alike): a softmax router
    ``gate`` (float32 probabilities) picks ``num_experts_per_tok`` of ``num_experts`` gated-MLP experts, their
    probabilities renormalised when ``norm_topk_prob``; a shared expert of ``shared_expert_intermediate_size``
    (``0``: none), weighed by ``sigmoid(shared_expert_gate(x))``, is added.

    Args:
        layers: which layers hold experts (the others keep the dense MLP).
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    layers: tuple[bool, ...]


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the native decoder needs to know of one model, as switches (see the module docstring).

    Args:
        num_layers, vocab_size, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim: the sizes.
        norm: ``"rms"`` (``x / rms(x) * weight``, float32 inside) or ``"layer"`` (LayerNorm, with ``norm_bias``).
        norm_eps: the norms' epsilon.
        block: how a layer wires its residuals: ``"sequential"`` (Llama: ``h = x + attn(norm(x))``,
            ``h + mlp(norm(h))``), ``"post_norm"`` (OLMo 2: ``h = x + norm(attn(x))``, ``h + norm(mlp(h))``),
            ``"parallel"`` (GPT-NeoX: ``x + attn(norm1(x)) + mlp(norm2(x))``) or ``"parallel_shared_norm"`` (Cohere:
            ``x + attn(norm(x)) + mlp(norm(x))``, one norm) or ``"single"`` (Nemotron-H: each layer one component,
            ``x + op(norm(x))``, its ``layer_types`` entry naming it: a token mixer or ``"mlp"``).
        qkv: ``"split"`` (``q_proj``, ``k_proj``, ``v_proj``), ``"fused"`` (one ``qkv_proj``: rows ``[q; k; v]``,
            Phi-3) or ``"fused_per_head"`` (one ``query_key_value``: per head ``[q, k, v]``, GPT-NeoX).
        qkv_name, output_name: the NNX names of the fused projection and the output projection.
        mlp: ``"gated"`` (``down(act(gate(x)) * up(x))``), ``"gated_fused"`` (``gate_up_proj`` rows ``[gate; up]``,
            Phi-3), ``"plain"`` (``down(act(up(x)))``) or ``"gpt_oss_experts"`` (:class:`GptOssExperts`: a router
            with a bias picks ``num_experts_per_tok`` of ``num_experts`` experts).
        num_experts, num_experts_per_tok: the experts of a mixture-of-experts MLP and how many each token uses.
        routed: DeepSeek-style routed experts (:class:`RoutedSpec`), on the layers it names; ``None``: none.
        latent_attention: multi-head latent attention (:class:`LatentAttentionSpec`, DeepSeek-V3) instead of
            ``q/k/v_proj``; ``None``: none.
        attention_sinks: each head has a learned sink logit that joins the softmax and is then dropped (GPT-OSS).
        activation: a key of :data:`ACTIVATIONS`.
        attention_bias, output_bias, mlp_bias: which projections carry a bias.
        qk_norm: ``"none"``, ``"head"`` (an RMS norm of each head, Qwen3-style) or ``"projection"`` (an RMS norm over
            the whole query and key projections, OLMo 2).
        ropes: each layer's :class:`Rope`, ``None`` for a layer without rotary embedding (SmolLM3's NoPE layers).
        windows: each layer's sliding window (keys within ``window - 1`` slots before the query), ``None``: full.
        attention_scale: queries times keys are multiplied by it (``head_dim ** -0.5``; Granite's
            ``attention_multiplier``).
        embedding_multiplier: the embeddings are multiplied by it (Granite).
        residual_multiplier: each block's attention and MLP outputs are multiplied by it before the residual add.
        logits_divisor: the logits are divided by it (Granite's ``logits_scaling``).
        logits_multiplier: the logits are multiplied by it (Cohere's ``logit_scale``).
        tie_embeddings: the output head is the input embedding.
        dtype: the parameters' dtype.
        norm_offset: the RMS norms multiply by ``norm_offset + weight`` (Qwen3-Next's and Qwen3.5's ``1 + weight``,
            their weights stored as the offset from it, initialised at zero).
        layer_types: each layer's token mixer: ``"attention"``, ``"linear_attention"`` (gated DeltaNet,
            :mod:`.linear_attention`), a name of ``recurrent_mixers``, or ``"mlp"`` (no token mixer: a ``"single"``
            block's MLP layer); empty: attention everywhere.
        recurrent_mixers: ``(layer type, factory)`` pairs: ``factory(spec, layer, rngs)`` builds the recurrent token
            mixer of layers of that type (stored under the type's name), an ``nnx.Module`` called ``(x [B, T, H],
            valid [B, T], state | None) -> (y, state | None)`` with ``state_shapes(dtype) -> {name: (shape,
            dtype)}`` (:mod:`.linear_attention`'s contract: LFM2's short convolution, Mamba-2).
        linear_attention: the gated DeltaNet layers' :class:`~.linear_attention.GatedDeltaNetSpec`.
        attention_output_gate: Qwen3-Next's gated attention: ``q_proj`` gives each head's query and a gate, and the
            attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``.
        sparse_moe: Qwen's mixture of experts (:class:`SparseMoeSpec`) on the layers it names; ``None``: none.
    """

    num_layers: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ropes: tuple[Rope | None, ...]
    windows: tuple[int | None, ...]
    norm: str = "rms"
    norm_eps: float = 1e-6
    norm_bias: bool = False
    block: str = "sequential"
    qkv: str = "split"
    qkv_name: str = "qkv_proj"
    output_name: str = "o_proj"
    mlp: str = "gated"
    activation: str = "silu"
    attention_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    routed: RoutedSpec | None = None
    latent_attention: LatentAttentionSpec | None = None
    attention_sinks: bool = False
    attention_scale: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    logits_multiplier: float = 1.0
    tie_embeddings: bool = False
    dtype: jnp.dtype = jnp.float32
    norm_offset: float = 0.0
    layer_types: tuple[str, ...] = ()
    recurrent_mixers: tuple[tuple[str, Callable[..., nnx.Module]], ...] = ()
    linear_attention: GatedDeltaNetSpec | None = None
    attention_output_gate: bool = False
    sparse_moe: SparseMoeSpec | None = None

    def __post_init__(self):
        for name, value, choices in (("norm", self.norm, NORMS), ("block", self.block, BLOCKS),
                                     ("qkv", self.qkv, QKV_LAYOUTS), ("mlp", self.mlp, MLPS),
                                     ("qk_norm", self.qk_norm, QK_NORMS), ("activation", self.activation, ACTIVATIONS)):
            if value not in choices:
                raise ValueError(f"DecoderSpec.{name}={value!r}; choose one of {list(choices)}.")
        if len(self.ropes) != self.num_layers or len(self.windows) != self.num_layers:
            raise ValueError(f"DecoderSpec: ropes ({len(self.ropes)}) and windows ({len(self.windows)}) need one entry "
                             f"per layer ({self.num_layers}).")
        if self.qkv == "fused_per_head" and self.num_kv_heads != self.num_heads:
            raise ValueError("DecoderSpec: qkv='fused_per_head' holds as many key/value heads as query heads.")
        if self.layer_types:
            known = [*LAYER_TYPES, *(name for name, _ in self.recurrent_mixers)]
            unknown = sorted(set(self.layer_types) - set(known))
            if unknown or len(self.layer_types) != self.num_layers:
                raise ValueError(f"DecoderSpec.layer_types needs one of {known} per layer "
                                 f"({self.num_layers}); got {list(self.layer_types)}.")
            if "mlp" in self.layer_types and self.block != "single":
                raise ValueError("DecoderSpec: 'mlp' layers (no token mixer) need block='single'.")
            if "linear_attention" in self.layer_types and self.linear_attention is None:
                raise ValueError("DecoderSpec: linear_attention layers need DecoderSpec.linear_attention.")

    def layer_type(self, layer: int) -> str:
        """Layer ``layer``'s token mixer (:attr:`layer_types`)."""
        return self.layer_types[layer] if self.layer_types else "attention"

    def recurrent_mixer(self, layer: int) -> str | None:
        """The NNX attribute of layer ``layer``'s recurrent mixer (``linear_attn`` for gated DeltaNet, else its
        type's name); ``None`` for attention and MLP layers."""
        kind = self.layer_type(layer)
        if kind == "linear_attention":
            return "linear_attn"
        return kind if kind in dict(self.recurrent_mixers) else None

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def cache_head_dim(self) -> int:
        """The KV cache's head size: ``head_dim``, or latent attention's wider of its key and value heads (its values
        are kept zero-padded to the keys' size)."""
        latent = self.latent_attention
        return self.head_dim if latent is None else max(latent.qk_head_dim, latent.v_head_dim)


# The mesh axes of each kind of parameter: the names Tunix's models use, so both shard alike on one mesh.
_IN_OUT = ("fsdp", "tp")
_OUT_IN = ("tp", "fsdp")


def _linear(spec: DecoderSpec, inputs: int, outputs: int, bias: bool, axes: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(inputs, outputs, use_bias=bias, param_dtype=spec.dtype, rngs=rngs,
                      kernel_init=nnx.with_partitioning(nnx.initializers.normal(0.02), axes),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)))


def mixer_linear(spec: DecoderSpec, inputs: int, outputs: int, bias: bool, rngs: nnx.Rngs, *,
                 to_residual: bool = False) -> nnx.Linear:
    """A projection of a recurrent mixer (:attr:`DecoderSpec.recurrent_mixers`), built as the decoder builds its own:
    kernel ``[inputs, outputs]`` sharded ``("fsdp", "tp")``, or ``("tp", "fsdp")`` for one writing into the residual
    stream (``to_residual``, as ``o_proj``)."""
    return _linear(spec, inputs, outputs, bias, _OUT_IN if to_residual else _IN_OUT, rngs)


class Norm(nnx.Module):
    """RMS norm or LayerNorm as ``transformers`` computes them: normalised, scaled (``scale``, or ``offset + scale``)
    and shifted (``bias``, LayerNorm with a bias) in float32, then cast back to the input's dtype."""

    def __init__(self, size: int, kind: str, eps: float, bias: bool, dtype, rngs: nnx.Rngs, offset: float = 0.0):
        self.kind = kind
        self.eps = eps
        self.offset = offset
        self.scale = nnx.Param(jnp.full((size,), 0.0 if offset else 1.0, dtype))
        self.bias = nnx.Param(jnp.zeros((size,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        values = x.astype(jnp.float32)
        if self.kind == "layer":
            values = values - jnp.mean(values, axis=-1, keepdims=True)
        normalised = values * jax.lax.rsqrt(jnp.mean(values * values, axis=-1, keepdims=True) + self.eps)
        scale = self.scale.get_value().astype(jnp.float32)
        out = (scale + self.offset if self.offset else scale) * normalised
        if self.bias is not None:
            out = out + self.bias.get_value().astype(jnp.float32)
        return out.astype(x.dtype)


def _norm(spec: DecoderSpec, size: int, rngs: nnx.Rngs) -> Norm:
    return Norm(size, spec.norm, spec.norm_eps, spec.norm_bias, spec.dtype, rngs, spec.norm_offset)


class Embedder(nnx.Module):
    """The token embedding: ``encode`` looks rows up, ``decode`` is the tied output head."""

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs):
        self.input_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (spec.vocab_size,
                                                                                       spec.hidden_size), spec.dtype),
                                         sharding=_OUT_IN)

    def encode(self, tokens: jax.Array) -> jax.Array:
        return self.input_embedding[(tokens,)]

    def decode(self, hidden: jax.Array) -> jax.Array:
        return jnp.dot(hidden, self.input_embedding.get_value().astype(hidden.dtype).T)


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads, the layer's rope and window, and the Tunix KV cache."""

    def __init__(self, spec: DecoderSpec, layer: int, rngs: nnx.Rngs):
        self.spec = spec
        self.rope = spec.ropes[layer]
        self.window = spec.windows[layer]
        hidden, heads, kv_heads, head_dim = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        bias = spec.attention_bias
        latent = spec.latent_attention
        if latent is not None:
            if latent.q_lora_rank is None:
                self.q_proj = _linear(spec, hidden, heads * latent.qk_head_dim, False, _IN_OUT, rngs)
            else:
                self.q_a_proj = _linear(spec, hidden, latent.q_lora_rank, bias, _IN_OUT, rngs)
                self.q_a_layernorm = Norm(latent.q_lora_rank, "rms", latent.latent_norm_eps, False, spec.dtype, rngs)
                self.q_b_proj = _linear(spec, latent.q_lora_rank, heads * latent.qk_head_dim, False, _IN_OUT, rngs)
            self.kv_a_proj_with_mqa = _linear(spec, hidden, latent.kv_lora_rank + latent.qk_rope_head_dim, bias,
                                              _IN_OUT, rngs)
            self.kv_a_layernorm = Norm(latent.kv_lora_rank, "rms", latent.latent_norm_eps, False, spec.dtype, rngs)
            self.kv_b_proj = _linear(spec, latent.kv_lora_rank,
                                     heads * (latent.qk_nope_head_dim + latent.v_head_dim), False, _IN_OUT, rngs)
            self.o_proj = _linear(spec, heads * latent.v_head_dim, hidden, spec.output_bias, _OUT_IN, rngs)
            return
        if spec.qkv == "split":
            gated = 2 if spec.attention_output_gate else 1
            self.q_proj = _linear(spec, hidden, gated * heads * head_dim, bias, _IN_OUT, rngs)
            self.k_proj = _linear(spec, hidden, kv_heads * head_dim, bias, _IN_OUT, rngs)
            self.v_proj = _linear(spec, hidden, kv_heads * head_dim, bias, _IN_OUT, rngs)
        else:
            width = (heads + 2 * kv_heads) * head_dim
            setattr(self, spec.qkv_name, _linear(spec, hidden, width, bias, _IN_OUT, rngs))
        setattr(self, spec.output_name, _linear(spec, heads * head_dim, hidden, spec.output_bias, _OUT_IN, rngs))
        if spec.attention_sinks:
            self.sinks = nnx.Param(jnp.zeros((heads,), spec.dtype))
        if spec.qk_norm == "head":
            self.q_norm = Norm(head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs, spec.norm_offset)
            self.k_norm = Norm(head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs, spec.norm_offset)
        elif spec.qk_norm == "projection":
            self.q_norm = Norm(heads * head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs)
            self.k_norm = Norm(kv_heads * head_dim, "rms", spec.norm_eps, False, spec.dtype, rngs)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Queries ``[B, T, N, D]``, keys and values ``[B, T, K, D]``, and the output gate ``[B, T, N * D]`` (``None``
        without :attr:`DecoderSpec.attention_output_gate`)."""
        spec = self.spec
        batch, length = x.shape[:2]
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        gate = None
        if spec.qkv == "split":
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if spec.attention_output_gate:  # per head: [query, gate]
                q, gate = jnp.split(q.reshape(batch, length, heads, 2 * head_dim), 2, axis=-1)
                gate = gate.reshape(batch, length, heads * head_dim)
        elif spec.qkv == "fused":
            qkv = getattr(self, spec.qkv_name)(x)
            q, k, v = jnp.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
        else:
            qkv = getattr(self, spec.qkv_name)(x).reshape(batch, length, heads, 3 * head_dim)
            q, k, v = jnp.split(qkv, 3, axis=-1)
        if spec.qk_norm == "projection":
            q, k = self.q_norm(q.reshape(batch, length, -1)), self.k_norm(k.reshape(batch, length, -1))
        q = q.reshape(batch, length, heads, head_dim)
        k = k.reshape(batch, length, kv_heads, head_dim)
        v = v.reshape(batch, length, kv_heads, head_dim)
        if spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def _project_latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Latent attention's queries and keys ``[B, T, N, qk_head_dim]`` (rope applied to their last
        ``qk_rope_head_dim`` features) and values ``[B, T, N, cache_head_dim]`` (zero-padded)."""
        spec, latent = self.spec, self.spec.latent_attention
        batch, length = x.shape[:2]
        heads, nope, rope_dim = spec.num_heads, latent.qk_nope_head_dim, latent.qk_rope_head_dim
        if latent.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(batch, length, heads, latent.qk_head_dim)
        compressed, k_rot = jnp.split(self.kv_a_proj_with_mqa(x), [latent.kv_lora_rank], axis=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).reshape(batch, length, heads, nope + latent.v_head_dim)
        k_pass, v = jnp.split(kv, [nope], axis=-1)
        q_pass, q_rot = jnp.split(q, [nope], axis=-1)
        k_rot = k_rot.reshape(batch, length, 1, rope_dim)
        cos, sin = self.rope.cos_sin(positions)
        q_rot, k_rot = self.rope.apply(q_rot, cos, sin), self.rope.apply(k_rot, cos, sin)
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        k = jnp.concatenate([k_pass, jnp.broadcast_to(k_rot, (*k_pass.shape[:-1], rope_dim))], axis=-1)
        padding = spec.cache_head_dim - latent.v_head_dim
        if padding:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, padding)))
        k_padding = spec.cache_head_dim - latent.qk_head_dim
        if k_padding:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, k_padding)))
            k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, k_padding)))
        return q, k, v

    def __call__(self, x: jax.Array, positions: jax.Array, cache: dict | None,
                 mask: jax.Array) -> tuple[jax.Array, dict | None]:
        """Attends ``x [B, T, H]`` (keys ``mask [B, T, S]`` allows, and the layer's window) and returns ``(output,
        the layer's updated cache or None)``."""
        spec = self.spec
        gate = None
        if spec.latent_attention is not None:
            q, k, v = self._project_latent(x, positions)
        else:
            q, k, v, gate = self._project(x)
            if self.rope is not None:
                cos, sin = self.rope.cos_sin(positions)
                q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        if paged_attention.is_paged(cache):  # the paged engine's kernels (it refuses sinks and latent attention)
            out, cache = paged_attention.attend(q, k, v, cache, scale=spec.scale, window=self.window)
            return self._output(out, gate, x.dtype), cache
        first = 0
        if cache is not None:
            first = cache["end_index"][0]
            slot = (0, first % cache["k"].shape[1], 0, 0)
            k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), slot)
            v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), slot)
            cache = {"k": k, "v": v, "end_index": cache["end_index"] + x.shape[1]}
        if self.window is not None:
            mask = mask & sliding_window_mask(x.shape[1], mask.shape[-1], first, self.window)
        batch, length, heads, head_dim = q.shape
        kv_heads = spec.num_kv_heads
        grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("BTKGD,BSKD->BKGTS", grouped, k.astype(q.dtype)) * spec.scale
        scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
        if spec.attention_sinks:
            # transformers joins each head's sink logit as one more key, takes the softmax, then drops that column.
            sinks = self.sinks.get_value().astype(scores.dtype).reshape(kv_heads, heads // kv_heads)
            sinks = jnp.broadcast_to(sinks[None, :, :, None, None], (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1).astype(jnp.float32), axis=-1)
            probs = probs[..., :-1].astype(v.dtype)
        else:
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v).reshape(batch, length, heads, head_dim)
        return self._output(out, gate, x.dtype), cache

    def _output(self, out: jax.Array, gate: jax.Array | None, dtype) -> jax.Array:
        """The output projection of the heads' outputs ``out [B, T, N, D]`` (gated where the spec gates them)."""
        spec = self.spec
        if spec.latent_attention is not None:
            out = out[..., :spec.latent_attention.v_head_dim]
        out = out.reshape(*out.shape[:2], -1).astype(dtype)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return getattr(self, spec.output_name)(out)


class MLP(nnx.Module):
    """The feed-forward block: gated (separate or fused gate and up projections) or plain."""

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs, intermediate_size: int | None = None):
        self.kind = spec.mlp
        self.activation = spec.activation
        hidden, inner, bias = spec.hidden_size, intermediate_size or spec.intermediate_size, spec.mlp_bias
        if spec.mlp == "gated":
            self.gate_proj = _linear(spec, hidden, inner, bias, _IN_OUT, rngs)
        if spec.mlp == "gated_fused":
            self.gate_up_proj = _linear(spec, hidden, 2 * inner, bias, _IN_OUT, rngs)
        else:
            self.up_proj = _linear(spec, hidden, inner, bias, _IN_OUT, rngs)
        self.down_proj = _linear(spec, inner, hidden, bias, _OUT_IN, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        if self.kind == "gated":
            inner = act(self.gate_proj(x)) * self.up_proj(x)
        elif self.kind == "gated_fused":
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
            inner = up * act(gate)
        else:
            inner = act(self.up_proj(x))
        return self.down_proj(inner)


class GptOssExperts(nnx.Module):
    """GPT-OSS's mixture-of-experts MLP as ``transformers``' ``GptOssMLP`` computes it: router logits
    ``x @ router + bias``, the top ``num_experts_per_tok`` of them softmaxed, and each chosen expert's
    ``((up + 1) * gate * sigmoid(1.702 * gate)) @ down + down_bias`` with ``gate, up`` the even and odd columns of
    ``x @ gate_up_proj + gate_up_proj_bias``, clamped to 7 (``up`` on both sides). Only the chosen experts run
    (``jax.lax.ragged_dot``, a grouped matmul). The expert tensors keep ``transformers``' layout: ``gate_up_proj``
    ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``.

    Attributes:
        records_router_logits: sow the router logits as ``nnx.Intermediate`` ``router_logits`` (the load-balancing
            loss reads them, :func:`~.experts.run_recording_router_logits`).
    """

    ALPHA = 1.702
    LIMIT = 7.0

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs):
        experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.top_k = spec.num_experts_per_tok
        self.records_router_logits = False
        self.router = _linear(spec, hidden, experts, True, (None, None), rngs)
        normal = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(normal(rngs.params(), (experts, hidden, 2 * inner), spec.dtype),
                                      sharding=("fsdp", None, "tp"))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((experts, 2 * inner), spec.dtype))
        self.down_proj = nnx.Param(normal(rngs.params(), (experts, inner, hidden), spec.dtype),
                                   sharding=("fsdp", "tp", None))
        self.down_proj_bias = nnx.Param(jnp.zeros((experts, hidden), spec.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        router_logits = self.router(x)
        if self.records_router_logits:
            self.sow(nnx.Intermediate, "router_logits", router_logits)
        top_logits, experts = jax.lax.top_k(router_logits, self.top_k)
        weights = jax.nn.softmax(top_logits, axis=-1)
        hidden = x.shape[-1]
        count = self.gate_up_proj.shape[0]
        chosen = experts.reshape(-1)
        order = jnp.argsort(chosen, stable=True)
        rows = jnp.repeat(x.reshape(-1, hidden), self.top_k, axis=0)[order]
        sizes = jnp.bincount(chosen, length=count).astype(jnp.int32)
        gate_up = jax.lax.ragged_dot(rows, self.gate_up_proj.get_value().astype(x.dtype), sizes)
        gate_up = gate_up + self.gate_up_proj_bias.get_value().astype(x.dtype)[chosen[order]]
        gate = jnp.minimum(gate_up[:, 0::2], self.LIMIT)
        up = jnp.clip(gate_up[:, 1::2], -self.LIMIT, self.LIMIT)
        activations = (up + 1) * (gate * jax.nn.sigmoid(gate * self.ALPHA))
        outputs = jax.lax.ragged_dot(activations, self.down_proj.get_value().astype(x.dtype), sizes)
        outputs = outputs + self.down_proj_bias.get_value().astype(x.dtype)[chosen[order]]
        outputs = jnp.zeros_like(outputs).at[order].set(outputs).reshape(*experts.shape, hidden)
        return jnp.einsum("BTKD,BTK->BTD", outputs, weights.astype(outputs.dtype))


class RoutedExperts(nnx.Module):
    """DeepSeek-V3's and GLM-4 MoE's mixture of experts as ``transformers`` computes it (see :class:`RoutedSpec`):
    ``router`` (float32 logits, no bias), ``e_score_correction_bias`` (a :class:`~.nnx_state.Buffer`: loaded and
    saved, never trained), the experts' stacked ``gate_proj``/``up_proj`` ``[E, H, I]`` and ``down_proj``
    ``[E, I, H]`` (only the chosen ones run, :func:`~.experts.routed_experts`) and ``shared_experts``, a gated MLP."""

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs):
        routed = spec.routed
        self.routed = routed
        hidden, inner, experts = spec.hidden_size, routed.intermediate_size, routed.num_experts
        self.router = _linear(spec, hidden, experts, False, (None, None), rngs)
        self.e_score_correction_bias = Buffer(jnp.zeros((experts,), jnp.float32))
        normal = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(normal(rngs.params(), (experts, hidden, inner), spec.dtype),
                                   sharding=("fsdp", None, "tp"))
        self.up_proj = nnx.Param(normal(rngs.params(), (experts, hidden, inner), spec.dtype),
                                 sharding=("fsdp", None, "tp"))
        self.down_proj = nnx.Param(normal(rngs.params(), (experts, inner, hidden), spec.dtype),
                                   sharding=("fsdp", "tp", None))
        self.shared_experts = MLP(spec, rngs, intermediate_size=inner * routed.n_shared_experts)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(chosen experts [B, T, K], their float32 weights [B, T, K])`` for tokens ``x``."""
        routed = self.routed
        kernel = self.router.kernel.get_value().astype(jnp.float32)
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ kernel)
        for_choice = scores + self.e_score_correction_bias.get_value().astype(jnp.float32)
        grouped = for_choice.reshape(*for_choice.shape[:-1], routed.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        _, best_groups = jax.lax.top_k(group_scores, routed.topk_group)
        group_mask = jnp.zeros_like(group_scores, bool).at[
            (*jnp.indices(best_groups.shape)[:-1], best_groups)].set(True)
        expert_mask = jnp.repeat(group_mask, routed.num_experts // routed.n_group, axis=-1)
        _, experts = jax.lax.top_k(jnp.where(expert_mask, for_choice, -jnp.inf), routed.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if routed.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return experts, weights * routed.routed_scaling_factor

    def __call__(self, x: jax.Array) -> jax.Array:
        experts, weights = self.route(x)
        routed = routed_experts(x, experts, weights.astype(x.dtype), self.gate_proj.get_value().astype(x.dtype),
                                self.up_proj.get_value().astype(x.dtype), self.down_proj.get_value().astype(x.dtype))
        return routed + self.shared_experts(x)


class SparseMoe(nnx.Module):
    """Qwen's mixture of experts as ``transformers``' ``Qwen3NextSparseMoeBlock`` computes it (see
    :class:`SparseMoeSpec`): the router ``gate`` (no bias), the experts' stacked ``gate_proj``/``up_proj``
    ``[E, H, I]`` and ``down_proj`` ``[E, I, H]`` (only the chosen ones run, :func:`~.experts.routed_experts`), and the
    gated ``shared_expert``.

    Attributes:
        records_router_logits: sow the router logits as ``nnx.Intermediate`` ``router_logits`` (the load-balancing
            loss reads them, :func:`~.experts.run_recording_router_logits`).
    """

    def __init__(self, spec: DecoderSpec, rngs: nnx.Rngs):
        moe = spec.sparse_moe
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.records_router_logits = False
        hidden, inner, experts = spec.hidden_size, moe.intermediate_size, moe.num_experts
        self.gate = _linear(spec, hidden, experts, False, (None, None), rngs)
        normal = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(normal(rngs.params(), (experts, hidden, inner), spec.dtype),
                                   sharding=("fsdp", None, "tp"))
        self.up_proj = nnx.Param(normal(rngs.params(), (experts, hidden, inner), spec.dtype),
                                 sharding=("fsdp", None, "tp"))
        self.down_proj = nnx.Param(normal(rngs.params(), (experts, inner, hidden), spec.dtype),
                                   sharding=("fsdp", "tp", None))
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(spec, rngs, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = _linear(spec, hidden, 1, False, (None, None), rngs)
        else:
            self.shared_expert = None

    def __call__(self, x: jax.Array) -> jax.Array:
        router_logits = self.gate(x)
        if self.records_router_logits:
            self.sow(nnx.Intermediate, "router_logits", router_logits)
        weights, experts = softmax_top_k(router_logits, self.top_k, self.norm_topk_prob)
        out = routed_experts(x, experts, weights.astype(x.dtype), self.gate_proj.get_value().astype(x.dtype),
                             self.up_proj.get_value().astype(x.dtype), self.down_proj.get_value().astype(x.dtype))
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _mlp(spec: DecoderSpec, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    if spec.mlp == "gpt_oss_experts":
        return GptOssExperts(spec, rngs)
    if spec.sparse_moe is not None and spec.sparse_moe.layers[layer]:
        return SparseMoe(spec, rngs)
    if spec.routed is not None and spec.routed.layers[layer]:
        return RoutedExperts(spec, rngs)
    return MLP(spec, rngs)


class DecoderLayer(nnx.Module):
    """One decoder block, its residual wiring chosen by ``DecoderSpec.block``."""

    def __init__(self, spec: DecoderSpec, layer: int, rngs: nnx.Rngs):
        self.block_kind = spec.block
        self.residual_multiplier = spec.residual_multiplier
        self.remat_config = Remat.NONE
        self.kind = spec.layer_type(layer)
        self.mixer_name = spec.recurrent_mixer(layer)
        if spec.block != "post_norm":
            self.input_layernorm = _norm(spec, spec.hidden_size, rngs)
        if self.kind == "linear_attention":
            linear = functools.partial(_linear_without_bias, spec, rngs)
            self.linear_attn = GatedDeltaNet(spec.linear_attention, spec.hidden_size, linear, spec.dtype, rngs)
        elif self.mixer_name is not None:
            setattr(self, self.mixer_name, dict(spec.recurrent_mixers)[self.kind](spec, layer, rngs))
        elif self.kind == "attention":
            self.attn = Attention(spec, layer, rngs)
        if spec.block == "single":  # one component per layer: the token mixer above, or the MLP
            if self.kind == "mlp":
                self.mlp = _mlp(spec, layer, rngs)
            return
        if spec.block != "parallel_shared_norm":
            self.post_attention_layernorm = _norm(spec, spec.hidden_size, rngs)
        if spec.block == "post_norm":
            self.post_feedforward_layernorm = _norm(spec, spec.hidden_size, rngs)
        self.mlp = _mlp(spec, layer, rngs)

    def mix(self, x, positions, cache, mask, valid):
        """The layer's token mixer: attention, or the recurrent mixer on the real tokens (``valid``)."""
        if self.mixer_name is not None:
            return getattr(self, self.mixer_name)(x, valid, cache)
        return self.attn(x, positions, cache, mask)

    def block(self, x, positions, cache, mask, valid):
        scale = self.residual_multiplier
        if self.block_kind == "single":
            normed = self.input_layernorm(x)
            if self.kind == "mlp":
                return cache, x + self.mlp(normed)
            mixed, cache = self.mix(normed, positions, cache, mask, valid)
            return cache, x + mixed
        if self.block_kind == "post_norm":
            attended, cache = self.mix(x, positions, cache, mask, valid)
            x = x + self.post_attention_layernorm(attended)
            return cache, x + self.post_feedforward_layernorm(self.mlp(x))
        normed = self.input_layernorm(x)
        attended, cache = self.mix(normed, positions, cache, mask, valid)
        if self.block_kind == "parallel_shared_norm":
            return cache, x + attended + self.mlp(normed)
        if self.block_kind == "parallel":
            return cache, x + attended + self.mlp(self.post_attention_layernorm(x))
        x = x + attended * scale if scale != 1.0 else x + attended
        fed = self.mlp(self.post_attention_layernorm(x))
        return cache, x + fed * scale if scale != 1.0 else x + fed

    def __call__(self, x, positions, cache, mask, valid):
        if self.remat_config == Remat.BLOCK:
            return nnx.remat(type(self).block)(self, x, positions, cache, mask, valid)
        return self.block(x, positions, cache, mask, valid)


def _linear_without_bias(spec: DecoderSpec, rngs: nnx.Rngs, inputs: int, outputs: int) -> nnx.Linear:
    return _linear(spec, inputs, outputs, False, _IN_OUT, rngs)


def _token_validity(mask: jax.Array, cache: dict | None) -> jax.Array:
    """Which of the call's tokens are real ``[B, T]``: those whose own slot their mask row shows (slot ``end_index + t``
    of the cache, or ``t`` without one). Padding is a token no query may see, itself included."""
    length = mask.shape[1]
    first = jnp.zeros((), jnp.int32) if cache is None else next(iter(cache.values()))["end_index"][0]
    slots = (first + jnp.arange(length)) % mask.shape[-1]
    return jnp.take_along_axis(mask, jnp.broadcast_to(slots[None, :, None], (mask.shape[0], length, 1)),
                               axis=-1)[..., 0]


class NativeDecoder(nnx.Module):
    """The native decoder (see the module docstring). ``config`` is its :class:`DecoderSpec`."""

    def __init__(self, spec: DecoderSpec, *, rngs: nnx.Rngs):
        self.config = spec
        self.embedder = Embedder(spec, rngs)
        self.layers = nnx.List([DecoderLayer(spec, layer, rngs) for layer in range(spec.num_layers)])
        self.final_norm = _norm(spec, spec.hidden_size, rngs)
        if not spec.tie_embeddings:
            self.lm_head = _linear(spec, spec.hidden_size, spec.vocab_size, False, _IN_OUT, rngs)

    def kv_cache_shapes(self) -> dict[str, tuple[int, int]]:
        """Each attention layer's ``(kv_heads, head_dim)``, by cache key."""
        return {f"layer_{index}": (self.config.num_kv_heads, self.config.cache_head_dim)
                for index in range(self.config.num_layers) if self.config.layer_type(index) == "attention"}

    def recurrent_state_shapes(self) -> dict[str, dict[str, tuple[tuple[int, ...], jnp.dtype]]]:
        """Each recurrent layer's state entries ``{name: (shape without the batch axis, dtype)}``, by cache key
        (:func:`~.decoder_contract.recurrent_state_shapes`)."""
        return {f"layer_{index}": getattr(layer, layer.mixer_name).state_shapes(self.config.dtype)
                for index, layer in enumerate(self.layers) if layer.mixer_name is not None}

    def paged_kernel_refusal(self) -> str | None:
        """Why the paged kernels cannot run this decoder's attention (:mod:`.paged_attention`), ``None`` when they
        can."""
        if self.config.attention_sinks:
            return "attention sinks (GPT-OSS) are not in JAX's paged kernels"
        if self.config.latent_attention is not None:
            return "latent attention (DeepSeek-V3's MLA) is not in JAX's paged kernels"
        return None

    def get_model_input(self) -> dict[str, jax.Array | None]:
        """A dummy call's arguments (Qwix traces the model with them to place its LoRA factors), as Tunix's models
        give them: two rows of one token."""
        return {"tokens": jnp.ones((2, 1), jnp.int32), "positions": jnp.zeros((2, 1), jnp.int32), "cache": None,
                "attention_mask": jnp.ones((2, 1, 1), bool)}

    def head(self, hidden: jax.Array) -> jax.Array:
        """The output head on final-norm ``hidden`` states: float32 logits."""
        logits = self.embedder.decode(hidden) if self.config.tie_embeddings else self.lm_head(hidden)
        if self.config.logits_multiplier != 1.0:
            logits = logits * jnp.asarray(self.config.logits_multiplier, logits.dtype)
        logits = logits.astype(jnp.float32)
        return logits / self.config.logits_divisor if self.config.logits_divisor != 1.0 else logits

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict | None,
                 attention_mask: jax.Array) -> tuple[jax.Array, dict | None]:
        """The model contract's call (:mod:`.decoder_contract`).

        Args:
            tokens: ``[B, T]`` token ids.
            positions: ``[B, T]`` their positions (rope).
            cache: ``None`` (the ``T`` tokens attend to each other) or the KV cache of :meth:`kv_cache_shapes`, the new
                keys and values written at slot ``end_index[0]``.
            attention_mask: ``[B, T, S]`` bool, ``S`` being ``T`` or the cache's size: which keys each query sees.

        Returns:
            ``(float32 logits [B, T, V], the updated cache or None)``.
        """
        return self.decode_embeddings(self.embedder.encode(tokens), positions, cache, attention_mask)

    def decode_embeddings(self, x: jax.Array, positions: jax.Array, cache: dict | None,
                          attention_mask: jax.Array, additions: Sequence[jax.Array] = ()
                          ) -> tuple[jax.Array, dict | None]:
        """:meth:`__call__` from the token embeddings ``x [B, T, H]`` on (a vision-language model's, with its image
        features in place; ``positions`` may then be ``[3, B, T]``, :attr:`Rope.mrope_section`); ``additions[i]``
        ``[B, T, H]`` is added to layer ``i``'s output (Qwen3-VL's DeepStack)."""
        if self.config.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.config.embedding_multiplier, x.dtype)
        new_cache = None if cache is None else {}
        valid = _token_validity(attention_mask, cache)
        for index, layer in enumerate(self.layers):
            name = f"layer_{index}"
            layer_cache, x = layer(x, positions, None if cache is None else cache.get(name), attention_mask, valid)
            if index < len(additions):
                x = x + additions[index]
            if layer_cache is not None:  # an MLP layer has no cache entry
                new_cache[name] = layer_cache
        return self.head(self.final_norm(x)), new_cache
