"""Sequence classification on a Tunix decoder: the ``score`` head, its Hugging Face names, and last-token pooling.

A ``transformers`` ``*ForSequenceClassification`` model is the decoder (``model.*``) and ``score``, a bias-free
``Linear(hidden_size, num_labels)`` applied to the final-norm hidden state of each row's last non-pad token. Here
the Tunix decoder gets that head as an ``nnx.Linear`` attribute named ``score`` (so every decoder path is unchanged
and Qwix's LoRA, the family tables and the sharding rules see the decoder they know), and
:func:`classifier_family` derives, from a causal-LM family table, the table of the classifier: the decoder's rows
without ``lm_head``, plus ``score.weight <-> score.kernel``. The classifier's decoder is built with tied
embeddings, so it holds no LM head (the head's logits are never used: XLA drops them from a jitted program).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..families import Family
from ..families.base import TRANSPOSED, WeightRule
from ..lora.runtime import lora_mode
from ..runtime.tracing import fast_tracing
from .tunix_model import causal_attention, positions_from_mask

SCORE_HF_NAME = "score.weight"
SCORE_NNX_PATH = "score.kernel"
SCORE_RULE = WeightRule(SCORE_HF_NAME, SCORE_NNX_PATH, TRANSPOSED)

_classifier_families: dict[tuple[str, str], Family] = {}


def classifier_family(family: Family, model_type: str | None = None) -> Family:
    """The ``*ForSequenceClassification`` table of a causal-LM family: its decoder rows without ``lm_head``, plus
    ``score.weight (num_labels, hidden) <-> score.kernel (hidden, num_labels)``, and a ``build_model`` that adds the
    ``score`` head to the decoder; its ``forward`` and ``logits_from_hidden`` refuse (there is no LM head to give
    logits). One object per family, so compiled programs and built abstract models are reused.

    Args:
        family: the causal-LM family table.
        model_type: the checkpoint's ``config.model_type`` (a family reading several names the classifier class
            of each, ``Family.sequence_classification``); ``None``: the family's first model type.

    Raises:
        ValueError: ``transformers`` has no classifier of the model type (Gemma 4, Granite), so there is no checkpoint
            layout to follow.
    """
    model_type = model_type or family.model_types[0]
    architecture = family.sequence_classification.get(model_type)
    if architecture is None:
        raise ValueError(f"{family.name} has no sequence-classification model in transformers (no "
                         f"*ForSequenceClassification class for model_type {model_type!r}), so torchlike has none "
                         "either. Load the checkpoint with AutoModelForCausalLM instead.")
    key = (family.name, model_type)
    if key not in _classifier_families:
        weights = tuple(rule for rule in family.weights if not rule.hf.startswith("lm_head.")) + (SCORE_RULE,)
        _classifier_families[key] = dataclasses.replace(
            family, architectures=(architecture,), weights=weights,
            build_model=functools.partial(build_classifier, family.build_model),
            forward=_no_language_model_head, logits_from_hidden=_no_language_model_head)
    return _classifier_families[key]


def _no_language_model_head(*args: Any) -> None:
    raise TypeError("a sequence classifier has no language-model head, so it gives no token logits: use "
                    "sequence_scores (the model's scores_function) for its scores, or load the checkpoint as a "
                    "causal LM.")


def build_classifier(build_decoder, hf_config, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The Tunix decoder of ``hf_config`` (built with tied embeddings: no LM head) with a ``score`` attribute,
    ``nnx.Linear(hidden_size, num_labels, use_bias=False)`` in ``dtype``.

    Args:
        build_decoder: the causal-LM family's ``build_model``.
        hf_config: a ``transformers`` config; ``num_labels`` sizes the head.
    """
    decoder_config = copy.deepcopy(hf_config)
    decoder_config.tie_word_embeddings = True
    module = build_decoder(decoder_config, dtype, rngs)
    module.score = nnx.Linear(hf_config.hidden_size, hf_config.num_labels, use_bias=False, dtype=dtype,
                              param_dtype=dtype, rngs=rngs)
    return module


