"""Mistral 3 (``Mistral3ForConditionalGeneration``: Pixtral's encoder at each image's own size, Mistral 3's patch
merger and projector, a Mistral decoder) against ``transformers`` (eager, float32): image and text logits with
images of different sizes in one batch, export round trip and reload, greedy generation on both engines, and TRL's
SFT step for step. (transformers' ``PixtralProcessor`` module imports torchvision's image processor: the model tests
expand the prompts as it expands them; the SFT test builds it with the PIL image processor, then
``torchlike.AutoProcessor`` loads it back without torchvision.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests.helpers.models import valid_max_diff
from tests.helpers.vision import hf_vlm, logits_counting_real_tokens, save_tiny_vlm
from torchlike.testing import multimodal_token_ids, tiny_image


@pytest.fixture(scope="module")
def mistral3_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("mistral3"), "mistral3")




def image_batch(path, padding_side: str = "right") -> dict:
    """A 16x32 image, a 32x16 and a 32x32 one in a second row, and a text-only row, as PixtralProcessor lays them
    out: ``[IMG]`` per merged patch, ``[IMG_BREAK]`` after each row of them, ``[IMG_END]`` last."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = multimodal_token_ids("mistral3")
    processor = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size={"height": 8, "width": 8},
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    images = [[tiny_image(0, 32).resize((32, 16))], [tiny_image(1, 32).resize((16, 32)), tiny_image(2, 32)], []]
    processed = processor([image for row in images for image in row], return_tensors="np")
    sizes = iter(processed["image_sizes"].tolist())
    rows = []
    for row, count in enumerate(len(row_images) for row_images in images):
        tokens = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"][:row + 2]
        for _ in range(count):
            height, width = next(sizes)
            grid = ([ids["[IMG]"]] * (width // 8) + [ids["[IMG_BREAK]"]]) * (height // 8)
            tokens = tokens + grid[:-1] + [ids["[IMG_END]"]]
        rows.append(tokens + tokenizer(" hello world", add_special_tokens=False)["input_ids"])
    width = max(map(len, rows))
    input_ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(input_ids)
    for row, tokens in enumerate(rows):
        place = slice(width - len(tokens), None) if padding_side == "left" else slice(0, len(tokens))
        input_ids[row, place], mask[row, place] = tokens, 1
    return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": processed["pixel_values"],
            "image_sizes": processed["image_sizes"]}


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_image_and_text_logits_equal_transformers(padding_side, mistral3_path):
    model = torchlike.AutoModelForImageTextToText.from_pretrained(mistral3_path)
    inputs = image_batch(mistral3_path, padding_side)
    assert inputs["image_sizes"].tolist() == [[16, 32], [32, 16], [32, 32]]
    reference = logits_counting_real_tokens(hf_vlm(mistral3_path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4
    without_images = model(inputs["input_ids"], inputs["attention_mask"]).logits
    assert valid_max_diff(without_images, reference, inputs["attention_mask"]) > 1e-2


def test_export_round_trips_reloads_and_generates_as_transformers(mistral3_path, tmp_path):
    model = torchlike.AutoModelForImageTextToText.from_pretrained(mistral3_path)
    model.save_pretrained(tmp_path / "export")
    source = load_file(mistral3_path / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) == set(source)
    assert all(np.array_equal(exported[name], array) for name, array in source.items())
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "export",
                                                                        attn_implementation="eager").eval()
    inputs = image_batch(mistral3_path, "left")
    assert np.array_equal(logits_counting_real_tokens(reloaded, inputs),
                          logits_counting_real_tokens(hf_vlm(mistral3_path), inputs))
    with torch.no_grad():
        expected = reloaded.generate(**{key: torch.tensor(value) for key, value in inputs.items()}, max_new_tokens=6,
                                     do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected), engine


def test_lora_adapter_is_peft_all_linear_and_loads_in_peft_with_the_same_logits(mistral3_path, tmp_path):
    import peft

    from tests.helpers.models import randomize_lora_
    from torchlike.peft import LoraConfig, get_peft_model

    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(mistral3_path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.vision_tower.transformer.layers.0.attention.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.multi_modal_projector.patch_merger.merging_layer.lora_B.weight" in keys
    theirs = peft.get_peft_model(hf_vlm(mistral3_path), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    reference = peft.PeftModel.from_pretrained(hf_vlm(mistral3_path), tmp_path / "adapter").eval()
    inputs = image_batch(mistral3_path)
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4


#: A Mistral-style chat template for the tiny tokenizer: ``[INST]`` turns whose image parts are ``[IMG]`` (the
#: processor expands each into its grid of image tokens).
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% for part in "
                 "message['content'] %}{% if part['type'] == 'image' %}[IMG]{% else %}{{ part['text'] }}{% endif %}"
                 "{% endfor %}[/INST]{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
                 "</s>{% endif %}{% endfor %}")


def pixtral_processor(path, monkeypatch) -> transformers.ProcessorMixin:
    """transformers' ``PixtralProcessor`` around its PIL image processor (images of up to 32 pixels a side in patches
    of 4, merged 2x2: one ``[IMG]`` per 8 pixels). Its module imports a size helper from the torchvision image
    processor's module, whose PIL twin defines the same helper: that module stands in for it while it imports."""
    import importlib
    import sys

    from transformers.models.pixtral import image_processing_pil_pixtral

    monkeypatch.setitem(sys.modules, "transformers.models.pixtral.image_processing_pixtral",
                        image_processing_pil_pixtral)
    processing = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    image_processor = image_processing_pil_pixtral.PixtralImageProcessorPil(
        size={"longest_edge": 32}, patch_size={"height": 4, "width": 4}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return processing.PixtralProcessor(image_processor=image_processor,
                                       tokenizer=transformers.AutoTokenizer.from_pretrained(path), patch_size=4,
                                       spatial_merge_size=2, chat_template=CHAT_TEMPLATE)


def test_mistral3_sft_matches_trl_step_for_step(mistral3_path, tmp_path, monkeypatch):
    """TRL's vision SFT on Mistral 3 with images at their own sizes (wide, tall; padded to the batch's largest, with
    ``image_sizes``) and a text-only row: losses, grad norms and every final weight."""
    import shutil
    import sys

    from tests.helpers.vision import SFT_SETTINGS, assert_sft_matches_trl, image_conversations, offline_runs

    rows = image_conversations(9, lambda row: [] if row % 3 == 2 else
                               [tiny_image(row, 32).resize(((32, 16), (16, 32))[row % 2])])
    # Saved with the checkpoint, torchlike.AutoProcessor loads it back around the PIL image processor (its module
    # imported anew, without the stand-in).
    path = tmp_path / "checkpoint"
    shutil.copytree(mistral3_path, path)
    pixtral_processor(path, monkeypatch).save_pretrained(path)
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, "transformers.models.pixtral.processing_pixtral")
    processor = torchlike.AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "PixtralProcessor"
    assert type(processor.image_processor).__name__ == "PixtralImageProcessorPil"
    assert "transformers.models.pixtral.image_processing_pixtral" not in sys.modules
    renames = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.", ""))

    def published(name: str) -> str:  # transformers' in-memory names -> the published ones torchlike exports
        prefix, target = next(pair for pair in renames if name.startswith(pair[0]))
        return target + name[len(prefix):]

    assert_sft_matches_trl(*offline_runs("SFT", path, rows, SFT_SETTINGS, tmp_path), published=published)
