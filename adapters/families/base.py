"""The shape of a family table: HF weight names <-> NNX paths with their layout transforms.

A family module (``qwen2.py``, ``llama3.py``...) declares, as data, which HF tensor goes
to which NNX parameter and how its axes move (torchtune's ``_FROM_HF`` dict is the
model). Import and export both read that one table, so a round trip is exact by
construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np


class UnsupportedConfigError(ValueError):
    """config.json asks for a feature this family's model (Tunix's or the native decoder) does not implement."""


class Layout:
    """How an HF tensor's axes map to the NNX parameter's axes (and back).

    The transforms use only ``.T``/``reshape``/``transpose``, so they run on numpy or, jitted, on device.
    """

    moves_axes = True

    def to_nnx(self, hf: np.ndarray, nnx_shape: tuple[int, ...]) -> np.ndarray:
        raise NotImplementedError

    def to_hf(self, nnx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def hf_shape(self, nnx_shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError


class AsIs(Layout):
    """Same shape on both sides (norms, embeddings, flat biases)."""

    moves_axes = False

    def to_nnx(self, hf, nnx_shape):
        return hf

    def to_hf(self, nnx):
        return nnx

    def hf_shape(self, nnx_shape):
        return tuple(nnx_shape)


class Transposed(Layout):
    """HF ``nn.Linear`` weight ``(out, in)`` <-> NNX kernel ``(in, out)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.T

    def to_hf(self, nnx):
        return nnx.T

    def hf_shape(self, nnx_shape):
        return tuple(reversed(nnx_shape))


class InputProjection(Layout):
    """HF ``(heads*head_dim, hidden)`` <-> NNX einsum weight ``(hidden, heads, head_dim)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.T.reshape(nnx_shape)

    def to_hf(self, nnx):
        return nnx.reshape(nnx.shape[0], -1).T

    def hf_shape(self, nnx_shape):
        return (int(np.prod(nnx_shape[1:])), nnx_shape[0])


class OutputProjection(Layout):
    """HF ``(hidden, heads*head_dim)`` <-> NNX einsum weight ``(heads, head_dim, hidden)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.T.reshape(nnx_shape)

    def to_hf(self, nnx):
        return nnx.reshape(-1, nnx.shape[-1]).T

    def hf_shape(self, nnx_shape):
        return (nnx_shape[-1], int(np.prod(nnx_shape[:-1])))


class ConvKernel(Layout):
    """HF ``nn.Conv2d`` weight ``(out, in, kh, kw)`` <-> NNX ``nnx.Conv`` kernel ``(kh, kw, in, out)``."""

    def to_nnx(self, hf, nnx_shape):
        return hf.transpose(2, 3, 1, 0)

    def to_hf(self, nnx):
        return nnx.transpose(3, 2, 0, 1)

    def hf_shape(self, nnx_shape):
        kh, kw, channels, out = nnx_shape
        return (out, channels, kh, kw)


class LeadingUnitAxis(Layout):
    """HF ``(rows, width)`` <-> NNX ``(1, rows, width)`` (a position-embedding table kept with a batch axis)."""

    def to_nnx(self, hf, nnx_shape):
        return hf.reshape(nnx_shape)

    def to_hf(self, nnx):
        return nnx.reshape(nnx.shape[1:])

    def hf_shape(self, nnx_shape):
        return tuple(nnx_shape[1:])


class HeadsFirstInputProjection(Layout):
    """HF ``(heads*head_dim, hidden)`` <-> NNX ``(heads, hidden, head_dim)`` (Gemma's ``q_einsum``)."""

    def to_nnx(self, hf, nnx_shape):
        heads, hidden, head_dim = nnx_shape
        return hf.reshape(heads, head_dim, hidden).transpose(0, 2, 1)

    def to_hf(self, nnx):
        heads, hidden, head_dim = nnx.shape
        return nnx.transpose(0, 2, 1).reshape(heads * head_dim, hidden)

    def hf_shape(self, nnx_shape):
        heads, hidden, head_dim = nnx_shape
        return (heads * head_dim, hidden)


