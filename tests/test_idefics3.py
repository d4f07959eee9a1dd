"""SmolVLM and Idefics3 (SigLIP on images padded to the batch's largest with bucketed positions, the pixel-shuffle
connector, a Llama decoder) against ``transformers`` (eager, float32): image and text logits, export round trip,
greedy generation on both engines, PEFT adapters. (transformers loads their image processor through its auto classes
only with torchvision: the prompts are expanded here as its processor expands them, without image splitting.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests.helpers.models import randomize_lora_, valid_max_diff
from tests.helpers.vision import hf_vlm, logits_counting_real_tokens, save_tiny_vlm
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import multimodal_token_ids, tiny_image

FAMILIES = ["smolvlm", "idefics3"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    built = {}

    def path(family: str):
        if family not in built:
            built[family] = save_tiny_vlm(tmp_path_factory.mktemp(family), family)
        return built[family]

    return path




def image_batch(family: str, path, padding_side: str = "right") -> dict:
    """A wide image (padded below), a tall and a square one in a second row, and a text-only row; each image
    written ``<fake_token_around_image><global-img>``, its 4 ``<image>`` tokens, ``<fake_token_around_image>``."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 16},
                                          max_image_size={"longest_edge": 16}, image_mean=[0.5] * 3,
                                          image_std=[0.5] * 3, do_pad=True)
    images = [[tiny_image(0, 32).resize((32, 16))], [tiny_image(1, 32).resize((16, 32)), tiny_image(2, 16)], []]
    processed = processor([row or [tiny_image(9, 16)] for row in images], return_tensors="np")
    pixels, masks = processed["pixel_values"], processed["pixel_attention_mask"]
    pixels[2], masks[2] = 0.0, 0  # the text-only row's slot is a padding image
    # The wide image as an image padded below its 8 rows of pixels (2 of the 4 patch rows hold image): its patches'
    # positions are bucketed over 2x4 patches and the padding patches are no keys.
    pixels[0, 0, :, 8:], masks[0, 0, 8:] = 0.0, 0
    ids = multimodal_token_ids(family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image = [ids["<fake_token_around_image>"], ids["<global-img>"]] + [ids["<image>"]] * 4 + [
        ids["<fake_token_around_image>"]]
    rows = []
    for row, row_images in enumerate(images):
        words = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"][:row + 2]
        rows.append(words + image * len(row_images) + tokenizer(" hello world", add_special_tokens=False)["input_ids"])
    width = max(map(len, rows))
    input_ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(input_ids)
    for row, tokens in enumerate(rows):
        place = slice(width - len(tokens), None) if padding_side == "left" else slice(0, len(tokens))
        input_ids[row, place], mask[row, place] = tokens, 1
    return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pixels, "pixel_attention_mask": masks}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_image_and_text_logits_equal_transformers(family, padding_side, paths):
    path = paths(family)
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    inputs = image_batch(family, path, padding_side)
    assert not inputs["pixel_attention_mask"][0, 0].all()  # a padded image: bucketed positions, masked patches
    reference = logits_counting_real_tokens(hf_vlm(path), inputs)
    assert valid_max_diff(model(**inputs).logits, reference, inputs["attention_mask"]) <= 1e-4
    without_images = model(inputs["input_ids"], inputs["attention_mask"]).logits
    assert valid_max_diff(without_images, reference, inputs["attention_mask"]) > 1e-2


def test_export_round_trips_and_generates_as_transformers_on_both_engines(paths, tmp_path):
    path = paths("smolvlm")
    model = torchlike.AutoModelForImageTextToText.from_pretrained(path)
    model.save_pretrained(tmp_path / "export")
    source, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) == set(source) and all(np.array_equal(exported[key], source[key]) for key in source)
    inputs = image_batch("smolvlm", path, "left")
    with torch.no_grad():
        expected = hf_vlm(path).generate(**{key: torch.tensor(value) for key, value in inputs.items()},
                                           max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        assert np.array_equal(np.asarray(out), expected), engine


def test_lora_adapter_is_peft_all_linear_and_loads_in_peft_with_the_same_logits(paths, tmp_path):
    import peft

    path = paths("smolvlm")
    model = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = peft.get_peft_model(hf_vlm(path), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert keys == {name.replace(".default", "") for name in peft.get_peft_model_state_dict(theirs)}
    assert "base_model.model.model.connector.modality_projection.proj.lora_A.weight" in keys
    reference = peft.PeftModel.from_pretrained(hf_vlm(path), tmp_path / "adapter").eval()
    inputs = image_batch("smolvlm", path)
    assert valid_max_diff(model(**inputs).logits, logits_counting_real_tokens(reference, inputs),
                          inputs["attention_mask"]) <= 1e-4


#: A SmolVLM-style chat template for the tiny tokenizer: each turn ``<Role>: <parts>`` closed by ``<end_of_utterance>``,
#: an image part written ``<image>`` (the processor expands it).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}:{% for part in message['content'] %}"
                 "{% if part['type'] == 'image' %}<image>{% else %} {{ part['text'] }}{% endif %}{% endfor %}"
                 "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def smolvlm_processor(path) -> transformers.Idefics3Processor:
    """transformers' ``Idefics3Processor`` around its PIL image processor (images of up to 16 pixels a side, no
    splitting: 4 image tokens each) and the checkpoint's tokenizer."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 16},
                                                max_image_size={"longest_edge": 16}, image_mean=[0.5] * 3,
                                                image_std=[0.5] * 3)
    return transformers.Idefics3Processor(image_processor=image_processor,
                                          tokenizer=transformers.AutoTokenizer.from_pretrained(path),
                                          image_seq_len=4, chat_template=CHAT_TEMPLATE)


def test_smolvlm_sft_matches_trl_step_for_step(paths, tmp_path):
    """TRL's vision SFT on SmolVLM with images of two shapes (padded to the batch's largest, their padding patches
    masked) and a text-only row: losses, grad norms and every final weight."""
    from tests.helpers.vision import SFT_SETTINGS, assert_sft_matches_trl, image_conversations, offline_runs

    path = paths("smolvlm")
    rows = image_conversations(9, lambda row: [] if row % 3 == 2 else
                               [tiny_image(row, 16).resize((16, 8 + 8 * (row % 2)))])
    assert_sft_matches_trl(*offline_runs("SFT", path, rows, SFT_SETTINGS, tmp_path,
                                         processor=lambda: smolvlm_processor(path)))
