"""The families on torchlike's native decoder (Mistral, Ministral, Phi-3, SmolLM3, OLMo 2/3, GPT-NeoX, Granite) against
``transformers``: fp32 logits on padded rows, greedy tokens on both rollout engines, the export round trip, the PEFT
adapter, state-dict surgery after ``get_peft_model``, and the config fields each refuses by name."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests import tiny
from tests.helpers.models import randomize_lora_, valid_max_diff
from torchlike.adapters.families import UnsupportedConfigError, family_for_config
from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest
from torchlike.adapters.rollout.sampling_settings import SamplingSettings
from torchlike.peft import LoraConfig, get_peft_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    """Each case's checkpoint and its ``transformers`` model (fp32, eager attention)."""
    loaded = {}

    def reference(case: str):
        if case not in loaded:
            path = tiny_checkpoints.path(case)
            loaded[case] = path, transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
        return loaded[case]

    return reference


def padded_logits(model) -> np.ndarray:
    ids, mask, _ = tiny.padded_batch()
    return np.asarray(model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("case", tiny.NATIVE_CASES)
def test_fp32_logits_equal_transformers_eager_on_left_and_right_padded_rows(case, references):
    path, reference = references(case)
    ids, mask, positions = tiny.padded_batch()
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    assert valid_max_diff(padded_logits(model), tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4


def _without_window(model):
    for layer in model.module.layers:
        layer.attn.window = None


def _rope_on_every_layer(model):
    rope = next(layer.attn.rope for layer in model.module.layers if layer.attn.rope is not None)
    for layer in model.module.layers:
        layer.attn.rope = rope


def _short_factors_only(model):
    for layer in model.module.layers:
        layer.attn.rope = dataclasses.replace(layer.attn.rope, long_inv_freq=())


def _half_split_rope(model):
    for layer in model.module.layers:
        if layer.attn.rope is not None:
            layer.attn.rope = dataclasses.replace(layer.attn.rope, interleaved=False)


def _sequential_residual(model):
    for layer in model.module.layers:
        layer.block_kind = "sequential"


def _no_multipliers(model):
    model.module.config = dataclasses.replace(model.module.config, embedding_multiplier=1.0, logits_divisor=1.0)
    for layer in model.module.layers:
        layer.residual_multiplier = 1.0


def _no_sinks(model):
    for layer in model.module.layers:
        layer.attn.sinks.set_value(jnp.full_like(layer.attn.sinks.get_value(), -1e30))


def _no_correction_bias(model):
    for layer in model.module.layers:
        if hasattr(layer.mlp, "e_score_correction_bias"):
            layer.mlp.e_score_correction_bias.set_value(jnp.zeros_like(layer.mlp.e_score_correction_bias.get_value()))


def _no_group_limit(model):
    for layer in model.module.layers:
        if hasattr(layer.mlp, "routed"):
            layer.mlp.routed = dataclasses.replace(layer.mlp.routed, topk_group=layer.mlp.routed.n_group)


def _unscaled_attention(model):
    for layer in model.module.layers:
        latent = layer.attn.spec.latent_attention
        layer.attn.spec = dataclasses.replace(layer.attn.spec, attention_scale=latent.qk_head_dim ** -0.5)


SWITCHES = [("gpt_oss", _no_sinks), ("gpt_oss", _without_window), ("glm4_moe", _no_correction_bias),
            ("glm4_moe", _no_group_limit), ("deepseek_v3", _unscaled_attention), ("deepseek_v3", _half_split_rope),
            ("mistral", _without_window), ("ministral", _without_window), ("phi3", _without_window),
            ("olmo3", _without_window), ("smollm3", _rope_on_every_layer), ("phi3_longrope", _short_factors_only),
            ("gpt_neox", _sequential_residual), ("granite", _no_multipliers), ("cohere2", _rope_on_every_layer),
            ("cohere2", _half_split_rope)]


@pytest.mark.parametrize(("case", "switch_off"), SWITCHES, ids=[f"{case}-{off.__name__}" for case, off in SWITCHES])
def test_each_family_switch_changes_the_logits_the_parity_test_checks(case, switch_off, tiny_checkpoints):
    """The parity test would fail if a family's switch were ignored: turning it off moves the logits by far more than
    its 1e-4 tolerance."""
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32")
    ids, mask, _ = tiny.padded_batch()
    honoured = padded_logits(model)
    switch_off(model)
    assert valid_max_diff(padded_logits(model), honoured, mask) > 1e-2


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, tiny.VOCAB, size=length).tolist() for length in (5, 13, 11)]  # 13 > the windows (8)


