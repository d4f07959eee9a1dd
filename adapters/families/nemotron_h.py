"""Nemotron-H (``NemotronHForCausalLM``) on the native decoder: a hybrid whose every layer is one component, chosen by
``config.layers_block_type`` (``hybrid_override_pattern``'s ``M``, ``*``, ``-``): a Mamba-2 mixer
(:mod:`adapters.model.mamba2`), grouped-query attention without rotary embedding, or a plain squared-ReLU MLP
(``up_proj``/``down_proj``), each wired ``x + op(norm(x))`` (``DecoderSpec.block="single"``). The checkpoints name the
model ``backbone.`` (``backbone.embedding``, ``backbone.norm_f``), which ``transformers`` renames ``model.`` in memory.

Refused by name: mixture-of-experts layers (``E``, ``moe``), which torchlike does not compute for this family; LoRA on
the mixers' ``out_proj`` and ``conv1d`` (and so ``all-linear``), which PEFT refuses on Nemotron-H. The
multi-token-prediction weights (``mtp.*``) are skipped, as ``transformers`` skips them.
"""

from __future__ import annotations

from ..model.mamba2 import Mamba2Spec
from ..model.native_decoder import ACTIVATIONS, DecoderSpec
from .base import TinyConfig, WeightRule, require
from .native import check_native_config, linear_rows, lora_targets_of, native_family, norm_rows, sizes
from .qwen3_next import DEPTHWISE_CONV_WEIGHT

FAMILY_NAME = "nemotron_h"
BLOCK_TYPES = {"mamba": "mamba", "attention": "attention", "mlp": "mlp"}
"""``config.layers_block_type`` -> the native decoder's layer types."""


def layer_types(hf_config) -> tuple[str, ...]:
    """The native layer types of ``config.layers_block_type``, checked.

    Raises:
        UnsupportedConfigError: a ``moe`` layer (``E`` in ``hybrid_override_pattern``) or an unknown block type.
    """
    types = list(hf_config.layers_block_type)
    experts = [index for index, kind in enumerate(types) if kind == "moe"]
    require(not experts, f"{FAMILY_NAME}: layers_block_type has 'moe' layers at {experts} (hybrid_override_pattern "
                         f"{hf_config.hybrid_override_pattern!r}): Nemotron-H's mixture-of-experts layers are not "
                         f"supported; use a checkpoint of mamba, attention and mlp layers ('M', '*', '-').")
    unknown = sorted(set(types) - set(BLOCK_TYPES))
    require(not unknown, f"{FAMILY_NAME}: layers_block_type {unknown} are not supported; supported: "
                         f"{sorted(BLOCK_TYPES)}.")
    return tuple(BLOCK_TYPES[kind] for kind in types)


def mamba2_spec(hf_config) -> Mamba2Spec:
    """The Mamba-2 settings of a Nemotron-H config, checked."""
    heads, groups = hf_config.mamba_num_heads, hf_config.n_groups
    require(heads % groups == 0, f"{FAMILY_NAME}: mamba_num_heads={heads} must be a multiple of n_groups={groups}.")
    activation = hf_config.mamba_hidden_act
    require(activation in ACTIVATIONS, f"{FAMILY_NAME}: mamba_hidden_act={activation!r} is not supported; supported: "
                                       f"{sorted(ACTIVATIONS)}.")
    return Mamba2Spec(num_heads=heads, head_dim=hf_config.mamba_head_dim, state_size=hf_config.ssm_state_size,
                      n_groups=groups, conv_kernel=hf_config.conv_kernel, chunk_size=hf_config.chunk_size,
                      conv_bias=bool(hf_config.use_conv_bias), projection_bias=bool(hf_config.use_bias),
                      activation=activation, time_step_min=float(hf_config.time_step_min),
                      norm_eps=hf_config.layer_norm_epsilon)


def spec_from_config(hf_config, dtype) -> DecoderSpec:
    """The decoder spec of a Nemotron-H config.

    ``transformers``' Nemotron-H attention has no rotary embedding and no biases whatever ``attention_bias`` says, no
    sliding window, and its ``lm_head`` is never tied to the embedding (``_tied_weights_keys`` is empty); the decoder
    computes the same.

    Raises:
        UnsupportedConfigError: a ``moe`` layer, dropout, or an activation the decoder lacks, named with its field.
    """
    check_native_config(hf_config, FAMILY_NAME, activation_field="mlp_hidden_act")
    types = layer_types(hf_config)
    layers = len(types)
    return DecoderSpec(**(sizes(hf_config, dtype) | {"tie_embeddings": False}), ropes=(None,) * layers,
                       windows=(None,) * layers, norm_eps=hf_config.layer_norm_epsilon, block="single", mlp="plain",
                       activation=hf_config.mlp_hidden_act, mlp_bias=bool(hf_config.mlp_bias), layer_types=types,
                       recurrent_mixers=(("mamba", mamba2_spec(hf_config)),))