AS_IS = AsIs()
TRANSPOSED = Transposed()
INPUT_PROJECTION = InputProjection()
OUTPUT_PROJECTION = OutputProjection()
HEADS_FIRST_INPUT_PROJECTION = HeadsFirstInputProjection()
CONV_KERNEL = ConvKernel()
LEADING_UNIT_AXIS = LeadingUnitAxis()


@dataclass(frozen=True)
class WeightRule:
    """One row of a family table.

    Args:
        hf: HF name template; ``{layer}`` stands for a layer index.
        nnx: NNX dotted path template with the same placeholders.
        layout: how axes move between the two.
        stack: ``(index, count)`` when several HF tensors are stacked on a new leading
            axis of one NNX parameter (Gemma's ``kv_einsum`` holds k and v).
        load_only: a second name the parameter is loaded from but never written as (transformers' in-memory
            name of a tensor its checkpoints store differently); several rows may share its ``hf`` template, one per
            parameter the tensor fills.
    """

    hf: str
    nnx: str
    layout: Layout = AS_IS
    stack: tuple[int, int] | None = None
    load_only: bool = False

    @property
    def hf_regex(self) -> re.Pattern:
        return _template_regex(self.hf)

    @property
    def nnx_regex(self) -> re.Pattern:
        return _template_regex(self.nnx)


_FIRST_DOTTED_NUMBER = re.compile(r"\.\d+\.")


@functools.cache
def _template_regex(template: str) -> re.Pattern:
    # Cached: a mixture-of-experts table has a row per expert, more templates than re's own cache keeps.
    return re.compile("^" + re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)") + "$")


