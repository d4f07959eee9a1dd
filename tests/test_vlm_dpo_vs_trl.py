"""DPOTrainer on TRL's vision preference data equals the real ``trl.DPOTrainer`` step for step on a Gemma 3
``*ForConditionalGeneration`` checkpoint: each pair's prompt and images processed by the model's processor (a row
without an image among them), the images through the vision tower for the chosen and the rejected sequence, in the
policy's forward and the reference's; and TRL's refusals of vision preference settings, in its words."""

from __future__ import annotations

import pytest

import torchlike
from tests.helpers.logs import assert_steps_close, evaluated, logged
from tests.helpers.vision import processor_with_image_seq_length, save_tiny_vlm, vision_preferences
from torchlike.trl import DPOConfig, DPOTrainer

# float32 on both sides (bf16 off); gradient checkpointing stays at TRL's default. Gradient accumulation, warmup (the
# first step runs at lr 0), weight decay and clipping (max_grad_norm below every step's norm) are compared too.
SETTINGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, beta=0.1, report_to="none", save_strategy="no")
#: TRL 1.16's DPO metrics beside the loss.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm-dpo"))


def test_vlm_dpo_matches_trl_step_for_step_and_in_evaluation(vlm_path, tmp_path):
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    rows = vision_preferences(7, seed=5)  # seven pairs with an image, the last one without
    held_out = vision_preferences(2, seed=11)
    reference = trl.DPOTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **SETTINGS),
        train_dataset=datasets.Dataset.from_list(rows), eval_dataset=datasets.Dataset.from_list(held_out),
        processing_class=transformers.AutoProcessor.from_pretrained(vlm_path))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()

    trainer = DPOTrainer(model=str(vlm_path), args=DPOConfig(output_dir=str(tmp_path / "ours"),
                                                             train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=datasets.Dataset.from_list(rows),
                         eval_dataset=datasets.Dataset.from_list(held_out),
                         processing_class=torchlike.AutoProcessor.from_pretrained(vlm_path))
    trainer.train()
    expected = [entry for entry in reference.state.log_history if "loss" in entry]
    ours = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in expected] == [1, 2, 3, 4, 5]
    assert [set(entry) for entry in ours] == [set(entry) for entry in expected]  # the same metrics
    assert min(logged(expected, "grad_norm")) > SETTINGS["max_grad_norm"]  # clipping is active every step
    # atol: the rewards of the steps at the initial weights are 0, where a float-noise difference is not relative.
    assert_steps_close(ours, expected, ("loss", "grad_norm", "learning_rate", *METRICS), beta=SETTINGS["beta"])
    assert logged(ours, "num_tokens") == logged(expected, "num_tokens")
    # Step 1 scores the initial weights (lr 0), where chosen > rejected is decided by float noise.
    assert logged(ours, "rewards/accuracies")[1:] == logged(expected, "rewards/accuracies")[1:]
    # The held-out pairs scored by the trained policy against the initial reference.
    expected_eval, ours_eval = evaluated(reference), evaluated(trainer)
    assert set(ours_eval) == set(expected_eval) >= {"eval_loss", "eval_rewards/margins", "eval_logps/chosen"}
    assert_steps_close([ours_eval], [expected_eval], expected_eval, beta=SETTINGS["beta"])


@pytest.mark.parametrize(("setting", "error", "words"), [
    ({"truncation_mode": "keep_end", "max_length": 64}, ValueError,
     "truncation_mode='keep_end' is not supported for vision-language models"),
    ({"precompute_ref_log_probs": True}, ValueError,
     r"`precompute_ref_log_probs=True` is not supported for vision datasets"),
    ({"pad_to_multiple_of": 8}, NotImplementedError,
     "Padding to a multiple of a value is not yet implemented for vision-language modeling"),
], ids=["keep_end", "precompute_ref_log_probs", "pad_to_multiple_of"])
def test_vision_preference_settings_trl_refuses_are_refused_with_its_words(vlm_path, tmp_path, setting, error, words):
    with pytest.raises(error, match=words):
        DPOTrainer(model=str(vlm_path), train_dataset=vision_preferences(2),
                   args=DPOConfig(output_dir=str(tmp_path), report_to="none", **setting))


def test_vision_preferences_on_a_text_only_model_are_refused_as_trl_does(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"The dataset appears to be vision-related .* does not seem to be a "
                                         r"vision-language model"):
        DPOTrainer(model=str(tiny_checkpoints.path("gemma3")), train_dataset=vision_preferences(2),
                   args=DPOConfig(output_dir=str(tmp_path), report_to="none"))


def test_max_length_that_cuts_image_tokens_is_refused_with_trls_words(vlm_path, tmp_path):
    with pytest.raises(ValueError, match=r"The current `max_length` \(8\) is too short and causes image placeholder "
                                         "tokens in `input_ids` to be truncated"):
        DPOTrainer(model=str(vlm_path), train_dataset=vision_preferences(2),
                   args=DPOConfig(output_dir=str(tmp_path), report_to="none", max_length=8))


def test_a_processor_that_does_not_match_the_checkpoint_is_a_named_error(vlm_path, tmp_path):
    other = processor_with_image_seq_length(vlm_path, 9)
    with pytest.raises(ValueError, match=r"The processor does not match the checkpoint:\n- the processor's "
                                         r"image_seq_length is 9 but the checkpoint's mm_tokens_per_image is 4"):
        DPOTrainer(model=str(vlm_path), train_dataset=vision_preferences(2), processing_class=other,
                   args=DPOConfig(output_dir=str(tmp_path), report_to="none"))


@pytest.mark.parametrize("trainer_name", ["DPOTrainer", "GRPOTrainer", "RLOOTrainer"])
def test_a_vlm_given_by_id_gets_its_processor_as_in_trl(vlm_path, tmp_path, trainer_name):
    """Without processing_class, TRL's DPO, GRPO and RLOO load ``AutoProcessor.from_pretrained(model id)``: the
    processor of a vision-language model (its image processor and tokenizer), not the bare tokenizer."""
    import datasets
    import transformers

    import torchlike.trl as ours

    expected = transformers.AutoProcessor.from_pretrained(vlm_path)
    config = getattr(ours, trainer_name.replace("Trainer", "Config"))(output_dir=str(tmp_path), report_to="none")
    data, extra = vision_preferences(2, seed=5), {}
    if trainer_name != "DPOTrainer":  # the preference rows' prompts and images, with a reward
        data = [{"prompt": row["prompt"], "images": row["images"]} for row in data]
        extra = {"reward_funcs": lambda completions, **kwargs: [0.0] * len(completions)}
    trainer = getattr(ours, trainer_name)(model=str(vlm_path), args=config,
                                          train_dataset=datasets.Dataset.from_list(data), **extra)
    assert type(trainer.processing_class).__name__ == type(expected).__name__
    assert trainer.processing_class.tokenizer.get_vocab() == expected.tokenizer.get_vocab()
    assert trainer.processing_class.image_processor.to_dict() == expected.image_processor.to_dict()
