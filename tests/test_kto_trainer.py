"""KTOTrainer end to end: TRL's numbers step for step, and the reference of a LoRA model (its base weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.data import UNPAIRED
from tests.helpers.tokenizers import tokenizer_for
from torchlike.peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, get_peft_model
from torchlike.trl import KTOConfig, KTOTrainer

DATA = UNPAIRED


def comparison_settings(loss_type: str) -> dict:
    """Settings both trainers get: gradient accumulation, truncation to max_length=12 (several sequences are cut), a
    warmup, weight decay and clipping (max_grad_norm below every step's norm) are part of what is compared.

    bf16 off: TRL's bf16 is torch autocast (matmuls in bf16, weights and the rest in float32) while torchlike casts the
    weights to bf16 for the step; both are valid mixed precision, but their roundings differ at bf16 precision, far
    above the tolerance compared here, so the comparison is in float32 on both sides (gradient checkpointing stays on,
    its default).
    The learning rate is large enough that each step after the first moves the weights clearly, and Adam's epsilon
    lies above float noise, so entries whose gradient is ~0 do not take lr-sized steps of either sign.
    """
    return dict(max_length=12, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=10,
                learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.05, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, beta=0.1, loss_type=loss_type, report_to="none",
                save_strategy="no")


def run_trl_kto(path, tokenizer_path, output_dir, settings):
    """``trl.KTOTrainer`` on DATA (sequential, its default): its log history and final parameters (HF names)."""
    import datasets
    import torch
    import transformers
    import trl

    trainer = trl.KTOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=trl.KTOConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(DATA),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer.train()
    params = tiny.saved_hf_params(trainer.model, output_dir / "model")
    return trainer.state.log_history, params


def run_torchlike_kto(path, tokenizer_path, output_dir, settings):
    """torchlike's KTOTrainer on DATA: its log history and final parameters as exported (HF names)."""
    from safetensors.numpy import load_file

    trainer = KTOTrainer(model=str(path), args=KTOConfig(output_dir=str(output_dir), **settings),
                         train_dataset=DATA, processing_class=tokenizer_for(tokenizer_path))
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


# sync_ref_model mixes the policy into the reference after steps 3, 6 and 9, so later steps score against it.
COMPARISON_CASES = {
    "kto, weighted": dict(loss_type="kto", desirable_weight=1.33, undesirable_weight=0.8),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired"),
    "kto, reference synced every 3 steps": dict(loss_type="kto", sync_ref_model=True, ref_model_sync_steps=3,
                                                ref_model_mixup_alpha=0.5),
    # TRL adds a mixture-of-experts model's router loss (here a larger coefficient than the config's).
    # (3 steps: the warmup's first step and two that move the weights are enough for the router loss.)
    "kto, Qwen3-MoE with its router loss": dict(loss_type="kto", model="qwen3_moe", router_aux_loss_coef=0.05,
                                                max_steps=3),
}
COMPARED_METRICS = ("loss", "grad_norm", "learning_rate", "kl", "rewards/chosen", "rewards/rejected",
                    "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy")


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_kto_losses_metrics_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path, case):
    options = dict(COMPARISON_CASES[case])
    path = tiny_checkpoints.path(options.pop("model", "qwen2"))
    settings = {**comparison_settings(options.pop("loss_type")), **options}
    expected_history, expected_params = run_trl_kto(path, tokenizer_dir, tmp_path / "trl", settings)
    history, params = run_torchlike_kto(path, tokenizer_dir, tmp_path / "ours", settings)
    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}

    assert list(ours) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(ours[step]) == set(expected[step]) for step in ours)  # the same metrics, logged the same steps
    assert all(entry["grad_norm"] > settings["max_grad_norm"] for entry in expected.values())  # clipping is on
    for key in (*COMPARED_METRICS, *(["aux_loss"] if "aux_loss" in expected[1] else [])):
        np.testing.assert_allclose([ours[step][key] for step in ours], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    assert [entry["num_tokens"] for entry in ours.values()] == [entry["num_tokens"] for entry in expected.values()]
    assert set(params) == set(expected_params)
    # atol for entries near 0 (the float noise of a run is ~1e-6 there); weight decay alone moves entries by ~1e-3.
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


def completion_log_prob(model, prompt_ids, completion_ids):
    """log p(completion | prompt) from the model's own forward pass (a prompt-tuning model's logits cover its virtual
    tokens first)."""
    ids = list(prompt_ids) + list(completion_ids)
    log_probs = jax.nn.log_softmax(jnp.asarray(model([ids]).logits[0, -len(ids):], jnp.float32), axis=-1)
    return float(sum(log_probs[t - 1, ids[t]] for t in range(len(prompt_ids), len(ids))))


def test_lora_kto_without_ref_model_scores_against_the_base_weights_and_trains_only_lora(tiny_checkpoints,
                                                                                         tokenizer_dir, tmp_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = {key: np.asarray(value) for key, value in model.state_dict().items()}
    # bf16 off: the stored reference log-probs are compared with a float32 forward pass at rtol 1e-5.
    trainer = KTOTrainer(model=model, args=KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                     max_length=32, max_steps=3, learning_rate=1e-2, bf16=False,
                                                     report_to="none", save_strategy="no", logging_steps=1),
                         train_dataset=DATA[:8], eval_dataset=DATA[8:], processing_class=tokenizer_for(tokenizer_dir))
    example = trainer.train_dataset[1]
    expected = completion_log_prob(base, example["prompt_ids"], example["completion_ids"])
    expected_kl = completion_log_prob(base, example["prompt_ids"], example["KL_completion_ids"])
    np.testing.assert_allclose([example["ref_logps"], example["ref_KL_logps"]], [expected, expected_kl], rtol=1e-5)
    trainer.train()
    changed = {key for key, value in model.state_dict().items() if not np.array_equal(np.asarray(value), before[key])}
    assert changed and all("_lora_" in key for key in changed)
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and {"eval_kl", "eval_rewards/chosen", "eval_rewards/margins",
                                                  "eval_logits/rejected"} <= set(metrics)
    assert not any("present/" in key for key in metrics)


@pytest.mark.parametrize("prompt_config", [PromptTuningConfig, PrefixTuningConfig])
def test_a_prompt_learning_adapter_without_ref_model_scores_against_the_base_model(tiny_checkpoints, tokenizer_dir,
                                                                                   tmp_path, prompt_config):
    """With a peft prompt-learning adapter and no ref_model, TRL's reference is the model with the adapter disabled:
    the base model without virtual tokens (prompt tuning) or prefix keys and values (prefix tuning)."""
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    model = get_peft_model(base, prompt_config(task_type="CAUSAL_LM", num_virtual_tokens=5))
    # bf16 off: the stored reference log-probs are compared with a float32 forward pass at rtol 1e-5.
    trainer = KTOTrainer(model=model, args=KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                     max_length=32, max_steps=1, bf16=False, report_to="none",
                                                     save_strategy="no"),
                         train_dataset=DATA[:8], processing_class=tokenizer_for(tokenizer_dir))
    example = trainer.train_dataset[1]
    expected = [completion_log_prob(base, example["prompt_ids"], example[column])
                for column in ("completion_ids", "KL_completion_ids")]
    np.testing.assert_allclose([example["ref_logps"], example["ref_KL_logps"]], expected, rtol=1e-5)
    # The virtual tokens move these log-probs, so a reference that kept them would differ.
    assert not np.isclose(completion_log_prob(model, example["prompt_ids"], example["completion_ids"]), expected[0],
                          rtol=1e-3)


def test_data_without_label_is_refused_with_the_expected_format(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"has no 'label' column\. Found columns: \['prompt', 'completion'\]"):
        KTOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=KTOConfig(output_dir=str(tmp_path)),
                   train_dataset=[{"prompt": "the", "completion": " fox"}],
                   processing_class=tokenizer_for(tokenizer_dir))
