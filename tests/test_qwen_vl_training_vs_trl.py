"""TRL's VLM training on Qwen-VL equals the real TRL step for step: SFT on conversations with images of different
sizes (and a text-only one) on Qwen2.5-VL and Qwen2-VL, DPO on image preference pairs and GRPO on image prompts
(scripted completions) on Qwen2.5-VL; every final weight compared; float32 on both sides, TRL's other defaults kept."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests.helpers.logs import logged
from tests.helpers.vision import ANSWERS, PROMPTS, offline_runs, save_tiny_vlm
from torchlike.testing import tiny_image

SETTINGS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, max_steps=4, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")


@pytest.fixture(scope="module")
def qwen_paths(tmp_path_factory):
    built = {}

    def path(family: str):
        if family not in built:
            built[family] = save_tiny_vlm(tmp_path_factory.mktemp(f"{family}-train"), family)
        return built[family]

    return path


@pytest.fixture(scope="module")
def qwen_path(qwen_paths):
    return qwen_paths("qwen2_5_vl")


def image_of(row: int):
    """Images of three sizes in turn (grids 1x4x4, 1x4x8, 1x8x8), and none every fourth row."""
    if row % 4 == 3:
        return []
    size = ((16, 16), (32, 16), (32, 32))[row % 4]
    return [tiny_image(row, 32).resize(size)]


def conversation_rows(count: int) -> list[dict]:
    rows = []
    for row in range(count):
        images = image_of(row)
        question = [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}] * len(images) + question},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]}],
            "images": images})
    return rows


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen_vl_sft_matches_trl_step_for_step(family, qwen_paths, tmp_path):
    qwen_path = qwen_paths(family)
    rows = conversation_rows(12)
    reference, trainer = offline_runs("SFT", qwen_path, rows, SETTINGS, tmp_path)
    expected, ours = reference.state.log_history, trainer.state.log_history
    assert min(logged(expected, "grad_norm")) > 2 * SETTINGS["max_grad_norm"]  # clipping is active every step
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == SETTINGS["max_steps"], key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    assert_same_weights(trainer.model, reference.model)


def assert_same_weights(ours, theirs, atol: float = 1e-5) -> None:
    """Every final weight of the torchlike model (published names) equals the transformers model's (in-memory names):
    the tower's, the merger's and the decoder's, weight decay's choices included."""
    mine = ours.hf_tensors()
    expected = {name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1):
                parameter.detach().numpy() for name, parameter in theirs.named_parameters()}
    assert set(mine) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(mine[name]), value, rtol=1e-4, atol=atol, err_msg=name)


#: TRL 1.16's DPO metrics beside the loss.
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def preference_rows(count: int, seed: int = 0) -> list[dict]:
    rows = []
    for row in range(count):
        images = image_of(row + seed)
        question = [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}] * len(images) + question}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text",
                                                                   "text": ANSWERS[row % len(ANSWERS)]}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text",
                                                                     "text": ANSWERS[(row + 1) % len(ANSWERS)]}]}],
                     "images": images})
    return rows


def test_qwen2_5_vl_dpo_matches_trl_step_for_step(qwen_path, tmp_path):
    settings = dict(SETTINGS, per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.1)
    rows = preference_rows(8)
    reference, trainer = offline_runs("DPO", qwen_path, rows, settings, tmp_path)
    expected = [entry for entry in reference.state.log_history if "loss" in entry]
    ours = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in expected] == [1, 2, 3, 4]
    assert [set(entry) for entry in ours] == [set(entry) for entry in expected]
    for key in ("loss", "grad_norm", *DPO_METRICS):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, atol=1e-6, err_msg=key)
    assert_same_weights(trainer.model, reference.model)


@pytest.mark.parametrize("case", [{}, {"beta": 0.04, "num_iterations": 2}], ids=["defaults", "kl-two-iterations"])
def test_qwen2_5_vl_grpo_matches_trl_step_for_step(case, qwen_path, tmp_path, monkeypatch):
    """Scripted completions (the same tokens for the same rows on both sides) for image prompts of three sizes (TRL's
    GRPO takes no text prompt beside image ones), prompts of different lengths; the loss's forward passes take the
    images and M-RoPE."""
    from tests import tiny
    from tests.helpers.vision import scripted_grpo_runs

    rows = [{"prompt": [{"role": "user", "content": PROMPTS[row % len(PROMPTS)]}],
             "images": image_of(row) or [tiny_image(row, 16)]} for row in range(8)]
    # "kl-two-iterations": the reference's and the stored old policy's log-probs take the images too.
    settings = dict(tiny.grpo_settings(loss_type="dapo", gradient_accumulation_steps=2, max_steps=3, **case),
                    per_device_train_batch_size=4, num_generations=4)
    expected, expected_params, ours, params = scripted_grpo_runs(qwen_path, rows, settings, tmp_path, monkeypatch)
    assert len(logged(expected, "loss")) == settings["max_steps"]
    for key in ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length"):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    assert set(params) == set(expected_params)
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-4, err_msg=name)


def test_qwen2_5_vl_rloo_samples_each_prompt_with_its_images(qwen_path, tmp_path, monkeypatch):
    """RLOO shares GRPO's image path: each prompt is one request carrying its own patches and M-RoPE offsets, the
    completions sampled with them, and training steps run on the image batches."""
    from tests import tiny
    from torchlike.adapters import rollout
    from torchlike.trl import RLOOConfig, RLOOTrainer

    rows = [{"prompt": [{"role": "user", "content": PROMPTS[row % len(PROMPTS)]}],
             "images": image_of(row) or [tiny_image(row, 16)]} for row in range(4)]
    requests = []
    engine_generate = rollout.StaticEngine.generate

    def recording(engine, batch_requests, settings):
        requests.extend(batch_requests)
        return engine_generate(engine, batch_requests, settings)

    monkeypatch.setattr(rollout.StaticEngine, "generate", recording)
    trainer = RLOOTrainer(model=str(qwen_path), reward_funcs=[tiny.token_reward, tiny.length_reward],
                          args=RLOOConfig(output_dir=str(tmp_path), **dict(tiny.grpo_settings(max_steps=2),
                                                                           per_device_train_batch_size=4,
                                                                           num_generations=2)),
                          train_dataset=rows, processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    output = trainer.train()
    assert output.global_step == 2 and np.isfinite(output.training_loss)
    assert [request.num_samples for request in requests] == [2] * len(requests)
    patches = [int((request.images["frames"] > 0).sum()) for request in requests[:2]]
    assert patches == [16, 32]  # the first two prompts' 1x4x4 and 1x4x8 images
    assert all(request.rope_delta != 0 for request in requests[:2])


#: TRL 1.16's KTO metrics beside the loss.
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected")


def test_qwen2_5_vl_kto_matches_trl_step_for_step(qwen_path, tmp_path):
    """TRL's vision KTO: each prompt with its images, the KL completions cycled within each batch, the reference
    scoring both; images of three sizes and a text-only row."""
    rows = []
    for row in range(12):
        images = image_of(row)
        question = [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}] * len(images) + question}],
                     "completion": [{"role": "assistant", "content": [{"type": "text",
                                                                       "text": ANSWERS[(row * 3) % len(ANSWERS)]}]}],
                     "label": row % 3 != 1, "images": images})
    # Batches of three: the KL completions' cycle has a direction (each prompt with the completion before it).
    settings = dict(SETTINGS, per_device_train_batch_size=3, gradient_accumulation_steps=2, beta=0.1,
                    train_sampling_strategy="sequential")
    reference, trainer = offline_runs("KTO", qwen_path, rows, settings, tmp_path)
    expected = [entry for entry in reference.state.log_history if "loss" in entry]
    ours = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in expected] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", *KTO_METRICS):
        if key in expected[0]:
            np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, atol=1e-6, err_msg=key)
    assert_same_weights(trainer.model, reference.model)