def _hf_greedy(reference, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# LongRoPE switches factors for a whole call once its largest position passes original_max_position_embeddings (as
# transformers' and vLLM's batched forward do), so a batch's tokens are not one-prompt generate's: its forward is
# checked above, as is the sequential GPT-NeoX variant's (its decoding is the parallel one's but for the residual).
GENERATED_CASES = [case for case in tiny.NATIVE_CASES if case not in ("phi3_longrope", "gpt_neox_sequential")]


@pytest.mark.parametrize("case", GENERATED_CASES)
def test_greedy_tokens_equal_transformers_generate_on_both_rollout_engines(case, references):
    path, reference = references(case)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    prompts = _prompts()
    expected = [_hf_greedy(reference, prompt) for prompt in prompts]

    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded, as generate takes them
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    static = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    assert np.asarray(static)[:, width:].tolist() == expected

    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=2, page_size=4, max_num_batched_tokens=6))
    outputs = engine.generate([RolloutRequest(prompt, NEW_TOKENS) for prompt in prompts], SamplingSettings())
    assert [output.token_ids[0].tolist() for output in outputs] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", tiny.NATIVE_CASES)
def test_save_pretrained_round_trips_bit_exact_and_transformers_reloads_it(case, dtype, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(case, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype=name)
    model.save_pretrained(tmp_path)
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, output_loading_info=True,
                                                                       attn_implementation="eager")
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    if dtype == torch.float32:
        ids, mask, positions = tiny.padded_batch()
        assert valid_max_diff(padded_logits(model), tiny.hf_logits(reloaded.eval(), ids, mask, positions), mask) <= 1e-4


