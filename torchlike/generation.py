"""``CausalLM.generate``: ``transformers``' generation arguments resolved and checked, then decoded through the
rollout engine boundary (:mod:`torchlike.adapters.rollout`).

Each prompt row becomes one :class:`~torchlike.adapters.rollout.RolloutRequest` whose ``num_return_sequences``
completions are its samples; output row ``i`` (prompt ``i // n``, sample ``i % n``) draws from the PRNG stream
``(seed, i)``, as the batch sampler numbered its rows, so a seed gives the same tokens through either engine: the
static one (one left-padded batch, one compiled program, ``rollout_engine="static"``) or the paged one
(``"paged"``); by default the backend's (``adapters.rollout.default_engine``: the paged engine on the CPU). The
rows are put back into ``transformers``' layout (prompt, then the new tokens, ``pad_token_id`` after a row's end
token).

Settings resolve as in ``transformers``: arguments of the call, then a ``generation_config`` passed
to the call, then the model's ``generation_config`` (``generation_config.json``), then
``transformers``' defaults (greedy, ``max_length=20``, ``top_k=50`` when sampling). The repetition penalty
counts the prompt's ids as the installed ``transformers`` does (:mod:`torchlike.version`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .adapters import rollout
from .adapters.distributed.mesh import entered
from .adapters.losses.settings import check_choice
from .adapters.rollout import sampling
from .adapters.rollout.sampling import bucket_length, cache_size
from .adapters.runtime.tracing import TRACE_COUNTS
from .version import repetition_penalty_skips_left_padding

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from transformers import GenerationConfig, PreTrainedTokenizerBase


__all__ = ["TRACE_COUNTS", "GenerateDecoderOnlyOutput", "RolloutEngineContext", "bucket_length", "cache_size",
           "generate", "register_rollout_engine", "resolve_generation_settings", "rollout_engine_names",
           "unregister_rollout_engine"]

TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": None,
    "max_length": 20,
    **sampling.SamplingSettings.defaults(),
    "eos_token_id": None,
    "pad_token_id": None,
    "num_beams": 1,
    "num_return_sequences": 1,
    "return_dict_in_generate": False,
}
"""``transformers``' global defaults (``GenerationConfig._get_default_generation_params``) for the
settings ``generate`` implements: the sampler's (:class:`~torchlike.adapters.rollout.sampling.SamplingSettings`)
and the length, end, padding, search and output settings ``generate`` handles itself."""

ROLLOUT_ENGINES: tuple[str, ...] = rollout.BUILT_IN
"""The built-in rollout engines ``generate`` and the online trainers decode with (``rollout_engine``), from the
adapters' registry (:data:`torchlike.adapters.rollout.BUILT_IN`); :func:`rollout_engine_names` adds those registered
with :func:`register_rollout_engine`."""

RolloutEngineContext = rollout.EngineContext
"""What a registered engine's builder receives beside the module (:class:`torchlike.adapters.rollout.EngineContext`):
the end and pad tokens, the LoRA mode, the mesh and the caller's ``rollout_*`` settings."""


def register_rollout_engine(name: str, builder: Callable[[Any, RolloutEngineContext], Any], *,
                            replace: bool = False) -> None:
    """Registers a rollout engine: ``rollout_engine=name`` (``generate``'s argument, ``GRPOConfig``'s and
    ``RLOOConfig``'s field) then samples with ``builder(module, context)``, in ``generate`` and every online trainer
    alike, with no change to either.

    Args:
        name: the ``rollout_engine`` value that picks the engine.
        builder: ``(module, context) -> engine``; the engine has ``generate(requests, settings)``,
            ``update_weights(module)`` and ``close()`` (the protocol of
            :class:`torchlike.adapters.rollout.RolloutEngine`), ``context`` is a :data:`RolloutEngineContext`.
        replace: replace an engine registered under ``name`` before (built-in engines cannot be replaced).

    Raises:
        ValueError: ``name`` is a built-in engine's, or taken without ``replace=True``.
        TypeError: ``builder`` is not callable.

    Example:

    ```python
    >>> from torchlike.adapters.rollout import StaticEngine
    >>> def build(module, context):
    ...     return StaticEngine(module, eos_token_ids=context.eos_token_ids, pad_token_id=context.pad_token_id,
    ...                         lora=context.lora)
    >>> torchlike.register_rollout_engine("my-engine", build)
    >>> model.generate(ids, max_new_tokens=8, rollout_engine="my-engine")
    ```
    """
    rollout.register_engine(name, builder, replace=replace)


