"""Token generation for Tunix decoders: one jitted program (prefill into a KV cache, then a
``lax.while_loop`` of cached one-token steps) with ``transformers``' logits processing.

The logits processors are small pure functions on ``[..., vocab]`` arrays, applied in the order
``transformers.generate`` applies them (repetition penalty, then temperature, top-k, top-p,
min-p), so a GRPO rollout can reuse them one by one or through :func:`choose_tokens`.

Tunix's own ``Sampler`` is not used: it has no repetition penalty or min-p, needs a fixed
``kv_cache_size`` (its cache index wraps silently), reuses one PRNG key per rollout and returns
NaN log-probs for temperature 0. Here the cache is sized from the bucketed prompt and
new-token lengths, greedy is an argmax, and every row draws from its own stream (:func:`stream_keys`: the
request's seed, the row's sample index, the token's index), so a row's tokens do not depend on the rows beside
it and equal the paged rollout engine's (:mod:`.rollout`) for the same request.

The settings are one :class:`SamplingSettings` value (``transformers.GenerationConfig``'s names,
defaults and ranges) that ``generate`` and GRPO both build. Only the shapes and its
:class:`SamplingSwitches` (which processors run) are compiled in; temperature, top-p, min-p, the
penalty, the number of new tokens, the end tokens and the seeds are traced values, so calls that
differ only in those reuse one program.
Prompt and new-token lengths are rounded up to buckets (:func:`bucket_length`) for the same reason.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ..distributed.mesh import place_array
from ..distributed.multihost import gather_to_host
from ..lora import runtime as lora_runtime
from ..model import decoder_contract
from ..model.tunix_model import image_blocks, positions_from_mask
from ..runtime.float32_dots import float32_dots
from ..runtime.tracing import record_trace, traced_cheaply
from .images import rope_deltas
from .sampling_settings import UNSUPPORTED_GENERATION_SETTINGS, SamplingSettings, SamplingSwitches, SamplingValues

_MIN_BUCKET = 16
_FINE_BUCKET_FROM = 1024
_FINE_BUCKET_STEP = 512


def bucket_length(length: int) -> int:
    """The compiled length for ``length`` tokens: a power of two (at least 16) up to 1024, then
    the next multiple of 512, so the padding stays under half the length and the number of
    programs stays small (a prompt of 40 and one of 60 share the 64 program).
    """
    if length < 1:
        raise ValueError(f"length must be positive, got {length}")
    if length <= _FINE_BUCKET_FROM:
        return max(_MIN_BUCKET, 1 << (length - 1).bit_length())
    return -(-length // _FINE_BUCKET_STEP) * _FINE_BUCKET_STEP


def cache_size(prompt_length: int, max_new_tokens: int) -> int:
    """KV cache slots for a batch: the bucketed prompt plus the bucketed new tokens.

    The last new token is never fed back, so ``prompt_length + max_new_tokens - 1`` slots are
    needed; both buckets are at least their lengths, so the cache can never be too small (Tunix
    writes at ``end_index % size`` and would otherwise overwrite the prompt without a word).
    """
    return bucket_length(prompt_length) + bucket_length(max_new_tokens)


# --------------------------------------------------------------------------- logits processors


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array | float) -> jax.Array:
    """``transformers``' ``RepetitionPenaltyLogitsProcessor``: scores of tokens already in the
    sequence become ``score / penalty`` when positive and ``score * penalty`` when negative.

    Args:
        logits: ``[B, V]`` float32 scores.
        seen: ``[B, V]`` bool, True for every token id present in the row so far: the prompt from
            the caller's first column, or from the row's first real token where ``transformers`` leaves
            left padding out (see :func:`generate_tokens`), then every new token.
        penalty: ``> 0``; ``1.0`` is no penalty, ``> 1`` discourages repeats.

    Returns:
        ``[B, V]`` penalised scores.
    """
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def apply_temperature(logits: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """``transformers``' ``TemperatureLogitsWarper``: ``logits / temperature`` (``temperature > 0``)."""
    return logits / temperature