def _lora_config(case: str, path) -> LoraConfig:
    """PEFT's default targets for the model type where PEFT has them, else every linear module."""
    family = family_for_config(transformers.AutoConfig.from_pretrained(path))
    targets = None if family.default_lora_targets else tiny.lora_targets(case)
    return LoraConfig(r=4, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")


@pytest.mark.parametrize("case", tiny.NATIVE_CASES)
def test_the_peft_adapter_loads_in_peft_with_the_same_logits(case, references, tmp_path):
    path, _ = references(case)
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
                           _lora_config(case, path))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager"),
        tmp_path / "adapter").eval()
    ids, mask, positions = tiny.padded_batch()
    assert valid_max_diff(padded_logits(model), tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4
    if case in ("phi3", "gpt_neox"):  # a fused projection is one PEFT module, adapted as a whole
        fused = {"phi3": "self_attn.qkv_proj", "gpt_neox": "attention.query_key_value"}[case]
        assert any(fused in name for name, _ in reference.named_modules() if name.endswith("lora_A"))


@pytest.mark.parametrize("case", ["mistral", "phi3", "gpt_neox"])
def test_load_state_dict_after_get_peft_model_reports_the_adapter_missing(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    base = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    expected = padded_logits(base)
    state = base.state_dict()
    target = get_peft_model(torchlike.AutoModelForCausalLM.from_config(base.config, dtype="float32", seed=1),
                            _lora_config(case, path))
    missing, unexpected = target.load_state_dict(state, strict=False)
    assert unexpected == [] and missing and all("lora" in key for key in missing)
    np.testing.assert_array_equal(padded_logits(target), expected)


REFUSED = [
    ("mistral", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("mistral", dict(hidden_act="mish"), "hidden_act='mish'"),
    ("mistral", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
     "rope_type='dynamic'"),
    ("gpt_neox", dict(hidden_dropout=0.1), "hidden_dropout=0.1"),
    ("ministral", dict(layer_types=["chunked_attention", "full_attention"]), "chunked_attention"),
    ("phi3", dict(attention_bias=True), "attention_bias=True"),
]


@pytest.mark.parametrize(("family", "change", "field"), REFUSED, ids=[field for _, _, field in REFUSED])
def test_a_config_feature_the_family_does_not_compute_is_refused_by_name(family, change, field):
    from torchlike.testing import tiny_config

    config = tiny_config(family, **change)
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
        torchlike.AutoModelForCausalLM.from_config(config, dtype="float32")


def test_gpt_oss_router_aux_loss_equals_transformers_and_is_added_to_the_loss(references):
    from torchlike.adapters.losses import router as router_loss
    from torchlike.adapters.losses import sft as sft_loss
    from torchlike.adapters.model.tunix_model import causal_attention, positions_from_mask

    path, reference = references("gpt_oss")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ids, mask, _ = tiny.padded_batch()
    labels = np.where(mask.astype(bool), ids, -100)
    reference.router_aux_loss_coef = 0.25
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
                        output_router_logits=True)
    tokens, valid = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)

    def forward(module):
        return model.family.forward(module, tokens, positions_from_mask(valid), causal_attention(valid))

    _, record = model.family.router_logits(forward, model.module)
    assert len(record.logits) == model.config.num_hidden_layers and record.top_k == 2
    aux = router_loss.load_balancing_loss(record.logits, jnp.asarray(mask), record.top_k)
    assert abs(float(aux) - float(out.aux_loss)) <= 1e-5
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(mask)}
    value, count, metrics = sft_loss.sft_step_loss(model.family, router_aux_loss_coef=0.25)(model.module, batch)
    assert abs(float(value / count) - float(out.loss)) <= 1e-5
    assert abs(float(metrics["aux_loss"]) - float(out.aux_loss)) <= 1e-5


