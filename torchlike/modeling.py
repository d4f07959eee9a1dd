"""``AutoModelForCausalLM`` and ``CausalLM``: Hugging Face checkpoints in and out of Tunix NNX models."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .adapters.checkpoint import hf_checkpoint, hf_hub
from .adapters.checkpoint.hf_source import HFSource, open_hf_source
from .adapters.distributed.mesh import entered, initialize_distributed, make_mesh
from .adapters.families import Family, all_families, family_for_config
from .adapters.model import model_habits, nnx_state, tunix_model
from .adapters.runtime.compilation import enable_compilation_cache
from .arrays import to_numpy, to_numpy_2d
from .dtypes import DTypeLike, dtype_name, resolve_dtype
from .module_tree import module_tree_lines
from .quantization import announce_quantization, requested_quantization

if TYPE_CHECKING:
    import torch
    from flax import nnx
    from jax.sharding import Mesh
    from numpy.typing import ArrayLike
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["AutoModelForCausalLM", "CausalLM", "CausalLMOutput", "InputEmbeddings", "OutputEmbeddings", "make_mesh"]


@dataclass
class CausalLMOutput:
    """Output of :class:`CausalLM` forward passes (the ``transformers`` field names).

    Args:
        logits: float32 ``jax.Array`` of shape ``(batch, sequence, vocab)``.
        loss: unused at inference; kept for the familiar layout.
    """

    logits: jax.Array
    loss: jax.Array | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class InputEmbeddings:
    """What :meth:`CausalLM.get_input_embeddings` returns: ``torch.nn.Embedding``'s attributes over the model's input
    embedding, read live (so it follows :meth:`CausalLM.resize_token_embeddings`).

    ``weight`` is a ``jax.Array`` and cannot be written in place; load new rows with
    ``model.load_state_dict({"model.embed_tokens.weight": rows}, strict=False)``.
    """

    def __init__(self, model: CausalLM):
        self._model = model

    @property
    def weight(self) -> jax.Array:
        """The embedding matrix ``(num_embeddings, embedding_dim)``, the model's own array."""
        model = self._model
        return model_habits.hf_weight(model.family, model.module, model_habits.INPUT_EMBEDDING)

    @property
    def num_embeddings(self) -> int:
        return int(self.weight.shape[0])

    @property
    def embedding_dim(self) -> int:
        return int(self.weight.shape[1])

    @property
    def padding_idx(self) -> int | None:
        """``config.pad_token_id`` while it is a row of the table, as the ``transformers`` families set it."""
        pad = getattr(self._model.config.get_text_config(), "pad_token_id", None)
        return pad if pad is not None and pad < self.num_embeddings else None

    def __repr__(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}{padding})"


class OutputEmbeddings:
    """What :meth:`CausalLM.get_output_embeddings` returns: ``torch.nn.Linear``'s attributes over the output head,
    read live. With tied embeddings ``weight`` is the input embedding's array, as in ``transformers``."""

    bias = None

    def __init__(self, model: CausalLM):
        self._model = model

    @property
    def weight(self) -> jax.Array:
        """The head matrix ``(out_features, in_features)`` (``transformers``' ``lm_head.weight`` layout)."""
        model = self._model
        head = model_habits.hf_weight(model.family, model.module, model_habits.OUTPUT_EMBEDDING)
        return model.get_input_embeddings().weight if head is None else head

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __repr__(self) -> str:
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, bias=False)"


