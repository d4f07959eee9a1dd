"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) against ``transformers`` (eager, float32): logits with images
of different sizes and a text-only row in one batch, greedy generation with images on both rollout engines, the
export (``transformers``' fused expert layout) and its round trip, a PEFT adapter, and SFT equal to TRL step for step
with the router's load-balancing loss."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests.helpers.models import randomize_lora_, valid_max_diff, with_config
from tests.helpers.vision import (
    SFT_SETTINGS,
    assert_sft_matches_trl,
    hf_vlm,
    image_conversations,
    offline_runs,
    qwen_vl_image_batch,
    reference_logits,
    save_tiny_vlm,
)
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_image

CLASS = "Qwen3VLMoeForConditionalGeneration"
EXPERTS = "model.language_model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """The tiny checkpoint (layer 0 dense, layer 1 4 experts of 24, 2 per token) with its processor."""
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl_moe"), "qwen3_vl_moe")


@pytest.fixture(scope="module")
def model(path):
    return torchlike.AutoModelForImageTextToText.from_pretrained(path)


@pytest.fixture(scope="module")
def inputs(path):
    """Three prompts, padded on the left: one 16x16 image; a 16x32 and a 32x32 image; text alone."""
    return qwen_vl_image_batch(path, "left")


def test_image_and_text_logits_equal_transformers(model, path, inputs):
    assert model.family.architectures == (CLASS,)
    mask = inputs["attention_mask"]
    reference = reference_logits(hf_vlm(path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, mask) <= 1e-4
    assert valid_max_diff(model(inputs["input_ids"], mask).logits, reference, mask) > 1e-2  # the images matter


def test_greedy_generate_with_images_equals_transformers_on_both_engines(model, path, inputs):
    with torch.no_grad():
        expected = hf_vlm(path).generate(**{key: torch.tensor(value) for key, value in inputs.items()},
                                         max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected), engine


def test_export_keeps_the_fused_experts_and_round_trips_bit_exact(model, path, inputs, tmp_path):
    source = load_file(path / "model.safetensors")
    assert source[EXPERTS + "gate_up_proj"].shape == (4, 48, 64) and source[EXPERTS + "down_proj"].shape == (4, 64, 24)
    model.save_pretrained(tmp_path / "once")
    once = load_file(tmp_path / "once" / "model.safetensors")
    assert json.loads((tmp_path / "once" / "config.json").read_text())["architectures"] == [CLASS]
    assert set(once) == set(source)
    for name, array in source.items():
        assert once[name].dtype == array.dtype and np.array_equal(once[name], array), name
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "once", attn_implementation="eager", output_loading_info=True)
    assert type(reloaded).__name__ == CLASS
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert np.array_equal(reference_logits(reloaded.eval(), inputs), reference_logits(hf_vlm(path), inputs))


def test_lora_all_linear_has_peft_keys_and_loads_in_peft_with_the_same_logits(path, inputs, tmp_path):
    """PEFT's ``"all-linear"`` adapts the attention, the dense layer's MLP and the tower; the fused experts and the
    router are parameters and a ``Qwen3VLMoeTextTopKRouter``, not linear modules, and are left alone on both sides."""
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.language_model.layers.0.mlp.gate_proj.lora_A.weight" in keys
    assert not any(".layers.1.mlp." in key for key in keys)
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    assert valid_max_diff(model(**inputs).logits, reference_logits(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4



def test_mlp_names_adapt_the_dense_layer_only_and_the_experts_are_refused_by_name(model, path, tmp_path):
    """PEFT has no ``target_parameters`` remapping for this model type: ``gate_proj``/``up_proj``/``down_proj`` reach
    the dense layer's MLP (``mlp_only_layers``) only; naming the experts or the router is refused, in PEFT as here."""
    targets = ["gate_proj", "up_proj", "down_proj", "q_proj"]
    adapted = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                             LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"))
    adapted.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules=targets))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    assert not any(".layers.1.mlp." in key for key in keys)
    with pytest.raises(ValueError, match=r"mlp\.experts is not adapted: transformers keeps the routed experts"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["experts"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=r"mlp\.gate is not adapted: the router is not a linear module"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["gate"], task_type="CAUSAL_LM"))



def conversation_rows(count: int) -> list[dict]:
    """Conversations with images of three sizes in turn (grids 1x4x4, 1x4x8, 1x8x8) and none every fourth row."""
    return image_conversations(count, lambda row: [] if row % 4 == 3 else
                               [tiny_image(row, 32).resize(((16, 16), (32, 16), (32, 32))[row % 4])])


def test_sft_with_the_router_loss_matches_trl_step_for_step(path, tmp_path):
    """``Qwen3VLMoeTextConfig`` has no ``output_router_logits``, so TRL adds the router loss only when the config sets
    it: here it does, and ``router_aux_loss_coef`` is raised so the loss moves the router at the tolerance."""
    config = json.loads((path / "config.json").read_text())
    routed = with_config(path, tmp_path / "routed",
                         text_config={**config["text_config"], "output_router_logits": True})
    settings = dict(SFT_SETTINGS, router_aux_loss_coef=0.5)
    reference, trainer = offline_runs("SFT", routed, conversation_rows(9), settings, tmp_path)
    assert reference.aux_loss_enabled and trainer.aux_loss_enabled
    assert_sft_matches_trl(reference, trainer, ("loss", "grad_norm", "entropy", "mean_token_accuracy", "aux_loss"))


def test_experts_as_qwen_publishes_them_load_as_transformers_loads_them(path, model, inputs, tmp_path):
    """Qwen's own checkpoints store the experts transposed (``gate_up_proj`` ``(E, H, 2I)``, ``down_proj``
    ``(E, I, H)``); transformers transposes them on load, and so does torchlike: the same logits."""
    import shutil

    from safetensors.numpy import save_file

    hub = tmp_path / "hub"
    shutil.copytree(path, hub)
    tensors = load_file(path / "model.safetensors")
    transposed = [name for name in tensors if name.startswith(EXPERTS)]
    assert sorted(transposed) == [EXPERTS + "down_proj", EXPERTS + "gate_up_proj"]
    save_file({name: np.ascontiguousarray(np.swapaxes(array, 1, 2)) if name in transposed else array
               for name, array in tensors.items()}, hub / "model.safetensors", metadata={"format": "pt"})
    loaded = torchlike.AutoModelForImageTextToText.from_pretrained(hub)
    np.testing.assert_array_equal(np.asarray(loaded(**inputs).logits), np.asarray(model(**inputs).logits))
    np.testing.assert_allclose(np.asarray(loaded(**inputs).logits), reference_logits(hf_vlm(hub), inputs), atol=1e-4)
