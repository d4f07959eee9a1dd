"""Mamba-2's mixer (``transformers``' ``NemotronHMamba2Mixer``, its torch path), a recurrent token mixer of the native
decoder.

``in_proj`` maps each token to a gate ``z``, the convolved stream ``xBC`` and a time step per head ``dt``. ``xBC``
runs through a causal depthwise convolution with a bias and the activation (:func:`~.linear_attention.causal_conv1d`)
and splits into the heads' inputs ``x`` ``[N, P]`` and the state-space inputs ``B``, ``C`` ``[G, S]`` of ``G`` groups,
each shared by ``N / G`` consecutive heads. With ``dt = max(softplus(dt + dt_bias), time_step_min)`` and
``A = -exp(A_log)`` each head keeps a state ``h [P, S]``:

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t + D * x_t

and the output is ``out_proj(gated_norm(y, z))``, the norm taking ``y * silu(z)`` to unit RMS per group of channels
(:class:`GroupedGatedRMSNorm`). A call of more than one token runs the chunked parallel (SSD) form
(:func:`chunked_state_space_scan`, ``transformers``' chunked torch implementation, continuing a given state); a
one-token call runs the recurrent form (:func:`recurrent_state_space_scan`, its cached single step).

The time step is clamped below at ``time_step_min`` as ``transformers``' torch path clamps it (its CUDA path clamps to
``time_step_limit`` instead; the torch path is the float32 reference). The call follows the recurrent mixers' contract
(:mod:`.linear_attention`): padding tokens are zeroed before ``in_proj`` and again after the convolution, as
``transformers`` zeroes them; the state (the convolution's last inputs and the float32 ``h``) is ``None`` in training,
else continued and returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from .linear_attention import DepthwiseConv
from .native_decoder import ACTIVATIONS, DecoderSpec, mixer_linear


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba-2's sizes and switches, as ``transformers``' ``NemotronHConfig`` gives them; calling it builds a layer's
    mixer (a :attr:`DecoderSpec.recurrent_mixers` factory, compared by value).

    Args:
        num_heads, head_dim: ``mamba_num_heads``, ``mamba_head_dim`` (the inner width is their product).
        state_size: ``ssm_state_size``.
        n_groups: ``n_groups``: the groups of ``B``/``C`` and of the gated norm.
        conv_kernel: ``conv_kernel``.
        chunk_size: the chunked form's chunk length (``chunk_size``).
        conv_bias: the convolution has a bias (``use_conv_bias``).
        projection_bias: ``in_proj`` and ``out_proj`` have biases (``use_bias``).
        activation: the convolution's activation, a key of :data:`~.native_decoder.ACTIVATIONS` (``mamba_hidden_act``).
        time_step_min: the time step's lower clamp.
        norm_eps: the gated norm's epsilon (``layer_norm_epsilon``).
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    projection_bias: bool
    activation: str
    time_step_min: float
    norm_eps: float

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.state_size

    def __call__(self, spec: DecoderSpec, layer: int, rngs: nnx.Rngs) -> Mamba2Mixer:
        return Mamba2Mixer(self, spec, rngs)


def segment_sum(a: jax.Array) -> jax.Array:
    """``out[..., i, j] = sum_{j < k <= i} a[..., k]`` for ``a [..., L]`` (``[..., L, L]``; zero above the diagonal),
    summed as ``transformers``' ``segment_sum`` sums it: a masked cumulative sum, not a difference of two."""
    length = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((length, length), bool), -1)
    expanded = jnp.where(strictly_lower, jnp.broadcast_to(a[..., :, None], (*a.shape, length)), 0.0)
    return jnp.cumsum(expanded, axis=-2)


def chunked_state_space_scan(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
                             state: jax.Array, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's scan in chunks (SSD, ``transformers``' torch implementation): within a chunk as masked attention
    ``(C B^T * decay) (dt x)``, across chunks through the state, which enters from ``state``.

    Args:
        x: ``[B, T, N, P]`` the heads' inputs; dt: ``[B, T, N]`` time steps (after softplus and clamp).
        a: ``[N]`` the (negative) decay rates; b, c: ``[B, T, N, S]`` each head's state-space inputs.
        state: ``[B, N, P, S]`` the state before the first token.
        chunk_size: the chunk length (``T`` is zero-padded to a multiple of it).

    Returns:
        ``(y [B, T, N, P] float32 without the D skip, the final state [B, N, P, S] float32)``.
    """
    batch, length, heads, head_dim = x.shape
    pad = (-length) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(value):  # [B, T, ...] -> [B, chunks, chunk_size, ...], zero-padded (padding neither decays nor adds)
        value = jnp.pad(value.astype(jnp.float32), ((0, 0), (0, pad)) + ((0, 0),) * (value.ndim - 2))
        return value.reshape(batch, chunks, chunk_size, *value.shape[2:])

    dt = chunked(dt)
    x, b, c = chunked(x) * dt[..., None], chunked(b), chunked(c)
    decay = jnp.moveaxis(dt * a.astype(jnp.float32), -1, 1)  # [B, N, chunks, L]
    cumulative = jnp.cumsum(decay, axis=-1)
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    within_decay = jnp.where(lower, jnp.exp(segment_sum(decay)), 0.0)
    within = jnp.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, within_decay, x)
    to_end = jnp.exp(cumulative[..., -1:] - cumulative)
    chunk_states = jnp.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, x)
    chunk_decay = jnp.exp(cumulative[..., -1])  # [B, N, chunks]

    def step(carry, inputs):
        added, kept = inputs
        return carry * kept[..., None, None] + added, carry

    final, entering = jax.lax.scan(step, state.astype(jnp.float32),
                                   (jnp.moveaxis(chunk_states, 1, 0), jnp.moveaxis(chunk_decay, 2, 0)))
    from_state = jnp.einsum("bclhn,cbhpn,bhcl->bclhp", c, entering, jnp.exp(cumulative))
    y = (within + from_state).reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    return y, final


def recurrent_state_space_scan(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
                               state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's scan token by token (``transformers``' cached single step), float32: ``h = exp(dt a) h + dt x b^T``,
    ``y = h c``. Arguments and returns as :func:`chunked_state_space_scan`."""
    a = a.astype(jnp.float32)

    def step(carry, inputs):
        x_t, dt_t, b_t, c_t = inputs
        carry = carry * jnp.exp(dt_t * a)[..., None, None] + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        return carry, jnp.einsum("bhpn,bhn->bhp", carry, c_t)

    inputs = tuple(jnp.moveaxis(value.astype(jnp.float32), 1, 0) for value in (x, dt, b, c))
    state, y = jax.lax.scan(step, state.astype(jnp.float32), inputs)
    return jnp.moveaxis(y, 0, 1), state