class CausalLM:
    """A causal language model backed by a Tunix NNX module, used like a ``transformers`` model.

    Create one with :meth:`AutoModelForCausalLM.from_pretrained`. Parameters are
    ``jax.Array``s (sharded over ``mesh`` when one was given); nothing is copied behind
    your back.

    Attributes:
        module: the Tunix ``flax.nnx.Module``.
        config: the ``transformers`` config (``PretrainedConfig``).
        training: ``False`` after loading, as in ``transformers``; set by :meth:`train` / :meth:`eval`.
        generation_config: ``transformers.GenerationConfig`` (from ``generation_config.json``).
        family: the adapter family table (``qwen2``, ``qwen3``, ``llama3``, ``gemma2``, ``gemma3``).
        mesh: the ``jax.sharding.Mesh`` the parameters live on, or ``None``.
        kept_weights: the checkpoint tensors the Tunix model has no place for but the checkpoint's class has (Gemma
            4's vision and audio towers), by HF name, as they were read; written back unchanged by
            :meth:`save_pretrained`.
    """

    def __init__(self, module, config, family: Family, generation_config=None, mesh=None, name_or_path: str = "",
                 kept_weights: dict[str, np.ndarray] | None = None):
        self.module = module
        self.kept_weights = dict(kept_weights or {})
        self.config = config
        self.family = family
        self.mesh = mesh
        self.name_or_path = name_or_path
        self._lora_mode = "eval"
        self.quantization: str | None = None
        self.model_tags: list[str] | None = None
        self.training = False  # transformers' from_pretrained returns a model in eval mode
        self._requires_grad = True
        self._gradient_checkpointing = False
        self._embedding_views: dict[str, InputEmbeddings | OutputEmbeddings] = {}
        if generation_config is None:
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_model_config(config)
        self.generation_config = generation_config

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 pixel_values: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, **vision: Any) -> CausalLMOutput:
        """Runs the model.

        Args:
            input_ids: token ids ``(batch, sequence)`` as a list, numpy, jax or torch array.
            attention_mask: 1 for real tokens, 0 for padding (left or right); default all ones.
                Positions count real tokens only, as ``transformers.generate`` does.
            pixel_values: the processor's images, every image of the batch in the order of their image tokens (a
                model with a vision tower: Gemma 3's ``(num_images, channels, height, width)``, Qwen-VL's patches
                ``(num_patches, channels * temporal_patch_size * patch_size ** 2)``).
            token_type_ids: the processor's ``(batch, sequence)`` ids, 1 on image tokens: each image's tokens then
                attend to each other both ways, as in Gemma 3's ``transformers`` model.
            vision: the processor's other vision outputs the model reads (``Family.image_keys``; Qwen-VL:
                ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``; LLaVA-NeXT
                and Mistral 3: ``image_sizes``; SmolVLM and Idefics3: ``pixel_attention_mask``);
                ``mm_token_type_ids`` is accepted: where the model attends over each image both ways from it (Gemma
                4 with ``use_bidirectional_attention="vision"``) it acts as ``token_type_ids``, else the image and video
                tokens say where each item goes. Another keyword is refused by name (``TypeError``).

        Returns:
            :class:`CausalLMOutput` with float32 ``logits`` of shape ``(batch, sequence, vocab)``.

        Raises:
            ValueError: images for a model without a vision tower, or image tokens that do not match the images.
        """
        ids = to_numpy_2d(input_ids, "input_ids")
        mask = np.ones_like(ids) if attention_mask is None else to_numpy_2d(attention_mask, "attention_mask")
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids shape {ids.shape}.")
        images = self.image_inputs(ids, pixel_values, **vision)
        types = None if token_type_ids is None else to_numpy_2d(token_type_ids, "token_type_ids")
        if types is None and self._mm_types_attend_both_ways(vision):
            types = np.isin(to_numpy_2d(vision["mm_token_type_ids"], "mm_token_type_ids"), (1, 2)).astype(np.int32)
        with entered(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            logits = tunix_model.forward_logits(self.family, self.module, ids, mask, lora=self._lora_mode,
                                                images=images, token_type_ids=types)
        return CausalLMOutput(logits=logits)

    def _mm_types_attend_both_ways(self, vision: dict[str, Any]) -> bool:
        """Whether ``vision``'s ``mm_token_type_ids`` make each image's tokens attend both ways in this model
        (``Family.mm_types_attend_both_ways``)."""
        rule = self.family.mm_types_attend_both_ways
        return vision.get("mm_token_type_ids") is not None and rule is not None and rule(self.config)

    def image_inputs(self, input_ids: np.ndarray, pixel_values: ArrayLike | None = None,
                     **vision: Any) -> np.ndarray | dict[str, np.ndarray] | None:
        """The processor's images (and videos) as the module takes them (``Family.images``).

        Args:
            input_ids: ``(batch, sequence)`` token ids whose image tokens the images fill.
            pixel_values: the processor's images, every image of the batch in token order (see :meth:`__call__`).
            vision: the processor's other vision outputs (see :meth:`__call__`).

        Returns:
            Gemma 3: float32 ``[B, N, H, W, C]`` (zero images after a row's own); Qwen-VL: a dict of per-row arrays
            (:func:`torchlike.adapters.model.qwen_vision.vision_inputs`); ``None`` when no image or video is given.

        Raises:
            ValueError: this model has no vision tower (why, and what to load instead), takes no videos, or cannot
                take an input its checkpoint's class reads (``Family.refused_inputs``: Gemma 4's audio), with why.
            TypeError: an input the model does not read, naming it.
        """
        vision = {key: value for key, value in vision.items() if value is not None and value is not False}
        vision.pop("mm_token_type_ids", None)
        unknown = sorted(set(vision) - set(self.family.image_keys))
        refused = [key for key in unknown if key in self.family.refused_inputs]
        if refused:
            raise ValueError(f"{refused} were given but this {self.family.name} model cannot take them: "
                             f"{self.family.refused_inputs[refused[0]]}.")
        if unknown:
            videos = [key for key in unknown if "video" in key]
            if videos and self.family.images is not None:
                raise ValueError(f"{videos} were given but this {self.family.name} model takes no videos; pass "
                                 "images (pixel_values) or text.")
            raise TypeError(f"CausalLM.__call__ does not support {unknown}; pass input_ids and attention_mask (and "
                            f"pixel_values{''.join(', ' + key for key in self.family.image_keys)} for this "
                            "vision-language model)." if self.family.images is not None else
                            f"CausalLM.__call__ does not support {unknown}; pass input_ids and attention_mask.")
        if pixel_values is None and not any("pixel" in key for key in vision):
            return None
        if self.family.images is None:
            reason = self.family.no_images_reason or (
                f"this {self.family.name} model is a text-only decoder with no vision tower; load a vision-language "
                "checkpoint (e.g. Gemma3ForConditionalGeneration) with torchlike.AutoModelForImageTextToText")
            raise ValueError(f"pixel_values were given but the model cannot take images: {reason}. Pass text only "
                             "(input_ids and attention_mask).")
        pixels = None if pixel_values is None else to_numpy(pixel_values, "pixel_values", ndim=None)
        arrays = {key: to_numpy(value, key, ndim=None, dtype=np.int64 if key.endswith("grid_thw") else np.float32)
                  for key, value in vision.items()}
        return self.family.images(self.config, input_ids, pixels, **arrays)

    forward = __call__

    def generate(
        self,
        inputs: ArrayLike | str | list[str] | None = None,
        attention_mask: ArrayLike | None = None,
        *,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        generation_config: GenerationConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        input_ids: ArrayLike | None = None,
        prompts: ArrayLike | str | list[str] | None = None,
        output_logprobs: bool = False,
        rollout_engine: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Generates continuations with a KV cache, with ``transformers.generate``'s meaning for every knob.

        Unset arguments (``None``) come from ``generation_config``, then from ``self.generation_config``,
        then from ``transformers``' defaults (greedy, 20 new tokens, ``top_k=50`` when sampling).
        Logits go through the repetition penalty, then (sampling only) temperature, top-k, top-p and
        min-p, in ``transformers``' order; greedy is the argmax after the penalty. Rows stop at an
        end token and are padded after it. With ``rollout_engine="static"`` one compiled program serves every
        call whose batch size, prompt-length bucket and new-token bucket (powers of two from 16) and sampling
        switches (``torchlike.adapters.rollout.sampling.SamplingSwitches``: which processors run) match (see
        ``torchlike.generation.TRACE_COUNTS``); the paged engine compiles a prefill per prompt-length bucket and a
        decode per bucket of live rows and columns.

        Args:
            inputs: token ids ``(batch, prompt)`` (list, numpy, jax or torch), left- or right-padded,
                or a string / list of strings when a tokenizer is given. ``input_ids``/``prompts`` are aliases.
            attention_mask: 1 for tokens, 0 for padding; inferred from ``pad_token_id`` when omitted.
            max_new_tokens: the most tokens to add (``max_length`` is also accepted, as total length).
            do_sample: sample (``True``) or decode greedily (``False``).
            temperature: divides the scores when sampling (``> 0``).
            top_p: nucleus sampling threshold in ``(0, 1]``.
            top_k: keep the ``k`` best tokens when sampling; ``0`` disables.
            min_p: drop tokens below ``min_p`` times the best token's probability.
            repetition_penalty: ``transformers``' ``RepetitionPenaltyLogitsProcessor`` over the prompt
                (padding included) and the tokens generated so far; ``1.0`` is off.
            eos_token_id: an id or list of ids that end a row (``[]``: none, run to ``max_new_tokens``).
            pad_token_id: written after a row ended (default: the first end token).
            seed: sampling seed; ``None`` draws a fresh one per call, so two calls differ. Output row ``i`` draws
                from its own stream ``(seed, i)`` (``torchlike.adapters.rollout.sampling.stream_keys``).
            pixel_values, token_type_ids: a vision-language model's images and token types, as its processor
                returns them (see :meth:`__call__`); the prefill puts the images in place of their tokens. The
                processor's other vision outputs the model reads go in ``kwargs`` too (Qwen-VL's
                ``image_grid_thw``..., LLaVA-NeXT's and Mistral 3's ``image_sizes``, SmolVLM's
                ``pixel_attention_mask``).
            generation_config: a ``transformers.GenerationConfig`` for this call.
            tokenizer: tokenizes text prompts (``processing_class`` is an alias).
            output_logprobs: with ``return_dict_in_generate=True``, also return each new token's
                log-prob under ``log_softmax(logits / temperature)`` (what GRPO needs).
            rollout_engine: torchlike only; the engine that decodes (``GRPOConfig.rollout_engine``'s values):
                ``"static"``, one left-padded batch in one program; ``"paged"``, the paged engine (KV pages freed as
                rows end, each prompt prefilled once for its ``num_return_sequences`` rows). Same tokens. ``None``
                (the default): the backend's fastest (``torchlike.adapters.rollout.default_engine``: ``"paged"`` on
                the CPU, ``"static"`` on a GPU or TPU).
            kwargs: ``max_length``, ``num_return_sequences``, ``return_dict_in_generate``, ``num_beams``
                (1 only), ``use_cache`` (``True`` only).

        Returns:
            The prompt (left-padded) followed by the new tokens, ``(batch * num_return_sequences,
            prompt + new)`` int64: a ``torch.Tensor`` when ``inputs`` was one, else a numpy array.
            With ``return_dict_in_generate=True``, a
            :class:`~torchlike.generation.GenerateDecoderOnlyOutput` (``sequences``, ``logprobs``).

        Example:
            >>> batch = tokenizer(["Hi", "Tell me a story"], return_tensors="np", padding=True, padding_side="left")
            >>> out = model.generate(**batch, max_new_tokens=32, do_sample=True, temperature=0.7, top_p=0.9)
            >>> tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        """
        from .generation import generate

        given = [value for value in (inputs, input_ids, prompts) if value is not None]
        if len(given) > 1:
            raise ValueError("pass the prompts once: as inputs, input_ids or prompts.")
        if tokenizer is not None and processing_class is not None:
            raise ValueError("pass either tokenizer or processing_class, not both.")
        return generate(
            self, given[0] if given else None, attention_mask, generation_config=generation_config,
            tokenizer=tokenizer if tokenizer is not None else processing_class, seed=seed,
            output_logprobs=output_logprobs, rollout_engine=rollout_engine, max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs,
        )

    @property
    def dtype(self) -> np.dtype:
        """The parameters' dtype (``numpy.dtype``; bfloat16 via ``ml_dtypes``)."""
        _, first = next(self.named_parameters())
        return np.dtype(first.dtype)

    @property
    def device(self):
        """``torch.device("cpu")``: where torch inputs for this model belong, so ``inputs.to(model.device)`` works as in
        ``transformers``. The model copies its inputs to its own devices; the parameters' placement is
        ``next(model.parameters()).sharding`` (over ``model.mesh`` when one was given)."""
        import torch

        return torch.device("cpu")

    def named_parameters(self) -> Iterator[tuple[str, jax.Array]]:
        """Yields ``(dotted NNX path, jax.Array)`` for every parameter, as ``torch`` does."""
        for name, variable in nnx_state.flat_variables(self.module).items():
            yield name, variable.get_value()

    def get_parameter(self, target: str) -> jax.Array:
        """The parameter named ``target``, as ``torch.nn.Module.get_parameter``.

        Args:
            target: a dotted path as :meth:`named_parameters` and :meth:`state_dict` name it
                (``"layers.0.attn.q_proj.w"``).

        Raises:
            AttributeError: no such parameter; the message lists the closest names.
        """
        variables = nnx_state.flat_variables(self.module)
        if target not in variables:
            close = difflib.get_close_matches(target, list(variables), n=3, cutoff=0.5)
            raise AttributeError(f"{type(self).__name__} has no parameter {target!r}"
                                 f"{f'; did you mean {close}' if close else ''}? Names are those of "
                                 "named_parameters() (Tunix module paths, not Hugging Face weight names).")
        return variables[target].get_value()

    def get_submodule(self, target: str) -> nnx.Module:
        """The NNX submodule at the dotted path ``target`` (``""`` is the whole Tunix module), as
        ``torch.nn.Module.get_submodule``.

        Raises:
            AttributeError: no such submodule; the message lists the closest paths.
        """
        modules = nnx_state.modules_by_path(self.module)
        if target not in modules:
            close = difflib.get_close_matches(target, [path for path in modules if path], n=3, cutoff=0.5)
            raise AttributeError(f"{type(self).__name__} has no submodule {target!r}"
                                 f"{f'; did you mean {close}' if close else ''}?")
        return modules[target]

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Adds ``tags`` to ``model_tags`` (each once, in order), as ``transformers.PreTrainedModel`` does; TRL's
        trainers tag the models they train."""
        self.model_tags = list(self.model_tags or [])
        for tag in [tags] if isinstance(tags, str) else tags:
            if tag not in self.model_tags:
                self.model_tags.append(tag)

    def parameters(self) -> Iterator[jax.Array]:
        """Yields every parameter array."""
        for _, array in self.named_parameters():
            yield array

    def state_dict(self):
        """The parameters as a flat dict: ``{"layers.0.attn.q_proj.w": jax.Array, ...}``.

        Keys are the NNX module paths joined by dots, every part a string; arrays are the
        model's own (native layout, no copies). LoRA factors appear as ``..._lora_a``/``_lora_b``.
        The dict's ``metadata`` (family, dtype, LoRA rank/alpha) is stored by :func:`torchlike.save`.

        Returns:
            :class:`torchlike.state_dict.StateDict` (a ``dict``).
        """
        from .state_dict import state_dict

        return state_dict(self)

    def load_state_dict(
        self,
        state_dict: Mapping[str, ArrayLike | Mapping],
        strict: bool = True,
        assign: bool = False,
        key_map: dict[str, str] | None = None,
        merge_lora: bool = False,
        ignore_mismatched_sizes: bool = False,
    ):
        """Copies parameters from ``state_dict`` into this model, as ``torch.nn.Module.load_state_dict``.

        The surgery is automatic: LoRA keys the checkpoint lacks are reported missing; LoRA keys the
        model lacks are reported unexpected (or folded into the weights with ``merge_lora=True``);
        int key parts, nested dicts and ``model.``/``base_model.model.`` prefixes are normalised;
        Hugging Face names (a ``transformers`` torch ``state_dict()`` or a safetensors dict) are
        translated through the family table; values are cast to the model's dtype and placed in
        its sharding. A lazy :func:`torchlike.load` checkpoint restores only the keys used.

        Args:
            state_dict: a mapping of names to arrays (jax, numpy or torch) or :func:`torchlike.load`'s result.
            strict: raise ``RuntimeError`` (torch's message layout) on missing or unexpected keys.
            assign: keep the checkpoint's dtype instead of casting to the model's.
            key_map: ``{regex: replacement}`` renames applied to checkpoint keys first.
            merge_lora: fold LoRA factors the model lacks into their base weights, with the scale
                stored in the checkpoint's metadata.
            ignore_mismatched_sizes: skip shape mismatches (listed in ``mismatched_keys``) instead of raising.

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)`` with an extra ``mismatched_keys`` attribute.

        Raises:
            RuntimeError: a shape mismatch (even with ``strict=False``, as torch), or with ``strict=True``
                missing/unexpected keys.
            ValueError: two checkpoint keys load into the same parameter (after ``key_map``, prefix
                stripping or HF-name translation), naming both keys and the parameter.
        """
        from .state_dict import load_state_dict

        return load_state_dict(self, state_dict, strict=strict, assign=assign, key_map=key_map,
                               merge_lora=merge_lora, ignore_mismatched_sizes=ignore_mismatched_sizes)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Counts parameters.

        Args:
            only_trainable: count only trainable parameters (LoRA factors once an adapter is added;
                all parameters of a plain model, none after ``requires_grad_(False)``, as in ``transformers``).
            exclude_embeddings: skip the input embeddings (``transformers``' ``nn.Embedding`` weights; the
                output head counts).

        Returns:
            The number of scalar parameters.
        """
        if only_trainable and not self._requires_grad:
            return 0
        total = 0
        for name, array in self.named_parameters():
            if exclude_embeddings and self._is_input_embedding(name):
                continue
            if only_trainable and self._has_lora() and "_lora_" not in name:
                continue
            total += int(np.prod(array.shape))
        return total

    def _is_input_embedding(self, name: str) -> bool:
        return any("embed_tokens" in hf_name for hf_name, _ in self.family.nnx_to_hf(name))

    def _has_lora(self) -> bool:
        return any("_lora_" in name for name, _ in self.named_parameters())

    # ------------------------------------------------------------------ torch / transformers habits
    def train(self, mode: bool = True) -> CausalLM:
        """Sets :attr:`training`, as ``torch.nn.Module.train``.

        Forward passes, ``generate`` and evaluation are deterministic in both modes: the Tunix models have no
        dropout, and LoRA dropout runs inside the trainers' steps only.

        Args:
            mode: ``True`` for training mode, ``False`` for evaluation mode.

        Returns:
            The model itself.
        """
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        return self

    def eval(self) -> CausalLM:
        """Sets :attr:`training` to ``False`` (``train(False)``), as ``torch.nn.Module.eval``.

        Returns:
            The model itself.
        """
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> CausalLM:
        """Marks every parameter trainable or frozen, as ``torch.nn.Module.requires_grad_``.

        torchlike has no per-array ``requires_grad``: the flag is the model's. ``num_parameters(only_trainable=True)``
        counts nothing while the model is frozen, and a trainer refuses to train a frozen model (torch's optimizer
        gets an empty parameter list). A frozen model serves as it is as a reference or teacher model; to train part
        of a model, add an adapter with ``torchlike.peft.get_peft_model``.

        Args:
            requires_grad: ``False`` freezes the model, ``True`` makes every parameter trainable again.

        Returns:
            The model itself.
        """
        self._requires_grad = bool(requires_grad)
        return self

    @property
    def requires_grad(self) -> bool:
        """Whether the parameters are trainable (``False`` after ``requires_grad_(False)``)."""
        return self._requires_grad

    def to(self, *args: Any, **kwargs: Any) -> CausalLM:
        """Casts the parameters, as ``torch.nn.Module.to``: ``to(torch.bfloat16)``, ``to(dtype=...)``,
        ``to("cpu", torch.float32)``.

        A dtype (torch, numpy or jax, or a name such as ``"bfloat16"``) casts every floating-point parameter in place,
        and the model then computes in that dtype, as one loaded with ``from_pretrained(..., dtype=...)`` does. A
        device (``"cpu"``, ``"cuda"``, ``"cuda:0"``, a ``torch.device`` or a JAX device) must be where the parameters
        already are: torchlike places parameters when it loads them (``from_pretrained(..., mesh=...)``), so a move is
        refused with that alternative.

        Args:
            args: a device, a dtype, or both (``non_blocking`` is accepted and has no effect).
            kwargs: ``device``, ``dtype``, ``non_blocking``.

        Returns:
            The model itself, as in ``torch`` (no copy).

        Raises:
            ValueError: a dtype cast on a quantised (QLoRA) model, or a device the parameters are not on.
            TypeError: a tensor or another argument ``to`` cannot take.
        """
        device, dtype = _device_and_dtype(args, kwargs)
        if device is not None:
            self._check_device(device)
        if dtype is not None:
            self._cast(dtype)
        return self

    def cpu(self) -> CausalLM:
        """``to("cpu")``: the model itself when its parameters are on the CPU."""
        return self.to("cpu")

    def cuda(self, device: int | str | torch.device | None = None) -> CausalLM:
        """``to("cuda")``: the model itself when its parameters are on the GPU (``device``: an index or device)."""
        return self.to(f"cuda:{device}" if isinstance(device, int) else device or "cuda")

    def half(self) -> CausalLM:
        """Casts the floating-point parameters to float16 in place (``to(torch.float16)``); returns the model."""
        return self.to(dtype=np.float16)

    def float(self) -> CausalLM:
        """Casts the floating-point parameters to float32 in place (``to(torch.float32)``); returns the model."""
        return self.to(dtype=np.float32)

    def bfloat16(self) -> CausalLM:
        """Casts the floating-point parameters to bfloat16 in place (``to(torch.bfloat16)``); returns the model."""
        return self.to(dtype="bfloat16")

    def _cast(self, dtype: DTypeLike) -> None:
        target = resolve_dtype(dtype)
        if model_habits.has_quantized_parameters(self.module):
            raise ValueError("You cannot cast a quantized (QLoRA) model to a new dtype: Qwix holds its base weights "
                             "quantized. Load the base model with from_pretrained(..., dtype=...) in the dtype you "
                             "want before get_peft_model quantizes it.")
        model_habits.cast_parameters(self.family, self.config, self._modules_sharing_parameters(), target)

    def _modules_sharing_parameters(self) -> list[nnx.Module]:
        """The modules a cast must reach together (a LoRA model adds its base model's)."""
        return [self.module]

    def _check_device(self, device: object) -> None:
        platform, index = _jax_platform(device)
        devices = {array_device for _, array in self.named_parameters() for array_device in array.devices()}
        on_it = all(placed.platform == platform for placed in devices) and (
            index is None or {placed.id for placed in devices} == {index})
        if not on_it:
            placed = sorted(str(placed) for placed in devices)
            raise ValueError(f"model.to({device!r}): the parameters are on {placed[:4]}"
                             f"{' ...' if len(placed) > 4 else ''} and torchlike models do not move between devices: "
                             "parameters are placed when the model is loaded. Load it where you want it: "
                             "from_pretrained(..., mesh=torchlike.make_mesh(...)) for accelerators, or "
                             "JAX_PLATFORMS=cpu for the CPU.")

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether :meth:`gradient_checkpointing_enable` is in effect."""
        return self._gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Turns on gradient checkpointing: a trainer then rematerialises each decoder layer in the backward pass
        (as ``TrainingArguments(gradient_checkpointing=True)``). Forward passes outside training are unchanged.

        Args:
            gradient_checkpointing_kwargs: ``torch.utils.checkpoint`` options (``use_reentrant``, ...); accepted and
                unused: JAX has one rematerialisation, ``jax.checkpoint`` with its default policy.

        Raises:
            ValueError: the model has no layer Tunix can rematerialise.
        """
        model_habits.check_rematerialisable(self.module)
        self._gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Turns gradient checkpointing off (a trainer still rematerialises when its ``gradient_checkpointing`` is
        on)."""
        self._gradient_checkpointing = False

    def get_input_embeddings(self) -> InputEmbeddings:
        """The input embedding, as ``transformers`` returns its ``nn.Embedding``: ``weight`` ``(num_embeddings,
        embedding_dim)``, ``num_embeddings``, ``embedding_dim``. The same object each call; it reads the model
        live, so it follows :meth:`resize_token_embeddings`.

        Returns:
            :class:`InputEmbeddings`.
        """
        return self._embedding_view("input", InputEmbeddings)

    def get_output_embeddings(self) -> OutputEmbeddings:
        """The output head, as ``transformers`` returns its ``nn.Linear``: ``weight`` ``(out_features, in_features)``
        (the input embedding's own array when the embeddings are tied), ``in_features``, ``out_features``.

        Returns:
            :class:`OutputEmbeddings`.
        """
        return self._embedding_view("output", OutputEmbeddings)

    @property
    def lm_head(self) -> OutputEmbeddings:
        """``transformers``' ``model.lm_head``: the output head (:meth:`get_output_embeddings`), with its ``weight``."""
        return self.get_output_embeddings()

    def _embedding_view(self, kind: str, view_class: type) -> Any:
        if kind not in self._embedding_views:
            self._embedding_views[kind] = view_class(self)
        return self._embedding_views[kind]

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True, *, seed: int = 0) -> InputEmbeddings:
        """Resizes the vocabulary to ``new_num_tokens`` rows, as ``transformers``: rows are added at the end (or cut
        from it) in the input embedding and an untied output head, ``config.vocab_size`` is updated, and a tied head
        follows the embedding.

        New rows are initialised as ``transformers`` 5 does: with ``mean_resizing`` from a normal with the old rows'
        mean and ``1e-9`` times their covariance (about the mean), else from ``normal(0, initializer_range)``. The
        Tunix module is rebuilt in the parameters' dtype and sharding (``model.module`` is a new module).

        Args:
            new_num_tokens: the new vocabulary size; ``None`` keeps it (or only pads it to ``pad_to_multiple_of``).
            pad_to_multiple_of: round the size up to a multiple of this.
            mean_resizing: initialise new rows about the old rows' mean (``False``: ``normal(0, initializer_range)``).
            seed: torchlike only: seeds the draw of the new rows (``transformers`` uses torch's global generator).

        Returns:
            :meth:`get_input_embeddings` (the same object, now with the new size).

        Raises:
            ValueError: ``pad_to_multiple_of`` is not an integer (``transformers``' message).
        """
        embeddings = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        rows = embeddings.num_embeddings if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of is not None:
            if not isinstance(pad_to_multiple_of, int):
                raise ValueError(f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which "
                                 "is not and integer. Please make sure to pass an integer")
            rows = (rows + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
        if rows != embeddings.num_embeddings:
            with entered(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                self.module = model_habits.resize_vocabulary(self.family, self.module, self.config, rows,
                                                             mean_resizing=mean_resizing, seed=seed, mesh=self.mesh)
        self.config.get_text_config().vocab_size = rows
        return embeddings

    def __repr__(self) -> str:
        header = f"CausalLM({self.family.name}, dtype={self.dtype.name}, parameters={self.num_parameters():,})"
        return "\n".join([header, *("  " + line for line in module_tree_lines(self.module))])

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        safe_serialization: bool = True,
        tokenizer: PreTrainedTokenizerBase | None = None,
        is_main_process: bool = True,
        push_to_hub: bool = False,
        **push_kwargs: Any,
    ) -> None:
        """Writes ``config.json``, ``generation_config.json``, safetensors weights and tokenizer files.

        The layout is what ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load:
        one ``model.safetensors`` when it fits in ``max_shard_size``, otherwise
        ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; every file
        carries ``{"format": "pt"}`` metadata. Shards are written one at a time (one tensor on
        the host at a time) into a staging folder beside ``save_directory``, tokenizer files
        included, which then replaces ``save_directory`` by renames: a crash at any moment leaves
        the complete old checkpoint or the complete new one there (the next ``from_pretrained``
        or ``save_pretrained`` finishes a swap the crash interrupted). Other files in
        ``save_directory`` (a README, logs) are kept; weight files of an earlier save are removed.

        Args:
            save_directory: output directory (created if missing; must not be a file).
            max_shard_size: largest shard, in bytes or as ``"5GB"``/``"200MB"``.
            safe_serialization: must be ``True``; torchlike writes safetensors only.
            tokenizer: a ``transformers`` tokenizer whose files are saved alongside.
            is_main_process: ``False`` writes nothing (transformers' meaning, for scripts that call this on every
                process). With several JAX processes every process must call ``save_pretrained`` (each takes part
                in gathering the sharded tensors, one at a time) and process 0 writes while the others wait.
            push_to_hub: also upload the directory with :meth:`push_to_hub` (``repo_id`` in
                ``push_kwargs``, default the directory name).
        """
        if not safe_serialization:
            raise ValueError("safe_serialization=False is not supported: torchlike writes safetensors only, "
                             "which transformers and vLLM load. Drop the argument.")
        hf_checkpoint.check_output_dir(save_directory)
        if not is_main_process and jax.process_count() == 1:
            return
        specs, tensor = self._hf_export_plan()
        hf_checkpoint.write_checkpoint(
            save_directory, specs, tensor,
            max_shard_size=max_shard_size, extra_files=lambda folder: self._save_metadata(folder, tokenizer),
        )
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", Path(save_directory).name)
            hf_hub.upload_folder(save_directory, repo_id, **push_kwargs)

    def _hf_export_plan(self) -> tuple[list, Callable]:
        """``(specs, tensor)``: the Hugging Face tensors :meth:`save_pretrained` writes, in its order, and
        ``tensor(spec) -> numpy array`` (each parameter in its HF name and layout, gathered to the host)."""
        specs, sources = tunix_model.export_plan(self.family, self.module)
        specs += tunix_model.kept_specs(self.kept_weights)

        def tensor(spec):
            if spec.name in self.kept_weights:
                return self.kept_weights[spec.name]
            return tunix_model.materialize_hf_tensor(sources, spec)

        return specs, tensor

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """The weights as ``save_pretrained`` writes them, in memory: ``{Hugging Face name: numpy array}`` in the
        checkpoint's names, layouts and dtypes (what an engine outside this process, such as vLLM, loads). With
        several JAX processes every process must call this (each takes part in gathering the sharded tensors)."""
        specs, tensor = self._hf_export_plan()
        return {spec.name: tensor(spec) for spec in specs}

    def _save_metadata(self, folder: Path, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """The files beside the weights: ``config.json`` (this dtype; the family's architecture when the config
        names none), ``generation_config.json`` and the tokenizer's files."""
        config = copy.deepcopy(self.config)
        config.dtype = dtype_name(self.dtype)
        if not getattr(config, "architectures", None):
            config.architectures = [self.family.architectures[0]]
        config.save_pretrained(folder)
        if self.family.export_config is not None:
            path = Path(folder) / "config.json"
            path.write_text(json.dumps(self.family.export_config(json.loads(path.read_text())), indent=2,
                                       sort_keys=True) + "\n")
        self.generation_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str = "Upload model",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str = "5GB",
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> str:
        """Saves to a temporary directory with :meth:`save_pretrained` and uploads it to ``repo_id``.

        Returns:
            The URL of the commit.
        """
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size, tokenizer=tokenizer)
            return hf_hub.upload_folder(folder, repo_id, commit_message=commit_message, private=private,
                                        token=token, revision=revision, create_pr=create_pr)




def _device_and_dtype(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``torch.nn.Module.to``'s arguments as ``(device or None, dtype or None)``."""
    unknown = sorted(set(kwargs) - {"device", "dtype", "non_blocking"})
    if unknown:
        raise TypeError(f"to() got unexpected keyword arguments {unknown}; it takes a device and/or a dtype.")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, bool):  # non_blocking, positionally
            continue
        if type(arg).__name__ in ("Tensor", "ArrayImpl", "ndarray"):
            raise TypeError("to(tensor) is not supported: pass the dtype (model.to(tensor.dtype)).")
        if _is_dtype_spelling(arg):
            dtype = arg
        else:
            device = arg
    return device, dtype


def _is_dtype_spelling(value: object) -> bool:
    if isinstance(value, str) or type(value).__module__ == "torch":
        try:
            resolve_dtype(value)
        except ValueError:
            return type(value).__name__ == "dtype"  # a torch dtype torchlike does not hold: resolve_dtype says so
        return True
    if isinstance(value, int):
        return False
    try:
        np.dtype(value)
    except TypeError:
        return False
    return True


#: torch device types and the JAX platform that plays their part.
_JAX_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu", "xla": "tpu"}


def _jax_platform(device: object) -> tuple[str, int | None]:
    """``(JAX platform, device index or None)`` for a torch-style device (``"cuda:1"``, ``torch.device``, an
    index) or a JAX device."""
    if hasattr(device, "platform") and hasattr(device, "id"):
        return device.platform, device.id
    if isinstance(device, int):
        return "gpu", device
    kind, _, index = str(device).partition(":")
    if kind not in _JAX_PLATFORMS:
        raise ValueError(f"model.to({device!r}): torchlike runs on JAX devices (cpu, cuda, tpu); {kind!r} has no JAX "
                         "platform. Load the model where you want it with from_pretrained(..., mesh=...).")
    return _JAX_PLATFORMS[kind], int(index) if index else None


#: The ``attn_implementation`` values that load without a warning (transformers' own; the Tunix attention runs).
ACCEPTED_ATTENTION = (None, "eager", "sdpa")


@dataclass(frozen=True)
class PretrainedLoad:
    """A ``from_pretrained`` call, checked and opened (:func:`open_pretrained`): what both Auto classes load from.

    Args:
        source: the opened checkpoint, hub id or ``transformers`` model (config, family table, tensors).
        dtype: the parameter dtype (the checkpoint's for ``None``/``"auto"``).
        mesh: the mesh the parameters are placed on, or ``None``.
        quantization: the QLoRA weight type asked for (``nf4``/``int8``), or ``None``.
    """

    source: HFSource
    dtype: np.dtype
    mesh: Mesh | None
    quantization: str | None


def open_pretrained(
    pretrained_model_name_or_path: str | os.PathLike | PreTrainedModel,
    model_args: tuple,
    overrides: dict[str, Any],
    *,
    dtype: DTypeLike = None,
    torch_dtype: DTypeLike = None,
    mesh: Mesh | None = None,
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> PretrainedLoad:
    """What every ``from_pretrained`` does first: refuse positional arguments and warn about options JAX cannot honour
    (in transformers' words), join the processes of a ``jax.distributed`` launch (before any device is touched) and
    load onto every device's mesh there (one process cannot hold a model for the others), enable the compilation
    cache, take the quantisation request out of ``overrides``, open the source (:func:`open_hf_source`) and resolve
    the dtype against the checkpoint's.

    Args:
        pretrained_model_name_or_path, dtype, mesh, attn_implementation, device_map, trust_remote_code, revision,
            cache_dir, token, local_files_only: as :meth:`AutoModelForCausalLM.from_pretrained` takes them.
        model_args: ``from_pretrained``'s extra positional arguments (refused).
        overrides: ``from_pretrained``'s other keywords: config fields, and the quantisation request.
        torch_dtype: the deprecated alias of ``dtype``.

    Returns:
        The :class:`PretrainedLoad`.
    """
    if model_args:
        raise TypeError("from_pretrained takes no extra positional arguments; pass config overrides as keywords.")
    initialize_distributed()
    if mesh is None and jax.process_count() > 1:
        mesh = make_mesh()
    if attn_implementation not in ACCEPTED_ATTENTION:
        warnings.warn(f"attn_implementation={attn_implementation!r} has no effect: torchlike uses the Tunix JAX "
                      "attention (XLA-compiled).", stacklevel=3)
    if device_map not in (None, "auto", "cpu"):
        warnings.warn(f"device_map={device_map!r} has no effect: place the model with mesh=make_mesh(...).",
                      stacklevel=3)
    quantization = requested_quantization(overrides)
    enable_compilation_cache()
    source = open_hf_source(pretrained_model_name_or_path, overrides, trust_remote_code, revision=revision,
                            cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    dtype = torch_dtype if dtype is None and torch_dtype is not None else dtype
    return PretrainedLoad(source, resolve_dtype(dtype, source.dtype_hint), mesh, quantization)



class AutoModelForCausalLM:
    """Loads Hugging Face causal LMs (Qwen2, Qwen3, Llama 3.x, Gemma 2, Gemma 3 text) as :class:`CausalLM`."""

    def __init__(self, *args, **kwargs):
        raise OSError("Use AutoModelForCausalLM.from_pretrained(...) or .from_config(...).")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike | PreTrainedModel,
        *model_args,
        dtype: DTypeLike = None,
        mesh: Mesh | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        device_map: str | dict | None = None,
        torch_dtype: DTypeLike = None,
        cache_dir: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        **kwargs,
    ) -> CausalLM:
        """Loads a checkpoint directory, hub id, or ``transformers.PreTrainedModel`` into JAX.

        Args:
            pretrained_model_name_or_path: a directory with ``config.json`` and weights
                (``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``,
                or ``pytorch_model.bin``), a hub repo id, or a ``transformers`` model object.
            dtype: parameter dtype: ``None``/``"auto"`` (the checkpoint's), a string
                (``"bfloat16"``), a numpy/jax dtype or a ``torch.dtype``.
            mesh: a ``jax.sharding.Mesh`` with axes ``fsdp``/``tp`` (see :func:`make_mesh`);
                parameters are placed sharded as they are read. When the script runs as one of several
                processes (``jax.distributed``), ``None`` means every device of every process on ``fsdp``.
            revision, cache_dir, token, local_files_only: hub download options.
            trust_remote_code: accepted, as transformers accepts it; a repository whose architecture exists only as
                its own (PyTorch) modelling code is refused, with or without it.
            attn_implementation: accepted for TRL scripts; the Tunix attention is always used.
            device_map: accepted for TRL scripts when ``None``/``"auto"``/``"cpu"``; use ``mesh``.
            quantization_config, load_in_4bit, load_in_8bit: QLoRA as in TRL scripts: recorded on the
                model (``nf4``/``int8``) and applied by Qwix to the adapted modules when
                ``torchlike.peft.get_peft_model`` adds the adapter.
            torch_dtype: deprecated alias of ``dtype``.
            kwargs: config overrides, e.g. ``num_hidden_layers=2``, as in ``transformers``.

        Returns:
            A :class:`CausalLM`.

        Example:
            >>> model = AutoModelForCausalLM.from_pretrained("path/to/qwen", dtype="bfloat16")
            >>> model([[1, 2, 3]]).logits.shape
        """
        loading = open_pretrained(pretrained_model_name_or_path, model_args, kwargs, dtype=dtype,
                                  torch_dtype=torch_dtype, mesh=mesh, attn_implementation=attn_implementation,
                                  device_map=device_map, trust_remote_code=trust_remote_code, revision=revision,
                                  cache_dir=cache_dir, token=token, local_files_only=local_files_only)
        source = loading.source
        kept: dict[str, np.ndarray] = {}
        module = tunix_model.load_weights(source.family, source.config, source.tensors(), loading.dtype,
                                          mesh=loading.mesh, source=source.location, kept=kept)
        model = CausalLM(module, source.config, source.family, source.generation_config, loading.mesh,
                         source.name_or_path, kept_weights=kept)
        model.quantization = announce_quantization(loading.quantization)
        return model

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: DTypeLike = None, mesh: Mesh | None = None,
                    seed: int = 0) -> CausalLM:
        """A randomly initialised model for a ``transformers`` config (normal(0, initializer_range) weights,
        ones for norms, zeros for biases), as ``transformers``' ``from_config`` gives.

        Args:
            config: a ``transformers.PretrainedConfig`` of a supported family.
            dtype: parameter dtype (default float32, or the config's ``dtype``).
            mesh: optional device mesh.
            seed: random seed.
        """
        enable_compilation_cache()
        family = family_for_config(config, source="config")
        target_dtype = resolve_dtype(dtype, getattr(config, "dtype", None))
        abstract = tunix_model.build_abstract_model(family, config, target_dtype)
        specs, _ = tunix_model.export_plan(family, abstract)
        rng = np.random.default_rng(seed)
        std = float(getattr(config, "initializer_range", 0.02))

        def random_tensors():
            for spec in specs:
                if re.search(r"(norm\d*|ln_q)\.weight$", spec.name):
                    # The neutral norm weight: 0 for a (1 + w) RMS norm, 1 for a plain one and for a vision tower's
                    # norms (SigLIP's, Qwen's), whatever the decoder's norms are.
                    one_plus = family.norms_scale_by_one_plus_weight and not re.search(r"vision_tower\.|visual\.",
                                                                                       spec.name)
                    value = 0.0 if one_plus else 1.0
                    yield spec.name, np.full(spec.shape, value, np.float32), "random init"
                elif spec.name.endswith(".bias"):
                    yield spec.name, np.zeros(spec.shape, np.float32), "random init"
                else:
                    yield spec.name, rng.normal(0.0, std, spec.shape).astype(np.float32), "random init"

        module = tunix_model.load_weights(family, config, random_tensors(), target_dtype, mesh=mesh,
                                          source="from_config")
        return CausalLM(module, config, family, None, mesh, "")


class AutoModelForImageTextToText(AutoModelForCausalLM):
    """Loads Hugging Face vision-language checkpoints (``Gemma3ForConditionalGeneration``,
    ``Gemma4ForConditionalGeneration``) as :class:`CausalLM`, as ``transformers.AutoModelForImageTextToText`` does.

    The model takes the processor's ``pixel_values`` (and ``token_type_ids``) beside ``input_ids`` where Tunix has the
    family's vision tower (Gemma 3); Gemma 4's towers are kept and saved back unchanged, and its image inputs are
    refused with the reason. :meth:`from_pretrained` takes :meth:`AutoModelForCausalLM.from_pretrained`'s arguments.

    Example:
        >>> model = AutoModelForImageTextToText.from_pretrained("path/to/gemma-3-4b-it", dtype="bfloat16")
        >>> processor = AutoProcessor.from_pretrained("path/to/gemma-3-4b-it")
        >>> inputs = processor(text=text, images=[image], return_tensors="np")
        >>> model(**inputs).logits.shape
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | PreTrainedModel, *model_args: Any,
                        **kwargs: Any) -> CausalLM:
        """Loads a vision-language checkpoint (see :meth:`AutoModelForCausalLM.from_pretrained` for the arguments).

        Returns:
            A :class:`CausalLM` whose ``__call__`` and ``generate`` take ``pixel_values``.

        Raises:
            ValueError: a text-only checkpoint (as ``transformers``: load it with ``AutoModelForCausalLM``).
        """
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if model.family.images is None and not model.family.kept_hf_keys:
            multimodal = [arch for family in all_families() if family.images or family.kept_hf_keys
                          for arch in family.architectures]
            raise ValueError(
                f"Unrecognized configuration class {type(model.config).__name__} for this kind of AutoModel: "
                f"AutoModelForImageTextToText. {model.name_or_path or 'The checkpoint'} is a text-only "
                f"{model.family.architectures[0]} model; load it with AutoModelForCausalLM, or load a vision-language "
                f"checkpoint ({', '.join(multimodal)}).")
        return model