@dataclass(frozen=True)
class TinyConfig:
    """A tiny test config of a family (``torchlike.testing.tiny_config`` builds it): the ``transformers`` config class
    and the fields that set it apart from the shared tiny shape.

    Args:
        config_class: the ``transformers`` config class name (``"Qwen2Config"``).
        fields: the family's own settings, on top of the shared shape.
        alternating_layer_types: ``layer_types`` alternate sliding and full attention over the layers unless given.
        copied_fields: field -> the field whose value it takes unless given (Gemma 3's ``query_pre_attn_scalar`` is
            the head size).
    """

    config_class: str
    fields: Mapping[str, Any]
    alternating_layer_types: bool = False
    copied_fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """Everything torchlike knows about one model family, as data plus two small functions.

    Args:
        name: short name (``"qwen2"``).
        model_types: HF ``config.model_type`` values this family reads.
        architectures: HF ``config.architectures`` entries this family reads.
        weights: the weight table.
        ignored_hf_keys: regexes of checkpoint entries that are not parameters
            (rotary buffers, a tied ``lm_head.weight``).
        lora_targets: HF module name (``"q_proj"``) -> NNX module path regex, used to
            translate PEFT ``target_modules``.
        default_lora_targets: the HF module names adapted when ``LoraConfig.target_modules`` is
            ``None``: PEFT's ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` entry for the
            family's ``model_type`` (a regex string where PEFT's entry is one); empty when PEFT has none (the user
            must name the targets).
        build_model: ``(hf_config, dtype, rngs) -> nnx.Module``; raises
            :class:`UnsupportedConfigError` for features the Tunix model lacks.
        forward: ``(module, tokens, positions, attention_mask) -> logits`` with
            ``attention_mask`` a boolean ``[B, T, T]`` (query, key) mask.
        hidden_states: ``(module, tokens, positions, attention_mask) -> [B, T, H]``: ``forward`` up to the
            output head (embeddings, decoder layers, final norm), in the module's compute dtype.
        logits_from_hidden: ``(module, hidden) -> float32 logits [..., V]``: the output head, so that
            ``logits_from_hidden(module, hidden_states(...))`` equals ``forward(...)``; it may run on a block of
            positions at a time (``adapters.losses.logprobs``).
        quantization_excluded: HF module names whose base weights Qwix cannot quantise in
            this family's Tunix model (QLoRA keeps them in full precision).
        norms_scale_by_one_plus_weight: the RMS norms multiply by ``1 + weight`` (Gemma), so their neutral weight
            is 0 rather than 1.
        config_weights: ``hf_config -> rows`` the table gains for one config (:meth:`for_config`): a row per expert of
            a mixture-of-experts model, whose count the config sets.
        lora_refused: HF module-name regex -> why LoRA cannot adapt the modules it names (stacked experts): a
            ``target_modules`` naming one of them raises with the reason instead of adapting the others.
        lora_not_linear: HF module-name regex -> why: modules that are not ``nn.Linear`` in ``transformers`` (GPT-OSS's
            stacked experts and router), which ``target_modules`` never adapts, as in PEFT; a name that reaches only
            them is refused with the reason.
        tiny_configs: the family's tiny test configs by name (``torchlike.testing.tiny_config(name)``).
        export_config: ``config.json``'s contents -> what to write instead on export, where the serving stack reads
            the config otherwise than the ``transformers`` pinned here (OLMo 3's rope per layer type); ``None``: as
            ``transformers`` writes it.
        import_tensors: ``(stream of (hf name, array, origin), hf_config)`` -> the stream the weight table reads, for
            checkpoints published in a storage format of their own (GPT-OSS's MXFP4 experts, dequantised; Qwen3-VL-MoE's
            experts as Qwen publishes them, transposed); ``None``: as stored.
        all_linear_refused: why ``target_modules="all-linear"`` is refused (PEFT's ``"all-linear"`` on DeepSeek-V3 and
            GLM-4 MoE also adapts the stacked experts and the router through ``target_parameters``); empty: accepted.
        router_logits: ``(run, module) -> (run(module), RouterRecord)``: runs ``run`` and returns, with its result, an
            :class:`adapters.losses.router.RouterRecord` of the router logits of the forward passes it ran
            (mixture-of-experts families; ``None`` for dense ones).
        kept_hf_keys: regexes of checkpoint tensors the Tunix model has no place for but the checkpoint's own class
            has (a vision or audio tower Tunix lacks): they are kept as they are, beside the module, and written back
            unchanged on export.
        images: ``(hf_config, input_ids, pixel_values) -> images``: ``transformers``' ``pixel_values`` as the module's
            ``forward``/``hidden_states`` take them (their ``images`` keyword), for a family whose module encodes
            images; ``None``: the model takes no images.
        image_keys: the processor's outputs beyond ``pixel_values`` that ``images`` takes as keywords (Qwen-VL's
            ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``); ``images`` then
            returns a dict of arrays with a leading batch axis, and may return ``rope_deltas`` ``[B]`` among them:
            what the positions of text after a row's prompt add (M-RoPE), which the rollout engines add when they
            decode.
        no_images_reason: why a model of this family takes no images (a tower Tunix lacks), for the error.
        in_memory_prefixes: ``(checkpoint prefix, in-memory prefix)`` pairs where ``transformers`` names a module
            otherwise in memory than its checkpoints do (``language_model.model.`` is ``model.language_model.``):
            PEFT adapters name modules as the model in memory does (:meth:`in_memory_name`).
        decoder: the text family whose decoder a multimodal family's model is built around (``"gemma3"``): state
            dicts of the one load into the other, less the towers; empty for a text family (itself).
        sequence_classification: ``model_type`` -> the ``transformers`` ``*ForSequenceClassification`` class of that
            model type (its ``architectures`` on export); empty where ``transformers`` has none.
        decay_overrides: NNX path regex -> whether weight decay applies, where ``transformers``' rule (no decay for
            ``nn.LayerNorm`` modules and names with ``bias``, ``layernorm``, ``rmsnorm``, ``.norm.``, ``_norm``) differs
            from torchlike's (no decay where the path says ``norm`` or ``bias``): Qwen2.5-VL's tower RMS norms
            ``norm1``/``norm2`` decay, Qwen2-VL's merger LayerNorm ``ln_q`` does not.
        config_kept_keys: ``hf_config -> regexes`` added to ``kept_hf_keys`` for one config (LLaVA's tower blocks
            after its feature layer, which it never runs).
        kept_renames: ``(other prefix, published prefix)`` pairs: a kept tensor read under another name of a module
            (``transformers``' in memory, or as ``transformers`` 5 saves it) is kept, and exported, under the
            published one.
        refused_inputs: processor outputs the checkpoint's class reads but this model cannot (Gemma 4's audio
            ``input_features``), each with why: ``model(...)`` and ``generate`` refuse them with that reason.
        mm_types_attend_both_ways: ``hf_config -> bool``: whether the processor's ``mm_token_type_ids`` (1 on image
            tokens, 2 on video tokens) make each image's tokens attend to each other both ways, as ``token_type_ids``
            do for Gemma 3 (Gemma 4's ``use_bidirectional_attention="vision"``); ``None``: they do not.
        prompt_learning: peft's prompt learning (prompt tuning, P-tuning, prefix tuning) applies: the embedder is a
            plain table lookup whose output peft prepends the virtual tokens to, and the decoder takes a prefix in
            its KV cache.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    weights: tuple[WeightRule, ...]
    build_model: Callable[..., Any]
    forward: Callable[..., Any]
    hidden_states: Callable[..., Any]
    logits_from_hidden: Callable[..., Any]
    ignored_hf_keys: tuple[str, ...] = ()
    lora_targets: Mapping[str, str] = field(default_factory=dict)
    default_lora_targets: tuple[str, ...] | str = ()
    quantization_excluded: tuple[str, ...] = ()
    norms_scale_by_one_plus_weight: bool = False
    config_weights: Callable[[Any], tuple[WeightRule, ...]] | None = None
    lora_refused: Mapping[str, str] = field(default_factory=dict)
    lora_not_linear: Mapping[str, str] = field(default_factory=dict)
    all_linear_refused: str = ""
    export_config: Callable[[dict], dict] | None = None
    tiny_configs: Mapping[str, TinyConfig] = field(default_factory=dict)
    import_tensors: Callable[[Any], Any] | None = None
    router_logits: Callable[..., Any] | None = None
    kept_hf_keys: tuple[str, ...] = ()
    images: Callable[..., Any] | None = None
    image_keys: tuple[str, ...] = ()
    no_images_reason: str = ""
    in_memory_prefixes: tuple[tuple[str, str], ...] = ()
    decoder: str = ""
    sequence_classification: Mapping[str, str] = field(default_factory=dict)
    prompt_learning: bool = False
    decay_overrides: Mapping[str, bool] = field(default_factory=dict)
    config_kept_keys: Callable[[Any], tuple[str, ...]] | None = None
    kept_renames: tuple[tuple[str, str], ...] = ()
    mm_types_attend_both_ways: Callable[[Any], bool] | None = None
    refused_inputs: Mapping[str, str] = field(default_factory=dict)

    def for_config(self, hf_config) -> Family:
        """This family with the rows ``hf_config`` adds (``config_weights``) and the tensors it keeps
        (``config_kept_keys``); the family itself when it adds none."""
        if self.config_weights is None and self.config_kept_keys is None:
            return self
        changes: dict[str, Any] = {"config_weights": None, "config_kept_keys": None}
        if self.config_weights is not None:
            changes["weights"] = self.weights + self.config_weights(hf_config)
        if self.config_kept_keys is not None:
            changes["kept_hf_keys"] = self.kept_hf_keys + self.config_kept_keys(hf_config)
        return dataclasses.replace(self, **changes)

    @functools.cached_property
    def _rows_by_hf_template(self) -> dict[str, list[WeightRule]]:
        """The rows of each HF template, keyed with ``{layer}`` written ``#``."""
        rows: dict[str, list[WeightRule]] = {}
        for rule in self.weights:
            rows.setdefault(rule.hf.replace("{layer}", "#"), []).append(rule)
        return rows

    def hf_to_nnx_all(self, hf_name: str) -> list[tuple[str, WeightRule]]:
        """The NNX paths and rules of every row an HF tensor name matches (several for a ``load_only`` tensor that
        fills several parameters; empty if none).

        The rows whose template is the name with its first dotted number as ``{layer}`` are tried first, so a table
        with a row per expert is not scanned row by row for each of its thousands of tensors.
        """
        likely = self._rows_by_hf_template.get(_FIRST_DOTTED_NUMBER.sub(".#.", hf_name, count=1), [])
        for rules in (likely, self.weights):
            found = [(rule.nnx.format(**match.groupdict()), rule) for rule in rules
                     if (match := rule.hf_regex.match(hf_name))]
            if found:
                return [(path, rule) for path, rule in found if rule.hf == found[0][1].hf]
        return []

    def hf_to_nnx(self, hf_name: str) -> tuple[str, WeightRule] | None:
        """The NNX path and rule for an HF tensor name (the first row it matches), or ``None`` if none."""
        found = self.hf_to_nnx_all(hf_name)
        return found[0] if found else None

    def nnx_to_hf(self, nnx_path: str) -> list[tuple[str, WeightRule]]:
        """The HF names (several when stacked) and rules for an NNX parameter path."""
        found = []
        for rule in self.weights:
            match = not rule.load_only and rule.nnx_regex.match(nnx_path)
            if match:
                found.append((rule.hf.format(**match.groupdict()), rule))
        return sorted(found, key=lambda item: item[1].stack or (0, 1))

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(pattern, hf_name) for pattern in self.ignored_hf_keys)

    def in_memory_name(self, hf_name: str) -> str:
        """The name ``transformers`` gives the checkpoint tensor ``hf_name`` in memory (``in_memory_prefixes``)."""
        for saved, in_memory in self.in_memory_prefixes:
            if hf_name.startswith(saved):
                return in_memory + hf_name[len(saved):]
        return hf_name

    def published_name(self, hf_name: str) -> str:
        """``hf_name`` under the published prefix where it uses another name of it (``kept_renames``)."""
        for other, published in self.kept_renames:
            if hf_name.startswith(other) and not hf_name.startswith(published):
                return published + hf_name[len(other):]
        return hf_name

    def is_kept(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is a tensor passed through import and export unchanged (``kept_hf_keys``)."""
        return any(re.fullmatch(pattern, hf_name) for pattern in self.kept_hf_keys)


def reprefixed(rows: tuple[WeightRule, ...], old: str, new: str, aliases: tuple[str, ...] = ()
               ) -> tuple[WeightRule, ...]:
    """A table's rows with the HF prefix ``old`` replaced by ``new`` (a text decoder's rows inside a multimodal
    checkpoint: ``model.layers.0...`` -> ``language_model.model.layers.0...``; ``old=""`` puts rows written relative
    to a tower under its prefix), plus, for each prefix in ``aliases``, ``load_only`` rows reading the same tensors
    under that prefix (the names ``transformers`` uses in memory).

    Raises:
        ValueError: a row whose HF name does not start with ``old``.
    """
    out = []
    for rule in rows:
        if not rule.hf.startswith(old):
            raise ValueError(f"row {rule.hf!r} does not start with {old!r}")
        rest = rule.hf[len(old):]
        out.append(dataclasses.replace(rule, hf=new + rest))
        out.extend(dataclasses.replace(rule, hf=alias + rest, load_only=True) for alias in aliases)
    return tuple(out)


def read_also_as(rows: tuple[WeightRule, ...], old: str, aliases: tuple[str, ...]) -> tuple[WeightRule, ...]:
    """Only the ``load_only`` rows of :func:`reprefixed`: the table's tensors read under other prefixes too (a text
    family reading a multimodal checkpoint's ``language_model`` names), never written as them."""
    return tuple(rule for rule in reprefixed(rows, old, old, aliases) if rule.load_only)