def unregister_rollout_engine(name: str) -> None:
    """Removes an engine :func:`register_rollout_engine` registered.

    Raises:
        KeyError: no engine was registered under ``name``.
    """
    rollout.unregister_engine(name)


def rollout_engine_names() -> tuple[str, ...]:
    """Returns the values ``rollout_engine`` accepts now: the built-in engines, then the registered ones."""
    return rollout.engine_names()


@dataclass
class GenerateDecoderOnlyOutput:
    """What :meth:`CausalLM.generate` returns with ``return_dict_in_generate=True``.

    Args:
        sequences: ``[batch * num_return_sequences, prompt + new]`` token ids (prompt included).
        logprobs: ``[batch * num_return_sequences, new]`` float32 log-probs of the new tokens under
            ``log_softmax(logits / temperature)`` (0 after a row ended), when ``output_logprobs=True``.
    """

    sequences: Any
    logprobs: np.ndarray | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def resolve_generation_settings(model_generation_config: GenerationConfig,
                                generation_config: GenerationConfig | None = None,
                                **overrides: Any) -> tuple[dict[str, Any], bool]:
    """The settings ``generate`` runs with, in ``transformers``' order of precedence.

    Args:
        model_generation_config: the model's ``transformers.GenerationConfig``.
        generation_config: a ``GenerationConfig`` passed to the call (its unset fields fall back to
            the model's).
        overrides: settings passed to the call; ``None`` means "not given".

    Returns:
        ``(settings, max_length_was_set)``: a dict with every key of :data:`TRANSFORMERS_DEFAULTS`,
        and whether ``max_length`` came from the caller or a config rather than the default.

    Raises:
        ValueError: a config asks for a processor torchlike does not implement.
    """
    settings = dict(TRANSFORMERS_DEFAULTS)
    max_length_was_set = False
    for source in (model_generation_config, generation_config):
        if source is None:
            continue
        for name in TRANSFORMERS_DEFAULTS:
            value = getattr(source, name, None)
            if value is not None:
                settings[name] = value
                max_length_was_set |= name == "max_length"
        unsupported = {name: getattr(source, name, off)
                       for name, off in sampling.UNSUPPORTED_GENERATION_SETTINGS.items()
                       if getattr(source, name, off) not in (None, off)}
        if unsupported:
            warnings.warn(f"generation_config sets {unsupported}, which torchlike's generate does not apply "
                          f"(implemented: {', '.join(sampling.SamplingSettings.names())}).", stacklevel=4)
    for name, value in overrides.items():
        if value is not None:
            settings[name] = value
            max_length_was_set |= name == "max_length"
    return settings, max_length_was_set


