"""Recurrent token mixers of the hybrid decoders, on the native decoder: gated DeltaNet (Qwen3-Next, Qwen3.5) and the
causal depthwise convolution they and LFM2's and Mamba-2's blocks share.

A recurrent mixer keeps a fixed-size state per sequence instead of a growing KV cache. Its call is
``mixer(x [B, T, H], valid [B, T], state | None) -> (y [B, T, H], state | None)``: ``valid`` marks the real tokens
(padding is zeroed before the mixer, as ``transformers``' ``apply_mask_to_padding_states`` does, so left padding leaves
the state at zero), and ``state`` is the layer's entry of the cache (:meth:`GatedDeltaNet.state_shapes`): ``None``
in training (the state starts at zero and is not returned), else continued and returned, so prefill, chunked prefill
and decoding are one call. A call of more than one token runs the chunked parallel form
(:func:`chunk_gated_delta_rule`: ``transformers``' ``torch_chunk_gated_delta_rule``, with the in-chunk inverse taken by
a triangular solve instead of its row loop); a one-token call runs the recurrent form
(:func:`recurrent_gated_delta_rule`), as ``transformers`` switches between its two kernels.

Written here because no JAX library in the pins has them: Flax and Tunix have no linear-attention layers, and the
flash-linear-attention kernels are Triton (ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

CHUNK_SIZE = 64  # transformers' torch_chunk_gated_delta_rule default


def l2_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x ** 2) + eps)`` over the last axis, in ``x``'s dtype (the FLA library's ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None, state: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
    """A causal depthwise convolution of ``x [B, T, C]`` with ``weight [C, K]`` (``nn.Conv1d(groups=C)``'s weight
    without its middle axis): ``y[t] = sum_j weight[:, j] * x[t - K + 1 + j]`` (plus ``bias``), the ``K - 1`` inputs
    before the first taken from ``state [B, K - 1, C]`` (zeros when ``None``: ``transformers``' left zero padding).

    Returns:
        ``(y [B, T, C] in x's dtype, the last K - 1 inputs [B, K - 1, C])``.
    """
    channels, kernel = weight.shape
    if state is None:
        state = jnp.zeros((x.shape[0], kernel - 1, channels), x.dtype)
    extended = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    length = x.shape[1]
    w = weight.astype(x.dtype)
    y = sum(extended[:, j:j + length] * w[:, j] for j in range(kernel))
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y, extended[:, -(kernel - 1):] if kernel > 1 else extended[:, :0]


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (``transformers``' ``torch_recurrent_gated_delta_rule``), float32.

    Args:
        q, k: ``[B, T, N, Dk]`` (L2-normalised, one per value head); v: ``[B, T, N, Dv]``.
        g: ``[B, T, N]`` log decays; beta: ``[B, T, N]`` write strengths.
        state: ``[B, N, Dk, Dv]`` float32.

    Returns:
        ``(outputs [B, T, N, Dv] float32, the final state)``.
    """
    q = q.astype(jnp.float32) * q.shape[-1] ** -0.5

    def step(carry, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs
        carry = carry * jnp.exp(g_t)[..., None, None]
        remembered = jnp.einsum("bnkv,bnk->bnv", carry, k_t)
        delta = (v_t - remembered) * beta_t[..., None]
        carry = carry + k_t[..., :, None] * delta[..., None, :]
        return carry, jnp.einsum("bnkv,bnk->bnv", carry, q_t)

    inputs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    state, outputs = jax.lax.scan(step, state.astype(jnp.float32), inputs)
    return jnp.moveaxis(outputs, 0, 1), state


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                           state: jax.Array, chunk_size: int = CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks (``transformers``' ``torch_chunk_gated_delta_rule``): within a chunk in parallel
    (the WY representation: ``(I + tril(diag(beta) K K^T * decay, -1))^-1``, a triangular solve), across chunks through
    the state. Arguments and returns as :func:`recurrent_gated_delta_rule`."""
    batch, length, heads, _ = k.shape
    pad = (-length) % chunk_size
    q, k, v, g, beta = (jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
                        for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    chunks = (length + pad) // chunk_size

    def split(x):  # [B, T, N, ...] -> [B, N, chunks, C, ...]
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(batch, heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, g[..., :, None] - g[..., None, :], 0.0)), 0.0)
    strictly_lower = jnp.tril(k_beta @ jnp.swapaxes(k, -1, -2) * decay, -1)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)
    inverse = jax.scipy.linalg.solve_triangular(eye + strictly_lower, jnp.broadcast_to(eye, strictly_lower.shape),
                                                lower=True)
    values = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * jnp.exp(g)[..., None])
    within = q @ jnp.swapaxes(k, -1, -2) * decay

    def step(carry, inputs):
        q_i, k_i, values_i, g_i, k_cumdecay_i, within_i = inputs
        v_new = values_i - k_cumdecay_i @ carry
        out = (q_i * jnp.exp(g_i)[..., None]) @ carry + within_i @ v_new
        last = g_i[..., -1]
        carry = carry * jnp.exp(last)[..., None, None] + jnp.swapaxes(
            k_i * jnp.exp(last[..., None] - g_i)[..., None], -1, -2) @ v_new
        return carry, out

    inputs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, values, g, k_cumdecay, within))
    state, outputs = jax.lax.scan(step, state.astype(jnp.float32), inputs)
    outputs = jnp.moveaxis(outputs, 0, 2).reshape(batch, heads, chunks * chunk_size, -1)[:, :, :length]
    return jnp.moveaxis(outputs, 1, 2), state


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet's sizes and layout, as ``transformers``' Qwen3-Next / Qwen3.5 configs give them.

    Args:
        num_key_heads, num_value_heads, key_head_dim, value_head_dim: ``linear_num_key_heads`` etc.
        conv_kernel: ``linear_conv_kernel_dim``.
        fused: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) instead of Qwen3.5's
            ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
        norm_eps: the gated output norm's epsilon (``rms_norm_eps``).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused: bool
    norm_eps: float

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class DepthwiseConv(nnx.Module):
    """``nn.Conv1d(C, C, K, groups=C)``'s weight as ``weight [C, K]`` (and an optional ``bias [C]``)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype, rngs: nnx.Rngs):
        bound = kernel ** -0.5
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (channels, kernel), dtype, -bound, bound),
                                sharding=("tp", None))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype), sharding=("tp",)) if bias else None

    def __call__(self, x: jax.Array, state: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return causal_conv1d(x, self.weight.get_value(), None if self.bias is None else self.bias.get_value(), state)


class GatedRMSNorm(nnx.Module):
    """``transformers``' ``Qwen3NextRMSNormGated``: ``weight * rms_normalise(x) * silu(gate)`` (normalised in float32,
    cast back before the weight)."""

    def __init__(self, size: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        values = x.astype(jnp.float32)
        normalised = (values * jax.lax.rsqrt(jnp.mean(values * values, axis=-1, keepdims=True) + self.eps))
        out = self.weight.get_value() * normalised.astype(x.dtype)
        return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet as ``transformers``' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` computes it (see the
    module docstring): projections, a causal depthwise convolution with SiLU over ``[q; k; v]``, L2-normalised queries
    and keys shared by ``num_value_heads // num_key_heads`` value heads, decay ``g = -exp(A_log) * softplus(a +
    dt_bias)``, strength ``beta = sigmoid(b)``, the gated delta rule, a gated RMS norm with ``z`` and ``out_proj``."""

    def __init__(self, spec: GatedDeltaNetSpec, hidden: int, linear, dtype, rngs: nnx.Rngs):
        self.spec = spec
        heads = spec.num_value_heads
        if spec.fused:
            self.in_proj_qkvz = linear(hidden, 2 * spec.key_dim + 2 * spec.value_dim)
            self.in_proj_ba = linear(hidden, 2 * heads)
        else:
            self.in_proj_qkv = linear(hidden, spec.conv_dim)
            self.in_proj_z = linear(hidden, spec.value_dim)
            self.in_proj_b = linear(hidden, heads)
            self.in_proj_a = linear(hidden, heads)
        self.conv1d = DepthwiseConv(spec.conv_dim, spec.conv_kernel, False, dtype, rngs)
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (heads,), jnp.float32, 1.0, 16.0)).astype(
            dtype))
        self.norm = GatedRMSNorm(spec.value_head_dim, spec.norm_eps, dtype)
        self.out_proj = linear(spec.value_dim, hidden)

    def state_shapes(self, dtype) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
        """The per-sequence state: the convolution's last inputs (in the model's dtype) and the delta rule's float32
        matrix per value head."""
        spec = self.spec
        return {"conv": ((spec.conv_kernel - 1, spec.conv_dim), dtype),
                "recurrent": ((spec.num_value_heads, spec.key_head_dim, spec.value_head_dim), jnp.float32)}

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(mixed qkv [B, T, conv_dim], z [B, T, N, Dv], b [B, T, N], a [B, T, N])``."""
        spec = self.spec
        batch, length = x.shape[:2]
        if not spec.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(batch, length, -1, spec.value_head_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        groups, per_group = spec.num_key_heads, spec.num_value_heads // spec.num_key_heads
        qkvz = self.in_proj_qkvz(x).reshape(batch, length, groups, -1)
        ba = self.in_proj_ba(x).reshape(batch, length, groups, 2 * per_group)
        q, k, v, z = jnp.split(qkvz, [spec.key_head_dim, 2 * spec.key_head_dim,
                                      2 * spec.key_head_dim + per_group * spec.value_head_dim], axis=-1)
        b, a = jnp.split(ba, 2, axis=-1)
        mixed = jnp.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
        return (mixed, z.reshape(batch, length, -1, spec.value_head_dim), b.reshape(batch, length, -1),
                a.reshape(batch, length, -1))

    def __call__(self, x: jax.Array, valid: jax.Array, state: dict | None) -> tuple[jax.Array, dict | None]:
        spec = self.spec
        x = x * valid[..., None].astype(x.dtype)
        batch, length = x.shape[:2]
        mixed, z, b, a = self._project(x)
        mixed, conv_state = self.conv1d(mixed, None if state is None else state["conv"])
        mixed = jax.nn.silu(mixed)
        q, k, v = jnp.split(mixed, [spec.key_dim, 2 * spec.key_dim], axis=-1)
        q = q.reshape(batch, length, spec.num_key_heads, spec.key_head_dim)
        k = k.reshape(batch, length, spec.num_key_heads, spec.key_head_dim)
        v = v.reshape(batch, length, spec.num_value_heads, spec.value_head_dim)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log.get_value().astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias.get_value().astype(jnp.float32))
        repeat = spec.num_value_heads // spec.num_key_heads
        if repeat > 1:
            q, k = jnp.repeat(q, repeat, axis=2), jnp.repeat(k, repeat, axis=2)
        q, k = l2_normalise(q), l2_normalise(k)
        initial = (jnp.zeros((batch, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim), jnp.float32)
                   if state is None else state["recurrent"])
        rule = recurrent_gated_delta_rule if length == 1 else chunk_gated_delta_rule
        out, recurrent = rule(q, k, v, g, beta, initial)
        out = self.norm(out.astype(x.dtype), z)
        y = self.out_proj(out.reshape(batch, length, -1))
        if state is None:
            return y, None
        return y, {**state, "conv": conv_state.astype(state["conv"].dtype), "recurrent": recurrent,
                   "end_index": state["end_index"] + length}
