"""torchlike.peft against the real peft: adapter files, logits, merging, dropout, QLoRA."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import peft
import pytest
import transformers
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
from safetensors import safe_open

import torchlike
from tests import tiny
from tests.helpers.models import randomize_lora_, valid_max_diff
from torchlike.adapters.families import all_families
from torchlike.adapters.lora import runtime as lora_runtime
from torchlike.adapters.lora import targets as lora_targets
from torchlike.adapters.model import tunix_model
from torchlike.peft import LoraConfig, PeftModel, get_peft_model

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen2_path(tiny_checkpoints):
    return tiny_checkpoints.path("qwen2")


def test_a_fresh_adapter_leaves_the_outputs_unchanged(qwen2_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))
    ids, mask, _ = tiny.padded_batch()
    np.testing.assert_array_equal(np.asarray(model(ids, mask).logits), np.asarray(base(ids, mask).logits))


@pytest.mark.parametrize("case", ["qwen2", "llama32", "gemma3"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_exported_adapter_loads_in_real_peft_with_the_same_logits(case, use_rslora, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(case)
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", use_rslora=use_rslora,
                                      lora_dropout=0.1, task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")

    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["use_rslora"] == use_rslora
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32"), tmp_path / "adapter").eval()
    ids, mask, positions = tiny.padded_batch()
    assert valid_max_diff(model(ids, mask).logits, tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4


def test_adapter_keys_and_shapes_follow_peft_layout(qwen2_path, tmp_path):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)
    assert tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    assert len(tensors) == 2 * 2 * 2


def test_merged_export_loads_in_transformers_with_the_same_logits(qwen2_path, tmp_path):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    randomize_lora_(model, seed=1)
    merged = model.merge_and_unload()
    assert not any("_lora_" in name for name, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="float32").eval()
    ids, mask, positions = tiny.padded_batch()
    lora_logits = model(ids, mask).logits
    assert valid_max_diff(merged(ids, mask).logits, lora_logits, mask) <= 1e-5
    assert valid_max_diff(tiny.hf_logits(reloaded, ids, mask, positions), lora_logits, mask) <= 1e-4


def test_peft_model_from_pretrained_reads_a_real_peft_adapter(qwen2_path, tmp_path):
    reference = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(qwen2_path, dtype="float32"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    reference.save_pretrained(tmp_path / "adapter")
    model = PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), tmp_path / "adapter")
    ids, mask, positions = tiny.padded_batch()
    assert valid_max_diff(model(ids, mask).logits, tiny.hf_logits(reference.eval(), ids, mask, positions), mask) <= 1e-4
    assert model.is_trainable is False and model.num_parameters(only_trainable=True) == 0


def test_is_trainable_true_counts_the_adapter_as_trainable(qwen2_path, tmp_path, capsys):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), tmp_path,
                                         is_trainable=True)
    reloaded.print_trainable_parameters()
    lora = 2 * (64 * 4 + 4 * 64)
    total = reloaded.base_model.num_parameters() + lora
    assert capsys.readouterr().out.strip() == (
        f"trainable params: {lora:,d} || all params: {total:,d} || trainable%: {100 * lora / total:.4f}")


def test_disable_adapter_gives_the_base_model_outputs(qwen2_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    randomize_lora_(model, seed=2)
    ids, mask, _ = tiny.padded_batch()
    with model.disable_adapter():
        np.testing.assert_array_equal(np.asarray(model(ids, mask).logits), np.asarray(base(ids, mask).logits))
    assert valid_max_diff(model(ids, mask).logits, base(ids, mask).logits, mask) > 1e-2


def test_lora_dropout_is_active_only_in_training_steps(qwen2_path):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules="all-linear"))
    randomize_lora_(model, seed=3)
    ids, mask, _ = tiny.padded_batch()
    first, second = np.asarray(model(ids, mask).logits), np.asarray(model(ids, mask).logits)
    np.testing.assert_array_equal(first, second)  # eval: deterministic, no dropout
    tokens, positions, attention = tunix_model.causal_inputs(ids, mask)
    lora_runtime.set_dropout_rng(model.module, jax.random.key(0))
    with lora_runtime.lora_mode(lora_runtime.TRAIN):
        trained = np.asarray(model.family.forward(model.module, tokens, positions, attention))
    assert valid_max_diff(trained, first, mask) > 1e-3


@pytest.mark.parametrize("targets, expected", [
    (["q_proj", "v_proj"], {"q_proj", "v_proj"}),
    (r"model\.layers\.1\.mlp\.(up|down)_proj", {"up_proj", "down_proj"}),
    ("all-linear", set(ALL_LINEAR)),
])
def test_target_modules_accept_names_regex_and_all_linear(qwen2_path, targets, expected):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                           LoraConfig(r=2, target_modules=targets))
    adapted = {name.split(".")[-2] for name, _ in model.named_parameters() if "_lora_" in name}
    assert adapted == expected
    if isinstance(targets, str) and targets.startswith("model"):
        assert all(name.startswith("layers.1.") for name, _ in model.named_parameters() if "_lora_" in name)


def _peft_default_adapter(path, tmp_path):
    """``peft.get_peft_model`` with ``target_modules`` left to PEFT's per-architecture default, saved."""
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
                                    peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False))
    reference.save_pretrained(tmp_path / "peft")
    return reference.eval(), tmp_path / "peft"


