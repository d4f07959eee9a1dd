"""torchlike.AutoProcessor on the tiny Gemma 3 vision-language checkpoint: the processor transformers saves, images
expanded as Gemma 3's processor does, numpy outputs a transformers model runs on, and check_processor_matches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests.helpers.vision import save_tiny_vlm, vision_conversations, vlm_batch
from torchlike.processing import check_processor_matches
from torchlike.testing import (
    VOCAB_SIZE,
    build_multimodal_tokenizer,
    build_processor,
    build_tokenizer,
    multimodal_token_ids,
    random_model,
    tiny_image,
    tiny_multimodal_config,
)

TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture
def processor(vlm_dir):
    return torchlike.AutoProcessor.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def config():
    return tiny_multimodal_config("gemma3")


def test_autoprocessor_loads_gemma3_processor(processor, config):
    assert isinstance(processor, transformers.Gemma3Processor)
    assert processor.image_seq_length == config.mm_tokens_per_image == TOKENS_PER_IMAGE
    check_processor_matches(processor, config)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_image_token_ids_are_tokenizer_entries_equal_to_the_config(tmp_path, family):
    config = tiny_multimodal_config(family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(build_multimodal_tokenizer(tmp_path, family))
    assert len(tokenizer) == config.get_text_config().vocab_size == VOCAB_SIZE
    assert tokenizer.image_token_id == config.image_token_id
    assert tokenizer.boi_token_id == (config.boi_token_index if family == "gemma3" else config.boi_token_id)
    assert tokenizer.eoi_token_id == (config.eoi_token_index if family == "gemma3" else config.eoi_token_id)
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in multimodal_token_ids(family)} \
        == multimodal_token_ids(family)


def test_multimodal_tokenizer_keeps_the_text_tokenizers_ids(tmp_path):
    text = transformers.AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "text")).get_vocab()
    multimodal = transformers.AutoTokenizer.from_pretrained(build_multimodal_tokenizer(tmp_path / "mm")).get_vocab()
    shared = set(text) & set(multimodal)
    assert len(shared) == VOCAB_SIZE - len(multimodal_token_ids("gemma3"))
    assert all(text[token] == multimodal[token] for token in shared)


def test_chat_template_renders_trl_vision_messages_as_gemma3(processor):
    conversations, _ = vision_conversations(count=1, text_only_row=False)
    text = processor.apply_chat_template(conversations[0], add_generation_prompt=False, tokenize=False)
    assert text == ("<s><start_of_turn>user\n<start_of_image>the quick brown fox<end_of_turn>\n"
                    "<start_of_turn>model\njumps over<end_of_turn>\n")
    prompt = processor.apply_chat_template(conversations[0][:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")


def test_one_image_expands_to_gemma3_image_sequence(processor, config):
    output = processor(text="hello <start_of_image> world", images=[tiny_image(0)], return_tensors="np")
    tokens = processor.tokenizer.convert_ids_to_tokens(output["input_ids"][0].tolist())
    start = tokens.index("<start_of_image>")
    assert tokens[start - 2:start + TOKENS_PER_IMAGE + 4] == (
        ["\n", "\n", "<start_of_image>"] + ["<image_soft_token>"] * TOKENS_PER_IMAGE + ["<end_of_image>", "\n", "\n"])
    ids = output["input_ids"][0]
    assert (ids == config.image_token_id).sum() == TOKENS_PER_IMAGE
    assert (ids == config.boi_token_index).sum() == 1 and (ids == config.eoi_token_index).sum() == 1
    np.testing.assert_array_equal(output["token_type_ids"][0], (ids == config.image_token_id).astype(np.int64))


def test_pixel_values_are_numpy_normalised_images(processor):
    output = processor(text="<start_of_image>", images=[tiny_image(0)], return_tensors="np")
    pixels = output["pixel_values"]
    assert isinstance(pixels, np.ndarray) and pixels.shape == (1, 3, 28, 28) and pixels.dtype == np.float32
    expected = np.asarray(tiny_image(0), dtype=np.float32).transpose(2, 0, 1) / 255.0 * 2.0 - 1.0  # mean, std 0.5
    np.testing.assert_allclose(pixels[0], expected, atol=1e-5)


def test_vlm_batch_pads_image_rows_and_a_text_only_row(processor):
    batch = vlm_batch(processor, count=2)
    rows, length = batch["input_ids"].shape
    assert rows == 3
    assert batch["attention_mask"].shape == batch["token_type_ids"].shape == (3, length)
    assert batch["pixel_values"].shape == (2, 3, 28, 28)
    np.testing.assert_array_equal(batch["token_type_ids"].sum(axis=1), [TOKENS_PER_IMAGE, TOKENS_PER_IMAGE, 0])
    assert batch["attention_mask"].min(axis=1).tolist().count(0) >= 1  # rows of different lengths were padded


def test_transformers_model_runs_on_vlm_batch(vlm_dir, processor):
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir, attn_implementation="eager").eval()
    assert isinstance(model, transformers.Gemma3ForConditionalGeneration)
    batch = vlm_batch(processor)
    with torch.no_grad():
        logits = model(**{name: torch.from_numpy(array) for name, array in batch.items()}).logits
    assert logits.shape == (*batch["input_ids"].shape, VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_every_parameter_randomises_vision_tower_and_projector(config):
    default = dict(random_model(config).named_parameters())
    drawn = dict(random_model(config, every_parameter=True).named_parameters())
    vision = [name for name in drawn if "vision_tower" in name or "multi_modal_projector" in name]
    assert vision
    assert all(not torch.equal(drawn[name], default[name]) for name in vision)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_random_model_of_multimodal_config_is_conditional_generation(family):
    model = random_model(tiny_multimodal_config(family))
    assert type(model).__name__ == f"{family.capitalize()}ForConditionalGeneration"


def test_gemma4_processor_loads_without_torchvision_and_expands_images_as_transformers(tmp_path):
    """``Gemma4Processor``'s module imports torchvision's image processor and its video processor needs torchvision:
    ``torchlike.AutoProcessor`` builds the saved one around the PIL image processor and a stand-in video processor,
    and it lays out images as :func:`torchlike.testing.gemma4_processed` (transformers' own parts) does."""
    import sys

    import torchlike
    from torchlike.testing import gemma4_processed, tiny_image

    build_processor(tmp_path, "gemma4")
    processor = torchlike.AutoProcessor.from_pretrained(tmp_path)
    assert type(processor).__name__ == "Gemma4Processor"
    assert type(processor.image_processor).__name__ == "Gemma4ImageProcessorPil"
    assert "transformers.models.gemma4.image_processing_gemma4" not in sys.modules
    text = ["<|image|> the quick brown fox", "hello <|image|> world"]
    images = [[tiny_image(0, 28)], [tiny_image(1, 42)]]
    out = processor(text=text, images=images, padding=True, return_tensors="np")
    expected = gemma4_processed(processor.tokenizer, text, images, padding=True)
    assert set(expected) <= set(out)
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(out[key]), value, err_msg=key)
    with pytest.raises(ValueError, match="mistral3"):
        build_processor(tmp_path, "mistral3")


@pytest.mark.parametrize("change, message", [
    ({"image_token_index": 5}, r"image token id is 127 but the checkpoint's image_token_id is 5"),
    ({"mm_tokens_per_image": 16}, r"image_seq_length is 4 but the checkpoint's mm_tokens_per_image is 16"),
    ({"text_config": {"vocab_size": 100}}, r"tokenizer has 128 tokens but the checkpoint's vocab_size is 100"),
])
def test_check_processor_matches_names_each_mismatch(processor, change, message):
    with pytest.raises(ValueError, match=message):
        check_processor_matches(processor, tiny_multimodal_config("gemma3", **change))


def test_check_processor_matches_refuses_a_bare_tokenizer(processor, config):
    with pytest.raises(ValueError, match="has no image processor"):
        check_processor_matches(processor.tokenizer, config)


def test_autoprocessor_names_a_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} holds no tokenizer.*found config\.json"):
        torchlike.AutoProcessor.from_pretrained(tmp_path)


def test_autoprocessor_names_a_missing_directory(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        torchlike.AutoProcessor.from_pretrained(tmp_path / "absent")
