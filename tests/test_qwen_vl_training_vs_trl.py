"""TRL's VLM training on Qwen2.5-VL equals the real TRL step for step: SFT on conversations with images of different
sizes (and a text-only one), DPO on image preference pairs, GRPO on image prompts (scripted completions); float32 on
both sides, TRL's other defaults kept."""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests.helpers.logs import logged
from tests.helpers.vision import ANSWERS, PROMPTS, save_tiny_vlm
from torchlike.testing import tiny_image

SETTINGS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, max_steps=4, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen-vl-train"), "qwen2_5_vl")


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


def test_qwen2_5_vl_sft_matches_trl_step_for_step(qwen_path, tmp_path):
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    from torchlike.trl import SFTConfig, SFTTrainer

    rows = conversation_rows(12)
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(qwen_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **SETTINGS),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()

    trainer = SFTTrainer(model=str(qwen_path), args=SFTConfig(output_dir=str(tmp_path / "ours"),
                                                              train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    trainer.train()
    expected, ours = reference.state.log_history, trainer.state.log_history
    assert min(logged(expected, "grad_norm")) > 2 * SETTINGS["max_grad_norm"]  # clipping is active every step
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == SETTINGS["max_steps"], key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    # The final weights, the tower's and the decoder's (published names; transformers' in memory).
    mine = trainer.model.hf_tensors()
    theirs = dict(reference.model.named_parameters())
    for name in ("visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        in_memory = name.replace("visual.", "model.visual.", 1).replace("model.layers.", "model.language_model.layers.")
        np.testing.assert_allclose(np.asarray(mine[name]), theirs[in_memory].detach().numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


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
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    from torchlike.trl import DPOConfig, DPOTrainer

    settings = dict(SETTINGS, per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.1)
    rows = preference_rows(8)
    reference = trl.DPOTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(qwen_path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()
    trainer = DPOTrainer(model=str(qwen_path), args=DPOConfig(output_dir=str(tmp_path / "ours"),
                                                              train_sampling_strategy="sequential", **settings),
                         train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=torchlike.AutoProcessor.from_pretrained(qwen_path))
    trainer.train()
    expected = [entry for entry in reference.state.log_history if "loss" in entry]
    ours = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in expected] == [1, 2, 3, 4]
    assert [set(entry) for entry in ours] == [set(entry) for entry in expected]
    for key in ("loss", "grad_norm", *DPO_METRICS):
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, atol=1e-6, err_msg=key)
    mine, theirs = trainer.model.hf_tensors(), dict(reference.model.named_parameters())
    np.testing.assert_allclose(np.asarray(mine["visual.blocks.1.mlp.up_proj.weight"]),
                               theirs["model.visual.blocks.1.mlp.up_proj.weight"].detach().numpy(), rtol=1e-4,
                               atol=1e-6)