def _adapter_keys(directory) -> set[str]:
    with safe_open(directory / "adapter_model.safetensors", "np") as handle:
        return set(handle.keys())


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "llama3"])
def test_target_modules_default_to_the_modules_peft_adapts(case, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(case)
    _, peft_dir = _peft_default_adapter(path, tmp_path)
    config = LoraConfig(r=4, task_type="CAUSAL_LM")
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path), config)
    model.save_pretrained(tmp_path / "ours")
    assert config.target_modules == ["q_proj", "v_proj"]
    assert _adapter_keys(tmp_path / "ours") == _adapter_keys(peft_dir)
    ours = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    theirs = json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"]
    assert sorted(ours) == sorted(theirs)


def test_gemma3_default_targets_also_adapt_k_proj_fused_with_v_proj(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma3")
    _, peft_dir = _peft_default_adapter(path, tmp_path)
    with pytest.warns(UserWarning, match=r"gemma3: adapting \['k_proj'\] too.*one LoRA pair serves both"):
        model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4))
    model.save_pretrained(tmp_path / "ours")
    k_proj = {f"base_model.model.model.layers.{layer}.self_attn.k_proj.lora_{factor}.weight"
              for layer in range(2) for factor in "AB"}
    assert _adapter_keys(tmp_path / "ours") == _adapter_keys(peft_dir) | k_proj
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["k_proj", "q_proj", "v_proj"]


def test_a_real_peft_gemma3_adapter_with_default_targets_loads_with_the_same_logits(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("gemma3")
    reference, peft_dir = _peft_default_adapter(path, tmp_path)
    with pytest.warns(UserWarning, match="adapting \\['k_proj'\\] too"):
        model = PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(path), peft_dir)
    ids, mask, positions = tiny.padded_batch()
    assert valid_max_diff(model(ids, mask).logits, tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4


def test_every_family_default_target_modules_is_peft_default_for_its_model_type():
    for family in all_families():
        for model_type in family.model_types:
            ours = family.default_lora_targets
            assert (ours if isinstance(ours, str) else list(ours)) == PEFT_DEFAULTS.get(model_type, []), (
                family.name, model_type)


def test_a_family_without_default_targets_asks_for_target_modules():
    family = dataclasses.replace(all_families()[0], default_lora_targets=())
    with pytest.raises(ValueError, match=r"the qwen2 family has no default LoRA target_modules; set "
                                         r"LoraConfig\(target_modules=\.\.\.\).*'all-linear'"):
        lora_targets.default_target_modules(family)


def test_unknown_target_module_names_list_the_valid_ones(qwen2_path):
    with pytest.raises(ValueError, match=r"\['qkv'\] match no module.*'q_proj'"):
        get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                       LoraConfig(target_modules=["qkv"]))


@pytest.mark.parametrize("option", [{"use_dora": True}, {"modules_to_save": ["lm_head"]}, {"bias": "all"},
                                    {"layers_to_transform": [0]}])
def test_unsupported_peft_options_are_refused_with_a_reason(option):
    with pytest.raises(ValueError, match=f"LoraConfig.{next(iter(option))}=.*is not supported: "):
        LoraConfig(target_modules=["q_proj"], **option)


def test_qlora_nf4_quantises_gemma3_base_weights_and_trains_the_adapter(tiny_checkpoints):
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj"],
                                            quantize_base="nf4", quantization_tile_size=16))
    keys = dict(model.state_dict())
    assert any(name.startswith("layers.0.mlp.gate_proj.kernel.") and "qvalue" in name for name in keys)
    ids, mask, _ = tiny.padded_batch()
    quantised = np.asarray(model(ids, mask).logits)
    reference = np.asarray(base(ids, mask).logits)
    assert np.isfinite(quantised).all() and valid_max_diff(quantised, reference, mask) > 0
    valid = mask.astype(bool)
    correlation = np.corrcoef(quantised[valid].ravel(), reference[valid].ravel())[0, 1]
    assert correlation > 0.9  # 4-bit rounding of the MLP, not garbage


def test_qlora_on_qwen2_keeps_attention_in_full_precision_with_a_warning(qwen2_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path)
    with pytest.warns(UserWarning, match="attention projections keep full-precision base weights"):
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", quantize_base="int8"))
    names = list(model.state_dict())
    assert any(name.startswith("layers.0.mlp.down_proj.kernel.") for name in names)
    assert "layers.0.attn.q_proj.w" in names and "layers.0.attn.q_proj.w_lora_a" in names
    ids, mask, _ = tiny.padded_batch()
    assert np.isfinite(np.asarray(model(ids, mask).logits)).all()


def test_bitsandbytes_4bit_request_at_load_time_becomes_nf4_qlora(tiny_checkpoints):
    with pytest.warns(UserWarning, match="quantization requested \\(nf4\\)"):
        base = torchlike.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoints.path("gemma3"), quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["up_proj"], quantization_tile_size=16))
    assert model.active_peft_config.quantize_base == "nf4"
    assert any(name.startswith("layers.0.mlp.up_proj.kernel.") for name in model.state_dict())


def test_quantisation_without_a_qwix_equivalent_is_refused_or_mapped_with_a_warning(qwen2_path):
    with pytest.raises(ValueError, match="quant_method='gptq' is not supported"):
        torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path, quantization_config={"quant_method": "gptq"})
    with pytest.warns(UserWarning, match="bnb_4bit_quant_type='fp4' has no Qwix equivalent"):
        model = torchlike.AutoModelForCausalLM.from_pretrained(
            qwen2_path, quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"})
    assert model.quantization == "nf4"
