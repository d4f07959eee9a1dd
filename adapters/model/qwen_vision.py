"""Qwen2-VL's and Qwen2.5-VL's vision tower as NNX modules, the host-side layout of their image and video inputs, and
the decoder that puts the tower's features in place of the image tokens and rotates them by M-RoPE.

The tower (``transformers``' ``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel``):
a linear patch embedding of ``temporal_patch_size x patch_size x patch_size`` patches (transformers' ``Conv3d`` with a
stride equal to its kernel), pre-norm blocks whose attention rotates each head by the patch's (row, column) (a 2-D
rope over half the head), a patch merger that concatenates ``spatial_merge_size ** 2`` neighbouring patches (the
processor lays them out consecutively) through an MLP to the text width. Qwen2.5-VL's blocks attend within windows of
``window_size`` pixels except ``fullatt_block_indexes``; Qwen2-VL's attend over each frame.

``transformers`` runs the tower on the batch's patches as one flat sequence and splits attention by cumulative lengths
(reordering the patches so that each window is contiguous, and back). Here each row's patches are one padded sequence
``[B, P, D]`` and attention is limited by segment ids: the frame (full attention) or the window a patch belongs to,
which the host computes with ``transformers.vision_utils`` (:func:`vision_inputs`). Attention within a set of patches
does not depend on their order, so no reordering is needed; padding patches see nothing and no token takes their
features.

The decoder computes Qwen's multimodal positions (``get_rope_index``) inside the call from offsets the host prepares
per vision token, so that any layout of the same rows (left or right padding, completions appended) gets the positions
``transformers`` gives it; text after a row's images continues at ``position + rope_delta`` (``vision_inputs``'
``rope_deltas``), which the rollout engines add to the positions they decode at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .native_decoder import DecoderSpec, NativeDecoder, Norm

VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
"""``transformers``' ``ACT2FN`` names a Qwen vision tower uses."""

MASKED = -2.3819763e38


