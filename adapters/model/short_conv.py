"""LFM2's short convolution (``transformers``' ``Lfm2ShortConv``), a recurrent token mixer of the native decoder.

``in_proj`` maps each token to three chunks ``B, C, x`` of the hidden size; the gated input ``B * x`` runs through a
causal depthwise convolution of ``kernel`` taps (:func:`~.linear_attention.causal_conv1d`), whose output is gated by
``C`` and projected back by ``out_proj``:

    y = out_proj(C * conv(B * x))

Its state is the convolution's last ``kernel - 1`` inputs ``B * x``; the call follows the recurrent mixers' contract
(:mod:`.linear_attention`): padding tokens are zeroed before ``in_proj``, as ``transformers``'
``apply_mask_to_padding_states`` does, and the state is ``None`` in training, else continued and returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from .linear_attention import DepthwiseConv
from .native_decoder import DecoderSpec, mixer_linear


@dataclass(frozen=True)
class ShortConvSpec:
    """The short convolution's settings, as ``transformers``' ``Lfm2Config`` gives them; calling it builds a layer's
    mixer (a :attr:`DecoderSpec.recurrent_mixers` factory, compared by value).

    Args:
        kernel: the convolution's taps (``conv_L_cache``).
        bias: ``in_proj``, the convolution and ``out_proj`` carry biases (``conv_bias``).
    """

    kernel: int
    bias: bool

    def __call__(self, spec: DecoderSpec, layer: int, rngs: nnx.Rngs) -> ShortConv:
        return ShortConv(self, spec, rngs)


class ShortConv(nnx.Module):
    """LFM2's short convolution (see the module docstring): ``in_proj`` ``[H, 3H]``, ``conv`` (depthwise, ``[H,
    kernel]``) and ``out_proj`` ``[H, H]``."""

    def __init__(self, settings: ShortConvSpec, spec: DecoderSpec, rngs: nnx.Rngs):
        hidden = spec.hidden_size
        self.settings = settings
        self.in_proj = mixer_linear(spec, hidden, 3 * hidden, settings.bias, rngs)
        self.conv = DepthwiseConv(hidden, settings.kernel, settings.bias, spec.dtype, rngs)
        self.out_proj = mixer_linear(spec, hidden, hidden, settings.bias, rngs, to_residual=True)

    def state_shapes(self, dtype) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
        """The per-sequence state: the convolution's last ``kernel - 1`` inputs, in the model's dtype."""
        return {"conv": ((self.settings.kernel - 1, self.in_proj.out_features // 3), dtype)}

    def __call__(self, x: jax.Array, valid: jax.Array, state: dict | None) -> tuple[jax.Array, dict | None]:
        """Mixes ``x [B, T, H]`` (``valid [B, T]``: the real tokens) and returns ``(y [B, T, H], the updated state or
        None)``."""
        x = x * valid[..., None].astype(x.dtype)
        gate_in, gate_out, values = jnp.split(self.in_proj(x), 3, axis=-1)
        mixed, conv_state = self.conv(gate_in * values, None if state is None else state["conv"])
        y = self.out_proj(gate_out * mixed)
        if state is None:
            return y, None
        return y, {**state, "conv": conv_state.astype(state["conv"].dtype),
                   "end_index": state["end_index"] + x.shape[1]}
