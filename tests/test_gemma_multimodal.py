"""Gemma as Google publishes it: ``Gemma3ForConditionalGeneration`` and ``Gemma4ForConditionalGeneration`` load,
give transformers' logits (text only for both, image and text for Gemma 3), export in the published layout, adapt
with LoRA in PEFT's layout, and refuse what they cannot take with a named error."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests.helpers.models import randomize_lora_, valid_max_diff
from tests.helpers.vision import save_tiny_vlm, vlm_batch
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_image

FAMILIES = ["gemma3", "gemma4"]


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    """The tiny vision-language checkpoints by ``(family, dtype name)``, built on first use."""
    built: dict[tuple[str, str], object] = {}

    def path(family: str, dtype: str = "float32"):
        if (family, dtype) not in built:
            root = tmp_path_factory.mktemp(f"{family}-{dtype}")
            built[family, dtype] = save_tiny_vlm(root, family, dtype=getattr(torch, dtype))
        return built[family, dtype]

    return path


def hf_vlm(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").eval()


def reference_logits(model, inputs: dict) -> np.ndarray:
    """transformers' logits with the position ids torchlike uses for a padded batch (real tokens counted)."""
    mask = inputs["attention_mask"]
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        tensors = {key: torch.tensor(value) for key, value in inputs.items()}
        return model(**tensors, position_ids=torch.tensor(positions)).logits.float().numpy()


