"""``AutoModelForSequenceClassification`` and ``SequenceClassifier``: ``*ForSequenceClassification`` checkpoints
(a decoder plus a ``score`` head pooled at the last non-pad token) in and out of Tunix NNX models."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .adapters.distributed.mesh import entered
from .adapters.model import sequence_classification as classification
from .adapters.model import tunix_model
from .arrays import to_numpy_2d
from .dtypes import DTypeLike, dtype_name
from .modeling import CausalLM, open_pretrained
from .module_tree import module_tree_lines
from .quantization import announce_quantization

if TYPE_CHECKING:
    from jax.sharding import Mesh
    from numpy.typing import ArrayLike
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["AutoModelForSequenceClassification", "SequenceClassifier", "SequenceClassifierOutput"]


@dataclass
class SequenceClassifierOutput:
    """Output of :class:`SequenceClassifier` forward passes (the ``transformers`` field names).

    Args:
        logits: float32 ``jax.Array`` of shape ``(batch, num_labels)``: the scores pooled at each row's last
            non-pad token (a reward model's rewards when ``num_labels == 1``).
        loss: unused at inference; kept for the familiar layout.
    """

    logits: jax.Array
    loss: jax.Array | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class SequenceClassifier(CausalLM):
    """A decoder with a ``score`` head, used like ``transformers``' ``*ForSequenceClassification`` (e.g. a reward
    model).

    Create one with :meth:`AutoModelForSequenceClassification.from_pretrained`. The parameters, ``state_dict``,
    ``load_state_dict``, ``named_parameters`` and the mesh work as for :class:`~torchlike.CausalLM`; the ``score``
    head is the parameter ``score.kernel`` ``(hidden, num_labels)`` (``score.weight`` in Hugging Face names).

    Attributes:
        module: the Tunix ``flax.nnx.Module`` (the decoder, with the head as its ``score`` attribute).
        config: the ``transformers`` config (``num_labels``, ``id2label``, ``pad_token_id``).
        family: the classifier's family table (the decoder's weight names plus ``score``).
        mesh: the ``jax.sharding.Mesh`` the parameters live on, or ``None``.
    """

    @property
    def num_labels(self) -> int:
        """The number of scores per row (``config.num_labels``)."""
        return int(self.config.num_labels)

    @property
    def scores_function(self) -> Callable[..., jax.Array]:
        """The pure function ``(module, input_ids, attention_mask) -> float32 scores [batch, num_labels]``, for use
        inside ``jax.jit``/``nnx.jit`` (a trainer's loss): this model's family and ``pad_token_id`` bound to
        :func:`torchlike.adapters.model.sequence_classification.sequence_scores`. It pools as ``transformers`` does, at
        each row's rightmost token that is not ``pad_token_id``.

        Example:
            >>> scores = model.scores_function
            >>> def loss(module, batch):
            ...     rewards = scores(module, batch["input_ids"], batch["attention_mask"])[:, 0]
        """
        return functools.partial(classification.sequence_scores, self.family,
                                 pad_token_id=self.config.pad_token_id)

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 **unused: Any) -> SequenceClassifierOutput:
        """Runs the model.

        Args:
            input_ids: token ids ``(batch, sequence)`` as a list, numpy, jax or torch array, left- or right-padded
                with ``config.pad_token_id``.
            attention_mask: 1 for real tokens, 0 for padding; default all ones.

        Returns:
            :class:`SequenceClassifierOutput` with float32 ``logits`` of shape ``(batch, num_labels)``.

        Raises:
            ValueError: ``config.pad_token_id`` is ``None`` and the batch has several rows (as ``transformers``).
        """
        unsupported = sorted(key for key, value in unused.items() if value not in (None, False))
        if unsupported:
            raise TypeError(f"{type(self).__name__}.__call__ does not support {unsupported}; pass input_ids and "
                            "attention_mask.")
        ids = to_numpy_2d(input_ids, "input_ids")
        mask = np.ones_like(ids) if attention_mask is None else to_numpy_2d(attention_mask, "attention_mask")
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids shape {ids.shape}.")
        with entered(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            scores = classification.forward_scores(self.family, self.module, ids, mask, self.config.pad_token_id,
                                                   lora=self._lora_mode)
        return SequenceClassifierOutput(logits=scores)

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a sequence classifier has no language-model head.

        Raises:
            TypeError: always.
        """
        raise TypeError(f"{type(self).__name__} cannot generate: a sequence classifier has no language-model head. "
                        "Load the checkpoint with AutoModelForCausalLM to generate.")

    def __repr__(self) -> str:
        header = (f"{type(self).__name__}({self.family.name}, num_labels={self.num_labels}, "
                  f"dtype={self.dtype.name}, parameters={self.num_parameters():,})")
        return "\n".join([header, *("  " + line for line in module_tree_lines(self.module))])

    def _save_metadata(self, folder: Path, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """``config.json`` with ``architectures`` the family's ``*ForSequenceClassification`` (transformers names the
        saving class) and the tokenizer's files; no ``generation_config.json``, as transformers writes none for a
        classifier. ``save_pretrained`` is :meth:`CausalLM.save_pretrained` (weights ``model.*`` and
        ``score.weight``), which loads in ``transformers.AutoModelForSequenceClassification``."""
        config = copy.deepcopy(self.config)
        config.dtype = dtype_name(self.dtype)
        config.architectures = [self.family.architectures[0]]
        config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


class AutoModelForSequenceClassification:
    """Loads Hugging Face sequence classifiers (``Qwen2ForSequenceClassification``, ``Qwen3...``, ``Llama...``,
    ``Gemma2...``, ``Gemma3TextForSequenceClassification``), or a causal LM with a new ``score`` head, as
    :class:`SequenceClassifier`."""

    def __init__(self, *args, **kwargs):
        raise OSError("Use AutoModelForSequenceClassification.from_pretrained(...).")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike | PreTrainedModel,
        *model_args,
        num_labels: int | None = None,
        dtype: DTypeLike = None,
        mesh: Mesh | None = None,
        ignore_mismatched_sizes: bool = False,
        seed: int = 0,
        revision: str | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        device_map: str | dict | None = None,
        torch_dtype: DTypeLike = None,
        cache_dir: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        **kwargs,
    ) -> SequenceClassifier:
        """Loads a checkpoint directory, hub id, or ``transformers.PreTrainedModel`` into JAX.

        A ``*ForSequenceClassification`` checkpoint loads as it is. A causal-LM checkpoint (or one whose head has
        another ``num_labels``, with ``ignore_mismatched_sizes=True``) gets a new ``score`` head drawn as
        ``transformers`` initialises it, ``normal(0, initializer_range)``, with a warning naming the newly
        initialised weights; its ``lm_head.weight`` is reported unused.

        Args:
            pretrained_model_name_or_path: a directory with ``config.json`` and weights, a hub repo id, or a
                ``transformers`` model object.
            num_labels: the number of scores (``1`` for a reward model); default the config's (``transformers``'
                default is 2).
            dtype: parameter dtype: ``None``/``"auto"`` (the checkpoint's), a string, a numpy/jax or torch dtype.
            mesh: a ``jax.sharding.Mesh`` with axes ``fsdp``/``tp``; parameters are placed sharded as they are read.
            ignore_mismatched_sizes: draw a new ``score`` head when the checkpoint's has another ``num_labels``
                (otherwise that is an error), as ``transformers``.
            seed: seeds a newly initialised ``score`` head (torchlike only; ``transformers`` uses torch's generator).
            revision, cache_dir, token, local_files_only: hub download options.
            trust_remote_code, attn_implementation, device_map, torch_dtype, quantization_config, load_in_4bit,
                load_in_8bit: as in :meth:`AutoModelForCausalLM.from_pretrained`.
            kwargs: config overrides (``id2label``, ``pad_token_id``...), as in ``transformers``.

        Returns:
            A :class:`SequenceClassifier`.

        Example:
            >>> model = AutoModelForSequenceClassification.from_pretrained("path/to/qwen", num_labels=1)
            >>> model(batch["input_ids"], batch["attention_mask"]).logits.shape
            (8, 1)
        """
        if num_labels is not None:
            kwargs["num_labels"] = num_labels
        loading = open_pretrained(pretrained_model_name_or_path, model_args, kwargs, dtype=dtype,
                                  torch_dtype=torch_dtype, mesh=mesh, attn_implementation=attn_implementation,
                                  device_map=device_map, trust_remote_code=trust_remote_code, revision=revision,
                                  cache_dir=cache_dir, token=token, local_files_only=local_files_only)
        source = loading.source
        family = classification.classifier_family(source.family, source.config.model_type)
        tensors, report = classification.with_score_tensor(source.tensors(), source.config, seed=seed,
                                                           ignore_mismatched_sizes=ignore_mismatched_sizes)
        module = tunix_model.load_weights(family, source.config, tensors, loading.dtype, mesh=loading.mesh,
                                          source=source.location)
        _warn_new_weights(family.architectures[0], source.location, report)
        model = SequenceClassifier(module, source.config, family, None, loading.mesh, source.name_or_path)
        model.quantization = announce_quantization(loading.quantization)
        return model


def _warn_new_weights(architecture: str, location: str, report: dict) -> None:
    """``transformers``' notice for heads the checkpoint did not provide."""
    lines = []
    if report["initialized"]:
        lines.append(f"Some weights of {architecture} were not initialized from the model checkpoint at {location} "
                     f"and are newly initialized: {report['initialized']}")
    if report["mismatched"]:
        details = ", ".join(f"{name}: found shape {found} in the checkpoint and {wanted} in the model instantiated"
                            for name, found, wanted in report["mismatched"])
        lines.append(f"Some weights of {architecture} were not initialized from the model checkpoint at {location} "
                     f"and are newly initialized because the shapes did not match: {details}")
    if lines:
        warnings.warn("\n".join(lines) + "\nYou should probably TRAIN this model on a down-stream task to be able to "
                      "use it for predictions and inference.", stacklevel=3)
