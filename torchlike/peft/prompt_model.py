"""``PromptLearningModel``: a ``CausalLM`` with a prompt-tuning, P-tuning or prefix-tuning adapter, saved and loaded
in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors`` holding ``prompt_embeddings``)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..adapters.checkpoint.safetensors_io import read_safetensors
from ..adapters.distributed.mesh import entered
from ..adapters.distributed.multihost import gather_to_host
from ..adapters.families.base import head_dim_of
from ..adapters.lora import runtime as lora_runtime
from ..adapters.model import prompt_learning as prompting
from ..adapters.model import tunix_model
from ..arrays import to_numpy_2d
from ..modeling import CausalLM, CausalLMOutput
from ..sequence_classification import SequenceClassifier
from .config import ADAPTER_WEIGHTS_NAME
from .model import PROMPT_LEARNING, PeftModel
from .prompt_config import (
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptLearningConfig,
    PromptTuningConfig,
    PromptTuningInit,
)

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from transformers import PretrainedConfig

__all__ = ["PromptLearningModel", "get_prompt_learning_model"]

PROMPT_EMBEDDINGS = "prompt_embeddings"
"""The one tensor of a PEFT prompt-learning adapter file: the encoder output ``[num_virtual_tokens, dim]``."""


class PromptLearningModel(PeftModel):
    """A :class:`~torchlike.peft.PeftModel` with a prompt-learning adapter (``peft.PeftModelForCausalLM`` with a
    ``PromptTuningConfig``, ``PromptEncoderConfig`` or ``PrefixTuningConfig``).

    Forward passes add the virtual tokens as ``peft`` does (``adapters.model.prompt_learning``): with prompt tuning and
    P-tuning the logits cover the virtual tokens too (``[batch, num_virtual_tokens + sequence, vocab]``), with prefix
    tuning the input tokens only. Training updates the prompt encoder only (:attr:`trainable_filter`);
    :meth:`disable_adapter` runs the base model. Generation is not implemented (the KV cache would lack the virtual
    tokens).
    """

    @property
    def prepends_virtual_tokens(self) -> bool:
        """Whether the virtual tokens are prepended to the input (prompt tuning and P-tuning, not prefix tuning)."""
        return self.active_peft_config.peft_type != prompting.PREFIX_TUNING

    @property
    def trainable_filter(self) -> prompting.PromptParameters:
        """The NNX filter of the prompt encoder's parameters, the only ones training updates."""
        return prompting.PromptParameters()

    @property
    def modules_to_save(self) -> list[str]:
        """Always empty: prompt-learning configs refuse ``modules_to_save``."""
        return []

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None, **unused: Any) -> CausalLMOutput:
        """Runs the model with the virtual tokens, as ``peft.PeftModelForCausalLM.forward`` does.

        Args:
            input_ids: token ids ``(batch, sequence)``.
            attention_mask: 1 for real tokens, 0 for padding; default all ones. It is extended by ones for the
                virtual tokens.

        Returns:
            :class:`~torchlike.CausalLMOutput` with float32 ``logits``: ``(batch, num_virtual_tokens + sequence,
            vocab)`` for prompt tuning and P-tuning, ``(batch, sequence, vocab)`` for prefix tuning or inside
            :meth:`disable_adapter`.
        """
        if not self.prepends_virtual_tokens or self._lora_mode == lora_runtime.DISABLED:
            return super().__call__(input_ids, attention_mask, **unused)
        unsupported = sorted(key for key, value in unused.items() if value not in (None, False))
        if unsupported:
            raise TypeError(f"PeftModel.__call__ does not support {unsupported}; pass input_ids and attention_mask.")
        ids = to_numpy_2d(input_ids, "input_ids")
        mask = np.ones_like(ids) if attention_mask is None else to_numpy_2d(attention_mask, "attention_mask")
        count = self.active_peft_config.num_virtual_tokens
        ids = np.concatenate([np.zeros((ids.shape[0], count), ids.dtype), ids], axis=1)
        mask = np.concatenate([np.ones((mask.shape[0], count), mask.dtype), mask], axis=1)
        family = dataclasses.replace(self.family, forward=prompting.placeholder_forward(self.family.forward, count))
        with entered(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            logits = tunix_model.forward_logits(family, self.module, ids, mask, lora=self._lora_mode)
        return CausalLMOutput(logits=logits)

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not implemented for prompt-learning adapters.

        Raises:
            NotImplementedError: always: the sampler's KV cache would not hold the virtual tokens.
        """
        raise NotImplementedError("generate() with a prompt-learning adapter is not implemented: torchlike's sampler "
                                  "decodes from a KV cache that would lack the virtual tokens. Score sequences with "
                                  "model(input_ids) instead.")

    def merge_and_unload(self) -> CausalLM:
        """Refused, as in ``peft``: virtual tokens are not weights that fold into the model.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"merge_and_unload() is for LoRA adapters; a {self.active_peft_config.peft_type} adapter "
                         "adds virtual tokens, which cannot be merged into the weights. Keep the PeftModel, or save "
                         "the adapter with save_pretrained.")

    def get_prompt_embedding_to_save(self, adapter_name: str = "default") -> np.ndarray:
        """The encoder output ``[num_virtual_tokens, dim]`` float32 that :meth:`save_pretrained` writes (peft's
        method of that name)."""
        return np.ascontiguousarray(gather_to_host(getattr(self.module, prompting.ENCODER_NAME)()))

    def _adapter_tensors(self) -> list[tuple[str, np.ndarray]]:
        """The one tensor peft writes for a prompt-learning adapter: ``prompt_embeddings``, the encoder output
        ``[num_virtual_tokens, dim]`` (:meth:`get_prompt_embedding_to_save`)."""
        return [(PROMPT_EMBEDDINGS, self.get_prompt_embedding_to_save())]

    @classmethod
    def load_adapter_directory(cls, model: CausalLM, directory: Path, config: PromptLearningConfig,
                               adapter_name: str = "default", is_trainable: bool = False) -> PromptLearningModel:
        """Adds the saved prompt-learning adapter in ``directory`` to ``model`` (``PeftModel.from_pretrained`` calls
        this for a prompt-learning ``adapter_config.json``).

        Raises:
            ValueError: ``is_trainable=True`` (peft's rule: a loaded prompt-learning adapter is frozen).
            FileNotFoundError: no ``adapter_model.safetensors``.
        """
        if is_trainable:
            raise ValueError("Cannot set a prompt learning adapter to trainable when loading pretrained adapter.")
        weights = directory / ADAPTER_WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} not found: an adapter directory needs {ADAPTER_WEIGHTS_NAME}.")
        tensors = read_safetensors(weights)
        if PROMPT_EMBEDDINGS not in tensors:
            raise ValueError(f"{weights} has no '{PROMPT_EMBEDDINGS}' tensor (found {sorted(tensors)[:8]}); "
                             "a prompt-learning adapter file holds that one tensor.")
        embeddings = np.array(tensors[PROMPT_EMBEDDINGS], np.float32)
        config.inference_mode = True
        peft_model = get_prompt_learning_model(model, config, adapter_name, embeddings=embeddings)
        peft_model.is_trainable = False
        return peft_model.eval()


