"""``get_peft_model`` and ``PeftModel``: a LoRA-adapted ``CausalLM`` or ``SequenceClassifier``, saved and loaded in
PEFT's format."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..adapters.checkpoint import hf_checkpoint
from ..adapters.checkpoint.safetensors_io import read_safetensors, write_safetensors
from ..adapters.distributed.mesh import entered
from ..adapters.lora import merge as lora_merge
from ..adapters.lora import modules_to_save as saved_modules
from ..adapters.lora import peft_format
from ..adapters.lora import runtime as lora_runtime
from ..adapters.lora import targets as lora_targets
from ..adapters.model.nnx_state import flat_variables, replace_parameters
from ..adapters.model.prompt_learning import PEFT_TYPES
from ..modeling import CausalLM, InputEmbeddings
from ..sequence_classification import SequenceClassifier
from .config import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CLASSIFIER_MODULE_NAMES,
    LoraConfig,
    TaskType,
    read_adapter_config,
)
from .prompt_config import PromptLearningConfig, prompt_config_from_dict

__all__ = ["PROMPT_LEARNING", "PeftModel", "PeftModelForSequenceClassification", "get_peft_model"]


class AdapterBuilders:
    """How ``get_peft_model`` and ``PeftModel.from_pretrained`` build an adapter implemented in another module.

    Attributes:
        create: ``(model, config, adapter_name, *, seed) -> PeftModel``: a new adapter.
        load: ``(model, directory, config, adapter_name, is_trainable) -> PeftModel``: a saved adapter.
    """

    create: Callable[..., PeftModel]
    load: Callable[..., PeftModel]


PROMPT_LEARNING = AdapterBuilders()
"""The prompt-learning builders, set by :mod:`torchlike.peft.prompt_model` (which ``torchlike.peft`` imports): that
module subclasses :class:`PeftModel`, so this one cannot import it."""


class PeftModel(CausalLM):
    """A :class:`~torchlike.CausalLM` with a LoRA adapter (Qwix factors on the Tunix module).

    Behaves like ``peft.PeftModel``: forward passes include the adapter (without dropout
    outside training steps), ``save_pretrained`` writes ``adapter_config.json`` and
    ``adapter_model.safetensors`` that ``peft`` and vLLM ``--lora-modules`` load, and
    :meth:`merge_and_unload` folds the adapter into the weights.

    Attributes:
        base_model: the :class:`~torchlike.CausalLM` the adapter was added to (its arrays are shared).
        peft_config: ``{"default": LoraConfig}``.
        is_trainable: whether training updates the adapter (``False`` after
            ``from_pretrained(..., is_trainable=False)`` or ``requires_grad_(False)``).
        training: ``True`` after ``get_peft_model`` and ``from_pretrained(..., is_trainable=True)``, ``False`` after
            ``from_pretrained(..., is_trainable=False)``, as in ``peft``; :meth:`train` / :meth:`eval` set it here and
            on :attr:`base_model`.
    """

    def __init__(self, base_model: CausalLM, module, peft_config: LoraConfig, adapter_name: str = "default",
                 is_trainable: bool = True):
        super().__init__(module, base_model.config, base_model.family, base_model.generation_config,
                         base_model.mesh, base_model.name_or_path, kept_weights=base_model.kept_weights)
        self.base_model = base_model
        self.peft_config = {adapter_name: peft_config}
        self.active_adapter = adapter_name
        self.is_trainable = is_trainable
        self.training = True  # peft's PeftModel is a fresh torch module, in training mode
        self._gradient_checkpointing = base_model.is_gradient_checkpointing

    @property
    def active_peft_config(self) -> LoraConfig:
        return self.peft_config[self.active_adapter]

    def get_base_model(self) -> CausalLM:
        """The model without the adapter (shares the base arrays)."""
        return self.base_model

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Within the block, forward passes use the base weights only (as ``peft``'s context manager)."""
        previous, self._lora_mode = self._lora_mode, lora_runtime.DISABLED
        try:
            yield
        finally:
            self._lora_mode = previous

    @property
    def modules_to_save(self) -> list[str]:
        """The top-level modules trained in full beside the adapter and saved in it (``["score"]`` for a
        ``SEQ_CLS`` classifier): the entries of ``modules_to_save`` this model has."""
        return saved_modules.present_modules(self.module, self.active_peft_config.modules_to_save or ())

    @property
    def trainable_filter(self):
        """The NNX filter of the parameters training updates: ``nnx.LoRAParam``, or with :attr:`modules_to_save`
        the LoRA factors and those modules' parameters (pass it as ``nnx.Optimizer(..., wrt=)`` and to
        ``nnx.DiffState``)."""
        return saved_modules.trainable_filter(self.modules_to_save)

    def train(self, mode: bool = True) -> PeftModel:
        """Sets :attr:`training` here and on :attr:`base_model`, as ``peft.PeftModel.train``.

        Returns:
            The model itself.
        """
        super().train(mode)
        self.base_model.train(mode)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> PeftModel:
        """``requires_grad_(False)`` freezes the adapter (:attr:`is_trainable` ``False``: nothing is trainable), as
        ``torch.nn.Module.requires_grad_`` freezes a ``peft`` model.

        ``requires_grad_(True)`` is refused: on a ``peft`` model it makes the base weights trainable too, and
        torchlike trains an adapter's factors (and :attr:`modules_to_save`) only.

        Returns:
            The model itself.

        Raises:
            ValueError: ``requires_grad=True``, naming the alternatives.
        """
        if requires_grad:
            raise ValueError("PeftModel.requires_grad_(True) would make the base weights trainable too, but torchlike "
                             "trains only the adapter (and modules_to_save). To train the adapter, create it with "
                             "get_peft_model or PeftModel.from_pretrained(..., is_trainable=True); to train every "
                             "weight, train the base model (or merge_and_unload() first).")
        self.is_trainable = False
        return self

    @property
    def requires_grad(self) -> bool:
        """Whether the adapter is trainable (:attr:`is_trainable`)."""
        return self.is_trainable

    def _modules_sharing_parameters(self) -> list:
        return [self.module, self.base_model.module]

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True, *, seed: int = 0) -> InputEmbeddings:
        """Refused: the adapter was built on the base model's vocabulary. Resize the base model first (TRL's scripts
        do so before the trainer adds the adapter), then call ``get_peft_model``.

        Raises:
            ValueError: always, unless nothing would change (``new_num_tokens`` and ``pad_to_multiple_of`` both
                ``None``: the input embeddings are returned, as in ``transformers``).
        """
        if new_num_tokens is None and pad_to_multiple_of is None:
            return self.get_input_embeddings()
        raise ValueError("resize_token_embeddings on a PeftModel is not supported: the adapter was added to the "
                         "model with its old vocabulary. Call base_model.resize_token_embeddings(...) before "
                         "get_peft_model(...) (or merge_and_unload() first, then resize).")

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable parameters, all parameters)``: the adapter and :attr:`modules_to_save` are trainable."""
        total = sum(int(np.prod(array.shape)) for _, array in self.named_parameters())
        if not self.is_trainable:
            return 0, total
        trainable = flat_variables(self.module, self.trainable_filter).values()
        return sum(int(np.prod(variable.get_value().shape)) for variable in trainable), total

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        if only_trainable:
            return self.get_nb_trainable_parameters()[0]
        return super().num_parameters(exclude_embeddings=exclude_embeddings)

    def print_trainable_parameters(self) -> None:
        """Prints ``trainable params: N || all params: M || trainable%: P`` as ``peft`` does."""
        trainable, total = self.get_nb_trainable_parameters()
        percent = 100 * trainable / total
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {percent:.4f}")

    def merge_and_unload(self) -> CausalLM:
        """The base model's class (a plain :class:`~torchlike.CausalLM` or
        :class:`~torchlike.SequenceClassifier`) with weights ``W + scale * B @ A`` and the trained
        :attr:`modules_to_save`.

        The delta is computed in float32 and cast once to the weight dtype; the result keeps
        the weights' sharding and shares every untouched array with the base model.
        """
        merged = lora_merge.merged_weights(self.family, self.module, self.active_peft_config.scale)
        merged.update(saved_modules.current_values(self.module, self.modules_to_save))
        module = replace_parameters(self.base_model.module, merged)
        return type(self.base_model)(module, self.config, self.family, self.generation_config, self.mesh,
                                     self.name_or_path, kept_weights=self.kept_weights)

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """The merged model's weights in Hugging Face names (:meth:`merge_and_unload` then
        :meth:`CausalLM.hf_tensors`): what an engine that loads a plain checkpoint, such as vLLM, takes."""
        return self.merge_and_unload().hf_tensors()

    def save_pretrained(self, save_directory: str | os.PathLike, safe_serialization: bool = True,
                        is_main_process: bool = True, **kwargs: Any) -> None:
        """Writes the adapter in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors``
        with keys ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)``,
        plus the :attr:`modules_to_save` under their Hugging Face names (``base_model.model.score.weight``); a
        prompt-learning adapter writes its ``prompt_embeddings`` instead (``_adapter_tensors``).

        The files (and a tokenizer's, given as ``tokenizer=``) are written into a staging folder that
        replaces ``save_directory`` by renames, as :meth:`CausalLM.save_pretrained` does: a crash
        leaves the old adapter or the new one, and other files in the directory are kept.

        Args:
            save_directory: output directory (created if missing).
            safe_serialization: must be ``True`` (safetensors only).
            is_main_process: ``False`` writes nothing (transformers' meaning). With several JAX processes every
                process must call this (each takes part in gathering the factors) and process 0 writes.
        """
        if not safe_serialization:
            raise ValueError("safe_serialization=False is not supported: adapters are written as safetensors.")
        unknown = sorted(set(kwargs) - {"selected_adapters", "save_embedding_layers", "tokenizer"})
        if unknown:
            raise TypeError(f"PeftModel.save_pretrained got unexpected arguments {unknown}.")
        hf_checkpoint.check_output_dir(save_directory)
        if not is_main_process and jax.process_count() == 1:
            return
        config = self.active_peft_config
        if config.base_model_name_or_path is None and self.name_or_path:
            config.base_model_name_or_path = self.name_or_path
        tensors = self._adapter_tensors()

        def fill(folder: Path) -> None:
            write_safetensors(folder / ADAPTER_WEIGHTS_NAME, [(k, v.dtype, v.shape) for k, v in tensors],
                              iter(tensors), {"format": "pt"})
            config.save_pretrained(folder)
            if kwargs.get("tokenizer") is not None:
                kwargs["tokenizer"].save_pretrained(folder)

        hf_checkpoint.write_directory(save_directory, fill, weights="adapter")

    def _adapter_tensors(self) -> list[tuple[str, np.ndarray]]:
        """``(name, array)`` of each tensor :meth:`save_pretrained` writes to ``adapter_model.safetensors``: the LoRA
        factors and the :attr:`modules_to_save`."""
        tensors = list(peft_format.peft_state(self.family, self.module))
        return tensors + list(saved_modules.module_tensors(self.family, self.module, self.modules_to_save))

    @classmethod
    def from_pretrained(cls, model: CausalLM, model_id: str | os.PathLike, adapter_name: str = "default",
                        is_trainable: bool = False, config: LoraConfig | None = None, **kwargs: Any) -> PeftModel:
        """Adds a saved adapter (PEFT's or torchlike's ``adapter_config.json`` + ``adapter_model.safetensors``)
        to ``model``: LoRA, or a prompt-learning adapter (prompt tuning, P-tuning, prefix tuning), which loads
        frozen as in ``peft`` (:class:`~torchlike.peft.prompt_model.PromptLearningModel`).

        Args:
            model: the base :class:`~torchlike.CausalLM` (a :class:`~torchlike.SequenceClassifier` for a
                ``SEQ_CLS`` adapter, whose saved ``score`` head replaces the model's).
            model_id: adapter directory or hub id.
            is_trainable: ``False`` (default, as in ``peft``) marks the adapter frozen.
            config: overrides the saved ``adapter_config.json``.

        Returns:
            The :class:`PeftModel`.

        Raises:
            ValueError: ``is_trainable=True`` for a prompt-learning adapter (peft's rule).
        """
        from ..adapters.checkpoint.hf_hub import resolve_model_dir
        hf_checkpoint.finish_interrupted_save(model_id)
        directory = resolve_model_dir(model_id, revision=kwargs.get("revision"), token=kwargs.get("token"))
        saved = read_adapter_config(directory)
        if isinstance(config, PromptLearningConfig) or (config is None and saved.get("peft_type") in PEFT_TYPES):
            config = config or prompt_config_from_dict(saved, str(directory / ADAPTER_CONFIG_NAME))
            return PROMPT_LEARNING.load(model, directory, config, adapter_name, is_trainable)
        config = config or LoraConfig.from_pretrained(directory)
        config.inference_mode = not is_trainable
        peft_model = get_peft_model(model, config, adapter_name=adapter_name)
        peft_model.is_trainable = is_trainable
        if not is_trainable:
            peft_model.eval()  # peft's from_pretrained does the same
        weights = directory / ADAPTER_WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} not found: an adapter directory needs {ADAPTER_WEIGHTS_NAME}.")
        tensors = read_safetensors(weights)
        for key in saved_modules.load_module_tensors(model.family, peft_model.module, peft_model.modules_to_save,
                                                     tensors, str(weights)):
            del tensors[key]
        unused = peft_format.load_peft_state(model.family, peft_model.module, tensors, str(weights))
        if unused:
            warnings.warn(f"{weights}: entries not used by the adapter: {unused[:8]}", stacklevel=2)
        return peft_model


class PeftModelForSequenceClassification(PeftModel, SequenceClassifier):
    """A :class:`~torchlike.SequenceClassifier` with a LoRA adapter (``peft.PeftModelForSequenceClassification``):
    forward passes return the pooled scores, the ``score`` head is trained in full beside the adapter
    (``modules_to_save``) and saved in it as ``base_model.model.score.weight``."""


def get_peft_model(model: CausalLM, peft_config: LoraConfig, adapter_name: str = "default", *, seed: int = 0,
                   **kwargs: Any) -> PeftModel:
    """Adds a fresh LoRA adapter to ``model`` (``peft.get_peft_model``); a prompt-learning config
    (``PromptTuningConfig``, ``PromptEncoderConfig``, ``PrefixTuningConfig``) adds that adapter instead
    (:func:`~torchlike.peft.prompt_model.get_prompt_learning_model`).

    ``target_modules`` are translated through the family table to the Tunix module paths;
    ``None`` becomes the family's default (PEFT's per-``model_type`` table, ``["q_proj", "v_proj"]``
    for the supported families) and is written back to ``peft_config``, as ``peft`` does.
    With ``task_type="SEQ_CLS"`` (a :class:`~torchlike.SequenceClassifier`), ``"classifier"`` and ``"score"`` are
    added to ``modules_to_save``, as ``peft`` does: the ``score`` head is then trained in full and saved with the
    adapter (:attr:`PeftModel.trainable_filter` selects it with the LoRA factors).
    With ``peft_config.quantize_base`` (or a model loaded with ``quantization_config``), the
    adapted modules' base weights are quantised by Qwix (QLoRA).

    Args:
        model: a :class:`~torchlike.CausalLM` or :class:`~torchlike.SequenceClassifier`.
        peft_config: a :class:`LoraConfig` (or a prompt-learning config).
        adapter_name: the adapter's name (one adapter per model).
        seed: torchlike only. Seeds the random initialisation of the LoRA ``A`` factors (``B`` starts at zero);
            PEFT draws them from torch's global generator, which ``transformers.set_seed`` seeds. The trainers pass
            ``args.seed`` when they create the adapter from ``peft_config``, as TRL seeds before creating it.

    Returns:
        A :class:`PeftModel` (:class:`PeftModelForSequenceClassification` for a classifier) whose outputs equal
        ``model``'s until the adapter is trained.

    Raises:
        ValueError: ``SEQ_CLS`` on a model without a ``score`` head, or ``modules_to_save`` naming ``score`` there.
    """
    if isinstance(model, PeftModel):
        raise ValueError("the model already has a LoRA adapter; call merge_and_unload() first or use the base model.")
    unsupported = sorted(k for k, v in kwargs.items() if v not in (None, False, True))
    if unsupported:
        raise TypeError(f"get_peft_model got unsupported arguments {unsupported}.")
    if isinstance(peft_config, PromptLearningConfig):
        return PROMPT_LEARNING.create(model, peft_config, adapter_name, seed=seed)
    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"peft_config must be a torchlike.peft LoraConfig, PromptTuningConfig, PromptEncoderConfig or "
                        f"PrefixTuningConfig, got {type(peft_config).__name__}.")
    _add_classifier_modules(model, peft_config)
    if peft_config.target_modules is None:
        peft_config.target_modules = lora_targets.default_target_modules(model.family)
    targets = lora_targets.select_targets(model.family, model.module, peft_config.target_modules)
    peft_config.check_patterns([name for target in targets for name in target.hf_modules])
    _name_fused_partners(model.family.name, targets, peft_config)
    quantization = peft_config.quantize_base or getattr(model, "quantization", None)
    plain: list[lora_targets.LoraTarget] = []
    if quantization:
        peft_config.quantize_base = quantization
        excluded = set(model.family.quantization_excluded)
        plain = [t for t in targets if any(m.rsplit(".", 1)[-1] in excluded for m in t.hf_modules)]
        targets = [t for t in targets if t not in plain]
        if plain:
            warnings.warn(
                f"QLoRA: the {model.family.name} attention projections keep full-precision base weights "
                f"({sorted({m.rsplit('.', 1)[-1] for t in plain for m in t.hf_modules})}): the Tunix attention "
                "einsum of this family cannot take Qwix's quantised weights. Their LoRA adapters are applied as usual.",
                stacklevel=2,
            )
    context = entered(model.mesh) if model.mesh is not None else contextlib.nullcontext()
    with context:
        module = lora_runtime.apply_lora(model.module, targets, rank=peft_config.r, scale=peft_config.scale,
                                         dropout=float(peft_config.lora_dropout), weight_qtype=quantization,
                                         tile_size=peft_config.quantization_tile_size, seed=seed,
                                         unquantized_targets=plain)
    peft_class = PeftModelForSequenceClassification if isinstance(model, SequenceClassifier) else PeftModel
    return peft_class(model, module, peft_config, adapter_name=adapter_name,
                      is_trainable=not peft_config.inference_mode)


def _add_classifier_modules(model: CausalLM, peft_config: LoraConfig) -> None:
    """PEFT's ``SEQ_CLS`` rule: ``"classifier"`` and ``"score"`` join ``modules_to_save``; and a check that a
    ``score`` named there exists."""
    classifier = isinstance(model, SequenceClassifier)
    if peft_config.task_type == TaskType.SEQ_CLS:
        if not classifier:
            raise ValueError("LoraConfig(task_type='SEQ_CLS') needs a sequence classifier; load the model with "
                             "AutoModelForSequenceClassification.from_pretrained, or use task_type='CAUSAL_LM'.")
        names = list(peft_config.modules_to_save or [])
        peft_config.modules_to_save = names + [name for name in CLASSIFIER_MODULE_NAMES if name not in names]
    if "score" in (peft_config.modules_to_save or ()) and not classifier:
        raise ValueError(f"modules_to_save={peft_config.modules_to_save} names 'score', which this "
                         f"{type(model).__name__} does not have (only sequence classifiers have a score head).")
    if classifier and peft_config.target_modules == "all-linear" and peft_config.task_type != TaskType.SEQ_CLS:
        raise ValueError("LoraConfig(target_modules='all-linear') on a sequence classifier without "
                         "task_type='SEQ_CLS': peft then adapts the classifier head `score` with LoRA as well, and "
                         "torchlike cannot put LoRA on that head. Pass task_type='SEQ_CLS' (the head is then trained "
                         "in full beside the adapter, as TRL recommends for reward models), or list the decoder "
                         "modules in target_modules.")


def _name_fused_partners(family_name: str, targets: list[lora_targets.LoraTarget], peft_config: LoraConfig) -> None:
    """Adds to a list of ``target_modules`` the modules adapted only because the Tunix model fuses them
    with a named one, so ``adapter_config.json`` names every module whose factors the adapter holds
    (``peft`` would otherwise skip them on load); a regex is kept and only warned about."""
    partners = lora_targets.unnamed_fused_modules(targets, peft_config.target_modules)
    if not partners:
        return
    if isinstance(peft_config.target_modules, str):
        warnings.warn(f"{family_name}: target_modules={peft_config.target_modules!r} also adapts {partners}, which "
                      "the Tunix model fuses with a targeted module (one LoRA pair serves both); peft skips their "
                      "factors when it loads the exported adapter unless the regex matches them too.", stacklevel=3)
        return
    peft_config.target_modules = sorted({*peft_config.target_modules, *partners})
    warnings.warn(f"{family_name}: adapting {partners} too: the Tunix model fuses them with a targeted module, so "
                  f"one LoRA pair serves both; target_modules is now {peft_config.target_modules}.", stacklevel=3)
