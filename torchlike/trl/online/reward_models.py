"""Reward models as reward functions: a sequence classifier scoring GRPO/RLOO completions the way TRL 1.16 does.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` take, among ``reward_funcs``, a reward model: a path or hub id (loaded with
``AutoModelForSequenceClassification.from_pretrained(num_labels=1, **args.model_init_kwargs)``) or a loaded
classifier, with its tokenizer from ``reward_processing_classes`` (default: the model's own). Each completion is scored
as ``logits[:, 0]`` of the prompt and completion together: for conversational prompts, the chat template renders the
prompt's messages followed by the completion's (no generation prompt, with ``args.chat_template_kwargs``); for
standard prompts, the prompt text and the completion text are concatenated. The texts are tokenised without special
tokens, right-padded with the tokenizer's pad token (its eos token when it has none), and the score is read at each
row's last non-pad token. :class:`RewardModel` wraps one such model in the reward-function convention
(``f(prompts, completions, **kwargs) -> list[float]``) and runs the jitted scoring on the trainer's mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ...adapters.checkpoint.hf_source import is_transformers_model
from ...adapters.distributed import mesh as mesh_lib
from ...adapters.distributed import multihost
from ...adapters.model import sequence_classification as classification
from ...adapters.rollout import sampling

if TYPE_CHECKING:
    from ...modeling import CausalLM
    from ...sequence_classification import SequenceClassifier
    from ...type_aliases import RewardFunc, Tokenizer
    from ..trainer.base_config import TRLConfig

__all__ = ["RewardModel", "is_reward_model", "reward_functions"]


def is_reward_model(value: object) -> bool:
    """Whether a ``reward_funcs`` entry is a reward model (a path / hub id, a torchlike ``SequenceClassifier`` or a
    ``transformers`` model) rather than a reward function."""
    from ...sequence_classification import SequenceClassifier

    return isinstance(value, (str, SequenceClassifier)) or is_transformers_model(value)


def _name(model_id: str) -> str:
    """TRL's name of a reward model in the metrics (``rewards/<name>/mean``): the last part of its id or path."""
    return str(model_id).split("/")[-1]


