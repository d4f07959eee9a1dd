"""GRPOTrainer on image prompts equals the real ``trl.GRPOTrainer`` step for step on a Gemma 3
``*ForConditionalGeneration`` checkpoint: TRL's vision prompt data (a conversational ``prompt`` beside an ``image``)
processed by the model's processor, the completions scripted on both sides (the same tokens for the same rows), and
the loss's forward passes taking the images and the both-ways attention inside each image."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.logs import logged
from tests.helpers.vision import save_tiny_vlm, scripted_grpo_runs
from torchlike.adapters import rollout
from torchlike.testing import tiny_image
from torchlike.trl import GRPOConfig, GRPOTrainer

#: One prompt text per row, each of the same token length: TRL pads the prompts' token types on the processor's side
#: (right) and their ids on the left, which agree only for prompts of one length.
PROMPT_TEXTS = ["the quick brown fox", "hello world this is", "jumps over the lazy", "quick fox lazy dog",
                "the fox jumps over", "over the lazy dog", "the quick lazy fox", "the brown fox jumps"]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm-grpo"))


def image_rows(count: int = 8) -> list[dict]:
    """TRL's vision prompt rows: a conversational prompt of its own text and an image of its own, by row."""
    return [{"prompt": [{"role": "user", "content": PROMPT_TEXTS[row]}], "image": tiny_image(row)}
            for row in range(count)]


SETTINGS = dict(tiny.grpo_settings(loss_type="dapo", gradient_accumulation_steps=2, max_steps=3),
                per_device_train_batch_size=4, num_generations=4)


def test_vlm_grpo_matches_trl_step_for_step(vlm_path, tmp_path, monkeypatch):
    import transformers

    expected, expected_params, ours, params = scripted_grpo_runs(
        vlm_path, image_rows(), SETTINGS, tmp_path, monkeypatch,
        trl_processor=transformers.AutoProcessor.from_pretrained(vlm_path))
    assert len(logged(expected, "loss")) == SETTINGS["max_steps"]
    for key in ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length"):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    # torchlike exports the vision tower under Google's names; transformers 5 saves them without "vision_model.".
    params = {name.replace("vision_tower.vision_model.", "vision_tower.", 1): value for name, value in params.items()}
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


def test_image_prompts_for_a_text_only_model_are_refused_as_trl_does(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"The dataset appears to be vision-related .* does not seem to be a "
                                         r"vision-language model"):
        GRPOTrainer(model=str(tiny_checkpoints.path("gemma3")), reward_funcs=tiny.length_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), report_to="none"), train_dataset=image_rows(2))


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_vlm_grpo_samples_its_completions_with_the_images(vlm_path, tmp_path, max_staleness, monkeypatch):
    # max_staleness=1: the next generation batch is sampled, with its images, while the current one trains.
    trainer = GRPOTrainer(model=str(vlm_path), reward_funcs=[tiny.token_reward, tiny.length_reward],
                          args=GRPOConfig(output_dir=str(tmp_path), max_staleness=max_staleness,
                                          **dict(SETTINGS, max_steps=1 + max_staleness)),
                          train_dataset=image_rows(4),
                          processing_class=torchlike.AutoProcessor.from_pretrained(vlm_path))
    requests = []
    from_rows = rollout.requests_from_rows

    def recording(*args, **kwargs):  # the requests the rollout worker hands its engine (whichever it is)
        batch_requests, places = from_rows(*args, **kwargs)
        requests.extend(batch_requests)
        return batch_requests, places

    monkeypatch.setattr(rollout, "requests_from_rows", recording)
    output = trainer.train()
    assert output.global_step == 1 + max_staleness and np.isfinite(output.training_loss)
    assert isinstance(trainer.rollout_engine, rollout.PagedEngine)  # the CPU's default engine samples the images
    # Every prompt was one request (its num_generations samples share a prefill) carrying its own image.
    assert [request.num_samples for request in requests] == [SETTINGS["num_generations"]] * len(requests)
    assert all(request.images is not None and request.images.shape[0] == 1 for request in requests)
    assert not np.array_equal(requests[0].images, requests[1].images)
    assert sum(request.token_type_ids.count(1) for request in requests[:1]) == 4  # one image's soft tokens