def test_lora_on_gpt_oss_experts_is_refused_naming_the_module(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gpt_oss"), dtype="float32")
    with pytest.raises(ValueError, match=r"\['experts'\] matches no module.*model\.layers\.0\.mlp\.experts.*"
                                         r"stacked parameters"):
        get_peft_model(model, LoraConfig(target_modules=["experts"]))
    # Llama's list of projections adapts the attention, as in PEFT (GPT-OSS has no linear MLP projections).
    adapted = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"]))
    assert {key.split(".")[3] for key in adapted.state_dict() if "lora" in key} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("case", ["glm4_moe", "deepseek_v3"])
def test_all_linear_is_refused_where_peft_would_adapt_the_routed_experts(case, tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32")
    with pytest.raises(ValueError, match=r"'all-linear' is not supported.*routed experts.*target_parameters"):
        get_peft_model(model, LoraConfig(target_modules="all-linear"))
    # PEFT applies the MLP names to the routed experts' parameters on these model types.
    with pytest.raises(ValueError, match=r"names model\.layers\.0\.mlp\.gate_proj.*routed experts"):
        get_peft_model(model, LoraConfig(target_modules=["gate_proj", "o_proj"]))


def test_olmo3_export_writes_its_rope_per_layer_type_too(tiny_checkpoints, tmp_path):
    """Later transformers (and vLLM) read OLMo 3's rope per layer type; the flat keys stay for the pinned one."""
    import json

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("olmo3"), dtype="float32")
    model.save_pretrained(tmp_path)
    rope = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert rope["rope_theta"] == 10000.0
    assert rope["sliding_attention"] == rope["full_attention"] == {"rope_theta": 10000.0, "rope_type": "default"}


def _mxfp4_pack(values: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random MXFP4 codes for a tensor laid out as ``values`` ``[E, columns, rows]``: ``(blocks, scales, the exact
    float32 values they hold, in ``values``' layout)``."""
    from torchlike.adapters.checkpoint.mxfp4 import FP4_VALUES

    experts, columns, rows = values.shape
    codes = rng.integers(0, 16, size=(experts, rows, columns // 32, 32)).astype(np.uint8)
    scales = rng.integers(120, 126, size=(experts, rows, columns // 32)).astype(np.uint8)
    exact = np.ldexp(FP4_VALUES[codes], (scales.astype(np.int32) - 127)[..., None]).reshape(experts, rows, columns)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales, np.swapaxes(exact, 1, 2)


def test_gpt_oss_mxfp4_experts_are_dequantised_on_import_and_exported_in_bf16(tmp_path):
    """An MXFP4 checkpoint (the layout OpenAI publishes: ``<name>_blocks``, ``<name>_scales``) loads with the values
    transformers dequantises, and exports as plain bfloat16 experts without the MXFP4 ``quantization_config``."""
    import json

    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    reference = tiny.build_hf_model(tiny.CASES["gpt_oss"](), dtype=torch.bfloat16)
    state = {name: tensor.float().numpy() for name, tensor in reference.state_dict().items()}
    quantized = {}
    for name in [name for name in state if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, exact = _mxfp4_pack(state.pop(name), rng)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        state[name] = exact
        # transformers' own dequantisation of the pair gives these values
        theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales)).float().numpy()
        np.testing.assert_array_equal(theirs, exact)
    with torch.no_grad():  # the plain reference holds exactly the quantised values
        reference.load_state_dict({name: torch.tensor(value).to(torch.bfloat16) for name, value in state.items()})
    reference.save_pretrained(tmp_path / "plain")
    (tmp_path / "mxfp4").mkdir()
    tensors = {name: value.astype(ml_dtypes.bfloat16) for name, value in state.items()
               if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **quantized}, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    model = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype="bfloat16")
    plain = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype="bfloat16")
    ours, expected = model.state_dict(), plain.state_dict()
    assert sorted(ours) == sorted(expected)
    for key, value in expected.items():
        assert np.array_equal(np.asarray(ours[key]), np.asarray(value)), key
    model.save_pretrained(tmp_path / "exported")
    assert "quantization_config" not in json.loads((tmp_path / "exported" / "config.json").read_text())
    exported, original = load_file(tmp_path / "exported" / "model.safetensors"), load_file(
        tmp_path / "plain" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(np.array_equal(exported[key], original[key]) for key in original)


def test_deepseek_multi_token_prediction_layers_are_not_loaded_and_named_in_a_note(tiny_checkpoints, tmp_path):
    import json

    from safetensors.numpy import save_file

    source = tiny_checkpoints.path("deepseek_v3")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.2.self_attn.q_a_proj.weight"] = tensors["model.layers.1.self_attn.q_a_proj.weight"]
    tensors["model.layers.2.enorm.weight"] = tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match=r"1 multi-token-prediction layer.*model\.layers\.2\.\*.*not loaded") as seen:
        model = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32")
    assert not any("were not used" in str(warning.message) for warning in seen)
    reference = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    np.testing.assert_array_equal(padded_logits(model), padded_logits(reference))


@pytest.mark.parametrize("case", ["mistral", "phi3"])
def test_qlora_quantises_every_adapted_projection_and_keeps_the_outputs(case, tiny_checkpoints):
    """Qwix's QLoRA on the native decoder: every adapted nnx.Linear (the attention too, fused ones included) holds
    quantised base weights, and the outputs stay those of the model up to 8-bit rounding."""
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32")
    targets = tiny.lora_targets(case)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, quantize_base="int8"))
    keys = list(model.state_dict())
    attention = "qkv_proj" if case == "phi3" else "q_proj"
    assert any(key.startswith(f"layers.0.attn.{attention}.kernel.") and "qvalue" in key for key in keys)
    assert any(key.startswith("layers.0.mlp.down_proj.kernel.") and "qvalue" in key for key in keys)
    ids, mask, _ = tiny.padded_batch()
    quantised, reference = padded_logits(model), padded_logits(base)
    valid = mask.astype(bool)
    assert 0 < valid_max_diff(quantised, reference, mask) < 0.1
    assert np.corrcoef(quantised[valid].ravel(), reference[valid].ravel())[0, 1] > 0.99