class GroupedGatedRMSNorm(nnx.Module):
    """``transformers``' ``Zamba2RMSNormGated`` (Mamba-2's gated norm): ``u = x * silu(z)`` taken to unit RMS within
    each group of ``group_size`` consecutive channels, times ``weight``; in float32, cast to ``x``'s dtype."""

    def __init__(self, size: int, group_size: int, eps: float, dtype):
        self.group_size = group_size
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        gated = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = gated.reshape(*gated.shape[:-1], -1, self.group_size)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        out = self.weight.get_value().astype(jnp.float32) * grouped.reshape(gated.shape)
        return out.astype(x.dtype)


class Mamba2Mixer(nnx.Module):
    """Mamba-2 as ``transformers``' ``NemotronHMamba2Mixer`` computes it (see the module docstring): ``in_proj``,
    ``conv1d`` (depthwise, ``[conv_dim, K]``), ``dt_bias``, ``A_log``, ``D`` (one per head), the gated ``norm`` and
    ``out_proj``, named as ``transformers`` names them."""

    def __init__(self, settings: Mamba2Spec, spec: DecoderSpec, rngs: nnx.Rngs):
        self.settings = settings
        heads, inner, dtype = settings.num_heads, settings.inner_size, spec.dtype
        self.in_proj = mixer_linear(spec, spec.hidden_size, inner + settings.conv_dim + heads,
                                    settings.projection_bias, rngs)
        self.conv1d = DepthwiseConv(settings.conv_dim, settings.conv_kernel, settings.conv_bias, dtype, rngs)
        # transformers' starting values: A = -(1, 2, ..., N), dt_bias and D at one.
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((heads,), dtype))
        self.norm = GroupedGatedRMSNorm(inner, inner // settings.n_groups, settings.norm_eps, dtype)
        self.out_proj = mixer_linear(spec, inner, spec.hidden_size, settings.projection_bias, rngs, to_residual=True)

    def state_shapes(self, dtype) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
        """The per-sequence state: the convolution's last ``K - 1`` inputs (in the model's dtype) and each head's
        float32 state ``[P, S]``."""
        settings = self.settings
        return {"conv": ((settings.conv_kernel - 1, settings.conv_dim), dtype),
                "ssm": ((settings.num_heads, settings.head_dim, settings.state_size), jnp.float32)}

    def __call__(self, x: jax.Array, valid: jax.Array, state: dict | None) -> tuple[jax.Array, dict | None]:
        """Mixes ``x [B, T, H]`` (``valid [B, T]``: the real tokens) and returns ``(y [B, T, H], the updated state or
        None)``."""
        settings = self.settings
        batch, length = x.shape[:2]
        keep = valid[..., None].astype(x.dtype)
        inner, grouped = settings.inner_size, settings.n_groups * settings.state_size
        gate, streams, dt = jnp.split(self.in_proj(x * keep), [inner, inner + settings.conv_dim], axis=-1)
        streams, conv_state = self.conv1d(streams, None if state is None else state["conv"])
        streams = ACTIVATIONS[settings.activation](streams) * keep
        values, b, c = jnp.split(streams, [inner, inner + grouped], axis=-1)
        values = values.reshape(batch, length, settings.num_heads, settings.head_dim)
        per_group = settings.num_heads // settings.n_groups
        b, c = (jnp.repeat(t.reshape(batch, length, settings.n_groups, settings.state_size), per_group, axis=2)
                for t in (b, c))
        dt = jnp.maximum(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias.get_value().astype(jnp.float32)),
                         settings.time_step_min)
        a = -jnp.exp(self.A_log.get_value().astype(jnp.float32))
        initial = (jnp.zeros((batch, settings.num_heads, settings.head_dim, settings.state_size), jnp.float32)
                   if state is None else state["ssm"])
        if length == 1:
            y, ssm = recurrent_state_space_scan(values, dt, a, b, c, initial)
        else:
            y, ssm = chunked_state_space_scan(values, dt, a, b, c, initial, settings.chunk_size)
        y = y + values.astype(jnp.float32) * self.D.get_value().astype(jnp.float32)[:, None]
        out = self.out_proj(self.norm(y.reshape(batch, length, inner), gate).astype(x.dtype))
        if state is None:
            return out, None
        return out, {**state, "conv": conv_state.astype(state["conv"].dtype), "ssm": ssm,
                     "end_index": state["end_index"] + length}