def top_k_candidates(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """``transformers``' ``TopKLogitsWarper`` as a gather: the ``top_k`` best scores and their ids.

    Sampling from the ``k`` candidates is sampling from the full vocabulary with the others at
    ``-inf``, and the later warpers (top-p, min-p) then sort ``k`` values instead of ``V``. The one
    difference: exact ties at the k-th score keep exactly ``k`` tokens (``transformers`` keeps all ties).

    Args:
        logits: ``[B, V]`` scores.
        top_k: a positive Python int (static: it sets the candidate shape); clipped to ``V``.

    Returns:
        ``(scores [B, k], token ids [B, k])``, best first.
    """
    return jax.lax.top_k(logits, min(int(top_k), logits.shape[-1]))


def top_p_filter(logits: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """``transformers``' ``TopPLogitsWarper``: keeps the smallest set of best tokens whose
    probability sums to at least ``top_p`` (always at least one); the rest become ``-inf``.

    Tokens are sorted ascending and removed while the cumulative probability is
    ``<= 1 - top_p``, exactly as ``transformers`` does; the kept set is then every score at or
    above the lowest kept score.

    Args:
        logits: ``[..., N]`` scores (the full vocabulary or top-k candidates).
        top_p: in ``(0, 1]``.
    """
    ascending = jnp.sort(logits, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    removed = (cumulative <= 1 - top_p).at[..., -1].set(False)
    first_kept = jnp.sum(removed, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ascending, first_kept, axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def min_p_filter(logits: jax.Array, min_p: jax.Array | float) -> jax.Array:
    """``transformers``' ``MinPLogitsWarper``: removes tokens whose probability is below
    ``min_p`` times the best token's, i.e. ``logit < max_logit + log(min_p)``; the best token
    always stays.

    Args:
        logits: ``[..., N]`` scores.
        min_p: in ``[0, 1]``; ``0`` keeps everything.
    """
    best = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(logits < best + jnp.log(min_p), -jnp.inf, logits)


def choose_tokens(
    logits: jax.Array,
    key: jax.Array,
    switches: SamplingSwitches,
    values: SamplingValues,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Picks the next token of every row the way ``transformers.generate`` does.

    Repetition penalty, then (sampling only) temperature, top-k, top-p, min-p, then a categorical
    draw; greedy is the argmax of the penalised scores.

    Args:
        logits: ``[B, V]`` float32 model scores for the next position.
        key: a PRNG key (unused when greedy).
        switches: :meth:`SamplingSettings.switches` (static).
        values: :meth:`SamplingSettings.traced_values`.
        seen: ``[B, V]`` bool of tokens already in each row; required when the penalty is on.

    Returns:
        ``[B]`` int32 token ids.
    """
    scores = logits
    if switches.repetition_penalty:
        scores = apply_repetition_penalty(scores, seen, values.repetition_penalty)
    if not switches.do_sample:
        return first_argmax(scores)
    scores = apply_temperature(scores, values.temperature)
    candidate_ids = None
    if switches.top_k:
        scores, candidate_ids = top_k_candidates(scores, switches.top_k)
    if switches.top_p:
        scores = top_p_filter(scores, values.top_p)
    if switches.min_p:
        scores = min_p_filter(scores, values.min_p)
    picked = sample_categorical(key, scores)
    if candidate_ids is not None:
        picked = jnp.take_along_axis(candidate_ids, picked[:, None], axis=-1)[:, 0]
    return picked.astype(jnp.int32)


_SAMPLE_BLOCK = 1024


def sample_categorical(key: jax.Array, scores: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(scores)`` (``[B, N]``, ``-inf`` for excluded tokens): ``[B]`` int32.

    The inverse of the cumulative distribution at one uniform number per row, as ``torch.multinomial`` draws:
    the row's weights ``exp(scores - max)`` are summed in blocks of 1024, the uniform picks a block from the
    blocks' running sums and then a token from that block's. It draws from the same distribution as
    ``jax.random.categorical``, whose Gumbel noise costs one random number per token and an ``argmax`` (on
    XLA:CPU about thirty times as long for 32 rows of a 152K vocabulary). A token whose weight is 0 is never drawn.
    """
    count = scores.shape[-1]
    block = min(_SAMPLE_BLOCK, count)
    best = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - best)
    blocks = jnp.pad(weights, ((0, 0), (0, -count % block))).reshape(scores.shape[0], -1, block)
    sums = jnp.sum(blocks, axis=-1)
    running = jnp.cumsum(sums, axis=-1)
    total = running[:, -1:]
    # Below the total, so the block chosen has weight (a product that rounds up to the total would pick past it).
    target = jnp.minimum(jax.random.uniform(key, total.shape, jnp.float32) * total, jnp.nextafter(total, 0.0))
    chosen = jnp.minimum(jnp.sum(running <= target, axis=-1), sums.shape[-1] - 1)[:, None]
    before = jnp.take_along_axis(running - sums, chosen, axis=-1)
    members = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1)[:, 0]
    inside = jnp.cumsum(members, axis=-1) + before
    # Rounding can put the target past the block's last token with weight (about once in 2**24 draws): that one.
    last = block - 1 - jnp.argmax(members[:, ::-1] > 0, axis=-1)
    return (chosen[:, 0] * block + jnp.minimum(jnp.sum(inside <= target, axis=-1), last)).astype(jnp.int32)


def first_argmax(scores: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (the first index on ties, as ``torch.argmax``): ``[B]`` int32.

    ``jnp.argmax`` reduces values and indices together. A maximum taken first and then compared with the scores is
    not safe: XLA may compute the scores (a log-softmax, say) once for the maximum and again for the comparison, with
    different roundings, so that no score equals the maximum.
    """
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array | float = 1.0) -> jax.Array:
    """``log_softmax(logits / temperature)[tokens]``: ``[B]`` float32.

    The raw model distribution at the sampling temperature (no penalty or filtering), which is
    what TRL's GRPO recomputes for the old and reference policies, so the two are comparable.
    """
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def mark_seen(seen: jax.Array, tokens: jax.Array) -> jax.Array:
    """``seen [B, V]`` with ``tokens [B]`` added (the repetition penalty's memory)."""
    return seen.at[jnp.arange(tokens.shape[0]), tokens].set(True)


def stream_keys(seeds: jax.Array, samples: jax.Array, steps: jax.Array | int) -> jax.Array:
    """Each row's key for its token ``steps``: ``fold_in(fold_in(key(seed), sample), step)``.

    A completion's stream depends only on its request's seed, its sample index and the token's index in it, so
    its tokens do not depend on the rows it is batched with, their order or the decode slot it runs in.

    Args:
        seeds: ``[B]`` uint32 request seeds.
        samples: ``[B]`` int32 sample indices within each request.
        steps: ``[B]`` int32 (or one int) token indices within each completion.

    Returns:
        ``[B]`` PRNG keys.
    """
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), seeds.shape)

    def one(seed, sample, step):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample), step)

    return jax.vmap(one)(seeds, samples, steps)


def choose_tokens_per_row(logits: jax.Array, keys: jax.Array, switches: SamplingSwitches, values: SamplingValues,
                          seen: jax.Array | None = None) -> jax.Array:
    """:func:`choose_tokens` with one key per row (``keys [B]``, see :func:`stream_keys`): ``[B]`` int32."""
    if seen is None:
        return jax.vmap(lambda row, key: choose_tokens(row[None], key, switches, values)[0])(logits, keys)
    return jax.vmap(lambda row, key, row_seen: choose_tokens(row[None], key, switches, values, row_seen[None])[0])(
        logits, keys, seen)


# --------------------------------------------------------------------------- the decode engine


def init_cache(module: nnx.Module, batch_size: int, size: int) -> dict[str, dict[str, jax.Array]]:
    """An empty cache of the model contract (:mod:`adapters.model.decoder_contract`): ``{"layer_i": {"k", "v":
    [B, size, kv_heads, head_dim], "end_index": [B]}}`` for each layer of
    :func:`~adapters.model.decoder_contract.kv_cache_shapes`, in the embedding table's dtype (what the projections
    produce), and ``{state name: zeros [B, *shape], "end_index": [B]}`` for each recurrent layer of
    :func:`~adapters.model.decoder_contract.recurrent_state_shapes`."""
    dtype = decoder_contract.embedding_table(module).dtype
    cache = {
        name: {
            "k": jnp.zeros((batch_size, size, *heads), dtype),
            "v": jnp.zeros((batch_size, size, *heads), dtype),
            "end_index": jnp.zeros((batch_size,), jnp.int32),
        }
        for name, heads in decoder_contract.kv_cache_shapes(module).items()
    }
    for name, entries in decoder_contract.recurrent_state_shapes(module).items():
        cache[name] = {key: jnp.zeros((batch_size, *shape), kind) for key, (shape, kind) in entries.items()}
        cache[name]["end_index"] = jnp.zeros((batch_size,), jnp.int32)
    return cache


@dataclass(frozen=True)
class _Program:
    """The static part of one compiled generation program."""

    new_tokens_bucket: int
    switches: SamplingSwitches
    lora: str
    return_logprobs: bool


class DecodeResult(NamedTuple):
    """What :func:`generate_tokens` returns (numpy, on the host).

    Attributes:
        tokens: ``[B, steps]`` int32 new tokens; a row that ended (end token) is padded after it.
        logprobs: ``[B, steps]`` float32 log-probs of the new tokens (see :func:`token_logprobs`;
            0 after a row ended), or ``None`` when not asked for.
        cache_size: KV cache slots used (bucketed prompt + bucketed new tokens).
    """

    tokens: np.ndarray
    logprobs: np.ndarray | None
    cache_size: int


def _decode_program(program: _Program, module, prompt_ids, prompt_mask, counted, max_new_tokens, values, end_ids,
                    pad_id, row_seeds, row_samples, images=None, token_types=None):
    batch, prompt_bucket = prompt_ids.shape
    new_bucket = program.new_tokens_bucket
    record_trace("generate", {"batch": batch, "prompt bucket": prompt_bucket, "new-token bucket": new_bucket,
                              "switches": program.switches})
    graphdef, state = nnx.split(module)
    temperature = values.temperature if program.switches.do_sample else 1.0

    def forward(tokens, positions, cache, attention, **inputs):
        # Merged at trace time only; Tunix decoders all take (tokens, positions, cache, mask) positionally.
        logits, cache = float32_dots(nnx.merge(graphdef, state))(tokens, positions, cache, attention, **inputs)
        return logits.astype(jnp.float32), cache

    prompt_mask = prompt_mask.astype(bool)
    positions = positions_from_mask(prompt_mask)
    lengths = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)
    # Cache slots: the prompt bucket, then one slot per new token; a new token's key is valid once written.
    generated_slots = jnp.arange(new_bucket)[None, :]

    def keys_up_to(step):
        return jnp.concatenate([prompt_mask, jnp.broadcast_to(generated_slots < step, (batch, new_bucket))], axis=-1)

    cache = init_cache(module, batch, prompt_bucket + new_bucket)
    # All prompt tokens but the last fill the cache; their logits are unused, so XLA drops Tunix's LM
    # head there (transformers too computes only the last position's logits). The last token then
    # goes through the same one-token step as the decode loop.
    head = prompt_bucket - 1
    causal = jnp.arange(prompt_bucket + new_bucket)[None, :] <= jnp.arange(head)[:, None]
    prefill_attention = causal[None] & keys_up_to(0)[:, None, :]
    inputs = {}
    shift = 0
    if images is not None:  # image prompts: the images replace their tokens (Gemma 3's see each other both ways)
        if token_types is not None:
            blocks = image_blocks(token_types)[:, :head]
            prefill_attention = prefill_attention | jnp.pad(blocks, ((0, 0), (0, 0), (0, new_bucket)))
        inputs = {"images": images}
        # A multimodal rope's tokens after the prompt's images sit rope_deltas further on.
        shift = jnp.asarray(rope_deltas(images), jnp.int32)[..., None] if isinstance(images, dict) else 0
    prefill_logits, cache = forward(prompt_ids[:, :head], positions[:, :head], cache, prefill_attention, **inputs)

    seen = None
    if program.switches.repetition_penalty:
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], prompt_ids.shape)
        seen = jnp.zeros((batch, prefill_logits.shape[-1]), bool).at[rows, prompt_ids].max(counted.astype(bool))

    def advance(step, logits, done, seen, tokens_out, logprobs_out):
        """Chooses token ``step`` from ``logits`` and records it (pad for rows already ended)."""
        token = choose_tokens_per_row(logits, stream_keys(row_seeds, row_samples, step), program.switches, values,
                                      seen)
        token = jnp.where(done, pad_id, token)
        tokens_out = tokens_out.at[:, step].set(token)
        if program.return_logprobs:
            logprob = jnp.where(done, 0.0, token_logprobs(logits, token, temperature))
            logprobs_out = logprobs_out.at[:, step].set(logprob)
        done = done | jnp.isin(token, end_ids)
        if seen is not None:
            seen = mark_seen(seen, token)
        return token, done, seen, tokens_out, logprobs_out

    tokens_out = jnp.full((batch, new_bucket), pad_id, jnp.int32)
    logprobs_out = jnp.zeros((batch, new_bucket) if program.return_logprobs else (batch, 0), jnp.float32)

    def keep_going(carry):
        step, _, _, done, _, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def one_step(carry):
        """Step ``step`` feeds ``token`` (the prompt's last token at step 0, then new token ``step - 1``, into slot
        ``prompt_bucket + step - 1``: Tunix writes at its end_index) and chooses new token ``step``. The prompt's
        last token goes through the loop, so the program holds one one-token forward pass, not two."""
        step, cache, token, done, seen, tokens_out, logprobs_out = carry
        position = (lengths + step - 1)[:, None] + shift
        logits, cache = forward(token[:, None], position, cache, keys_up_to(step)[:, None, :])
        token, done, seen, tokens_out, logprobs_out = advance(step, logits[:, 0], done, seen, tokens_out,
                                                              logprobs_out)
        return step + 1, cache, token, done, seen, tokens_out, logprobs_out

    # A left-padded prompt's last slot is its last token, at position lengths - 1 (step 0's).
    carry = (jnp.int32(0), cache, prompt_ids[:, head].astype(jnp.int32), jnp.zeros((batch,), bool), seen,
             tokens_out, logprobs_out)
    steps, _, _, _, _, tokens_out, logprobs_out = jax.lax.while_loop(keep_going, one_step, carry)
    return tokens_out, logprobs_out, steps


