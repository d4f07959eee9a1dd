"""SFT, DPO and GRPO with bf16 mixed precision (TRL's default) follow the real TRL trainers step for step.

bf16 and gradient checkpointing are left at their defaults (on) on both sides: TRL's accelerate runs torch's CPU
autocast on float32 master weights, torchlike casts the parameters to bf16 for the forward and backward pass and
updates float32 weights. Each trainer trains full weights and a LoRA adapter (the same ``peft`` adapter on both
sides) from the same weights on the same rows in order (GRPO on scripted completions); accumulation, warmup, weight
decay and clipping are on.

Tolerance: per-step loss within 1% (plus 2e-3 absolute: GRPO's loss is a small signed sum of ratios times
advantages), grad norm within 5%, and final weights apart by at most 5% of the update
(``||w_ours - w_trl|| / ||w_trl - w_initial||``). bf16 keeps 8 significant bits (relative rounding ~2e-3 per operation)
and the libraries round at different places (autocast keeps the residual stream, norms and embeddings in float32;
torchlike rounds every parameter), so single values differ by a few 1e-3 and six steps drift apart by ~2% of the
update; measured: at most 2.9e-3 relative in loss (1.2e-3 absolute in GRPO's), 1.5e-2 in grad norm, 2.1% in weights.

Breaks it catches (torchlike's side only): learning rate x1.2 moves the weights by 18-27% of the update in all six
runs; DPO's beta x1.2 moves the loss by 19-45% and GRPO's by 6%. It does not tell bf16 from float32 on this tiny
model: torchlike in float32 against TRL in bf16 stays as close (2.8e-3, 1.6e-2, 2.0%), since bf16 rounding moves a
six-step run less than the two libraries' different rounding points do; what it checks is that training with TRL's
bf16 default follows TRL's, not that torchlike computes in bf16.
"""

from __future__ import annotations

import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.bf16 import relative_weight_difference, saved_params, torchlike_model, trl_model, write_lora_adapter
from tests.helpers.data import PREFERENCES, prompt_completion_data
from tests.helpers.logs import logged

STEPS = 6
LOSS_RTOL, LOSS_ATOL, GRAD_NORM_RTOL, WEIGHT_TOLERANCE = 1e-2, 2e-3, 5e-2, 5e-2
# bf16 is not set (on by default on both sides). Clipping is active; Adam's epsilon sits above float noise.
COMMON = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS, warmup_steps=1,
              weight_decay=0.1, adam_epsilon=1e-4, logging_steps=1, seed=0, report_to="none", save_strategy="no")
# GRPO: two iterations per generation, so the loss depends on the policy (old log-probs, the ratio) and on a KL
# reference; the learning rate keeps the second iteration's ratios mostly inside the clip range, where bf16 noise
# does not flip tokens in and out of it.
GRPO = {name: value for name, value in tiny.grpo_settings(loss_type="dapo", gradient_accumulation_steps=2,
                                                          num_iterations=2, beta=0.04, learning_rate=3e-3,
                                                          max_steps=STEPS).items() if name != "bf16"}
SETTINGS = {"sft": dict(COMMON, learning_rate=3e-3, max_grad_norm=0.5, max_length=32),
            "dpo": dict(COMMON, learning_rate=1e-2, max_grad_norm=0.05, max_length=20, beta=0.1),
            "grpo": GRPO}
# The LoRA runs start from a trained adapter (its B non-zero): GRPO's KL is then scored against a frozen copy of it,
# as TRL's "ref" adapter.
LORA_SETTINGS = {"grpo": dict(learning_rate=1e-3, max_grad_norm=0.2)}
DATA = {"sft": prompt_completion_data(STEPS * 8), "dpo": PREFERENCES, "grpo": [{"prompt": p} for p in tiny.PROMPTS]}
ONLINE = dict(reward_funcs=[tiny.token_reward, tiny.length_reward], rollout_func=tiny.scripted_rollout)


def train_trl(name, model, tokenizer_dir, output_dir, settings, monkeypatch):
    """The real TRL trainer ``name`` on ``DATA[name]`` in order: its log history and final (saved) parameters."""
    import datasets
    import transformers
    import trl
    import trl.trainer.grpo_trainer as trl_grpo
    from torch.utils.data import SequentialSampler

    config_class, trainer_class = {"sft": (trl.SFTConfig, trl.SFTTrainer), "dpo": (trl.DPOConfig, trl.DPOTrainer),
                                   "grpo": (trl.GRPOConfig, trl.GRPOTrainer)}[name]
    args = config_class(output_dir=str(output_dir), use_cpu=True, **settings)
    assert args.bf16 and args.gradient_checkpointing
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    trainer = trainer_class(model=model, args=args, train_dataset=datasets.Dataset.from_list(DATA[name]),
                            processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
                            **(ONLINE if name == "grpo" else {}))
    if name != "grpo":  # GRPO's prompts stay in order with shuffle_dataset=False
        trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    return trainer.state.log_history, saved_params(trainer.model, output_dir / "model")


def train_torchlike(name, model, tokenizer_dir, output_dir, settings):
    """torchlike's trainer ``name`` as :func:`train_trl` runs TRL's."""
    from torchlike import trl

    config_class, trainer_class = {"sft": (trl.SFTConfig, trl.SFTTrainer), "dpo": (trl.DPOConfig, trl.DPOTrainer),
                                   "grpo": (trl.GRPOConfig, trl.GRPOTrainer)}[name]
    args = config_class(output_dir=str(output_dir), train_sampling_strategy="sequential", **settings)
    assert args.bf16 and args.gradient_checkpointing
    trainer = trainer_class(model=model, args=args, train_dataset=DATA[name],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                            **(ONLINE if name == "grpo" else {}))
    trainer._shuffled = lambda batch, seed: batch  # GRPO: the rows of a generation batch in order, as TRL's
    trainer.train()
    return trainer.state.log_history, saved_params(trainer.model, output_dir / "model")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_bf16_training_follows_trl_step_for_step(name, lora, tiny_checkpoints, tokenizer_dir, tmp_path, monkeypatch):
    path = tiny_checkpoints.path("qwen2")
    adapter_dir = write_lora_adapter(path, tmp_path / "adapter") if lora else None
    settings = {**SETTINGS[name], **(LORA_SETTINGS.get(name, {}) if lora else {})}
    initial = saved_params(trl_model(path, adapter_dir), tmp_path / "initial")
    expected_history, expected_params = train_trl(name, trl_model(path, adapter_dir), tokenizer_dir,
                                                  tmp_path / "trl", settings, monkeypatch)
    history, params = train_torchlike(name, torchlike_model(path, adapter_dir), tokenizer_dir, tmp_path / "ours",
                                      settings)

    assert len(logged(history, "loss")) == len(logged(expected_history, "loss")) == STEPS
    assert min(logged(expected_history, "grad_norm")) > settings["max_grad_norm"]  # clipping is active every step
    np.testing.assert_allclose(logged(history, "loss"), logged(expected_history, "loss"), rtol=LOSS_RTOL,
                               atol=LOSS_ATOL)
    np.testing.assert_allclose(logged(history, "grad_norm"), logged(expected_history, "grad_norm"),
                               rtol=GRAD_NORM_RTOL)
    assert relative_weight_difference(params, expected_params, initial) < WEIGHT_TOLERANCE
