"""Underlying distribution matching (UDM) for BCO, as TRL 1.0.0's ``BCOTrainer`` builds it: a scikit-learn
``LogisticRegression`` (balanced classes) that tells desirable prompts from undesirable ones by their embeddings, and
the density-ratio weight ``p / (1 - p)`` it gives each undesirable example, clamped to
``[min_density_ratio, max_density_ratio]``.

The embedding function is TRL's: ``embedding_func(input_ids=..., attention_mask=...)`` called on a batch of prompts
tokenised by ``embedding_tokenizer``, given as torch ``int64`` CPU tensors ``[B, L]`` right-padded to the batch's
longest prompt (the padding, and any token equal to the processing class's pad token, replaced by the embedding
tokenizer's pad token, as TRL does), so a function written for TRL ports unchanged. It returns ``[B, D]`` embeddings
as a torch tensor, a NumPy array or a JAX array. Batches are the ones TRL embeds: consecutive chunks of the per-device
batch size of the data read in order (BCO reads its training data in order).

scikit-learn and joblib are imported only when UDM is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["CLF_NAME", "PromptEmbedder", "add_density_ratio_weights", "fit_density_ratio_classifier",
           "require_udm_libraries"]

#: The file of a checkpoint holding the fitted classifier (TRL's name, written with ``joblib``).
CLF_NAME = "clf.pkl"


def require_udm_libraries() -> None:
    """Raises TRL's ``ImportError`` when scikit-learn or joblib is missing."""
    try:
        import joblib  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError as error:
        raise ImportError("BCOTrainer with UDM requires the scikit-learn and joblib libraries. Please install it with "
                          "`pip install scikit-learn joblib`.") from error


def _as_numpy(embeddings: ArrayLike) -> np.ndarray:
    if hasattr(embeddings, "detach"):  # a torch tensor
        embeddings = embeddings.detach().cpu().float().numpy()
    return np.asarray(embeddings, np.float32)


class PromptEmbedder:
    """Calls a TRL ``embedding_func`` on one batch of prepared examples (their ``embedding_ids``).

    Args:
        embedding_func: ``(input_ids=, attention_mask=) -> [B, D]`` embeddings.
        pad_token_id: the processing class's pad token, which pads the batch (TRL's collator).
        embedding_pad_token_id: the embedding tokenizer's pad token, which replaces it.
    """

    def __init__(self, embedding_func: Callable, pad_token_id: int, embedding_pad_token_id: int):
        self.embedding_func = embedding_func
        self.pad_token_id = pad_token_id
        self.embedding_pad_token_id = embedding_pad_token_id

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        import torch

        longest = max(len(example["embedding_ids"]) for example in examples)
        input_ids = torch.full((len(examples), longest), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(examples), longest), dtype=torch.int64)
        for row, example in enumerate(examples):
            input_ids[row, :len(example["embedding_ids"])] = torch.tensor(example["embedding_ids"], dtype=torch.int64)
            attention_mask[row, :len(example["embedding_ids"])] = 1
        input_ids = torch.where(input_ids == self.pad_token_id, self.embedding_pad_token_id, input_ids)
        with torch.no_grad():
            return _as_numpy(self.embedding_func(input_ids=input_ids, attention_mask=attention_mask))

    def in_batches(self, examples: Sequence[Mapping[str, Any]], batch_size: int) -> np.ndarray:
        """``[N, D]``: the embeddings of ``examples`` in consecutive batches of ``batch_size``."""
        return np.concatenate([self(examples[start:start + batch_size])
                               for start in range(0, len(examples), batch_size)])


def fit_density_ratio_classifier(examples: Sequence[Mapping[str, Any]], embed: PromptEmbedder, batch_size: int,
                                 sample_size: int, seed: int) -> Any:
    """The UDM classifier, fitted as TRL 1.0.0's ``BCOTrainer.__init__`` fits it.

    Up to ``sample_size`` desirable and then up to ``sample_size`` undesirable examples are drawn with replacement
    (NumPy's legacy generator seeded with ``seed``: TRL's ``np.random.choice`` after transformers' ``set_seed``), their
    prompts embedded in batches of ``batch_size``, and ``LogisticRegression(class_weight="balanced")`` fitted to tell
    them apart (label 1: desirable).

    Args:
        examples: the prepared training examples (``label``, ``embedding_ids``).
        embed: the embedding function.
        batch_size: ``per_device_train_batch_size``.
        sample_size: ``prompt_sample_size``.
        seed: ``seed``.

    Returns:
        The fitted ``sklearn.linear_model.LogisticRegression``.

    Raises:
        ValueError: the examples lack desirable or undesirable ones (the classifier needs both).
    """
    from sklearn.linear_model import LogisticRegression

    desirable = [example for example in examples if example["label"]]
    undesirable = [example for example in examples if not example["label"]]
    if not desirable or not undesirable:
        raise ValueError(f"Underlying distribution matching needs desirable and undesirable examples to fit its "
                         f"density-ratio classifier; the training data has {len(desirable)} desirable and "
                         f"{len(undesirable)} undesirable ones. Pass both, or leave embedding_func unset.")
    generator = np.random.RandomState(seed)
    samples = []
    for group in (desirable, undesirable):
        picked = generator.choice(len(group), size=(min(len(group), sample_size),))
        samples.append(embed.in_batches([group[index] for index in picked], batch_size))
    labels = np.concatenate([np.ones(len(samples[0]), np.float32), np.zeros(len(samples[1]), np.float32)])
    return LogisticRegression(class_weight="balanced").fit(np.concatenate(samples), labels)


def add_density_ratio_weights(examples: Sequence[dict[str, Any]],
                              classifier: Any,  # Any: an sklearn-style classifier (predict_proba)
                              embed: PromptEmbedder,
                              batch_size: int, min_ratio: float, max_ratio: float) -> None:
    """Sets each example's ``udm_weight`` in place: for an undesirable example ``clamp(p / (1 - p + 1e-8),
    min_ratio, max_ratio)`` in float32, ``p`` the classifier's probability that its prompt is desirable; 1 for a
    desirable one (TRL weighs only the undesirable losses).

    Args:
        examples: prepared examples (``label``, ``embedding_ids``), embedded in the batches TRL forms: consecutive
            chunks of ``batch_size``.
        classifier: the fitted classifier (:func:`fit_density_ratio_classifier`).
        embed: the embedding function.
        batch_size: the per-device batch size of the data (training or evaluation).
        min_ratio, max_ratio: ``min_density_ratio`` and ``max_density_ratio``.
    """
    embeddings = embed.in_batches(examples, batch_size)
    probabilities = classifier.predict_proba(embeddings)[:, 1].astype(np.float32)
    weights = np.clip(probabilities / (np.float32(1.0) - probabilities + np.float32(1e-8)), np.float32(min_ratio),
                      np.float32(max_ratio)).astype(np.float32)
    for example, weight in zip(examples, weights, strict=True):
        example["udm_weight"] = float(weight) if not example["label"] else 1.0