def text_batch(padding_side: str) -> dict:
    """Three rows of tiny-vocabulary tokens (no image tokens), padded on ``padding_side``."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 100, size=(3, 16))
    mask = np.ones_like(ids)
    lengths = [16, 11, 7]
    for row, length in enumerate(lengths):
        pad = slice(length, None) if padding_side == "right" else slice(None, 16 - length)
        mask[row, pad] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_text_only_logits_equal_transformers(family, padding_side, vlm_dirs):
    path = vlm_dirs(family)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path)
    assert model.family.architectures[0] == f"{family.capitalize()}ForConditionalGeneration"
    batch = text_batch(padding_side)
    ours = model(batch["input_ids"], batch["attention_mask"]).logits
    assert valid_max_diff(ours, reference_logits(hf_vlm(path), batch), batch["attention_mask"]) <= 1e-4


def test_gemma3_image_and_text_logits_equal_transformers(vlm_dirs):
    path = vlm_dirs("gemma3")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = dict(vlm_batch(torchlike.AutoProcessor.from_pretrained(path)))  # two rows with an image, one without
    reference = reference_logits(hf_vlm(path), inputs)
    ours = model(**inputs).logits
    assert valid_max_diff(ours, reference, inputs["attention_mask"]) <= 1e-4
    # The images and the both-ways attention inside each image both matter at this tolerance.
    without_images = model(inputs["input_ids"], inputs["attention_mask"]).logits
    assert valid_max_diff(without_images, reference, inputs["attention_mask"]) > 1e-2
    causal_only = model(inputs["input_ids"], inputs["attention_mask"], pixel_values=inputs["pixel_values"]).logits
    assert valid_max_diff(causal_only, reference, inputs["attention_mask"]) > 1e-2


def test_gemma3_loads_from_a_transformers_model_object_with_its_in_memory_names(vlm_dirs):
    path = vlm_dirs("gemma3")
    reference = hf_vlm(path)
    model = torchlike.AutoModelForImageTextToText.from_pretrained(reference)
    inputs = dict(vlm_batch(torchlike.AutoProcessor.from_pretrained(path)))
    assert valid_max_diff(model(**inputs).logits, reference_logits(reference, inputs), inputs["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_the_published_layout_and_round_trips_bit_exact(family, dtype, vlm_dirs, tmp_path):
    path = vlm_dirs(family, dtype)
    source = load_file(path / "model.safetensors")
    model = torchlike.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path / "once")
    once = load_file(tmp_path / "once" / "model.safetensors")
    config = json.loads((tmp_path / "once" / "config.json").read_text())
    assert config["architectures"] == [f"{family.capitalize()}ForConditionalGeneration"]
    published = {
        # transformers 5 saves SigLIP without its "vision_model." level; Google's checkpoints (and torchlike) have it.
        "gemma3": lambda name: name.replace("vision_tower.", "vision_tower.vision_model.", 1),
        "gemma4": lambda name: name,
    }[family]
    expected = {published(name): array for name, array in source.items()}
    assert set(once) == set(expected)
    for name, array in expected.items():
        assert once[name].dtype == array.dtype and np.array_equal(once[name], array), name
    torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "once").save_pretrained(tmp_path / "twice")
    twice = load_file(tmp_path / "twice" / "model.safetensors")
    assert set(twice) == set(once) and all(np.array_equal(twice[name], once[name]) for name in once)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reloads_the_export_as_the_multimodal_class_with_the_same_logits(family, vlm_dirs, tmp_path):
    path = vlm_dirs(family)
    torchlike.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "export")
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export", attn_implementation="eager", output_loading_info=True)
    assert type(reloaded).__name__ == f"{family.capitalize()}ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    batch = text_batch("right")
    assert valid_max_diff(reference_logits(reloaded.eval(), batch), reference_logits(hf_vlm(path), batch),
                          batch["attention_mask"]) == 0.0


def test_gemma4_vision_weights_load_into_its_tower_instead_of_being_kept(vlm_dirs):
    """Gemma 4's vision tower is a module (``tests/test_gemma4_vision.py`` checks its logits): its tensors are
    parameters and buffers of the model, none passed through as kept weights."""
    path = vlm_dirs("gemma4")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    source = load_file(path / "model.safetensors")
    towers = {name for name in source if name.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert towers and not model.kept_weights
    assert towers <= set(model.hf_tensors())


def test_an_image_for_a_text_only_model_is_a_named_error(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    with pytest.raises(ValueError, match=r"cannot take images: this gemma3 model is a text-only decoder with no vision "
                                         r"tower; load a vision-language checkpoint"):
        model(np.array([[2, 5, 6]]), pixel_values=np.zeros((1, 3, 28, 28), np.float32))
    with pytest.raises(ValueError, match=r"Unrecognized configuration class Gemma3TextConfig for this kind of "
                                         r"AutoModel: AutoModelForImageTextToText\..*AutoModelForCausalLM"):
        torchlike.AutoModelForImageTextToText.from_pretrained(tiny_checkpoints.path("gemma3"))


def test_more_images_than_image_tokens_is_a_named_error(vlm_dirs):
    path = vlm_dirs("gemma3")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = dict(vlm_batch(torchlike.AutoProcessor.from_pretrained(path)))
    extra = np.concatenate([inputs["pixel_values"], inputs["pixel_values"][:1]])
    with pytest.raises(ValueError, match=r"2 images' worth of image tokens \(id \d+\) but pixel_values holds 3 images"):
        model(inputs["input_ids"], inputs["attention_mask"], pixel_values=extra)
    cut = inputs["input_ids"].copy()
    cut[0, np.flatnonzero(inputs["token_type_ids"][0])[0]] = 5
    with pytest.raises(ValueError, match=r"each image takes exactly 4 \(mm_tokens_per_image\)"):
        model(cut, inputs["attention_mask"], pixel_values=inputs["pixel_values"])
    larger = np.zeros((2, 3, 56, 56), np.float32)  # beyond the processor's 28x28
    with pytest.raises(ValueError, match=r"pixel_values are 56x56 but the vision tower takes 28x28 images"):
        model(inputs["input_ids"], inputs["attention_mask"], pixel_values=larger)


def test_a_text_only_checkpoint_loads_leniently_into_the_multimodal_model_and_back(vlm_dirs, tiny_checkpoints):
    multimodal = torchlike.AutoModelForCausalLM.from_pretrained(vlm_dirs("gemma3"))
    vision = {name for name in multimodal.state_dict() if name.startswith(("vision_encoder.", "embedder.mm_"))}
    # A Gemma3ForCausalLM checkpoint (its HF names) into the multimodal model: only the vision tower is missing.
    text_only = load_file(tiny_checkpoints.path("gemma3") / "model.safetensors")
    result = multimodal.load_state_dict(text_only, strict=False)
    assert set(result.missing_keys) == vision and not result.unexpected_keys
    text_model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    batch = text_batch("left")
    np.testing.assert_array_equal(np.asarray(multimodal(**batch).logits), np.asarray(text_model(**batch).logits))
    # ...and back: the multimodal model's state dict, and transformers' in-memory one, into the text-only model.
    source = torchlike.AutoModelForCausalLM.from_pretrained(vlm_dirs("gemma3"))
    result = text_model.load_state_dict(source.state_dict(), strict=False)
    assert set(result.unexpected_keys) == vision and not result.missing_keys
    np.testing.assert_array_equal(np.asarray(text_model(**batch).logits), np.asarray(source(**batch).logits))
    text_model.load_state_dict(load_file(tiny_checkpoints.path("gemma3") / "model.safetensors"))
    in_memory = {name: value.numpy() for name, value in hf_vlm(vlm_dirs("gemma3")).state_dict().items()}
    result = text_model.load_state_dict(in_memory, strict=False)
    assert not result.missing_keys and all(name.startswith("model.vision_tower.") or "multi_modal" in name
                                           for name in result.unexpected_keys)
    np.testing.assert_array_equal(np.asarray(text_model(**batch).logits), np.asarray(source(**batch).logits))


def test_lora_adapter_exports_in_peft_layout_and_loads_in_peft_with_the_same_logits(vlm_dirs, tmp_path):
    path = vlm_dirs("gemma3")
    # "all-linear" covers the vision tower's linear layers too, in PEFT as here.
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.vision_tower.encoder.layers.1.self_attn.v_proj.lora_B.weight" in keys
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    inputs = dict(vlm_batch(torchlike.AutoProcessor.from_pretrained(path)))
    ours = model(**inputs).logits
    assert valid_max_diff(ours, reference_logits(reference, inputs), inputs["attention_mask"]) <= 1e-4
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    merged = hf_vlm(tmp_path / "merged")
    assert valid_max_diff(ours, reference_logits(merged, inputs), inputs["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_on_text_equals_transformers(family, vlm_dirs):
    path = vlm_dirs(family)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path)
    batch = text_batch("left")
    ours = np.asarray(model.generate(**batch, max_new_tokens=6, do_sample=False))
    with torch.no_grad():
        theirs = hf_vlm(path).generate(**{key: torch.tensor(value) for key, value in batch.items()},
                                       max_new_tokens=6, do_sample=False).numpy()
    np.testing.assert_array_equal(ours[:, -6:], theirs[:, -6:])


def test_sft_trainer_takes_a_multimodal_checkpoint_with_lora_on_trls_defaults(vlm_dirs, tmp_path):
    from torchlike.trl import SFTConfig, SFTTrainer

    path = vlm_dirs("gemma3")
    rows = [{"prompt": f"the quick brown fox {i}", "completion": " jumps over"} for i in range(4)]
    from datasets import Dataset

    trainer = SFTTrainer(model=str(path), train_dataset=Dataset.from_list(rows),
                         args=SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                                        max_length=32, report_to="none", logging_steps=1),
                         processing_class=transformers.AutoTokenizer.from_pretrained(path),
                         peft_config=LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)"))
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults
    output = trainer.train()
    assert output.global_step == 2 and np.isfinite(output.training_loss)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and losses[0] > 0


def test_greedy_generate_with_an_image_equals_transformers(vlm_dirs):
    path = vlm_dirs("gemma3")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    processor = torchlike.AutoProcessor.from_pretrained(path)
    inputs = dict(vlm_batch(processor, count=1, text_only_row=False))
    # Two rows left-padded, as generation takes them.
    padded = processor(text=processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
         for text in ("the quick brown fox", "hello world")], tokenize=False, add_generation_prompt=True),
        images=[[tiny_image(0)], [tiny_image(1)]], padding=True, padding_side="left", return_tensors="np")
    for batch in (inputs, dict(padded)):
        with torch.no_grad():
            theirs = hf_vlm(path).generate(**{key: torch.tensor(value) for key, value in batch.items()},
                                           max_new_tokens=6, do_sample=False).numpy()
        for engine in ("static", "paged"):
            ours = np.asarray(model.generate(**batch, max_new_tokens=6, do_sample=False, rollout_engine=engine))
            np.testing.assert_array_equal(ours[:, -6:], theirs[:, -6:], err_msg=engine)


def test_from_config_starts_the_vision_layer_norms_at_one_and_the_gemma_norms_at_zero():
    from torchlike.testing import tiny_multimodal_config

    model = torchlike.AutoModelForCausalLM.from_config(tiny_multimodal_config("gemma3"))
    weights = model.state_dict()
    assert np.all(np.asarray(weights["vision_encoder.siglip_encoder.transformer.blocks.0.ln1.scale"]) == 1.0)
    assert np.all(np.asarray(weights["vision_encoder.siglip_encoder.transformer.encoder_norm.scale"]) == 1.0)
    assert np.all(np.asarray(weights["embedder.mm_soft_embedding_norm.scale"]) == 0.0)
    assert np.all(np.asarray(weights["final_norm.scale"]) == 0.0)
    assert np.all(np.asarray(weights["layers.0.pre_attention_norm.scale"]) == 0.0)


def test_gemma4_lora_on_peft_default_targets_loads_in_peft_with_the_same_logits(vlm_dirs, tmp_path):
    path = vlm_dirs("gemma4")
    # target_modules=None: PEFT's default for model_type "gemma4", the language model's q_proj and v_proj (a regex).
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert keys and all(key.startswith("base_model.model.model.language_model.layers.") for key in keys)
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    batch = text_batch("right")
    assert valid_max_diff(model(**batch).logits, reference_logits(reference, batch), batch["attention_mask"]) <= 1e-4
    # The merged model keeps the towers Tunix lacks, so its export is a whole Gemma4ForConditionalGeneration.
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    source = load_file(path / "model.safetensors")
    towers = [name for name in source if name.startswith(("model.vision_tower.", "model.embed_vision."))]
    assert towers and all(np.array_equal(merged[name], source[name]) for name in towers)
