"""Qwen2-VL and Qwen2.5-VL (``*ForConditionalGeneration``) against ``transformers`` (eager, float32): logits with
images of different sizes in one batch, with a video (Qwen2.5-VL), on text alone; the export's layout and round trip;
named errors for inputs that do not match."""

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
from tests.helpers.vision import qwen_vl_image_batch, reference_logits, save_tiny_vlm
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import multimodal_token_ids

FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5"]
CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    """The tiny Qwen-VL checkpoints (with their processors) by ``(family, dtype name)``, built on first use."""
    built: dict[tuple[str, str], object] = {}

    def path(family: str, dtype: str = "float32"):
        if (family, dtype) not in built:
            built[family, dtype] = save_tiny_vlm(tmp_path_factory.mktemp(f"{family}-{dtype}"), family,
                                                 dtype=getattr(torch, dtype))
        return built[family, dtype]

    return path


def hf_vlm(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_image_and_text_logits_equal_transformers_with_images_of_different_sizes(family, padding_side, qwen_dirs):
    path = qwen_dirs(family)
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    assert model.family.architectures == (CLASSES[family],)
    inputs = qwen_vl_image_batch(path, padding_side)
    reference = reference_logits(hf_vlm(path), inputs)
    mask = inputs["attention_mask"]
    assert valid_max_diff(model(**inputs).logits, reference, mask) <= 1e-4
    # The images matter at this tolerance, and so do their multimodal positions: the text after them, given the
    # image features but plain positions, is off.
    without_images = model(inputs["input_ids"], mask).logits
    assert valid_max_diff(without_images, reference, mask) > 1e-2


def test_multimodal_positions_matter_at_the_tolerance(qwen_dirs, monkeypatch):
    path = qwen_dirs("qwen2_5_vl")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = qwen_vl_image_batch(path, "left")
    # The two image rows: a shape no other test compiles, so that the patched call is traced.
    inputs.update({key: inputs[key][:2] for key in ("input_ids", "attention_mask", "mm_token_type_ids")})
    reference = reference_logits(hf_vlm(path), inputs)
    decoder = type(model.module)  # the model's own class, however its module was imported
    original = decoder.merge_vision

    def plain_positions(self, tokens, positions, x, images):
        merged, _, additions = original(self, tokens, positions, x, images)
        return merged, positions, additions

    monkeypatch.setattr(decoder, "merge_vision", plain_positions)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) > 1e-2


