"""Gemma 4's vision encoder: ``Gemma4ForConditionalGeneration`` takes images and gives ``transformers``' logits (eager,
float32) and greedy tokens on both rollout engines, exports its vision tower bit-exact in the published layout,
adapts the tower with LoRA in PEFT's layout, and refuses what it cannot take with a named error.

The checkpoint has what the published ones may switch on: per-layer inputs, clipped linears with binding bounds and
standardized soft tokens. transformers' ``Gemma4Processor`` cannot be built without torchvision, so the batches come
from ``torchlike.testing.gemma4_processed`` (its image processor and its image-token expansion).
"""

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
from tests.helpers.vision import hf_vlm, logits_counting_real_tokens
from torchlike.adapters.families import UnsupportedConfigError
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import (
    build_multimodal_tokenizer,
    gemma4_processed,
    random_model,
    tiny_image,
    tiny_multimodal_config,
)

VISION = {"standardize": True, "use_clipped_linears": True}
TEXT = {"hidden_size_per_layer_input": 8}  # per-layer inputs on, which read the pad token at image tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny ``Gemma4ForConditionalGeneration`` (every parameter drawn; the standardization and the clip
    bounds drawn too, the bounds tight enough to bind) with its tokenizer."""
    directory = tmp_path_factory.mktemp("gemma4-vision") / "tiny-gemma4-vlm"
    model = random_model(tiny_multimodal_config("gemma4", vision_config=VISION, text_config=TEXT),
                         every_parameter=True, attn_implementation="eager")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("std_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("std_scale"):
                buffer.copy_(1.0 + 0.2 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith(("input_min", "output_min")):
                buffer.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(2.0)
    model.save_pretrained(directory)
    build_multimodal_tokenizer(directory, "gemma4")
    return directory


@pytest.fixture(scope="module")
def model(checkpoint):
    return torchlike.AutoModelForImageTextToText.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_vlm(checkpoint)


def image_batch(checkpoint, padding_side: str = "right", text_only_row: bool = True) -> dict:
    """Two rows with one image each, of different sizes (28x28: 4 soft tokens; 42x42: 9), and a text-only row."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = ["<|image|> the quick brown fox", "hello <|image|> world", "one two three"]
    images = [[tiny_image(0, 28)], [tiny_image(1, 42)], []]
    rows = 3 if text_only_row else 2
    return gemma4_processed(tokenizer, text[:rows], images[:rows], padding=True, padding_side=padding_side)


def test_image_and_text_logits_equal_transformers(checkpoint, model, reference):
    inputs = image_batch(checkpoint)
    assert inputs["pixel_values"].shape[0] == 2 and inputs["mm_token_type_ids"].sum() == 4 + 9
    ours = model(**inputs).logits
    theirs = logits_counting_real_tokens(reference, inputs)
    assert valid_max_diff(ours, theirs, inputs["attention_mask"]) <= 1e-4
    # The images matter: the same rows without them differ where the image tokens and what follows sit.
    text_only = logits_counting_real_tokens(reference, {key: inputs[key] for key in ("input_ids", "attention_mask")})
    assert valid_max_diff(ours, text_only, inputs["attention_mask"]) > 1e-2


def test_embeddings_path_repeats_the_token_paths_layers(model):
    module = model.module
    tokens = np.random.default_rng(0).integers(3, 100, size=(2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12), (2, 12))
    mask = np.tril(np.ones((12, 12), bool))[None].repeat(2, axis=0)
    via_tokens, _ = module(tokens, positions, None, mask)
    embedded = module.embedder.encode(tokens)
    via_embeddings, _ = module.decode_embeddings(embedded, module.embedder.encode_per_layer_input(embedded, tokens),
                                                 positions, None, mask)
    np.testing.assert_array_equal(np.asarray(via_embeddings), np.asarray(via_tokens))


def test_greedy_generate_with_images_equals_transformers_on_both_engines(checkpoint, model, reference):
    inputs = image_batch(checkpoint, "left")
    with torch.no_grad():
        expected = reference.generate(**{key: torch.tensor(value) for key, value in inputs.items()},
                                      max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=engine)


