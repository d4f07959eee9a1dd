"""The geometric mixture of a policy and a reference as one decoder the rollout engines sample from (TRL 1.0.0's
``GeometricMixtureWrapper``, which Nash-MD samples its second completions from).

:class:`GeometricMixture` is an NNX module with the Tunix decoder's call, ``(tokens, positions, cache, mask) ->
(scores, cache)``: it runs both models on the same tokens, each with its own KV cache, and returns
``log_softmax(mixture_coef * reference_logits + (1 - mixture_coef) * policy_logits)``. Its cache is one flat dict of
both models' layers, the policy's under ``policy/<layer>`` and the reference's under ``reference/<layer>``
(:meth:`GeometricMixture.kv_cache_shapes`), so :class:`~.engine.StaticEngine` and :class:`~.paged.PagedEngine` build,
page and update it as they do a single decoder's. The reference may be the policy module itself with its LoRA
adapter off (``reference_lora="disabled"``); the coefficient is a variable, so a new value reuses the compiled
programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..lora import runtime as lora_runtime
from ..model import decoder_contract
from .sampling import init_cache

__all__ = ["GeometricMixture", "MixtureCoefficient", "mixture_scores"]

POLICY_PREFIX, REFERENCE_PREFIX = "policy/", "reference/"


class MixtureCoefficient(nnx.Variable):
    """The mixture's weight of the reference (a traced value, not a trained parameter)."""


def mixture_scores(policy_logits: jax.Array, reference_logits: jax.Array, mixture_coef: jax.Array | float
                   ) -> jax.Array:
    """TRL's ``GeometricMixtureWrapper.forward``: ``log_softmax(c * reference + (1 - c) * policy)`` over the last axis,
    in float32. Sampling from these scores (any temperature, top-k, top-p or min-p) samples from the normalised
    geometric mixture ``policy^(1-c) * reference^c``; a repetition penalty acts on them as TRL's does.

    Args:
        policy_logits, reference_logits: ``[..., V]`` next-token logits of the two models.
        mixture_coef: ``c``, the reference's weight (0: the policy, 1: the reference).
    """
    mixed = mixture_coef * reference_logits.astype(jnp.float32) + (1 - mixture_coef) * policy_logits.astype(jnp.float32)
    return jax.nn.log_softmax(mixed, axis=-1)


class GeometricMixture(nnx.Module):
    """A policy and a reference decoding together, scored as their geometric mixture (see the module docstring).

    Args:
        policy: the policy's Tunix decoder, run in the engine's LoRA mode.
        reference: the reference's Tunix decoder (``policy`` itself for its adapter-off base), same vocabulary.
        mixture_coef: the reference's weight ``c`` in ``[0, 1]``.
        reference_lora: :func:`lora_runtime.lora_mode` the reference runs in (``"disabled"``: the policy's base).

    Raises:
        ValueError: the two vocabularies differ in size (the logits cannot be mixed).
    """

    def __init__(self, policy: nnx.Module, reference: nnx.Module, mixture_coef: float,
                 reference_lora: str = lora_runtime.EVAL):
        vocabularies = decoder_contract.vocab_size(policy), decoder_contract.vocab_size(reference)
        if vocabularies[0] != vocabularies[1]:
            raise ValueError(f"the policy's vocabulary has {vocabularies[0]} rows and the reference's "
                             f"{vocabularies[1]}: the geometric mixture adds their logits token by token, so both "
                             "models need the same vocabulary (the same tokenizer and embedding size).")
        self.policy = policy
        self.reference = reference
        self.mixture_coef = MixtureCoefficient(jnp.asarray(mixture_coef, jnp.float32))
        self.reference_lora = reference_lora

    @property
    def config(self):
        """The policy's Tunix model config."""
        return self.policy.config

    @property
    def embedder(self) -> nnx.Module:
        """The embedder whose dtype the shared KV cache takes: the wider of the two models' (each model's layers
        are cast to its own dtype around its call, which loses nothing)."""
        policy, reference = self.policy.embedder, self.reference.embedder
        wider = jnp.dtype(reference.input_embedding.get_value().dtype).itemsize > \
            jnp.dtype(policy.input_embedding.get_value().dtype).itemsize
        return reference if wider else policy

    def kv_cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each cached layer's ``(kv_heads, head_dim)``: the policy's layers, then the reference's, under their
        prefixes (read by :func:`~.sampling.init_cache`)."""
        shapes = {}
        for prefix, member in ((POLICY_PREFIX, self.policy), (REFERENCE_PREFIX, self.reference)):
            layers = jax.eval_shape(lambda member=member: init_cache(member, 1, 1))
            shapes.update({prefix + name: tuple(entry["k"].shape[2:]) for name, entry in layers.items()
                           if "k" in entry})
        return shapes

    def recurrent_state_shapes(self) -> dict[str, dict[str, tuple[tuple[int, ...], jnp.dtype]]]:
        """Each recurrent layer's state entries (hybrid decoders): the policy's, then the reference's, under their
        prefixes (read by :func:`~.sampling.init_cache`)."""
        return {prefix + name: entries
                for prefix, member in ((POLICY_PREFIX, self.policy), (REFERENCE_PREFIX, self.reference))
                for name, entries in decoder_contract.recurrent_state_shapes(member).items()}

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: dict, attention_mask: jax.Array,
                 **inputs) -> tuple[jax.Array, dict]:
        policy_logits, policy_cache = self._member(self.policy, POLICY_PREFIX, tokens, positions, cache,
                                                   attention_mask, inputs)
        with lora_runtime.lora_mode(self.reference_lora):
            reference_logits, reference_cache = self._member(self.reference, REFERENCE_PREFIX, tokens, positions,
                                                             cache, attention_mask, inputs)
        scores = mixture_scores(policy_logits, reference_logits, self.mixture_coef.get_value())
        return scores, {**policy_cache, **reference_cache}

    @staticmethod
    def _member(module: nnx.Module, prefix: str, tokens, positions, cache: dict, attention_mask, inputs: dict):
        """One model's call on its own layers of the shared cache (cast to its dtype and back)."""
        dtype = decoder_contract.embedding_table(module).dtype
        own = {name[len(prefix):]: {part: value.astype(dtype) if part in ("k", "v") else value
                                    for part, value in layer.items()}
               for name, layer in cache.items() if name.startswith(prefix)}
        logits, own = module(tokens, positions, own, attention_mask, **inputs)
        stored = {prefix + name: {part: value.astype(cache[prefix + name][part].dtype)
                                  for part, value in layer.items()} for name, layer in own.items()}
        return logits, stored