_compiled_decode = traced_cheaply(nnx.jit(_decode_program, static_argnums=(0,)))


def end_token_array(eos_token_ids: Sequence[int]) -> np.ndarray:
    """End ids padded with -1 (never a token) to a multiple of 8, so one or three end tokens share a program."""
    ids = list(eos_token_ids)
    width = max(8, -(-len(ids) // 8) * 8)
    return np.asarray(ids + [-1] * (width - len(ids)), np.int32)


def generate_tokens(
    module: nnx.Module,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    max_new_tokens: int,
    settings: SamplingSettings,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    seed: int = 0,
    lora: str = lora_runtime.EVAL,
    return_logprobs: bool = False,
    repetition_penalty_skips_left_padding: bool = False,
    batch_sharding: NamedSharding | None = None,
    row_streams: tuple[np.ndarray, np.ndarray] | None = None,
    penalised_positions: np.ndarray | None = None,
    images: np.ndarray | None = None,
    token_type_ids: np.ndarray | None = None,
) -> DecodeResult:
    """Generates up to ``max_new_tokens`` tokens for a left-padded batch with a Tunix decoder.

    The prompt is left-padded further to its bucket (padding is masked and positions count
    real tokens only, so this changes nothing), the cache holds :func:`cache_size` slots, and
    one compiled program runs the prefill and the decode loop. The loop stops early once every
    row has produced an end token.

    Args:
        module: a Tunix decoder (Qwen2, Qwen3, Llama 3, Gemma 2, Gemma 3), LoRA-adapted or not.
        input_ids: ``[B, P]`` int token ids, left-padded.
        attention_mask: ``[B, P]`` 1 for real tokens, 0 for (left) padding.
        max_new_tokens: the most tokens to add per row (``>= 1``).
        settings: how each next token is chosen.
        eos_token_ids: ids that end a row (the token itself is kept; ``pad_token_id`` follows).
        pad_token_id: the id written after a row ended.
        seed: the PRNG seed for sampling: row ``i`` draws from the stream ``(seed, i)`` (:func:`stream_keys`).
        lora: :func:`lora_runtime.lora_mode` for the adapter (``"eval"`` or ``"disabled"``).
        return_logprobs: also return each new token's log-prob (see :func:`token_logprobs`).
        repetition_penalty_skips_left_padding: which prompt ids the repetition penalty counts, as the
            ``transformers.generate`` being mirrored does: ``False``, every id of ``input_ids``, padding
            included; ``True``, the ids from each row's first real token on (its ``prompt_ignore_length`` is
            the index of the first 1 in ``attention_mask``). The caller decides from the installed version.
        batch_sharding: spreads the rows over the mesh's data axes (``mesh.batch_sharding``), so each device
            decodes its own rows, also across processes (each process passes the whole batch and receives every
            row); ``None`` leaves the placement to JAX (the batch replicated).
        row_streams: ``(seeds [B], samples [B])``: each row's own stream (:func:`stream_keys`) instead of
            ``(seed, row index)``, so a completion's tokens match a rollout engine's for the same request.
        penalised_positions: ``[B, P]``, true where the repetition penalty counts the id of ``input_ids``, in place
            of the rule ``repetition_penalty_skips_left_padding`` names.
        images: the prompts' images as the model takes them (a model with a vision tower, ``Family.images``: Gemma
            3's ``[B, N, H, W, C]``, Qwen-VL's dict of arrays), which the prefill puts in place of their image tokens;
            a ``rope_deltas`` ``[B]`` among them shifts the positions after the prompt (M-RoPE). ``None``: text.
        token_type_ids: ``[B, P]``, 1 on the prompts' image tokens, for a model whose image tokens attend to each
            other both ways in the prefill (Gemma 3); ``None``: causal.

    Returns:
        :class:`DecodeResult` whose ``tokens`` have as many columns as steps were run (fewer than
        ``max_new_tokens`` when every row ended early, as ``transformers`` returns).
    """
    ids = np.asarray(input_ids, np.int32)
    mask = np.asarray(attention_mask, np.int32)
    batch, length = ids.shape
    prompt_bucket = bucket_length(length)
    extra = prompt_bucket - length
    padded_ids = np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad_token_id)
    padded_mask = np.pad(mask, ((0, 0), (extra, 0)))
    # The repetition penalty sees the caller's ids, never the bucket's padding.
    if penalised_positions is None:
        penalised_positions = penalised_prompt_positions(mask, repetition_penalty_skips_left_padding)
    counted = np.pad(np.asarray(penalised_positions, np.int32), ((0, 0), (extra, 0)))
    program = _Program(bucket_length(max_new_tokens), settings.switches(), lora, return_logprobs)
    if row_streams is None:
        row_streams = (np.full(batch, seed), np.arange(batch))
    row_seeds = np.asarray(row_streams[0], np.int64).astype(np.uint32)
    row_samples = np.asarray(row_streams[1], np.int32)
    if batch_sharding is not None:
        padded_ids, padded_mask, counted, row_seeds, row_samples = (
            place_array(rows, batch_sharding) for rows in (padded_ids, padded_mask, counted, row_seeds, row_samples))
    token_types = None
    if images is not None:
        images = jax.tree.map(_host_rows, images)
        if token_type_ids is not None:
            token_types = np.pad(np.asarray(token_type_ids, np.int32), ((0, 0), (extra, 0)))
        if batch_sharding is not None:
            images = jax.tree.map(lambda rows: place_array(rows, batch_sharding), images)
            token_types = None if token_types is None else place_array(token_types, batch_sharding)
    with lora_runtime.lora_mode(lora):
        tokens, logprobs, steps = _compiled_decode(
            program, module, padded_ids, padded_mask, counted, np.int32(max_new_tokens),
            SamplingValues(*(np.float32(value) for value in settings.traced_values())),
            end_token_array(eos_token_ids),
            np.int32(pad_token_id), row_seeds, row_samples, images, token_types,
        )
    steps = int(gather_to_host(steps))
    return DecodeResult(
        tokens=gather_to_host(tokens)[:, :steps],
        logprobs=gather_to_host(logprobs)[:, :steps] if return_logprobs else None,
        cache_size=cache_size(length, max_new_tokens),
    )


def _host_rows(rows) -> np.ndarray:
    """An image array on the host: floating ones in float32, ids as they are."""
    rows = np.asarray(rows)
    return rows.astype(np.float32) if np.issubdtype(rows.dtype, np.floating) else rows


def penalised_prompt_positions(attention_mask: np.ndarray, skip_left_padding: bool) -> np.ndarray:
    """The prompt positions whose ids the repetition penalty counts, as ``transformers.generate`` counts them.

    Args:
        attention_mask: ``[B, P]`` 1 for real tokens, 0 for padding.
        skip_left_padding: leave out each row's positions before its first real token (``generate`` passes
            ``prompt_ignore_length = argmax(attention_mask != 0)`` to ``RepetitionPenaltyLogitsProcessor``, so
            a row without a real token keeps them all); otherwise every position counts, padding included.

    Returns:
        ``[B, P]`` int32, 1 where the id counts.
    """
    mask = np.asarray(attention_mask)
    if not skip_left_padding:
        return np.ones(mask.shape, np.int32)
    real = mask != 0
    return ((np.cumsum(real, axis=-1) > 0) | ~real.any(axis=-1, keepdims=True)).astype(np.int32)


def random_seed() -> int:
    """A fresh seed from the OS, so calls without an explicit seed never repeat each other."""
    return secrets.randbelow(2**31)


__all__ = [
    "DecodeResult",
    "UNSUPPORTED_GENERATION_SETTINGS",
    "SamplingSettings",
    "SamplingSwitches",
    "SamplingValues",
    "apply_repetition_penalty",
    "apply_temperature",
    "bucket_length",
    "cache_size",
    "choose_tokens",
    "choose_tokens_per_row",
    "end_token_array",
    "first_argmax",
    "generate_tokens",
    "init_cache",
    "mark_seen",
    "min_p_filter",
    "penalised_prompt_positions",
    "random_seed",
    "stream_keys",
    "top_k_candidates",
    "token_logprobs",
    "top_p_filter",
]