LAYER, NNX_LAYER = "backbone.layers.{layer}", "layers.{layer}"
MIXER = f"{LAYER}.mixer"
NNX_MAMBA = f"{NNX_LAYER}.mamba"


def _rows() -> tuple[WeightRule, ...]:
    rows = [WeightRule("backbone.embedding.weight", "embedder.input_embedding")]
    rows += norm_rows(f"{LAYER}.norm", f"{NNX_LAYER}.input_layernorm")
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rows += linear_rows(f"{MIXER}.{projection}", f"{NNX_LAYER}.attn.{projection}")
    # Every bias row is listed: a config without mlp_bias / use_bias has no bias parameter for them to fill.
    for projection in ("up_proj", "down_proj"):
        rows += linear_rows(f"{MIXER}.{projection}", f"{NNX_LAYER}.mlp.{projection}", bias=True)
    for projection in ("in_proj", "out_proj"):
        rows += linear_rows(f"{MIXER}.{projection}", f"{NNX_MAMBA}.{projection}", bias=True)
    rows += [WeightRule(f"{MIXER}.conv1d.weight", f"{NNX_MAMBA}.conv1d.weight", DEPTHWISE_CONV_WEIGHT),
             WeightRule(f"{MIXER}.conv1d.bias", f"{NNX_MAMBA}.conv1d.bias"),
             *(WeightRule(f"{MIXER}.{name}", f"{NNX_MAMBA}.{name}") for name in ("dt_bias", "A_log", "D")),
             WeightRule(f"{MIXER}.norm.weight", f"{NNX_MAMBA}.norm.weight")]
    rows += norm_rows("backbone.norm_f", "final_norm")
    rows += linear_rows("lm_head", "lm_head")
    return tuple(rows)


WEIGHTS = _rows()

LORA_TARGETS = lora_targets_of(mlp=("up_proj", "down_proj")) | {"in_proj": r"layers/\d+/mamba/in_proj"}
"""HF module names LoRA adapts: the attention projections, the MLPs' ``up_proj``/``down_proj`` and the Mamba-2
mixers' ``in_proj``."""

PEFT_REFUSES = ("PEFT refuses LoRA on the out_proj and conv1d of Mamba-based models (model_type 'nemotron_h'), so such "
                "an adapter would not load there; adapt in_proj, the attention projections (q_proj, k_proj, v_proj, "
                "o_proj) and the MLPs (up_proj, down_proj)")
LORA_REFUSED = {r"backbone\.layers\.\d+\.mixer\.(out_proj|conv1d)": PEFT_REFUSES}

TINY_CONFIGS = {
    # Mamba-2, attention, Mamba-2, MLP ("M*M-"): 8 Mamba heads of 8 in 2 groups of B/C (4 heads each) with a state
    # of 16, the convolution with its bias, chunks of 32 (an 80-token row ends in a partial third chunk; the state
    # carried across chunks is checked against transformers' cached step, see adapters/upstream.py).
    "nemotron_h": TinyConfig("NemotronHConfig", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=32, use_conv_bias=True,
        layer_norm_epsilon=1e-5, use_mamba_kernels=False, tie_word_embeddings=False)),
}
"""The tests' and examples' tiny configs of the family (``torchlike.testing.tiny_config``)."""

FAMILY = native_family(
    name=FAMILY_NAME,
    model_types=(FAMILY_NAME,),
    architectures=("NemotronHForCausalLM",),
    spec_from_config=spec_from_config,
    weights=WEIGHTS,
    lora_targets=LORA_TARGETS,
    lora_refused=LORA_REFUSED,
    all_linear_refused=f"it reaches the Mamba-2 out_proj: {PEFT_REFUSES}",
    default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),  # PEFT's default for model_type "nemotron_h"
    # transformers skips the multi-token-prediction layers on load and never saves them.
    ignored_hf_keys=(r"mtp\..*",),
    in_memory_prefixes=(("backbone.embedding.", "model.embeddings."), ("backbone.", "model.")),
    tiny_configs=TINY_CONFIGS,
)
