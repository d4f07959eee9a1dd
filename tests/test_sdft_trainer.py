"""SDFTTrainer (``trl.experimental.sdft``): self-distillation step for step against the real
``trl.experimental.sdft.SDFTTrainer`` on the same scripted completions, for each teacher and distillation mode."""

from __future__ import annotations

import importlib
import os

import datasets
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from tests.helpers.scripted import MAX_NEW_TOKENS, scripted_trl_generate, scripted_turn
from tests.helpers.tokenizers import CHAT_TEMPLATE
from torchlike.adapters.losses.self_distillation import divergence
from torchlike.trl.experimental.sdft import SDFTConfig, SDFTTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_sdft = importlib.import_module("trl.experimental.sdft")
trl_loss_utils = importlib.import_module("trl.experimental.sdft.loss_utils")

CONTEXTS = ["the answer is fox", "think of three", "it is a tiny test", "nine comes next"]
ROWS = [{"prompt": prompt, "privileged_context": CONTEXTS[index % 4]} for index, prompt in enumerate(tiny.PROMPTS[:8])]
EVAL_ROWS = [{"prompt": prompt, "privileged_context": "the lazy dog"} for prompt in tiny.EVAL_PROMPTS[:2]]
#: Every metric TRL's SDFT logs beside loss, grad_norm and learning_rate.
METRICS = ("self_distillation/distillation_loss", "sdft/distillation_loss", "completions/mean_length",
           "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length")


def comparison_settings(**case) -> dict:
    """Both trainers' settings: a decaying learning rate, weight decay, clipping below every step's norm, an Adam
    epsilon above float noise, prompts in dataset order, gradient checkpointing on (TRL's default), float32."""
    values = dict(per_device_train_batch_size=4, per_device_eval_batch_size=2, num_generations=2,
                  max_completion_length=MAX_NEW_TOKENS, max_steps=4, learning_rate=1e-2, weight_decay=0.1,
                  max_grad_norm=0.05, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False, report_to="none",
                  save_strategy="no", shuffle_dataset=False, distillation_topk=20)
    values.update(case)
    return values


def rows(conversational: bool, source: list[dict]) -> list[dict]:
    if not conversational:
        return source
    return [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in source]