@dataclass(frozen=True)
class QwenVisionSpec:
    """A Qwen vision tower's sizes and switches.

    Args:
        depth, width, num_heads, intermediate_size: the blocks (``intermediate_size``: the MLP's inner width).
        out_hidden_size: the merger's output width (the text model's hidden size).
        patch_size, temporal_patch_size, in_channels: one patch is ``in_channels x temporal_patch_size x patch_size
            x patch_size`` values.
        spatial_merge_size: the merger joins ``spatial_merge_size ** 2`` patches into one token.
        norm: ``"layer"`` (Qwen2-VL: LayerNorm with a bias) or ``"rms"`` (Qwen2.5-VL).
        mlp: ``"plain"`` (Qwen2-VL's ``fc1``/``fc2``) or ``"gated"`` (Qwen2.5-VL's ``gate_proj``/``up_proj``/
            ``down_proj``, with biases).
        activation: a key of :data:`VISION_ACTIVATIONS`.
        window_size: Qwen2.5-VL's attention window in pixels; ``0``: every block attends over the whole frame.
        fullatt_block_indexes: with windows, the blocks that attend over the whole frame.
        image_token_id, video_token_id: the text placeholders the merged tokens replace.
        dtype: the parameters' dtype.
        patch_bias: the patch embedding has a bias (Qwen3-VL).
        num_position_embeddings: Qwen3-VL's learned position table (a square grid, bilinearly interpolated to each
            image's patch grid); ``0``: none.
        deepstack_layers: Qwen3-VL's DeepStack: after these blocks a merger of their own makes features that are
            added to the vision tokens' hidden states after the first text layers, one per block.
        merger: ``"qwen2"`` (``ln_q`` before concatenating, ``mlp.0``/``mlp.2``) or ``"qwen3"`` (``norm``,
            ``linear_fc1``/``linear_fc2``; DeepStack's mergers normalise after concatenating).
        frames_apart: each temporal patch of a video is an item of its own in the text (Qwen3-VL writes a timestamp
            before each), so its M-RoPE positions restart per frame.
    """

    depth: int
    width: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    norm: str
    mlp: str
    activation: str
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    image_token_id: int
    video_token_id: int
    dtype: jnp.dtype = jnp.float32
    patch_bias: bool = False
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    merger: str = "qwen2"
    frames_apart: bool = False

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_values(self) -> int:
        """The values of one patch (``pixel_values``' second axis)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def windowed(self, block: int) -> bool:
        return bool(self.window_size) and block not in self.fullatt_block_indexes


def _linear(spec: QwenVisionSpec, inputs: int, outputs: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(inputs, outputs, use_bias=bias, param_dtype=spec.dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class VisionAttention(nnx.Module):
    """One fused ``qkv`` projection (with a bias), the 2-D rope in float32, attention within the segments the mask
    allows, and ``proj``."""

    def __init__(self, spec: QwenVisionSpec, rngs: nnx.Rngs):
        self.num_heads = spec.num_heads
        self.qkv = _linear(spec, spec.width, 3 * spec.width, True, rngs)
        self.proj = _linear(spec, spec.width, spec.width, True, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3, self.num_heads, -1), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        q, k = _rotate(q, cos, sin).astype(x.dtype), _rotate(k, cos, sin).astype(x.dtype)
        scores = jnp.einsum("BPND,BQND->BNPQ", q, k) * (q.shape[-1] ** -0.5)
        scores = jnp.where(mask[:, None], scores, MASKED)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("BNPQ,BQND->BPND", probs, v).reshape(batch, length, width)
        return self.proj(out)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``transformers``' ``apply_rotary_pos_emb_vision``: ``rotate_half`` over the whole head, in float32."""
    x = x.astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class VisionMLP(nnx.Module):
    """Qwen2-VL's ``fc1``/``fc2``, Qwen3-VL's ``linear_fc1``/``linear_fc2`` (``mlp="plain"`` with those names) or
    Qwen2.5-VL's gated ``gate_proj``/``up_proj``/``down_proj``, all with biases."""

    def __init__(self, spec: QwenVisionSpec, rngs: nnx.Rngs):
        self.gated = spec.mlp == "gated"
        self.activation = VISION_ACTIVATIONS[spec.activation]
        if self.gated:
            self.gate_proj = _linear(spec, spec.width, spec.intermediate_size, True, rngs)
            self.up_proj = _linear(spec, spec.width, spec.intermediate_size, True, rngs)
            self.down_proj = _linear(spec, spec.intermediate_size, spec.width, True, rngs)
            return
        self.names = ("linear_fc1", "linear_fc2") if spec.merger == "qwen3" else ("fc1", "fc2")
        setattr(self, self.names[0], _linear(spec, spec.width, spec.intermediate_size, True, rngs))
        setattr(self, self.names[1], _linear(spec, spec.intermediate_size, spec.width, True, rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gated:
            return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        first, second = (getattr(self, name) for name in self.names)
        return second(self.activation(first(x)))


class VisionBlock(nnx.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(...))``; the norms' epsilon is 1e-6 as in ``transformers``."""

    def __init__(self, spec: QwenVisionSpec, rngs: nnx.Rngs):
        bias = spec.norm == "layer"
        self.norm1 = Norm(spec.width, spec.norm, 1e-6, bias, spec.dtype, rngs)
        self.norm2 = Norm(spec.width, spec.norm, 1e-6, bias, spec.dtype, rngs)
        self.attn = VisionAttention(spec, rngs)
        self.mlp = VisionMLP(spec, rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """A norm, ``spatial_merge_size ** 2`` consecutive patches concatenated, an MLP with exact GELU to the text
    width. Qwen2-VL / Qwen2.5-VL: ``ln_q`` on each patch, ``mlp_in``/``mlp_out`` (HF ``mlp.0``/``mlp.2``); Qwen3-VL:
    ``norm`` (a LayerNorm; on the concatenated patches with ``after_concatenating``, DeepStack's),
    ``linear_fc1``/``linear_fc2``."""

    def __init__(self, spec: QwenVisionSpec, rngs: nnx.Rngs, after_concatenating: bool = False):
        self.unit = spec.merge_unit
        self.after = after_concatenating
        merged = spec.width * spec.merge_unit
        self.qwen3 = spec.merger == "qwen3"
        if self.qwen3:
            self.norm = Norm(merged if after_concatenating else spec.width, "layer", 1e-6, True, spec.dtype, rngs)
            self.linear_fc1 = _linear(spec, merged, merged, True, rngs)
            self.linear_fc2 = _linear(spec, merged, spec.out_hidden_size, True, rngs)
        else:
            self.ln_q = Norm(spec.width, spec.norm, 1e-6, spec.norm == "layer", spec.dtype, rngs)
            self.mlp_in = _linear(spec, merged, merged, True, rngs)
            self.mlp_out = _linear(spec, merged, spec.out_hidden_size, True, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        norm, first, second = ((self.norm, self.linear_fc1, self.linear_fc2) if self.qwen3
                               else (self.ln_q, self.mlp_in, self.mlp_out))
        if self.after:
            x = norm(x.reshape(batch, length // self.unit, self.unit * width))
        else:
            x = norm(x).reshape(batch, length // self.unit, self.unit * width)
        return second(jax.nn.gelu(first(x), approximate=False))


class QwenVisionTower(nnx.Module):
    """The tower: ``patch_embed`` (kernel ``[C, T, P, P, width]``; ``patch_embed_bias`` with
    :attr:`QwenVisionSpec.patch_bias`), ``pos_embed`` (Qwen3-VL), ``blocks``, ``merger`` and DeepStack's
    ``deepstack_mergers``."""

    def __init__(self, spec: QwenVisionSpec, rngs: nnx.Rngs):
        self.spec = spec
        shape = (spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size, spec.width)
        self.patch_embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, spec.dtype))
        if spec.patch_bias:
            self.patch_embed_bias = nnx.Param(jnp.zeros((spec.width,), spec.dtype))
        if spec.num_position_embeddings:
            self.pos_embed = nnx.Param(nnx.initializers.normal(0.02)(
                rngs.params(), (spec.num_position_embeddings, spec.width), spec.dtype))
        self.blocks = nnx.List([VisionBlock(spec, rngs) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec, rngs)
        self.deepstack_mergers = nnx.List([PatchMerger(spec, rngs, after_concatenating=True)
                                           for _ in spec.deepstack_layers])

    def __call__(self, patches: jax.Array, rows_cols: jax.Array, frames: jax.Array, windows: jax.Array,
                 position_indices: jax.Array | None = None,
                 position_weights: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
        """The merged tokens ``[B, P / merge_unit, out_hidden_size]`` of each row's patches, and DeepStack's features
        (one such array per :attr:`QwenVisionSpec.deepstack_layers`).

        Args:
            patches: ``[B, P, patch_values]``, each row's patches in the order of its vision tokens (padding after).
            rows_cols: ``[B, P, 2]`` each patch's row and column in its frame (the 2-D rope).
            frames: ``[B, P]`` the frame each patch belongs to, from 1 (full attention stays within it); ``0``:
                padding.
            windows: ``[B, P]`` the window each patch belongs to, from 1 (Qwen2.5-VL's windowed blocks); ``0``:
                padding.
            position_indices, position_weights: ``[B, P, 4]`` the rows of ``pos_embed`` each patch interpolates and
                their weights (Qwen3-VL's bilinear interpolation).
        """
        spec = self.spec
        kernel = self.patch_embed.get_value()
        x = patches.astype(kernel.dtype).reshape(*patches.shape[:2], *kernel.shape[:-1])
        x = jnp.einsum("BPctij,ctijW->BPW", x, kernel)
        if spec.patch_bias:
            x = x + self.patch_embed_bias.get_value()
        if spec.num_position_embeddings:
            table = self.pos_embed.get_value()
            x = x + jnp.einsum("BPKW,BPK->BPW", table[position_indices], position_weights.astype(table.dtype))
        quarter = spec.head_dim // 4
        inv_freq = 1.0 / (10000.0 ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
        angles = (rows_cols.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)).reshape(*rows_cols.shape[:2], -1)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        full = _same_segment(frames)
        windowed = _same_segment(windows) if spec.window_size else full
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, windowed if spec.windowed(index) else full)
            if index in spec.deepstack_layers:
                deepstack.append(self.deepstack_mergers[spec.deepstack_layers.index(index)](x))
        return self.merger(x), deepstack


def _same_segment(segments: jax.Array) -> jax.Array:
    """``[B, P, P]``: both patches in one segment, neither padding (segment 0)."""
    return (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)


class QwenVLDecoder(NativeDecoder):
    """The native decoder (:class:`~.native_decoder.NativeDecoder`) with Qwen's vision tower as ``visual``: a call
    with ``images`` (:func:`vision_inputs`' arrays) runs the tower, puts its tokens in place of the image and video
    tokens in order, and rotates every token by its M-RoPE position; a call without them (text, or the decode steps
    after an image prompt, whose positions include the row's ``rope_deltas``) is the text decoder's."""

    def __init__(self, spec: DecoderSpec, vision: QwenVisionSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, rngs=rngs)
        self.visual = QwenVisionTower(vision, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict | None, attention_mask: jax.Array,
                 images: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        x = self.embedder.encode(tokens)
        additions = ()
        if images is not None:
            x, positions, additions = self.merge_vision(tokens, positions, x, images)
        return self.decode_embeddings(x, positions, cache, attention_mask, additions)

    def get_model_input(self) -> dict[str, jax.Array | dict | None]:
        """The dummy call Qwix traces to place LoRA factors: :meth:`NativeDecoder.get_model_input` with one image
        token per row and a one-token image, so the tower runs too."""
        inputs = super().get_model_input()
        vision = self.visual.spec
        unit = vision.merge_unit
        inputs["tokens"] = jnp.full((2, 1), vision.image_token_id, jnp.int32)
        inputs["images"] = {"patches": jnp.zeros((2, unit, vision.patch_values), jnp.float32),
                            "rows_cols": jnp.zeros((2, unit, 2), jnp.int32),
                            "frames": jnp.ones((2, unit), jnp.int32), "windows": jnp.ones((2, unit), jnp.int32),
                            "token_offsets": jnp.zeros((2, 1, 3), jnp.int32),
                            "text_shift": jnp.zeros((2, 2), jnp.int32), "rope_deltas": jnp.zeros((2,), jnp.int32)}
        if vision.num_position_embeddings:
            inputs["images"]["position_indices"] = jnp.zeros((2, unit, 4), jnp.int32)
            inputs["images"]["position_weights"] = jnp.zeros((2, unit, 4), jnp.float32)
        return inputs

    def merge_vision(self, tokens, positions, x, images):
        """``(embeddings with the vision tokens replaced, M-RoPE positions [3, B, T], DeepStack's additions to the
        first layers' outputs [B, T, H] each)``."""
        vision = self.visual.spec
        merged, deepstack = self.visual(images["patches"], images["rows_cols"], images["frames"], images["windows"],
                                        images.get("position_indices"), images.get("position_weights"))
        is_vision = (tokens == vision.image_token_id) | (tokens == vision.video_token_id)
        seen = jnp.cumsum(is_vision, axis=1)  # vision tokens up to and including each token
        rank = jnp.clip(seen - 1, 0, merged.shape[1] - 1)

        def at_vision_tokens(features, fill):
            gathered = jnp.take_along_axis(features, rank[..., None], axis=1).astype(x.dtype)
            return jnp.where(is_vision[..., None], gathered, fill)

        x = at_vision_tokens(merged, x)
        additions = tuple(at_vision_tokens(features, jnp.zeros((), x.dtype)) for features in deepstack)
        offsets = jnp.take_along_axis(images["token_offsets"], rank[..., None], axis=1)  # [B, T, 3]
        shift = jnp.take_along_axis(images["text_shift"], jnp.clip(seen, 0, images["text_shift"].shape[1] - 1),
                                    axis=1)
        delta = jnp.where(is_vision[..., None], offsets, shift[..., None])
        return x, positions[None] + jnp.moveaxis(delta, -1, 0).astype(positions.dtype), additions


@dataclass(frozen=True)
class VisualItem:
    """One image or video of a row: its patches and grid, and how far apart its frames are in M-RoPE positions."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    time_interval: int


def vision_inputs(spec: QwenVisionSpec, input_ids: np.ndarray, images: Sequence[VisualItem],
                  videos: Sequence[VisualItem], window_size: int, patch_size: int) -> dict[str, np.ndarray]:
    """The model's ``images`` for a batch: each row's images and videos, in the order of their tokens, as padded
    arrays (:class:`QwenVLDecoder`).

    Args:
        spec: the tower's spec.
        input_ids: ``[B, T]`` the rows whose image (video) tokens the items fill, in order.
        images, videos: every image (video) of the batch in token order, row after row.
        window_size, patch_size: the tower's window (pixels; 0: none) and patch size.

    Returns:
        ``patches [B, P, D]`` (``P``: the most patches of a row, in merged tokens rounded up to a power of two),
        ``rows_cols [B, P, 2]``, ``frames``/``windows [B, P]`` (from 1; 0 on padding),
        ``token_offsets [B, N, 3]`` (each vision token's M-RoPE position minus its plain one), ``text_shift
        [B, N + 1]`` (a text token's, by the vision tokens before it) and ``rope_deltas [B]`` (text after the row's
        last vision token), with ``N = P / merge_unit``; with a position table (Qwen3-VL) also ``position_indices``
        and ``position_weights [B, P, 4]``. Zeros are padding everywhere, so rows of several calls
        stack by padding each array's first axis with zeros (the rollout engines' requests).

    Raises:
        ValueError: the tokens and the items disagree (a run of image tokens without an image left, a partial image,
            images left over), naming the counts.
    """
    import torch
    from transformers.vision_utils import (
        get_vision_bilinear_indices_and_weights,
        get_vision_position_ids,
        get_vision_window_index,
    )

    unit, merge = spec.merge_unit, spec.spatial_merge_size
    if spec.frames_apart:  # each temporal patch of a video is its own item of the text
        videos = [VisualItem(frame, (1, *video.grid[1:]), video.time_interval) for video in videos
                  for frame in np.split(video.patches, video.grid[0])]
    queues = {spec.image_token_id: list(images), spec.video_token_id: list(videos)}
    names = {spec.image_token_id: "image", spec.video_token_id: "video"}
    rows = []
    for row_ids in np.asarray(input_ids):
        items, index = [], 0
        while index < len(row_ids):
            token = int(row_ids[index])
            if token not in queues:
                index += 1
                continue
            if not queues[token]:
                raise ValueError(f"a row has more {names[token]} tokens (id {token}) than the {names[token]}s given: "
                                 f"pass one {names[token]} per placeholder, in order, as the processor builds them.")
            item = queues[token].pop(0)
            count = int(np.prod(item.grid)) // unit
            run = row_ids[index:index + count]
            if len(run) < count or not np.all(run == token):
                raise ValueError(f"a {names[token]} of grid {list(item.grid)} needs {count} consecutive {names[token]} "
                                 f"tokens (id {token}) but its run is shorter: build the text with the processor.")
            items.append(item)
            index += count
        rows.append(items)
    for token, left in queues.items():
        if left:
            raise ValueError(f"{len(left)} {names[token]}(s) were given beyond the {names[token]} tokens (id {token}) "
                             "of the text: each needs its placeholder tokens, as the processor writes them.")
    patches_per_row = [sum(int(np.prod(item.grid)) for item in items) for items in rows]
    # A power of two (in whole merged tokens), so that batches of similar images share one compiled program.
    width = -(-max(max(patches_per_row, default=0), unit) // unit)
    width = (1 << (width - 1).bit_length()) * unit
    batch = len(rows)
    out = {"patches": np.zeros((batch, width, spec.patch_values), np.float32),
           "rows_cols": np.zeros((batch, width, 2), np.int32),
           "frames": np.zeros((batch, width), np.int32), "windows": np.zeros((batch, width), np.int32),
           "token_offsets": np.zeros((batch, width // unit, 3), np.int32),
           "text_shift": np.zeros((batch, width // unit + 1), np.int32), "rope_deltas": np.zeros((batch,), np.int32)}
    if spec.num_position_embeddings:
        out["position_indices"] = np.zeros((batch, width, 4), np.int32)
        out["position_weights"] = np.zeros((batch, width, 4), np.float32)
        side = int(round(spec.num_position_embeddings ** 0.5))
    for row, items in enumerate(rows):
        patch, token, frame, window, shift = 0, 0, 1, 1, 0
        for item in items:
            t, h, w = item.grid
            count = t * h * w
            grid = torch.tensor([item.grid])
            out["patches"][row, patch:patch + count] = item.patches.reshape(count, -1)
            out["rows_cols"][row, patch:patch + count] = get_vision_position_ids(grid, merge).numpy()
            out["frames"][row, patch:patch + count] = frame + np.repeat(np.arange(t), h * w)
            if spec.num_position_embeddings:
                indices, weights = get_vision_bilinear_indices_and_weights(grid, num_grid_per_side=side,
                                                                           spatial_merge_size=merge)
                out["position_indices"][row, patch:patch + count] = indices.numpy().T
                out["position_weights"][row, patch:patch + count] = weights.numpy().T
            if window_size:
                order, bounds = get_vision_window_index(grid, merge, window_size, patch_size)
                group_window = np.empty(count // unit, np.int32)
                group_window[order.numpy()] = np.searchsorted(bounds.numpy() // unit, np.arange(count // unit),
                                                              side="right") - 1
                out["windows"][row, patch:patch + count] = window + np.repeat(group_window, unit)
                window += int(group_window.max()) + 1
            else:
                out["windows"][row, patch:patch + count] = out["frames"][row, patch:patch + count]
            tokens = count // unit
            lt, lh, lw = t, h // merge, w // merge
            coords = np.stack([np.repeat(np.arange(lt) * item.time_interval, lh * lw),
                               np.tile(np.repeat(np.arange(lh), lw), lt), np.tile(np.arange(lw), lh * lt)], axis=-1)
            # A vision token's M-RoPE position is (text before it) + (extent of the items before it) + its coords;
            # its plain position counts every token before it, so the offset subtracts the vision tokens before it.
            out["token_offsets"][row, token:token + tokens] = shift - np.arange(tokens)[:, None] + coords
            shift += max(lh, lw) - tokens
            token += tokens
            out["text_shift"][row, token:] = shift
            patch += count
            frame += t
        out["rope_deltas"][row] = shift
    return out