def get_prompt_learning_model(model: CausalLM, peft_config: PromptLearningConfig, adapter_name: str = "default", *,
                              seed: int = 0, embeddings: np.ndarray | None = None) -> PromptLearningModel:
    """Adds a prompt-learning adapter to ``model`` (``peft.get_peft_model`` with a prompt-learning config).

    The config's model fields are filled from ``model.config`` as ``peft`` fills them (``num_layers``, ``token_dim``,
    ``num_attention_heads``: for prefix tuning the key/value heads and their size, ``num_transformer_submodules=1``,
    ``encoder_hidden_size``).

    Args:
        model: a :class:`~torchlike.CausalLM` of a family prompt learning supports (Qwen2, Qwen3, Llama 3).
        peft_config: a :class:`PromptTuningConfig`, :class:`PromptEncoderConfig` or :class:`PrefixTuningConfig`.
        adapter_name: the adapter's name.
        seed: seeds the random initialisation (peft draws from torch's global generator).
        embeddings: the saved encoder output to load (with ``peft_config.inference_mode``), else ``None``.

    Returns:
        The :class:`PromptLearningModel`.

    Raises:
        ValueError: a sequence classifier, an unsupported family, a model loaded with ``quantization_config``, config
            fields that disagree with the model, or a saved tensor of the wrong shape.
    """
    if isinstance(model, SequenceClassifier):
        raise ValueError("prompt learning is implemented for causal language models; use a LoraConfig for a "
                         "sequence classifier.")
    prompting.check_family(model.family)
    if model.quantization:
        raise ValueError(f"the model was loaded with quantization_config ({model.quantization}), which torchlike "
                         "applies when LoRA is added (QLoRA); a prompt-learning adapter would train on the "
                         "full-precision base. Load the model without quantization_config, or use a LoraConfig.")
    settings = _fill_model_fields(model.config, peft_config)
    initial = embeddings
    key = jax.random.key(seed)
    mlp: list[tuple] = []
    activation = "relu"
    rows = peft_config.num_virtual_tokens
    if isinstance(peft_config, PrefixTuningConfig):
        width = peft_config.num_layers * 2 * peft_config.token_dim
        if peft_config.prefix_projection and not peft_config.inference_mode:
            activation, hidden = "tanh", peft_config.encoder_hidden_size
            first, last = jax.random.split(jax.random.fold_in(key, 1))
            mlp = [prompting.linear_init(first, peft_config.token_dim, hidden),
                   prompting.linear_init(last, hidden, width)]
            if peft_config.init_weights == "zero":
                mlp[-1] = (np.zeros_like(mlp[-1][0]), np.zeros_like(mlp[-1][1]))
            width = peft_config.token_dim
        if initial is None:
            initial = (np.zeros((rows, width), np.float32) if peft_config.init_weights == "zero" and not mlp
                       else np.asarray(jax.random.normal(key, (rows, width), jnp.float32)))
    else:
        width = peft_config.token_dim
        if initial is None:
            initial = _initial_virtual_tokens(model, peft_config, key)
        if isinstance(peft_config, PromptEncoderConfig) and not peft_config.inference_mode:
            hidden = peft_config.encoder_hidden_size
            keys = jax.random.split(jax.random.fold_in(key, 1), 3)
            mlp = [prompting.linear_init(keys[0], width, hidden), prompting.linear_init(keys[1], hidden, hidden),
                   prompting.linear_init(keys[2], hidden, width)]
    initial = np.asarray(initial, np.float32)
    if embeddings is not None and initial.shape != (rows, width):
        raise ValueError(f"'{PROMPT_EMBEDDINGS}' has shape {initial.shape}, but this {peft_config.peft_type} adapter "
                         f"on the model needs {(rows, width)} (num_virtual_tokens, token_dim"
                         f"{' * num_layers * 2' if isinstance(peft_config, PrefixTuningConfig) else ''}).")
    if model.mesh is not None:
        replicated = NamedSharding(model.mesh, PartitionSpec())
        initial = jax.device_put(initial, replicated)
        mlp = [(jax.device_put(kernel, replicated), jax.device_put(bias, replicated)) for kernel, bias in mlp]
    encoder = prompting.PromptEncoder(settings, initial, mlp, activation)
    module = prompting.with_prompt_encoder(model.module, encoder)
    return PromptLearningModel(model, module, peft_config, adapter_name=adapter_name,
                               is_trainable=not peft_config.inference_mode)