def _check_search_settings(settings: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the bad value and the fix for ``num_beams`` and ``num_return_sequences``
    (the sampling settings check themselves in :class:`~torchlike.adapters.rollout.sampling.SamplingSettings`)."""
    if settings["num_beams"] != 1:
        raise ValueError(f"num_beams={settings['num_beams']}: beam search is not supported; use num_beams=1 "
                         "(greedy or sampling).")
    count = settings["num_return_sequences"]
    if not isinstance(count, int | np.integer) or count < 1:
        raise ValueError(f"num_return_sequences must be a positive integer, got {count!r}.")


def _token_ids(value: object, name: str, vocab_size: int) -> list[int]:
    """An id or a list of ids as a list, each checked against the vocabulary."""
    if value is None:
        return []
    ids = [value] if isinstance(value, int | np.integer) else list(value)
    for token in ids:
        if not isinstance(token, int | np.integer) or not 0 <= token < vocab_size:
            raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {value!r}.")
    return [int(token) for token in ids]


def _tokenize(prompts: Sequence[str], tokenizer: PreTrainedTokenizerBase | None,
              pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts tokenized one by one and left-padded with ``pad_token_id`` (no tokenizer pad token needed)."""
    if tokenizer is None:
        raise ValueError("generate() got text prompts but no tokenizer: pass tokenizer=AutoTokenizer.from_pretrained("
                         "...) (or processing_class=...), or pass input_ids and attention_mask.")
    rows = [list(tokenizer(prompt)["input_ids"]) for prompt in prompts]
    if any(not row for row in rows):
        raise ValueError("generate() got an empty prompt (no tokens after tokenization).")
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad_token_id, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = row
        mask[index, width - len(row):] = 1
    return ids, mask


def _left_aligned(ids: np.ndarray, mask: np.ndarray, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows with padding on the right moved to left padding: decoding continues from the last slot."""
    is_left_padded = np.all(np.diff(mask, axis=-1) >= 0, axis=-1)
    if is_left_padded.all():
        return ids, mask
    warnings.warn("generate() got right-padded rows; they were moved to left padding (a decoder-only model continues "
                  "from the last position), so the returned prompts are left-padded. Tokenize with "
                  "padding_side='left' to silence this.", stacklevel=4)
    ids, mask = ids.copy(), mask.copy()
    for row in np.flatnonzero(~is_left_padded):
        real = ids[row][mask[row] == 1]
        ids[row] = pad_token_id
        ids[row, ids.shape[1] - len(real):] = real
        mask[row] = 0
        mask[row, ids.shape[1] - len(real):] = 1
    return ids, mask


def _prompt_arrays(inputs: ArrayLike | None, attention_mask: ArrayLike | None,
                   tokenizer: PreTrainedTokenizerBase | None, pad_token_id: int | None,
                   eos_token_ids: list[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    from .arrays import to_numpy_2d

    fill = 0 if pad_token_id is None else pad_token_id
    if inputs is None:
        raise ValueError("generate() needs prompts: input_ids (with attention_mask) or text with a tokenizer.")
    if isinstance(inputs, str) or (isinstance(inputs, list | tuple) and inputs and isinstance(inputs[0], str)):
        if attention_mask is not None:
            raise ValueError("attention_mask cannot be given with text prompts; the tokenizer makes it.")
        ids, mask = _tokenize([inputs] if isinstance(inputs, str) else list(inputs), tokenizer, fill)
    else:
        ids = to_numpy_2d(inputs, "input_ids", dtype=np.int64)
        if ids.size == 0:
            raise ValueError("input_ids is empty; generate needs at least one prompt token per row.")
        if attention_mask is not None:
            mask = to_numpy_2d(attention_mask, "attention_mask", dtype=np.int64)
        elif pad_token_id is not None and pad_token_id not in eos_token_ids and (ids == pad_token_id).any():
            mask = (ids != pad_token_id).astype(np.int64)  # transformers infers the mask the same way
        else:
            mask = np.ones_like(ids)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids shape {ids.shape}.")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    if not mask.any(axis=-1).all():
        raise ValueError(f"rows {np.flatnonzero(~mask.any(axis=-1)).tolist()} of attention_mask are all padding; "
                         "every prompt needs at least one token.")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab_size}): min {ids.min()}, max "
                         f"{ids.max()}. Pad with the tokenizer's pad_token_id, not -100.")
    return _left_aligned(ids, mask, fill)


def generate(
    model: Any,  # Any: a CausalLM (torchlike.modeling imports this module, which cannot name it back)
    inputs: ArrayLike | str | list[str] | None = None,
    attention_mask: ArrayLike | None = None,
    *,
    generation_config: GenerationConfig | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int | None = None,
    output_logprobs: bool = False,
    rollout_engine: str | None = None,
    use_cache: bool | None = None,
    pixel_values: ArrayLike | None = None,
    token_type_ids: ArrayLike | None = None,
    **settings: Any,
) -> Any:
    """The body of :meth:`torchlike.CausalLM.generate` (see there for the arguments)."""
    if rollout_engine is not None:
        check_choice("rollout_engine", rollout_engine, rollout.engine_names())
    vision = {key: settings.pop(key) for key in (*model.family.image_keys, *VISION_INPUTS,
                                                 *model.family.refused_inputs) if key in settings}
    if use_cache is False:
        raise ValueError("use_cache=False is not supported: generation always decodes over a KV cache.")
    unknown = sorted(set(settings) - set(TRANSFORMERS_DEFAULTS))
    if unknown:
        raise TypeError(f"generate() got unsupported arguments {unknown}; supported: "
                        f"{sorted(TRANSFORMERS_DEFAULTS)}, generation_config, tokenizer, seed, output_logprobs.")
    if seed is not None and not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}.")
    resolved, max_length_was_set = resolve_generation_settings(model.generation_config, generation_config, **settings)
    _check_search_settings(resolved)
    sampling_settings = sampling.SamplingSettings.from_mapping(resolved)
    vocab_size = int(model.config.get_text_config().vocab_size)
    eos_token_ids = _token_ids(resolved["eos_token_id"], "eos_token_id", vocab_size)
    pad_token_id = resolved["pad_token_id"]
    if pad_token_id is None and eos_token_ids:
        pad_token_id = eos_token_ids[0]  # transformers' fallback for open-ended generation
    if pad_token_id is not None:
        _token_ids(pad_token_id, "pad_token_id", vocab_size)

    returns_torch = hasattr(inputs, "detach") and hasattr(inputs, "cpu")
    ids, mask = _prompt_arrays(inputs, attention_mask, tokenizer, pad_token_id, eos_token_ids, vocab_size)
    prompt_length = ids.shape[1]
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    max_new_tokens = resolved["max_new_tokens"]
    if max_new_tokens is None:
        max_length = resolved["max_length"]
        if not max_length_was_set:  # transformers: by default 20 new tokens, within max_position_embeddings
            max_length = prompt_length + max_length if limit is None else min(prompt_length + max_length, limit)
        max_new_tokens = max_length - prompt_length
        if max_new_tokens < 1:
            raise ValueError(f"max_length={max_length} leaves no room after the {prompt_length}-token prompt; pass "
                             "max_new_tokens instead.")
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if limit is not None and prompt_length + max_new_tokens > limit:
        warnings.warn(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                      f"max_position_embeddings ({limit}); positions past it were not trained.", stacklevel=3)

    copies = int(resolved["num_return_sequences"])
    requests = _requests(ids, mask, int(max_new_tokens), copies,
                         sampling.random_seed() if seed is None else int(seed))
    if pixel_values is not None or any(value is not None for value in vision.values()):
        both_ways = token_type_ids is not None or model._mm_types_attend_both_ways(vision)
        requests = _with_images(model, requests, ids, mask, pixel_values, both_ways, vision)
    pad = 0 if pad_token_id is None else int(pad_token_id)
    engine = rollout.build_engine(rollout_engine, model.module, rollout.EngineContext(
        eos_token_ids=tuple(eos_token_ids), pad_token_id=pad, lora=model._lora_mode, mesh=model.mesh,
        hf_weights=model.hf_tensors, weights_version=lambda: 0))
    with entered(model.mesh) if model.mesh is not None else contextlib.nullcontext():
        outputs = engine.generate(requests, sampling_settings)
    places = [(row, sample) for row in range(len(requests)) for sample in range(copies)]
    tokens, logprobs = rollout.rows_from_outputs(outputs, places, pad)
    sequences = np.concatenate([np.repeat(ids, copies, axis=0), tokens.astype(np.int64)], axis=1)
    if returns_torch:
        import torch

        sequences = torch.from_numpy(sequences)
    if resolved["return_dict_in_generate"]:
        return GenerateDecoderOnlyOutput(sequences=sequences, logprobs=logprobs if output_logprobs else None)
    return sequences


def _with_images(model: Any,  # Any: a CausalLM, as in generate
                 requests: list[rollout.RolloutRequest], ids: np.ndarray, mask: np.ndarray,
                 pixel_values: ArrayLike | None, both_ways: bool,
                 vision: dict[str, Any]) -> list[rollout.RolloutRequest]:
    """The requests of a prompt batch with each row's images (``CausalLM.image_inputs``, ``vision`` its other
    inputs); with ``both_ways`` (the caller gave ``token_type_ids``, as Gemma 3's processor returns them, or Gemma 4's
    ``mm_token_type_ids`` where its images attend both ways) each image's
    tokens attend to each other both ways in the prefill, as in ``transformers``, else causally (what
    ``transformers`` does without them, and Qwen-VL always)."""
    images = model.image_inputs(ids, pixel_values, **vision)
    if images is None:
        return requests
    image_token = model.config.image_token_id  # transformers' name in every vision-language config
    out = []
    for row, request in enumerate(requests):
        real = ids[row][mask[row].astype(bool)]
        types = tuple((real == image_token).astype(np.int32)) if both_ways else ()
        out.append(dataclasses.replace(request, images=rollout.row_of(images, row), token_type_ids=types))
    return out


VISION_INPUTS = ("image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids")
"""Processor outputs ``generate`` passes to the model's image inputs besides the model family's own
(``Family.image_keys``): a model that does not read them refuses them by name (``CausalLM.image_inputs``)."""


def _requests(ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, copies: int,
              seed: int) -> list[rollout.RolloutRequest]:
    """One request per left-padded prompt row, its ``copies`` completions drawing the streams ``(seed, i)`` of
    output rows ``i``; a row's left padding is counted by the repetition penalty where the installed
    ``transformers`` counts it."""
    counts_padding = not repetition_penalty_skips_left_padding()
    real = mask.astype(bool)
    return [rollout.RolloutRequest(row_ids[row_real], max_new_tokens, num_samples=copies, seed=seed,
                                   first_sample=row * copies,
                                   penalised_ids=row_ids[~row_real] if counts_padding else ())
            for row, (row_ids, row_real) in enumerate(zip(ids, real, strict=True))]
