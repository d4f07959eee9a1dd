"""LLaVA (``LlavaForConditionalGeneration``: CLIP up to its feature layer, the projector, a Llama decoder) against
``transformers`` (eager, float32): image and text logits, greedy generation on both engines, the export's layout and
round trip (the tower's unused block kept), PEFT adapters, and SFT step for step against TRL."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests.helpers.logs import logged
from tests.helpers.models import randomize_lora_, valid_max_diff
from tests.helpers.vision import ANSWERS, PROMPTS, hf_vlm, logits_counting_real_tokens, offline_runs, save_tiny_vlm
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_image


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    built = {}

    def path(dtype: str = "float32"):
        if dtype not in built:
            built[dtype] = save_tiny_vlm(tmp_path_factory.mktemp(f"llava-{dtype}"), "llava",
                                         dtype=getattr(torch, dtype))
        return built[dtype]

    return path




def image_batch(path, padding_side: str = "right") -> dict:
    """Two conversations with one and two images, and one without."""
    processor = torchlike.AutoProcessor.from_pretrained(path)
    images = [[tiny_image(0, 24)], [tiny_image(1, 16), tiny_image(2, 32)], []]
    conversations = [[{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": text}]}]
                     for row, text in zip(images, PROMPTS, strict=False)]
    texts = processor.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    processor.tokenizer.padding_side = padding_side
    return dict(processor(text=texts, images=[image for row in images for image in row], padding=True,
                          return_tensors="np"))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_image_and_text_logits_equal_transformers(padding_side, llava_dirs):
    path = llava_dirs()
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = image_batch(path, padding_side)
    assert inputs["pixel_values"].shape == (3, 3, 16, 16)
    reference = logits_counting_real_tokens(hf_vlm(path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4
    without_images = model(inputs["input_ids"], inputs["attention_mask"]).logits
    assert valid_max_diff(without_images, reference, inputs["attention_mask"]) > 1e-2


def test_several_feature_layers_concatenate_their_hidden_states_as_transformers(llava_dirs, tmp_path):
    """``vision_feature_layer=[0, -2]``: the embeddings and the second-to-last block's output, concatenated along the
    features (the projector reads twice the width); the last block stays kept, unused."""
    from torchlike.testing import build_processor, random_model, tiny_multimodal_config

    path = tmp_path / "llava-two-layers"
    random_model(tiny_multimodal_config("llava", vision_feature_layer=[0, -2]), every_parameter=True,
                 attn_implementation="eager").save_pretrained(path)
    build_processor(path, "llava")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    assert any(".encoder.layers.2." in name for name in model.kept_weights)
    inputs = image_batch(path)
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(hf_vlm(path), inputs),
                          inputs["attention_mask"]) <= 1e-4
    model.save_pretrained(tmp_path / "export")  # llava-hf's layout, the kept block included: transformers reloads it
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "export",
                                                                       attn_implementation="eager")
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(reloaded, inputs),
                          inputs["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_llava_hf_layout_round_trips_bit_exact_and_reloads(dtype, llava_dirs, tmp_path):
    path = llava_dirs(dtype)
    source = load_file(path / "model.safetensors")  # transformers 5 saves the tower without "vision_model."
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    assert any("encoder.layers.2." in name for name in model.kept_weights)  # the block LLaVA never runs
    model.save_pretrained(tmp_path / "once")
    once = load_file(tmp_path / "once" / "model.safetensors")
    config = json.loads((tmp_path / "once" / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    expected = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): array for name, array in source.items()}
    assert set(once) == set(expected)
    for name, array in expected.items():
        assert once[name].dtype == array.dtype and np.array_equal(once[name], array), name
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "once", attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if dtype == "float32":
        inputs = image_batch(path)
        assert np.array_equal(logits_counting_real_tokens(reloaded.eval(), inputs),
                              logits_counting_real_tokens(hf_vlm(path), inputs))


def test_greedy_generate_with_images_equals_transformers_on_both_engines(llava_dirs):
    path = llava_dirs()
    inputs = image_batch(path, "left")
    with torch.no_grad():
        expected = hf_vlm(path).generate(**{key: torch.tensor(value) for key, value in inputs.items()},
                                           max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected), engine


def test_lora_adapter_loads_in_peft_with_the_same_image_logits(llava_dirs, tmp_path):
    path = llava_dirs()
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "linear_1", "fc2"],
                                      task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.multi_modal_projector.linear_1.lora_B.weight" in keys
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj",
                                                                                       "linear_1", "fc2"]))
    # PEFT adapts the block LLaVA never runs too; it has no effect on the logits and no gradient.
    unused = {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)} - keys
    assert unused and all(".encoder.layers.2." in name for name in unused)
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    inputs = image_batch(path)
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4


def test_llava_sft_matches_trl_step_for_step(llava_dirs, tmp_path):
    path = llava_dirs()
    settings = dict(per_device_train_batch_size=3, max_steps=4, learning_rate=3e-3, lr_scheduler_type="linear",
                    warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0,
                    bf16=False, report_to="none", save_strategy="no")
    rows = []
    for row in range(12):
        images = [] if row % 4 == 3 else [tiny_image(row, 16 + 8 * (row % 3))]
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}] * len(images)
             + [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]}],
            "images": images})
    reference, trainer = offline_runs("SFT", path, rows, settings, tmp_path)
    expected, ours = reference.state.log_history, trainer.state.log_history
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == settings["max_steps"], key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    mine = trainer.model.hf_tensors()
    mine.update(trainer.model.kept_weights)
    theirs = {name.replace("model.vision_tower.", "vision_tower.vision_model.", 1)
              .replace("model.language_model.", "language_model.model.", 1)
              .replace("model.multi_modal_projector.", "multi_modal_projector.", 1)
              .replace("lm_head.", "language_model.lm_head.", 1): parameter.detach().numpy()
              for name, parameter in reference.model.named_parameters()}
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(np.asarray(mine[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_llava_grpo_matches_trl_step_for_step(llava_dirs, tmp_path, monkeypatch):
    """Scripted completions for image prompts (the image slots laid out per prompt) against TRL's GRPO."""
    from tests import tiny
    from tests.helpers.vision import scripted_grpo_runs

    path = llava_dirs()
    rows = [{"prompt": [{"role": "user", "content": PROMPTS[row % len(PROMPTS)]}], "image": tiny_image(row, 16)}
            for row in range(8)]
    settings = dict(tiny.grpo_settings(loss_type="dapo", gradient_accumulation_steps=2, max_steps=3),
                    per_device_train_batch_size=4, num_generations=4)
    expected, expected_params, ours, params = scripted_grpo_runs(path, rows, settings, tmp_path, monkeypatch)
    assert len(logged(expected, "loss")) == settings["max_steps"]
    for key in ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length"):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    # torchlike exports llava-hf's names; transformers 5 saves the tower without "vision_model.". The block LLaVA
    # never runs is saved unchanged on both sides.
    params = {name.replace("vision_tower.vision_model.", "vision_tower.", 1): value for name, value in params.items()}
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