def _fill_model_fields(hf_config: PretrainedConfig, peft_config: PromptLearningConfig) -> prompting.PromptSettings:
    """Fills the config's model fields as peft's ``_prepare_prompt_learning_config`` does, refusing values that
    disagree with the model; returns the forward pass's
    :class:`~torchlike.adapters.model.prompt_learning.PromptSettings`."""
    prefix = isinstance(peft_config, PrefixTuningConfig)
    head_dim = head_dim_of(hf_config)
    heads = hf_config.num_key_value_heads if prefix else hf_config.num_attention_heads
    expected = {"num_layers": hf_config.num_hidden_layers, "num_transformer_submodules": 1,
                "token_dim": heads * head_dim if prefix else hf_config.hidden_size, "num_attention_heads": heads}
    for name, value in expected.items():
        given = getattr(peft_config, name)
        if given is not None and given != value:
            raise ValueError(f"{type(peft_config).__name__}.{name}={given} disagrees with the model, which needs "
                             f"{value}; leave it unset (None) and get_peft_model fills it in.")
        setattr(peft_config, name, value)
    if isinstance(peft_config, (PrefixTuningConfig, PromptEncoderConfig)) and peft_config.encoder_hidden_size is None:
        peft_config.encoder_hidden_size = peft_config.token_dim
    if isinstance(peft_config, PromptEncoderConfig) and peft_config.encoder_num_layers != 2:
        warnings.warn("for MLP, the argument `encoder_num_layers` is ignored. Exactly 2 MLP layers are used.",
                      stacklevel=3)
    return prompting.PromptSettings(peft_config.peft_type, peft_config.num_virtual_tokens,
                                    num_layers=hf_config.num_hidden_layers, num_key_value_heads=heads,
                                    head_dim=head_dim)


def _initial_virtual_tokens(model: CausalLM, config: PromptLearningConfig, key: jax.Array) -> np.ndarray:
    """peft's initial ``embedding``: ``N(0, 1)`` (P-tuning, ``RANDOM``), or the word embeddings of the
    ``prompt_tuning_init_text`` tokens (``TEXT``, repeated or cut to ``num_virtual_tokens``) or of random vocabulary
    tokens (``SAMPLE_VOCAB``)."""
    rows = config.num_virtual_tokens
    init = config.prompt_tuning_init if isinstance(config, PromptTuningConfig) else PromptTuningInit.RANDOM
    if init == PromptTuningInit.RANDOM:
        return np.asarray(jax.random.normal(key, (rows, config.token_dim), jnp.float32))
    if init == PromptTuningInit.SAMPLE_VOCAB:
        ids = np.asarray(jax.random.randint(key, (rows,), 0, model.config.vocab_size))
    else:
        from transformers import AutoTokenizer

        options = dict(config.tokenizer_kwargs or {})
        options.pop("trust_remote_code", None)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name_or_path, **options)
        text_ids = tokenizer(config.prompt_tuning_init_text)["input_ids"]
        ids = np.asarray((text_ids * -(-rows // len(text_ids)))[:rows])
    return np.asarray(prompting.token_embeddings(model.module, ids), np.float32)


PROMPT_LEARNING.create = get_prompt_learning_model
PROMPT_LEARNING.load = PromptLearningModel.load_adapter_directory