def images_by_row(input_ids: np.ndarray, image_token_id: int, items: list, tokens_of: Callable[[Any], int],
                  placeholder: str) -> list[list]:
    """``items`` (every image of a batch, in token order, row after row) split by row: each row takes images until
    they fill its image tokens (``tokens_of(item)`` each).

    Raises:
        ValueError: a row whose image tokens the images do not fill exactly, or images beyond the text's tokens,
            naming the counts and ``placeholder`` (the text's image marker).
    """
    counts = (np.asarray(input_ids) == image_token_id).sum(axis=1)
    rows, start = [], 0
    for row, count in enumerate(counts):
        taken, total = [], 0
        while total < count and start < len(items):
            taken.append(items[start])
            total += tokens_of(items[start])
            start += 1
        if total != count:
            raise ValueError(f"row {row} has {int(count)} image tokens (id {image_token_id}) but its images take "
                             f"{total}: build the prompts with the model's processor, one image per {placeholder}.")
        rows.append(taken)
    if start != len(items):
        raise ValueError(f"{len(items) - start} image(s) were given beyond the image tokens of the text (id "
                         f"{image_token_id}): each needs its placeholder tokens, as the processor writes them.")
    return rows


def require(condition: bool, message: str) -> None:
    """Raises :class:`UnsupportedConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UnsupportedConfigError(message)


DECODER_WEIGHTS: tuple[WeightRule, ...] = (
    WeightRule("model.embed_tokens.weight", "embedder.input_embedding"),
    WeightRule("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attn.q_proj.w", INPUT_PROJECTION),
    WeightRule("model.layers.{layer}.self_attn.k_proj.weight", "layers.{layer}.attn.k_proj.w", INPUT_PROJECTION),
    WeightRule("model.layers.{layer}.self_attn.v_proj.weight", "layers.{layer}.attn.v_proj.w", INPUT_PROJECTION),
    WeightRule("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.attn.o_proj.w", OUTPUT_PROJECTION),
    WeightRule("model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.mlp.gate_proj.kernel", TRANSPOSED),
    WeightRule("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.mlp.up_proj.kernel", TRANSPOSED),
    WeightRule("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.mlp.down_proj.kernel", TRANSPOSED),
    WeightRule("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.input_layernorm.w"),
    WeightRule("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.post_attention_layernorm.w"),
    WeightRule("model.norm.weight", "final_norm.w"),
    WeightRule("lm_head.weight", "lm_head.w", TRANSPOSED),
)
"""The Llama-style decoder table shared by Qwen2, Qwen3 and Llama 3 (each adds its extras)."""

DECODER_LORA_TARGETS: Mapping[str, str] = {
    "q_proj": r"layers/\d+/attn/q_proj",
    "k_proj": r"layers/\d+/attn/k_proj",
    "v_proj": r"layers/\d+/attn/v_proj",
    "o_proj": r"layers/\d+/attn/o_proj",
    "gate_proj": r"layers/\d+/mlp/gate_proj",
    "up_proj": r"layers/\d+/mlp/up_proj",
    "down_proj": r"layers/\d+/mlp/down_proj",
}

DECODER_IGNORED_KEYS: tuple[str, ...] = (r"model\.rotary_emb\..*", r"model\.layers\.\d+\.self_attn\.rotary_emb\..*")


def gemma_weights(post_attention_norm: str) -> tuple[WeightRule, ...]:
    """The Gemma decoder table that Gemma 2 and Gemma 3 share; Tunix names the post-attention norm
    ``post_attn_norm`` (its Gemma) or ``post_attention_norm`` (its Gemma3). The ``q_einsum``/``kv_einsum`` rows hold
    for every config because each family's ``build_model`` splits a fused ``qkv_einsum`` (:func:`split_fused_qkv`).
    """
    layer, nnx_layer = "model.layers.{layer}", "layers.{layer}"
    return (
        # Tunix's Embedder scales by sqrt(embed_dim) at lookup, as HF's scaled word embedding does, so the table
        # itself is stored unscaled on both sides.
        WeightRule("model.embed_tokens.weight", "embedder.input_embedding"),
        WeightRule(f"{layer}.self_attn.q_proj.weight", f"{nnx_layer}.attn.q_einsum.w", HEADS_FIRST_INPUT_PROJECTION),
        WeightRule(f"{layer}.self_attn.k_proj.weight", f"{nnx_layer}.attn.kv_einsum.w", HEADS_FIRST_INPUT_PROJECTION,
                   stack=(0, 2)),
        WeightRule(f"{layer}.self_attn.v_proj.weight", f"{nnx_layer}.attn.kv_einsum.w", HEADS_FIRST_INPUT_PROJECTION,
                   stack=(1, 2)),
        WeightRule(f"{layer}.self_attn.o_proj.weight", f"{nnx_layer}.attn.attn_vec_einsum.w", OUTPUT_PROJECTION),
        # Both sides apply RMSNorm weights as (1 + w), so the norms copy as they are.
        WeightRule(f"{layer}.input_layernorm.weight", f"{nnx_layer}.pre_attention_norm.scale"),
        WeightRule(f"{layer}.post_attention_layernorm.weight", f"{nnx_layer}.{post_attention_norm}.scale"),
        WeightRule(f"{layer}.pre_feedforward_layernorm.weight", f"{nnx_layer}.pre_ffw_norm.scale"),
        WeightRule(f"{layer}.post_feedforward_layernorm.weight", f"{nnx_layer}.post_ffw_norm.scale"),
        WeightRule(f"{layer}.mlp.gate_proj.weight", f"{nnx_layer}.mlp.gate_proj.kernel", TRANSPOSED),
        WeightRule(f"{layer}.mlp.up_proj.weight", f"{nnx_layer}.mlp.up_proj.kernel", TRANSPOSED),
        WeightRule(f"{layer}.mlp.down_proj.weight", f"{nnx_layer}.mlp.down_proj.kernel", TRANSPOSED),
        WeightRule("model.norm.weight", "final_norm.scale"),
    )


GEMMA_IGNORED_KEYS: tuple[str, ...] = DECODER_IGNORED_KEYS + (r"lm_head\.weight",)
"""Tunix's Gemma models decode with the input embedding (no lm_head) and both families require tied embeddings, so a
saved lm_head.weight is a copy of embed_tokens."""

GEMMA_LORA_TARGETS: Mapping[str, str] = {
    **DECODER_LORA_TARGETS,
    "q_proj": r"layers/\d+/attn/q_einsum",
    # k_proj and v_proj share one kv_einsum in Tunix: targeting either adapts both.
    "k_proj": r"layers/\d+/attn/kv_einsum",
    "v_proj": r"layers/\d+/attn/kv_einsum",
    "o_proj": r"layers/\d+/attn/attn_vec_einsum",
}


def gemma_model_sizes(hf_config) -> dict[str, int]:
    """The size fields of a Tunix Gemma or Gemma3 ``ModelConfig``, from the HF config."""
    return {
        "num_layers": hf_config.num_hidden_layers,
        "num_embed": hf_config.vocab_size,
        "embed_dim": hf_config.hidden_size,
        "hidden_dim": hf_config.intermediate_size,
        "num_heads": hf_config.num_attention_heads,
        "head_dim": hf_config.head_dim,
        "num_kv_heads": hf_config.num_key_value_heads,
    }


def split_fused_qkv(attention, einsum: type, config, rngs, **einsum_options) -> None:
    """Replaces a Tunix Gemma attention's fused ``qkv_einsum`` (num_kv_heads == heads) by ``q_einsum``/``kv_einsum``.

    The loader maps each HF tensor to one NNX path, so one table cannot send ``q_proj`` to ``q_einsum`` for GQA and
    to ``qkv_einsum[0]`` for MHA. Tunix's attention takes the unfused path whenever ``qkv_einsum`` is absent, and
    with K == N its non-GQA einsums compute the same thing, so the parameter tree is the only difference.

    Args:
        einsum: the Tunix module's ``Einsum`` class; ``einsum_options`` go to it (e.g. ``param_dtype``).
    """
    shd = config.shd_config
    attention.q_einsum = einsum(einsum_str="BTD,NDH->BTNH", shape=(config.num_heads, config.embed_dim, config.head_dim),
                                rngs=rngs, sharding=shd.q_weight_ndh, **einsum_options)
    attention.kv_einsum = einsum(einsum_str="BSD,CKDH->CBSKH",
                                 shape=(2, config.num_kv_heads, config.embed_dim, config.head_dim), rngs=rngs,
                                 sharding=shd.kv_weight_cndh, **einsum_options)
    del attention.qkv_einsum


def head_dim_of(hf_config) -> int:
    """The attention head size: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def decoder_forward(module, tokens, positions, attention_mask, **inputs):
    """Calls a Tunix decoder as ``module(tokens, positions, cache=None, attention_mask, **inputs)`` (``inputs``: a
    multimodal decoder's ``images``); returns float32 logits."""
    logits, _ = module(tokens, positions, None, attention_mask, **inputs)
    return logits.astype(jnp.float32)