# --- LLaVA-NeXT ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def next_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("llava-next"), "llava_next")


def tiled_batch(path, padding_side: str = "right") -> dict:
    """A wide, a tall and a square image (tiled 1x2, 2x1 and 2x2 after the base view, unpadded to each aspect ratio)
    and a text-only row."""
    processor = torchlike.AutoProcessor.from_pretrained(path)
    images = [[tiny_image(0, 32).resize((40, 18))], [tiny_image(1, 32).resize((18, 40)), tiny_image(2, 32)], []]
    conversations = [[{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": text}]}]
                     for row, text in zip(images, PROMPTS, strict=False)]
    texts = processor.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    processor.tokenizer.padding_side = padding_side
    return dict(processor(text=texts, images=[image for row in images for image in row], padding=True,
                          return_tensors="np"))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_llava_next_tiled_image_logits_equal_transformers(padding_side, next_path):
    model = torchlike.AutoModelForImageTextToText.from_pretrained(next_path)
    inputs = tiled_batch(next_path, padding_side)
    assert inputs["pixel_values"].shape[1] == 5 and inputs["image_sizes"].tolist() == [[18, 40], [40, 18], [32, 32]]
    reference = logits_counting_real_tokens(hf_vlm(next_path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4
    without_images = model(inputs["input_ids"], inputs["attention_mask"]).logits
    assert valid_max_diff(without_images, reference, inputs["attention_mask"]) > 1e-2


def test_llava_next_export_round_trips_and_generates_as_transformers(next_path, tmp_path):
    model = torchlike.AutoModelForImageTextToText.from_pretrained(next_path)
    model.save_pretrained(tmp_path / "export")
    source = load_file(next_path / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    expected = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): array for name, array in source.items()}
    assert set(exported) == set(expected) and "image_newline" in exported
    assert all(np.array_equal(exported[name], array) for name, array in expected.items())
    inputs = tiled_batch(next_path, "left")
    with torch.no_grad():
        expected_tokens = hf_vlm(next_path).generate(**{key: torch.tensor(value) for key, value in inputs.items()},
                                                       max_new_tokens=6, do_sample=False, eos_token_id=[],
                                                       pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected_tokens), engine


def test_llava_next_sft_matches_trl_step_for_step(next_path, tmp_path):
    settings = dict(per_device_train_batch_size=3, max_steps=3, learning_rate=3e-3, lr_scheduler_type="linear",
                    warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0,
                    bf16=False, report_to="none", save_strategy="no")
    shapes = ((40, 18), (18, 40), (32, 32))
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]}],
        "images": [tiny_image(row, 32).resize(shapes[row % 3])]} for row in range(9)]
    reference, trainer = offline_runs("SFT", next_path, rows, settings, tmp_path)
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(reference.state.log_history, key)) == settings["max_steps"], key
        np.testing.assert_allclose(logged(trainer.state.log_history, key), logged(reference.state.log_history, key),
                                   rtol=1e-4, err_msg=key)
    newline = dict(reference.model.named_parameters())["model.image_newline"].detach().numpy()
    np.testing.assert_allclose(np.asarray(trainer.model.hf_tensors()["image_newline"]), newline, rtol=1e-4,
                               atol=1e-5)