def last_non_pad_indices(input_ids: jax.Array, pad_token_id: int | None) -> jax.Array:
    """Each row's pooling position ``[B]``, as ``transformers``' ``GenericForSequenceClassification``: the rightmost
    token that is not ``pad_token_id`` (so left and right padding both work; a row of pad tokens only pools position
    0), or the last position when there is no pad token.

    Args:
        input_ids: ``[B, T]`` token ids.
        pad_token_id: the config's pad token, or ``None``.

    Raises:
        ValueError: ``pad_token_id`` is ``None`` and the batch has more than one row (``transformers``' message).
    """
    batch, length = input_ids.shape
    if pad_token_id is None:
        if batch != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        return jnp.full((batch,), length - 1, jnp.int32)
    non_pad = (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.argmax(jnp.arange(length, dtype=jnp.int32) * non_pad, axis=-1).astype(jnp.int32)


def _scores(hidden_states, module: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array,
            pad_token_id: int | None) -> jax.Array:
    mask = attention_mask.astype(bool)
    tokens = input_ids.astype(jnp.int32)
    hidden = hidden_states(module, tokens, positions_from_mask(mask), causal_attention(mask))
    pooled = hidden[jnp.arange(hidden.shape[0]), last_non_pad_indices(tokens, pad_token_id)]
    return module.score(pooled).astype(jnp.float32)


def sequence_scores(family: Family, module: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array,
                    pad_token_id: int | None) -> jax.Array:
    """The classifier's float32 scores ``[B, num_labels]``: ``score`` on the final-norm hidden state at
    :func:`last_non_pad_indices`, for use inside a jitted step (a reward model's rewards when ``num_labels == 1``).

    Positions count real tokens (``cumsum(attention_mask) - 1``) and padding keys are hidden; with rotary
    embeddings this equals ``transformers``' forward without ``position_ids`` on a left- or right-padded batch.

    Args:
        family: the classifier's family table (:func:`classifier_family`).
        module: the Tunix decoder with its ``score`` head (LoRA-adapted or not).
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]``, 1 for real tokens and 0 for padding.
        pad_token_id: the config's pad token (pooling looks for the last token that is not it), or ``None``.
    """
    return _scores(family.hidden_states, module, input_ids, attention_mask, pad_token_id)


@nnx.jit(static_argnums=(0, 1, 2))
def _jitted_scores(hidden_states, pad_token_id, lora, module, input_ids, attention_mask):
    with lora_mode(lora):
        return _scores(hidden_states, module, input_ids, attention_mask, pad_token_id)


def forward_scores(family: Family, module: nnx.Module, input_ids: np.ndarray, attention_mask: np.ndarray,
                   pad_token_id: int | None, lora: str = "eval") -> jax.Array:
    """:func:`sequence_scores` of a host batch, compiled once per shape, pad token and LoRA mode.

    Args:
        lora: ``"eval"`` (adapter on, no dropout) or ``"disabled"`` (base decoder only).
    """
    tokens, mask = jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32)
    with fast_tracing():
        return _jitted_scores(family.hidden_states, pad_token_id, lora, module, tokens, mask)


def with_score_tensor(tensors: Iterable[tuple[str, np.ndarray, Any]], hf_config, seed: int = 0,
                      ignore_mismatched_sizes: bool = False) -> tuple[Iterator[tuple[str, np.ndarray, Any]], dict]:
    """The checkpoint's tensors, completed with a new ``score.weight`` when the checkpoint has none (a causal-LM
    checkpoint) or, with ``ignore_mismatched_sizes``, one of another ``num_labels``.

    The new head is drawn as ``transformers`` initialises a ``Linear``: ``normal(0, initializer_range)``.

    Returns:
        ``(tensors, report)``: the stream to load, and a dict that, once the stream is consumed, holds
        ``"initialized"`` (the HF names drawn fresh) and ``"mismatched"`` (``(name, checkpoint shape, model
        shape)`` of the tensors skipped for shape).

    Raises:
        ValueError: (while the stream is read) the checkpoint's ``score.weight`` has another ``num_labels`` and
            ``ignore_mismatched_sizes`` is off.
    """
    report: dict[str, list] = {"initialized": [], "mismatched": []}
    shape = (hf_config.num_labels, hf_config.hidden_size)

    def stream():
        seen = False  # a score.weight was loaded or skipped for its shape
        for name, array, source in tensors:
            if name == SCORE_HF_NAME and tuple(array.shape) != shape:
                if not ignore_mismatched_sizes:
                    raise ValueError(
                        f"{source}: size mismatch for {name}: the checkpoint's has shape {tuple(array.shape)}, the "
                        f"model's {shape} (num_labels={hf_config.num_labels}). Pass ignore_mismatched_sizes=True to "
                        "start a new head, or the checkpoint's num_labels.")
                report["mismatched"].append((name, tuple(array.shape), shape))
                seen = True
                continue
            seen = seen or name == SCORE_HF_NAME
            yield name, array, source
        if not seen:
            report["initialized"].append(SCORE_HF_NAME)
        if report["initialized"] or report["mismatched"]:
            std = float(getattr(hf_config, "initializer_range", 0.02))
            yield SCORE_HF_NAME, np.random.default_rng(seed).normal(0.0, std, shape).astype(np.float32), "new"

    return stream(), report