def test_export_is_the_published_layout_bit_exact_and_transformers_reloads_it(checkpoint, model, reference,
                                                                              tmp_path):
    model.save_pretrained(tmp_path / "export")
    source = load_file(checkpoint / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert any(name.startswith("model.vision_tower.encoder.layers.0.self_attn.q_proj.input_min") for name in source)
    assert set(exported) == set(source)
    for name, array in source.items():
        assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert not model.kept_weights  # the vision tower is in the module now; there is no audio tower here
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export", attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = image_batch(checkpoint)
    assert valid_max_diff(logits_counting_real_tokens(reloaded.eval(), inputs),
                          logits_counting_real_tokens(reference, inputs), inputs["attention_mask"]) == 0.0


def test_lora_on_the_vision_tower_loads_in_peft_with_the_same_image_logits(checkpoint, tmp_path):
    targets = ["linear", "embedding_projection"]  # the tower's nn.Linear inside each Gemma4ClippableLinear
    lora = get_peft_model(torchlike.AutoModelForImageTextToText.from_pretrained(checkpoint),
                          LoraConfig(r=4, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"))
    randomize_lora_(lora)
    lora.save_pretrained(tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.lora_A.weight" in keys
    assert "base_model.model.model.embed_vision.embedding_projection.lora_B.weight" in keys
    theirs = peft.PeftModel.from_pretrained(hf_vlm(checkpoint), tmp_path / "adapter").eval()
    inputs = image_batch(checkpoint)
    assert valid_max_diff(lora(**inputs).logits, logits_counting_real_tokens(theirs, inputs),
                          inputs["attention_mask"]) <= 1e-4


def test_more_images_than_image_tokens_is_a_named_error(checkpoint, model):
    inputs = image_batch(checkpoint)
    extra = {"pixel_values": np.concatenate([inputs["pixel_values"], inputs["pixel_values"][:1]]),
             "image_position_ids": np.concatenate([inputs["image_position_ids"], inputs["image_position_ids"][:1]])}
    with pytest.raises(ValueError, match=r"1 image\(s\) were given beyond the image tokens of the text"):
        model(inputs["input_ids"], inputs["attention_mask"], **extra)
    with pytest.raises(ValueError, match=r"needs image_position_ids with pixel_values"):
        model(inputs["input_ids"], inputs["attention_mask"], pixel_values=inputs["pixel_values"])
    audio = np.zeros((1, 8, 128), np.float32)
    with pytest.raises(ValueError, match=r"\['input_features'\] were given but this gemma4_multimodal model cannot "
                                         r"take them: Tunix 0\.1\.7 has no Gemma 4 audio encoder"):
        model(inputs["input_ids"], inputs["attention_mask"], input_features=audio)
    with pytest.raises(ValueError, match=r"cannot take them: Tunix 0\.1\.7 has no Gemma 4 audio encoder"):
        model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], input_features=audio,
                       max_new_tokens=2)


@pytest.fixture(scope="module")
def both_ways_checkpoint(tmp_path_factory):
    """The larger Gemma 4 checkpoints' attention: each image's tokens see each other both ways
    (``use_bidirectional_attention="vision"``), with a sliding window (16) no shorter than an image."""
    directory = tmp_path_factory.mktemp("gemma4-both-ways") / "tiny-gemma4-vlm"
    config = tiny_multimodal_config("gemma4", vision_config=VISION,
                                    text_config={**TEXT, "use_bidirectional_attention": "vision", "sliding_window": 16})
    random_model(config, every_parameter=True, attn_implementation="eager").save_pretrained(directory)
    build_multimodal_tokenizer(directory, "gemma4")
    return directory


def test_images_attending_both_ways_give_transformers_logits_and_tokens(both_ways_checkpoint):
    """``mm_token_type_ids`` mark each image's block, as transformers reads them; without them transformers attends
    causally, which differs (the blocks matter)."""
    model = torchlike.AutoModelForImageTextToText.from_pretrained(both_ways_checkpoint)
    reference = hf_vlm(both_ways_checkpoint)
    inputs = image_batch(both_ways_checkpoint)
    ours = model(**inputs).logits
    assert valid_max_diff(ours, logits_counting_real_tokens(reference, inputs), inputs["attention_mask"]) <= 1e-4
    causal = {key: value for key, value in inputs.items() if key != "mm_token_type_ids"}
    assert valid_max_diff(ours, logits_counting_real_tokens(reference, causal), inputs["attention_mask"]) > 1e-3
    left = image_batch(both_ways_checkpoint, "left")
    with torch.no_grad():
        expected = reference.generate(**{key: torch.tensor(value) for key, value in left.items()},
                                      max_new_tokens=4, do_sample=False, eos_token_id=[], pad_token_id=0).numpy()
    for engine in ("static", "paged"):
        out = model.generate(**left, max_new_tokens=4, do_sample=False, eos_token_id=[], pad_token_id=0,
                             rollout_engine=engine)
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=engine)


def test_an_image_longer_than_the_sliding_window_and_all_way_attention_are_refused_by_name(tmp_path):
    config = tiny_multimodal_config("gemma4", text_config={"use_bidirectional_attention": "vision",
                                                           "sliding_window": 8})
    model = torchlike.AutoModelForImageTextToText.from_config(config)
    build_multimodal_tokenizer(tmp_path, "gemma4")
    inputs = image_batch(tmp_path)  # a 42x42 image: 9 soft tokens
    with pytest.raises(ValueError, match=r"an image of 9 soft tokens is longer than text_config\.sliding_window=8"):
        model(**inputs)
    config = tiny_multimodal_config("gemma4", text_config={"use_bidirectional_attention": "all"})
    with pytest.raises(UnsupportedConfigError, match=r"text_config\.use_bidirectional_attention='all' is not "
                                                     r"supported: only None .* and 'vision'"):
        torchlike.AutoModelForImageTextToText.from_config(config)


def test_gemma4_sft_matches_trl_step_for_step(tmp_path):
    """TRL's vision SFT on Gemma 4 (its processor as ``torchlike.AutoProcessor`` loads it without torchvision):
    images of two sizes and a text-only row; losses, grad norms and every final weight and buffer (``layer_scalar``
    is a buffer in transformers: trained on neither side)."""
    from tests.helpers.vision import (
        SFT_SETTINGS,
        assert_sft_matches_trl,
        image_conversations,
        offline_runs,
        save_tiny_vlm,
    )

    path = save_tiny_vlm(tmp_path / "checkpoint", "gemma4")
    rows = image_conversations(9, lambda row: [] if row % 3 == 2 else [tiny_image(row, 28 + 14 * (row % 2))])
    assert_sft_matches_trl(*offline_runs("SFT", path, rows, SFT_SETTINGS, tmp_path), buffers=True,
                           published=lambda name: None if name == "lm_head.weight" else name)  # tied