def decoder_hidden_states(module, tokens, positions, attention_mask, **inputs):
    """The output of a Tunix decoder's ``final_norm`` (the head's input), ``[B, T, H]``; ``inputs`` as in
    :func:`decoder_forward`.

    Runs the module's own ``__call__``, as :func:`decoder_forward` does, so that Qwix's LoRA interception (which
    wraps only the top-level ``__call__``) and the rope patches apply, and records what ``final_norm`` returns. The
    logits the call also computes are unused: XLA removes them from a jitted program.
    """
    with _recorded_outputs(module.final_norm) as outputs:
        module(tokens, positions, None, attention_mask, **inputs)
    return outputs[-1]


def head_logits(module, hidden, tied: bool):
    """A Tunix decoder's output head on final-norm ``hidden`` states: its embedding's ``decode`` when the
    embeddings are tied, else its ``lm_head``; cast to float32 as :func:`decoder_forward` does."""
    head = module.embedder.decode if tied else module.lm_head
    return head(hidden).astype(jnp.float32)


@contextlib.contextmanager
def _recorded_outputs(submodule) -> Iterator[list]:
    """Within the block, every return value of ``submodule(...)`` is appended to the yielded list.

    The instance gets a subclass of its own class for the duration (Python looks ``__call__`` up on the type; Qwix
    swaps a module's class the same way), so the module tree and its parameters are untouched.
    """
    outputs: list = []
    original = type(submodule)

    def call(self, *args, **kwargs):
        output = original.__call__(self, *args, **kwargs)
        outputs.append(output)
        return output

    recording = type(original.__name__, (original,), {"__call__": call, "__module__": original.__module__})
    object.__setattr__(submodule, "__class__", recording)
    try:
        yield outputs
    finally:
        object.__setattr__(submodule, "__class__", original)


def check_decoder_config(hf_config, family: str) -> None:
    """Refuses the Llama-style config options no Tunix decoder implements."""
    activation = getattr(hf_config, "hidden_act", "silu")
    require(activation == "silu", f"{family}: hidden_act={activation!r} is not supported (only 'silu').")
    require(not getattr(hf_config, "mlp_bias", False), f"{family}: mlp_bias=True is not supported by the Tunix model.")
    require(getattr(hf_config, "num_experts", None) in (None, 0),
            f"{family}: mixture-of-experts checkpoints are not supported yet (dense models only).")