class RewardModel:
    """A one-label sequence classifier called like a reward function, as TRL scores completions with a reward model.

    Args:
        model: a :class:`~torchlike.SequenceClassifier` (its first score is the reward).
        tokenizer: the reward model's tokenizer. Without a pad token it gets its eos token as one (TRL's rule), and
            the model config's ``pad_token_id`` is set to it: the score is read at the last token that is not it.
        name: the reward's name in the metrics (default: the last part of ``model.name_or_path``, as TRL).
        chat_template_kwargs: keyword arguments for ``apply_chat_template`` on conversational prompts (the trainer's
            ``args.chat_template_kwargs``).

    Example:
        >>> reward = RewardModel(AutoModelForSequenceClassification.from_pretrained("path/to/rm", num_labels=1),
        ...                      AutoTokenizer.from_pretrained("path/to/rm"))
        >>> reward(prompts=["The sky is"], completions=[" blue."])
        [0.73]
    """

    def __init__(self, model: SequenceClassifier, tokenizer: Tokenizer, name: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name or _name(model.name_or_path)

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        """Puts the model's parameters on ``mesh`` (the trainer's) unless it already lives on a mesh."""
        if self.model.mesh is None:
            mesh_lib.shard_module(self.model.module, mesh)
            self.model.mesh = mesh

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The texts TRL scores: the chat template over ``prompt + completion`` messages, or ``prompt +
        completion`` strings."""
        if prompts and isinstance(prompts[0], list):
            return [self.tokenizer.apply_chat_template(prompt + completion, tokenize=False,
                                                       **self.chat_template_kwargs)
                    for prompt, completion in zip(prompts, completions, strict=True)]
        return [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """``float32 [len(texts)]`` rewards of ``texts``, tokenised without special tokens and right-padded (to a
        bucketed length, so a few programs serve every batch; the score does not depend on the padding).

        The rows are split over the data-parallel devices of the model's mesh when they divide evenly.
        """
        if not texts:
            return np.zeros((0,), np.float32)
        encoded = self.tokenizer(text=list(texts), add_special_tokens=False)
        lengths = [len(ids) for ids in encoded["input_ids"]]
        width = sampling.bucket_length(max(lengths))
        input_ids = np.full((len(texts), width), self.tokenizer.pad_token_id, np.int32)
        attention_mask = np.zeros((len(texts), width), np.int32)
        for row, ids in enumerate(encoded["input_ids"]):
            input_ids[row, :len(ids)], attention_mask[row, :len(ids)] = ids, 1
        mesh = self.model.mesh
        context = mesh_lib.entered(mesh) if mesh is not None else contextlib.nullcontext()
        with context:
            if mesh is not None and len(texts) % mesh_lib.data_parallel_size(mesh) == 0:
                sharding = mesh_lib.batch_sharding(mesh)
                input_ids, attention_mask = jax.device_put((input_ids, attention_mask), sharding)
            scores = classification.forward_scores(self.model.family, self.model.module, input_ids, attention_mask,
                                                   self.model.config.pad_token_id)
        return np.asarray(mesh_lib.to_host(scores))[:, 0].astype(np.float32)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """The rewards of ``completions`` of ``prompts`` (one float each), in the reward-function convention.

        With several JAX processes each passes its own completions; they are gathered so that every process runs the
        same sharded program, and each gets its own rewards back.
        """
        pieces = multihost.allgather_objects(self.texts(prompts, completions))
        start = sum(len(piece) for piece in pieces[:jax.process_index()])
        scores = self.scores([text for piece in pieces for text in piece])
        return scores[start:start + len(prompts)].tolist()


def reward_functions(reward_funcs: Sequence[RewardFunc], reward_processing_classes: Tokenizer | list[Tokenizer] | None,
                     args: TRLConfig, policy: CausalLM) -> list[Callable]:
    """``reward_funcs`` with every reward model turned into a :class:`RewardModel` on the trainer's mesh (TRL's
    ``GRPOTrainer`` rules); reward functions are returned as they are.

    Args:
        reward_funcs: the trainer's reward functions and models: a path or hub id is loaded with
            ``AutoModelForSequenceClassification.from_pretrained(num_labels=1, **args.model_init_kwargs)``; a
            ``transformers`` sequence classifier is converted (its weights copied into JAX); a torchlike
            ``SequenceClassifier`` is used as it is. Their first score (``logits[:, 0]``) is the reward.
        reward_processing_classes: ``None``, one tokenizer (for a single reward function) or a list with one entry per
            reward function; a reward model whose entry is ``None`` loads the tokenizer of its path. Entries of reward
            functions are ignored, as in TRL.
        args: the trainer's config (``model_init_kwargs``, ``chat_template_kwargs`` where it has the field, the mesh
            settings).
        policy: the model the trainer trains. When there is a reward model, the policy is placed on the trainer's mesh
            now (``resolve_mesh``, which the trainer then finds in place) and the reward models on the same mesh.

    Returns:
        One callable per entry of ``reward_funcs``, in order.

    Raises:
        ValueError: ``reward_processing_classes`` has another length than ``reward_funcs`` (TRL's message).
    """
    from ... import AutoModelForSequenceClassification, AutoTokenizer
    from ...training.device_mesh import resolve_mesh

    tokenizers = reward_processing_classes if isinstance(reward_processing_classes, list) else \
        [reward_processing_classes] if reward_processing_classes is not None else [None] * len(reward_funcs)
    if len(tokenizers) != len(reward_funcs):
        raise ValueError(f"The number of reward processing classes ({len(tokenizers)}) must match the number of "
                         f"reward functions ({len(reward_funcs)}).")
    init_kwargs = dict(args.model_init_kwargs or {})
    functions: list[Callable] = []
    for function, tokenizer in zip(reward_funcs, tokenizers, strict=True):
        if not is_reward_model(function):
            functions.append(function)
            continue
        if isinstance(function, str):
            model = AutoModelForSequenceClassification.from_pretrained(function, num_labels=1, **init_kwargs)
        elif is_transformers_model(function):
            model = AutoModelForSequenceClassification.from_pretrained(function)
        else:
            model = function
        if tokenizer is None:
            source = function if isinstance(function, str) else model.name_or_path
            tokenizer = AutoTokenizer.from_pretrained(source, revision=init_kwargs.get("revision"))
        name = _name(function) if isinstance(function, str) else None  # else the loaded model's name_or_path
        # OnlineDPOConfig has no chat_template_kwargs: TRL's online DPO renders the conversations without any.
        template_kwargs = args.chat_template_kwargs if hasattr(args, "chat_template_kwargs") else None
        reward = RewardModel(model, tokenizer, name=name, chat_template_kwargs=template_kwargs)
        reward.place_on(resolve_mesh(args, policy))
        functions.append(reward)
    return functions