def write_adapter(path, directory):
    """A LoRA adapter written by ``peft`` with its own random ``lora_A`` and a non-zero ``lora_B`` (both trainers load
    it, so they start from the same adapter and the student differs from its base from the first step)."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return directory


def run_trl(path, tokenizer_path, output_dir, settings, conversational, adapter=None):
    import peft

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    trainer = trl_sdft.SDFTTrainer(
        model=model,
        args=trl_sdft.SDFTConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows(conversational, ROWS)),
        eval_dataset=datasets.Dataset.from_list(rows(conversational, EVAL_ROWS)), processing_class=tokenizer)
    trainer._generate = scripted_trl_generate(trainer)
    trainer.train()
    trainer.evaluate()
    return trainer, tiny.saved_hf_params(trainer.model, output_dir / "model")


def run_torchlike(path, tokenizer_path, output_dir, settings, conversational, adapter=None):
    from safetensors.numpy import load_file

    from torchlike.peft import PeftModel

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    trainer = SDFTTrainer(model=model, args=SDFTConfig(output_dir=str(output_dir), **settings),
                          train_dataset=rows(conversational, ROWS), eval_dataset=rows(conversational, EVAL_ROWS),
                          processing_class=tokenizer)
    trainer._generate_single_turn = scripted_turn(trainer)
    trainer.train()
    trainer.evaluate()
    if adapter is not None:  # the merged weights, as TRL's are compared
        trainer.model = trainer.model.merge_and_unload()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer, load_file(output_dir / "model" / "model.safetensors")


CASES = {
    # The initial student as teacher (a frozen copy); the top-k divergence with a tail bucket; two micro-batches per
    # generation, so the rollout's log-probabilities are kept and the second step's importance weights differ from 1.
    "base teacher, topk with tail, importance weights": dict(teacher_model_kind="base", distillation_add_tail=True,
                                                             steps_per_generation=2, num_loss_tokens_to_skip=1),
    # An EMA teacher (half-way each step), the full-vocabulary forward KL, two accumulated micro-batches.
    "ema teacher, full logits, forward KL, accumulation 2": dict(teacher_model_kind="ema", teacher_update_rate=0.5,
                                                                 distillation_mode="full_logits",
                                                                 distillation_alpha=0.0,
                                                                 gradient_accumulation_steps=2, max_steps=2),
    # The live student as teacher, the sampled-token reverse KL, conversational prompts, sampled after the teacher
    # prompt, at temperature 0.7.
    "live teacher, sampled token, conversations, generate from teacher": dict(
        teacher_model_kind="live", distillation_mode="sampled_token", distillation_alpha=1.0,
        generate_from_teacher=True, temperature=0.7, conversational=True),
    # A LoRA adapter: the base teacher is the student with its adapter off.
    "LoRA, base teacher (adapter off)": dict(teacher_model_kind="base", lora=True, learning_rate=5e-2),
    # A LoRA adapter with an EMA teacher: TRL keeps a second adapter, moved towards the student's.
    "LoRA, ema teacher adapter": dict(teacher_model_kind="ema", teacher_update_rate=0.5, lora=True,
                                      learning_rate=5e-2),
}
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.mark.parametrize("case", list(CASES))
def test_sdft_matches_trl_step_for_step(tiny_checkpoints, pad_tokenizer_dir, tmp_path, case):
    settings = comparison_settings(**CASES[case])
    conversational = settings.pop("conversational", False)
    path = tiny_checkpoints.path("qwen2")
    adapter = write_adapter(path, tmp_path / "adapter") if settings.pop("lora", False) else None
    theirs, their_params = run_trl(path, pad_tokenizer_dir, tmp_path / "trl", settings, conversational, adapter)
    if adapter is not None:
        their_params = tiny.saved_hf_params(theirs.model.merge_and_unload(), tmp_path / "trl" / "merged")
    ours, params = run_torchlike(path, pad_tokenizer_dir, tmp_path / "ours", settings, conversational, adapter)
    expected = {entry["step"]: entry for entry in theirs.state.log_history if "loss" in entry}
    found = {entry["step"]: entry for entry in ours.state.log_history if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found), (found, expected)
    assert all(expected[step]["grad_norm"] > settings["max_grad_norm"] for step in expected)
    for key in ("loss", "grad_norm", "learning_rate", *METRICS):
        steps = [step for step in expected if key in expected[step]]
        np.testing.assert_allclose([found[step][key] for step in steps], [expected[step][key] for step in steps],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    assert set(params) == set(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    their_eval = next(entry for entry in reversed(theirs.state.log_history) if "eval_loss" in entry)
    our_eval = next(entry for entry in reversed(ours.state.log_history) if "eval_loss" in entry)
    assert set(our_eval) == set(their_eval)
    for key in ("eval_loss", *(f"eval_{name}" for name in METRICS)):
        np.testing.assert_allclose(our_eval[key], their_eval[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_divergence_is_trls(alpha):
    rng = np.random.default_rng(0)
    student, teacher = (torch.log_softmax(torch.tensor(rng.normal(size=(2, 3, 7)), dtype=torch.float32), -1)
                        for _ in range(2))
    expected = trl_loss_utils.compute_divergence(student, teacher, alpha).numpy()
    np.testing.assert_allclose(divergence(student.numpy(), teacher.numpy(), alpha), expected, rtol=1e-5, atol=1e-7)


def test_trls_config_errors(tmp_path):
    with pytest.raises(ValueError, match="only supports reverse KL, so it requires `distillation_alpha=1.0`"):
        SDFTConfig(output_dir=str(tmp_path), distillation_mode="sampled_token")
    with pytest.raises(ValueError, match="must contain both `{prompt}` and `{privileged_context}` placeholders"):
        SDFTConfig(output_dir=str(tmp_path), teacher_prompt_template="{prompt} only")
    with pytest.raises(ValueError, match="teacher_model_kind='mean' is not a recognised value"):
        SDFTConfig(output_dir=str(tmp_path), teacher_model_kind="mean")


def test_a_missing_privileged_context_is_trls_error(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="`privileged_context` must not be None"):
        SDFTTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=[{"prompt": "one two"}],
                    processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir),
                    args=SDFTConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8))
