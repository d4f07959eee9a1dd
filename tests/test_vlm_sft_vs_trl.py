"""SFTTrainer on TRL's vision datasets equals the real ``trl.SFTTrainer`` step for step on a Gemma 3
``*ForConditionalGeneration`` checkpoint: conversations with images (and a text-only one) rendered and processed by
the model's processor, images through the vision tower and projector, each image's tokens attending both ways."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests.helpers.logs import logged
from tests.helpers.vision import processor_with_image_seq_length, save_tiny_vlm, vision_conversations
from torchlike.trl import SFTConfig, SFTTrainer

# float32 on both sides (bf16 off); gradient checkpointing stays at TRL's default (on). Clipping is active.
SETTINGS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, max_steps=6, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm-sft"))


def vision_rows(count: int) -> list[dict]:
    conversations, images = vision_conversations(count - 1, seed=3)
    return [{"messages": messages, "images": row_images} for messages, row_images in zip(conversations, images,
                                                                                          strict=True)]


def test_vlm_sft_matches_trl_step_for_step(vlm_path, tmp_path):
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    rows = vision_rows(12)
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **SETTINGS),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=transformers.AutoProcessor.from_pretrained(vlm_path))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()

    trainer = SFTTrainer(model=str(vlm_path), args=SFTConfig(output_dir=str(tmp_path / "ours"),
                                                             train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=torchlike.AutoProcessor.from_pretrained(vlm_path))
    trainer.train()
    expected, ours = reference.state.log_history, trainer.state.log_history
    assert min(logged(expected, "grad_norm")) > 2 * SETTINGS["max_grad_norm"]  # clipping is active every step
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == SETTINGS["max_steps"], key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)


def test_vision_data_settings_trl_refuses_are_refused_with_its_words(vlm_path, tmp_path):
    rows = vision_rows(3)
    for setting, words in (({"packing": True}, "Packing is not supported for vision datasets"),
                           ({"padding_free": True}, "Padding-free training is yet not supported for vision datasets"),
                           ({"truncation_mode": "keep_end"}, "truncation_mode='keep_end' is not supported for vision")):
        with pytest.raises(ValueError, match=words):
            SFTTrainer(model=str(vlm_path), train_dataset=rows,
                       args=SFTConfig(output_dir=str(tmp_path), report_to="none", **setting))


def test_vision_data_on_a_text_only_model_is_refused_as_trl_does(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"The dataset appears to be vision-related .* does not seem to be a "
                                         r"vision-language model"):
        SFTTrainer(model=str(tiny_checkpoints.path("gemma3")), train_dataset=vision_rows(3),
                   args=SFTConfig(output_dir=str(tmp_path), report_to="none"))


def test_a_processor_that_does_not_match_the_checkpoint_is_a_named_error(vlm_path, tmp_path):
    other = processor_with_image_seq_length(vlm_path, 9)
    with pytest.raises(ValueError, match=r"The processor does not match the checkpoint:\n- the processor's "
                                         r"image_seq_length is 9 but the checkpoint's mm_tokens_per_image is 4"):
        SFTTrainer(model=str(vlm_path), train_dataset=vision_rows(3), processing_class=other,
                   args=SFTConfig(output_dir=str(tmp_path), report_to="none"))


def test_text_data_on_a_vlm_given_by_id_trains_with_its_processor_as_trl(vlm_path, tmp_path):
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    rows = [{"prompt": f"the sky {word}", "completion": f" is {word} today"} for word in
            ("blue", "red", "green", "grey", "dark", "light")]
    settings = dict(SETTINGS, max_steps=2)
    reference = trl.SFTTrainer(  # no processing_class: TRL loads the processor of the model's id
        model=transformers.AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()
    trainer = SFTTrainer(model=str(vlm_path), args=SFTConfig(output_dir=str(tmp_path / "ours"),
                                                             train_sampling_strategy="sequential", **settings),
                         train_dataset=rows)
    assert isinstance(reference.processing_class, transformers.ProcessorMixin)
    assert type(trainer.processing_class) is type(reference.processing_class)
    trainer.train()
    for key in ("loss", "grad_norm", "mean_token_accuracy"):
        assert len(logged(reference.state.log_history, key)) == 2, key
        np.testing.assert_allclose(logged(trainer.state.log_history, key),
                                   logged(reference.state.log_history, key), rtol=1e-4, err_msg=key)
