"""NEFTune: uniform noise on a Tunix decoder's input embeddings, in the train step only.

transformers' ``neftune_post_forward_hook`` (``Trainer`` with ``neftune_noise_alpha``) adds
``Uniform(-m, m)`` noise to the embedding layer's output while the model trains, with
``m = alpha / sqrt(L * H)``: ``L`` the length of the batch as the model sees it (its padded length; with
padding-free batches, the one flattened row), ``H`` the hidden size. Here the embedder's ``encode`` is wrapped for
the duration of a loss traced by a train step (:func:`adapters.training.train_step.training_key` gives its key), so eval
steps, log-prob passes and the sampler run the module untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from ..training import train_step


def noise_magnitude(alpha: float, length, hidden_size: int):
    """transformers' ``mag_norm = alpha / sqrt(length * hidden_size)``: the half-width of the uniform noise."""
    return alpha / jnp.sqrt(jnp.asarray(length, jnp.float32) * hidden_size)


@contextlib.contextmanager
def noisy_embeddings(module: nnx.Module, alpha: float, key: jax.Array, length) -> Iterator[None]:
    """Within the block, ``module.embedder.encode(tokens)`` returns its embeddings plus ``Uniform(-m, m)`` noise,
    ``m = noise_magnitude(alpha, length, H)``, drawn from ``key``.

    The embedder gets a subclass of its own class for the duration (as ``families.base`` records the final norm), so
    the module tree, its parameters and the output head (``embedder.decode`` for tied embeddings) are untouched.

    Args:
        module: a Tunix decoder with an ``embedder``.
        alpha: ``neftune_noise_alpha``.
        key: the noise's random key.
        length: the ``L`` of the formula (a Python or traced scalar).
    """
    embedder = module.embedder
    original = type(embedder)

    def encode(self, *args, **kwargs):
        embeddings = original.encode(self, *args, **kwargs)
        magnitude = noise_magnitude(alpha, length, embeddings.shape[-1])
        noise = jax.random.uniform(key, embeddings.shape, jnp.float32, -1.0, 1.0) * magnitude
        return embeddings + noise.astype(embeddings.dtype)

    noisy = type(original.__name__, (original,), {"encode": encode, "__module__": original.__module__})
    object.__setattr__(embedder, "__class__", noisy)
    try:
        yield
    finally:
        object.__setattr__(embedder, "__class__", original)


def batch_length(batch: dict, padding_free: bool = False, pad_to_multiple_of: int | None = None) -> jax.Array:
    """The ``L`` transformers' hook sees for a batch TRL's collator built: the longest row's real tokens (TRL pads
    each batch to its longest example) or, ``padding_free``, all real tokens of the batch (one flattened row),
    rounded up to ``pad_to_multiple_of``."""
    tokens = batch["attention_mask"].astype(jnp.int32).sum(-1)
    length = tokens.sum() if padding_free else tokens.max()
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return length


def with_neftune(loss: Callable, alpha: float, length: Callable[[dict], jax.Array] = batch_length) -> Callable:
    """``loss`` (a step loss ``(module, batch, num_items_in_batch) -> (value, weight, aux)``) with NEFTune noise on
    the embeddings when a train step traces it, and unchanged anywhere else (no :func:`train_step.training_key`).

    Args:
        loss: the step loss.
        alpha: ``neftune_noise_alpha`` (> 0).
        length: ``batch -> L`` (:func:`batch_length`).
    """

    def noisy_loss(module, batch, num_items_in_batch=None):
        key = train_step.training_key()
        if key is None:
            return loss(module, batch, num_items_in_batch)
        with noisy_embeddings(module, alpha, key, length(batch)):
            return loss(module, batch, num_items_in_batch)

    return noisy_loss