def video_batch(path) -> dict:
    """A prompt with a 4-frame 16x16 video (grid 2x4x4: 8 tokens) two seconds per temporal patch, and one with an
    image, as ``transformers``' processor lays them out (``pixel_values_videos`` built here: the video processor
    needs torchvision)."""
    processor = torchlike.AutoProcessor.from_pretrained(path)
    ids = multimodal_token_ids("qwen2_5_vl")
    tokenizer = processor.tokenizer
    video = [ids["<|vision_start|>"]] + [ids["<|video_pad|>"]] * 8 + [ids["<|vision_end|>"]]
    image = [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * 4 + [ids["<|vision_end|>"]]
    words = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    rows = [words[:2] + video + words, image + words + video]
    width = max(map(len, rows))
    input_ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for row, tokens in enumerate(rows):
        input_ids[row, width - len(tokens):], mask[row, width - len(tokens):] = tokens, 1
    types = np.where(input_ids == ids["<|image_pad|>"], 1, np.where(input_ids == ids["<|video_pad|>"], 2, 0))
    rng = np.random.default_rng(0)
    return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types,
            "pixel_values": rng.normal(size=(16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
            "pixel_values_videos": rng.normal(size=(64, 96)).astype(np.float32),
            "video_grid_thw": np.array([[2, 4, 4], [2, 4, 4]]), "second_per_grid_ts": np.array([2.0, 1.0])}


def test_qwen2_5_vl_video_logits_equal_transformers(qwen_dirs):
    path = qwen_dirs("qwen2_5_vl")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = video_batch(path)
    reference = reference_logits(hf_vlm(path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4
    # The seconds per temporal patch space the frames' positions.
    other = dict(inputs, second_per_grid_ts=np.array([1.0, 1.0]))
    assert valid_max_diff(model(**other).logits, reference, inputs["attention_mask"]) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_logits_equal_transformers(family, qwen_dirs):
    path = qwen_dirs(family)
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 100, size=(2, 12))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    assert valid_max_diff(model(**batch).logits, reference_logits(hf_vlm(path), batch), mask) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_the_published_layout_and_round_trips_bit_exact(family, dtype, qwen_dirs, tmp_path):
    path = qwen_dirs(family, dtype)
    source = load_file(path / "model.safetensors")
    assert any(".blocks.0.attn.qkv." in name for name in source) and any(".layers.0." in name for name in source)
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    model.save_pretrained(tmp_path / "once")
    once = load_file(tmp_path / "once" / "model.safetensors")
    assert json.loads((tmp_path / "once" / "config.json").read_text())["architectures"] == [CLASSES[family]]
    assert set(once) == set(source)
    for name, array in source.items():
        assert once[name].dtype == array.dtype and np.array_equal(once[name], array), name
    torchlike.AutoModelForImageTextToText.from_pretrained(tmp_path / "once").save_pretrained(tmp_path / "twice")
    twice = load_file(tmp_path / "twice" / "model.safetensors")
    assert set(twice) == set(once) and all(np.array_equal(twice[name], once[name]) for name in once)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reloads_the_export_with_the_same_image_logits(family, qwen_dirs, tmp_path):
    path = qwen_dirs(family)
    torchlike.AutoModelForImageTextToText.from_pretrained(path).save_pretrained(tmp_path / "export")
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export", attn_implementation="eager", output_loading_info=True)
    assert type(reloaded).__name__ == CLASSES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = qwen_vl_image_batch(path, "right")
    assert np.array_equal(reference_logits(reloaded.eval(), inputs), reference_logits(hf_vlm(path), inputs))


def test_loads_from_a_transformers_model_object_with_its_in_memory_names(qwen_dirs):
    path = qwen_dirs("qwen2_5_vl")
    reference = hf_vlm(path)
    assert any(name.startswith("model.language_model.") for name in reference.state_dict())
    model = torchlike.AutoModelForImageTextToText.from_pretrained(reference)
    inputs = qwen_vl_image_batch(path, "right")
    assert valid_max_diff(model(**inputs).logits, reference_logits(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4


def test_inputs_that_do_not_match_are_named_errors(qwen_dirs, tiny_checkpoints):
    path = qwen_dirs("qwen2_5_vl")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = qwen_vl_image_batch(path, "right")
    extra = dict(inputs, pixel_values=np.concatenate([inputs["pixel_values"], inputs["pixel_values"][:16]]),
                 image_grid_thw=np.concatenate([inputs["image_grid_thw"], [[1, 4, 4]]]))
    with pytest.raises(ValueError, match=r"1 image\(s\) were given beyond the image tokens \(id \d+\)"):
        model(**extra)
    fewer = dict(inputs, pixel_values=inputs["pixel_values"][:16], image_grid_thw=inputs["image_grid_thw"][:1])
    with pytest.raises(ValueError, match=r"a row has more image tokens \(id \d+\) than the images given"):
        model(**fewer)
    with pytest.raises(ValueError, match=r"image_grid_thw counts 112 patches but the pixels hold 100"):
        model(**dict(inputs, pixel_values=inputs["pixel_values"][:100]))
    with pytest.raises(ValueError, match=r"needs image_grid_thw with its pixels"):
        model(**dict(inputs, image_grid_thw=None))
    video = video_batch(path)
    qwen2 = torchlike.AutoModelForImageTextToText.from_pretrained(qwen_dirs("qwen2_vl"))
    assert qwen2.family.image_keys  # Qwen2-VL takes videos too; Gemma 3 does not:
    gemma = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    with pytest.raises((ValueError, TypeError), match=r"pixel_values_videos.*video_grid_thw"):
        gemma(video["input_ids"], video["attention_mask"], pixel_values_videos=video["pixel_values_videos"],
              video_grid_thw=video["video_grid_thw"])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_images_equals_transformers_on_both_engines(family, qwen_dirs):
    path = qwen_dirs(family)
    inputs = qwen_vl_image_batch(path, "left")
    hf = hf_vlm(path)
    with torch.no_grad():
        expected = hf.generate(**{key: torch.tensor(value) for key, value in inputs.items()}, max_new_tokens=8,
                               do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected), engine


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_loads_in_peft_with_the_same_image_logits_and_merges(family, qwen_dirs, tmp_path):
    path = qwen_dirs(family)
    # "all-linear": the text decoder's, the tower's and the merger's linear layers, in PEFT as here.
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.visual.blocks.1.attn.qkv.lora_B.weight" in keys
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    inputs = qwen_vl_image_batch(path, "right")
    ours = model(**inputs).logits
    assert valid_max_diff(ours, reference_logits(reference, inputs), inputs["attention_mask"]) <= 1e-4
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    assert valid_max_diff(ours, reference_logits(hf_vlm(tmp_path / "merged"), inputs),
                          inputs["attention_mask"]) <= 1e-4


def test_peft_has_no_default_targets_for_qwen_vl_and_neither_has_torchlike(qwen_dirs, tmp_path):
    model = torchlike.AutoModelForImageTextToText.from_pretrained(qwen_dirs("qwen2_5_vl"))
    with pytest.raises(ValueError, match=r"the qwen2_5_vl family has no default LoRA target_modules"):
        get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))
    # PEFT's "proj" would adapt the Conv3d patch embedding as a convolution, which torchlike does not: refused.
    with pytest.raises(ValueError, match=r"names visual\.patch_embed\.proj.*Conv3d.*'attn\.proj'"):
        get_peft_model(model, LoraConfig(target_modules=["qkv", "proj"], task_type="CAUSAL_LM"))
    adapted = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(qwen_dirs("qwen2_5_vl")),
                             LoraConfig(target_modules=["qkv", "attn.proj"], task_type="CAUSAL_LM"))
    adapted.save_pretrained(tmp_path / "adapter")
    modules = {name.split(".lora_")[0] for name in load_file(tmp_path / "adapter" / "adapter_model.safetensors")}
    assert modules == {f"base_model.model.model.visual.blocks.{block}.attn.{name}" for block in (0, 1)
                       for name in ("proj", "qkv")}


def test_qwen3_vl_video_frames_each_its_own_item_equal_transformers(qwen_dirs):
    """Qwen3-VL writes a timestamp before each temporal patch of a video: each is a run of video tokens of its own."""
    path = qwen_dirs("qwen3_vl")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    ids = multimodal_token_ids("qwen3_vl")
    words = torchlike.AutoProcessor.from_pretrained(path).tokenizer("the quick brown fox",
                                                                     add_special_tokens=False)["input_ids"]
    frame = [ids["<|vision_start|>"]] + [ids["<|video_pad|>"]] * 4 + [ids["<|vision_end|>"]]
    image = [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * 4 + [ids["<|vision_end|>"]]
    tokens = words[:1] + frame + words[1:3] + frame + image + words
    input_ids = np.asarray([tokens])
    types = np.where(input_ids == ids["<|image_pad|>"], 1, np.where(input_ids == ids["<|video_pad|>"], 2, 0))
    rng = np.random.default_rng(2)
    inputs = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "mm_token_type_ids": types,
              "pixel_values": rng.normal(size=(16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
              "pixel_values_videos": rng.normal(size=(32, 96)).astype(np.float32),
              "video_grid_thw": np.array([[2, 4, 4]])}
    reference = reference_logits(hf_vlm(path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4


def test_a_target_modules_regex_matches_the_in_memory_names_as_in_peft(qwen_dirs, tmp_path):
    """PEFT matches a regex against the model's names in memory: Qwen2.5-VL's decoder is saved as ``model.layers``
    but is ``model.language_model.layers`` in memory."""
    path = qwen_dirs("qwen2_5_vl")
    regex = r".*language_model.*\.(q_proj|v_proj)"
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, target_modules=regex, task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules=regex))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    assert len(keys) == 2 * 2 * 2  # two layers, q and v, A and B: the tower's modules are not named