def test_images_of_another_size_or_beyond_their_tokens_are_named_errors(llava_dirs):
    path = llava_dirs()
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = image_batch(path)
    larger = np.zeros((3, 3, 32, 32), np.float32)
    with pytest.raises(ValueError, match=r"pixel_values are 32x32 but the vision tower takes 16x16 images "
                                         r"\(vision_config.image_size\)"):
        model(**dict(inputs, pixel_values=larger))
    with pytest.raises(ValueError, match=r"the batch has 3 images' worth of image tokens .* pixel_values holds 4"):
        model(**dict(inputs, pixel_values=np.concatenate([inputs["pixel_values"], inputs["pixel_values"][:1]])))


def test_llava_next_grpo_matches_trl_step_for_step(next_path, tmp_path, monkeypatch):
    """Tiled image prompts (wide, tall, square, small: 2 to 5 tiles each, padded across prompts) with scripted
    completions against TRL's GRPO."""
    from tests import tiny
    from tests.helpers.vision import scripted_grpo_runs

    shapes = ((40, 18), (18, 40), (32, 32), (16, 16))
    rows = [{"prompt": [{"role": "user", "content": PROMPTS[row % len(PROMPTS)]}],
             "image": tiny_image(row, 32).resize(shapes[row % 4])} for row in range(8)]
    settings = dict(tiny.grpo_settings(loss_type="dapo", gradient_accumulation_steps=2, max_steps=2),
                    per_device_train_batch_size=4, num_generations=4)
    expected, expected_params, ours, params = scripted_grpo_runs(next_path, rows, settings, tmp_path,
                                                                 monkeypatch)
    assert len(logged(expected, "loss")) == settings["max_steps"]
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    params = {name.replace("vision_tower.vision_model.", "vision_tower.", 1): value for name, value in params.items()}
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


def test_llava_next_lora_adapter_is_peft_all_linear_with_the_same_tiled_logits(next_path, tmp_path):
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(next_path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = peft.get_peft_model(hf_vlm(next_path), peft.LoraConfig(r=4, target_modules="all-linear"))
    # PEFT also adapts the block LLaVA never runs; torchlike keeps that block as it is (no effect on the logits).
    expected = {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    assert keys == {name for name in expected if ".encoder.layers.2." not in name}
    reference = peft.PeftModel.from_pretrained(hf_vlm(next_path), tmp_path / "adapter").eval()
    inputs = tiled_batch(next_path)
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4
