"""TRL's VLM training on Qwen-VL equals the real TRL step for step: SFT on conversations with images of different
sizes (and a text-only one) on Qwen2.5-VL and Qwen2-VL, DPO on image preference pairs and GRPO on image prompts
(scripted completions) on Qwen2.5-VL; every final weight compared; float32 on both sides, TRL's other defaults kept."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from torch.utils.data import SequentialSampler

import torchlike
from tests.helpers.logs import assert_steps_close, logged
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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
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
    expected = {name: parameter.detach().numpy() for name, parameter in theirs.named_parameters()}
    if set(mine) != set(expected):  # Qwen2-VL's and Qwen2.5-VL's published names (Qwen3-VL's are the in-memory ones)
        expected = {name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1): value
                    for name, value in expected.items()}
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
    assert_steps_close(ours, expected, ("loss", "grad_norm", *DPO_METRICS), beta=settings["beta"])
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
    from_rows = rollout.requests_from_rows

    def recording(*args, **kwargs):  # the requests the rollout worker hands its engine (whichever it is)
        batch_requests, places = from_rows(*args, **kwargs)
        requests.extend(batch_requests)
        return batch_requests, places

    monkeypatch.setattr(rollout, "requests_from_rows", recording)
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


def scripted_preference_completion(prompt_ids, copy: int, eos: int) -> list[int]:
    """A fixed completion of 6 tokens per (prompt, which of its two samples), half of them ending with EOS. (All of
    one length: TRL's metrics sum over the padding after a shorter completion too, at positions transformers' M-RoPE
    sets to 0, where torchlike continues counting, as for text models.)"""
    rng = np.random.default_rng([zlib.crc32(np.asarray(prompt_ids, np.int64).tobytes()), copy])
    completion = rng.integers(3, 100, size=6).tolist()
    if rng.random() < 0.5:
        completion[-1] = eos
    return completion


@pytest.mark.parametrize("trl_m_rope", [True, False], ids=["trl-with-m-rope", "trl-as-released"])
def test_qwen2_5_vl_online_dpo_matches_trl_step_for_step(trl_m_rope, qwen_path, tmp_path):
    """TRL's vision path of Online DPO (an ``image`` column, conversational prompts whose user turn gets the image):
    both sides sample the same scripted completions for the same prompt tokens (so the processed prompts must agree,
    image tokens included), rank them by the rewards and train on the pairs with their images; every logged metric
    and every final weight compared.

    TRL's ``_forward`` passes the images and their grids but not the processor's ``mm_token_type_ids``, without which
    transformers' Qwen-VL cannot place M-RoPE positions and numbers image tokens like text. torchlike rotates them by
    M-RoPE, as the model was trained and as TRL's GRPO (which passes them) does: equal to TRL given the token types,
    and different from TRL as released."""
    import datasets
    import torch
    import transformers
    from trl.experimental import online_dpo as trl_online_dpo

    from tests import tiny
    from tests.helpers.logs import assert_online_preference_run_matches
    from torchlike.trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    rows = [{"prompt": [{"role": "user", "content": PROMPTS[row % len(PROMPTS)]}],
             "image": (image_of(row) or [tiny_image(row, 16)])[0]} for row in range(8)]
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_new_tokens=6, max_steps=3,
                    learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1,
                    seed=0, bf16=False, report_to="none", save_strategy="no", beta=0.2, missing_eos_penalty=0.3,
                    reward_weights=[1.0, 0.5])
    rewards = [tiny.token_reward, tiny.length_reward]
    processor = torchlike.AutoProcessor.from_pretrained(qwen_path)
    eos = processor.tokenizer.eos_token_id
    pad = processor.tokenizer.pad_token_id

    def trl_generate(input_ids, attention_mask, generation_config, **vision):
        assert vision["image_grid_thw"].shape[0] == len(input_ids)  # each row generates with its image
        half = len(input_ids) // 2
        completions = [scripted_preference_completion(ids[mask.bool()].tolist(), row // half, eos)
                       for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True))]
        tokens = torch.full((len(completions), max(map(len, completions))), pad, dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return torch.cat([input_ids, tokens], dim=1)

    reference = trl_online_dpo.OnlineDPOTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(qwen_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        reward_funcs=rewards, args=trl_online_dpo.OnlineDPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True,
                                                                  **settings),
        train_dataset=datasets.Dataset.from_list(rows), processing_class=processor)
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.model.generate = trl_generate
    for model in (reference.model, reference.ref_model) if trl_m_rope else ():
        def with_token_types(input_ids=None, *args, forward=model.forward, **kwargs):
            kwargs.setdefault("mm_token_type_ids", (input_ids == processor.image_token_id).long())
            return forward(input_ids, *args, **kwargs)

        model.forward = with_token_types
    reference.train()
    expected_params = {name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1):
                       value.detach().numpy() for name, value in reference.model.named_parameters()}

    sampled = []

    def our_turn(prompt_ids, seed, vision=None, **kwargs):
        sampled.append(vision)
        half = len(prompt_ids) // 2
        return [scripted_preference_completion(ids, row // half, eos) for row, ids in enumerate(prompt_ids)], None

    trainer = OnlineDPOTrainer(model=str(qwen_path), reward_funcs=rewards,
                               args=OnlineDPOConfig(output_dir=str(tmp_path / "ours"),
                                                    train_sampling_strategy="sequential", **settings),
                               train_dataset=rows, processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    trainer._generate_single_turn = our_turn
    trainer.train()
    assert all(vision is not None for vision in sampled) and len(sampled) == 6  # 3 steps of 2 micro-batches
    params = {name: np.asarray(value) for name, value in trainer.model.hf_tensors().items()}
    if trl_m_rope:
        assert_online_preference_run_matches(trainer.state.log_history, reference.state.log_history, params,
                                             expected_params, ONLINE_DPO_METRICS)
    else:  # the first step scores the same weights: only the image tokens' positions differ
        first, expected_first = (next(entry for entry in history if "loss" in entry)
                                 for history in (trainer.state.log_history, reference.state.log_history))
        assert abs(first["logps/chosen"] - expected_first["logps/chosen"]) > 1e-3


#: TRL 1.16's Online DPO metrics with reward functions, beside loss, grad_norm and learning_rate.
ONLINE_DPO_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                      "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
                      "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
                      "val/contain_eos_token", "beta")
