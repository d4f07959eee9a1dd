"""DPOTrainer end to end: TRL's numbers step for step, preference formats, references (LoRA base, explicit, initial)."""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torchlike
from tests import tiny
from tests.helpers.data import PREFERENCES, message
from tests.helpers.logs import logged
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for
from torchlike.adapters.losses.dpo import DPOLossSettings, dpo_step_loss
from torchlike.peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, get_peft_model
from torchlike.trl import DPOConfig, DPOTrainer
from torchlike.trl.data.dpo_data import PreferenceDataWarning, collate_preference_batch, prepare_preference_examples

FORMATS = {
    "standard, explicit prompt": [{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog"},
                                  {"prompt": "one two", "chosen": " three</s>", "rejected": " four five"}],
    "standard, implicit prompt": [{"chosen": "the quick brown fox jumps", "rejected": "the quick brown dog"},
                                  {"chosen": "one two three", "rejected": "one two four five"}],
    "conversational, explicit prompt": [{"prompt": [message("user", "the quick brown")],
                                         "chosen": [message("assistant", "fox")],
                                         "rejected": [message("assistant", "dog")]}],
    "conversational, implicit prompt": [{"chosen": [message("user", "one two"), message("assistant", "three")],
                                         "rejected": [message("user", "one two"), message("assistant", "four")]}],
}


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_length=20, per_device_train_batch_size=4, max_steps=6,
                  learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                  train_sampling_strategy="sequential")
    values.update(overrides)
    return DPOConfig(**values)


def sequence_log_prob(model, prompt_ids, response_ids):
    """log p(response | prompt) from the model's own forward pass (a prompt-tuning model's logits cover its virtual
    tokens first)."""
    ids = list(prompt_ids) + list(response_ids)
    log_probs = jax.nn.log_softmax(jnp.asarray(model([ids]).logits[0, -len(ids):], jnp.float32), axis=-1)
    return float(sum(log_probs[t - 1, ids[t]] for t in range(len(prompt_ids), len(ids))))


def comparison_settings(loss_type: str) -> dict:
    """Settings both trainers get: gradient accumulation, truncation to max_length=20 (several sequences are cut), a
    warmup, weight decay and clipping (max_grad_norm below every step's norm) are part of what is compared.

    bf16 off: the comparison is in float32 on both sides (gradient checkpointing stays at its default, on). The
    learning rate is large enough that each step after the first (warmup starts at lr 0) moves the weights clearly,
    and Adam's epsilon lies above float noise, so entries whose gradient is ~0 do not take lr-sized steps of either
    sign.
    """
    return dict(max_length=20, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=5,
                learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.05, adam_epsilon=1e-4,
                logging_steps=1, seed=0, bf16=False, beta=0.1, loss_type=[loss_type], report_to="none",
                save_strategy="no")


def run_trl_dpo(path, tokenizer_path, output_dir, settings):
    """``trl.DPOTrainer`` on PREFERENCES in order: its log history and final parameters (HF names)."""
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    trainer = trl.DPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=trl.DPOConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(PREFERENCES),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    params = tiny.saved_hf_params(trainer.model, output_dir / "model")
    return trainer.state.log_history, params


def run_torchlike_dpo(path, tokenizer_path, output_dir, settings):
    """torchlike's DPOTrainer on PREFERENCES in order: its log history and final parameters as exported (HF names)."""
    from safetensors.numpy import load_file

    trainer = DPOTrainer(model=str(path), args=DPOConfig(output_dir=str(output_dir),
                                                         train_sampling_strategy="sequential", **settings),
                         train_dataset=PREFERENCES, processing_class=tokenizer_for(tokenizer_path))
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


# Each case is compared step for step; use_weighting (WPO) and sync_ref_model (the reference mixed with the policy
# after steps 2 and 4, so steps 3 and 5 score against an updated reference) change the loss TRL computes.
COMPARISON_CASES = {
    "sigmoid": dict(loss_type="sigmoid"),
    "ipo": dict(loss_type="ipo"),
    "sigmoid + ipo, WPO weighting": dict(loss_type="sigmoid", extra=dict(
        use_weighting=True, loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5])),
    "sigmoid, reference synced every 2 steps": dict(loss_type="sigmoid", extra=dict(
        sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)),
    # TRL adds a mixture-of-experts model's router loss with the config's coefficient by default.
    "sigmoid, Qwen3-MoE with its router loss": dict(loss_type="sigmoid", model="qwen3_moe"),
}


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_dpo_losses_metrics_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path, case):
    options = dict(COMPARISON_CASES[case])
    path = tiny_checkpoints.path(options.pop("model", "qwen2"))
    settings = {**comparison_settings(options.pop("loss_type")), **options.pop("extra", {}), **options}
    expected_history, expected_params = run_trl_dpo(path, tokenizer_dir, tmp_path / "trl", settings)
    history, params = run_torchlike_dpo(path, tokenizer_dir, tmp_path / "ours", settings)
    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}

    assert list(ours) == list(expected) == [1, 2, 3, 4, 5]
    assert all(entry["grad_norm"] > settings["max_grad_norm"] for entry in expected.values())  # clipping is on
    assert all(set(ours[step]) == set(expected[step]) for step in ours)  # the same metrics (aux_loss with MoE)
    for key in ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
                "mean_token_accuracy", *(["aux_loss"] if "aux_loss" in expected[1] else [])):
        np.testing.assert_allclose([ours[step][key] for step in ours], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    assert [entry["num_tokens"] for entry in ours.values()] == [entry["num_tokens"] for entry in expected.values()]
    # Steps 1 and 2 score the initial weights (warmup starts at lr 0), so chosen > rejected is decided by float noise.
    assert [ours[step]["rewards/accuracies"] for step in (3, 4, 5)] == \
        [expected[step]["rewards/accuracies"] for step in (3, 4, 5)]
    assert set(params) == set(expected_params)
    # atol for entries near 0 (the float noise of a run is ~1e-6 there); weight decay alone moves entries by ~1e-3.
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_preference_format_is_tokenised_as_trl_does(tokenizer_dir, tmp_path, name):
    import datasets
    import trl

    tokenizer = tokenizer_for(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    # TRL's own preparation; it reads nothing from the trainer but the tokenizer.
    theirs = trl.DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tokenizer),
                                             datasets.Dataset.from_list(FORMATS[name]), tokenizer, args, "train")
    ours = prepare_preference_examples(FORMATS[name], tokenizer, max_length=args.max_length)
    assert ours == [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in theirs]


def test_preference_data_missing_rejected_names_the_columns_and_the_formats(tiny_checkpoints, tokenizer_dir,
                                                                            tmp_path):
    data = [{"prompt": "the quick brown", "chosen": " fox", "score": 1.0}]
    with pytest.raises(ValueError) as error:
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path), train_dataset=data,
                   processing_class=tokenizer_for(tokenizer_dir))
    message = str(error.value)
    assert "no 'rejected' column" in message and "['prompt', 'chosen', 'score']" in message
    assert "explicit prompt" in message and "implicit prompt" in message and "conversational" in message


def test_prompts_that_fill_max_length_are_dropped_with_a_warning(tokenizer_dir):
    data = [{"prompt": "one two three four five six seven eight nine ten", "chosen": " a", "rejected": " b"},
            {"prompt": "one", "chosen": " two", "rejected": " three"}]
    with pytest.warns(PreferenceDataWarning, match="Example 0 is dropped: its prompt has"):
        examples = prepare_preference_examples(data, tokenizer_for(tokenizer_dir), max_length=8)
    assert len(examples) == 1


def test_rows_padding_a_partial_batch_leave_the_loss_and_metrics_unchanged(tiny_checkpoints, tokenizer_dir):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    examples = prepare_preference_examples(PREFERENCES[:2], tokenizer_for(tokenizer_dir), max_length=20)
    for offset, example in enumerate(examples):  # a reference different from the policy, so the loss is not log 2
        example.update(ref_chosen_logps=-40.0 - offset, ref_rejected_logps=-45.0 + 3 * offset)
    loss = dpo_step_loss(model.family, DPOLossSettings(beta=0.1, loss_type=["sigmoid", "ipo", "sft"]))
    exact = collate_preference_batch(examples, 0, 24, max_length=20)
    # The Trainer fills a partial batch with all-zero rows.
    padded = {key: np.concatenate([value, np.zeros_like(value)]) for key, value in exact.items()}
    value, weight, metrics = loss(model.module, {key: jnp.asarray(v) for key, v in exact.items()})
    padded_value, padded_weight, padded_metrics = loss(model.module, {key: jnp.asarray(v) for key, v in padded.items()})
    np.testing.assert_allclose(float(padded_value), float(value), rtol=1e-6)
    assert float(weight) == float(padded_weight) == 1.0
    for key in metrics:
        np.testing.assert_allclose(float(padded_metrics[key]), float(metrics[key]), rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_lora_dpo_without_ref_model_scores_against_the_base_weights_and_trains_only_lora(tiny_checkpoints,
                                                                                         tokenizer_dir, tmp_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    tokenizer = tokenizer_for(tokenizer_dir)
    first = prepare_preference_examples(PREFERENCES[:1], tokenizer, max_length=20)[0]
    # Stored reference: the base weights (keep_start truncation to 20 tokens, as the trainer does).
    expected = sequence_log_prob(base, first["prompt_ids"], first["chosen_ids"][:20 - len(first["prompt_ids"])])
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = {key: np.asarray(value) for key, value in model.state_dict().items()}
    # bf16 off: the stored reference log-probs are compared with a float32 forward pass at rtol 1e-5.
    trainer = DPOTrainer(model=model, args=config(tmp_path, max_steps=8, learning_rate=1e-2, bf16=False),
                         train_dataset=PREFERENCES, processing_class=tokenizer)
    assert trainer.ref_model is None
    np.testing.assert_allclose(trainer.train_dataset[0]["ref_chosen_logps"], expected, rtol=1e-5)
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert np.isclose(losses[0], np.log(2), atol=1e-4) and losses[-1] < losses[0] - 0.2
    changed = {key for key, value in model.state_dict().items() if not np.array_equal(np.asarray(value), before[key])}
    assert changed and all("_lora_" in key for key in changed)
    # The base weights are still the reference, so new data can be scored after training.
    metrics = trainer.evaluate(PREFERENCES[:4])
    assert metrics["eval_rewards/margins"] > 0 and np.isfinite(metrics["eval_loss"])


@pytest.mark.parametrize("prompt_config", [PromptTuningConfig, PrefixTuningConfig])
def test_a_prompt_learning_adapter_without_ref_model_scores_against_the_base_model(tiny_checkpoints, tokenizer_dir,
                                                                                   tmp_path, prompt_config):
    """With a peft prompt-learning adapter and no ref_model, TRL's reference is the model with the adapter disabled:
    the base model without virtual tokens (prompt tuning) or prefix keys and values (prefix tuning)."""
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    tokenizer = tokenizer_for(tokenizer_dir)
    model = get_peft_model(base, prompt_config(task_type="CAUSAL_LM", num_virtual_tokens=5))
    # bf16 off: the stored reference log-probs are compared with a float32 forward pass at rtol 1e-5.
    trainer = DPOTrainer(model=model, args=config(tmp_path, max_steps=1, bf16=False), train_dataset=PREFERENCES[:4],
                         processing_class=tokenizer)
    example = trainer.train_dataset[1]
    kept = 20 - len(example["prompt_ids"])  # keep_start truncation to max_length
    chosen, rejected = example["chosen_ids"][:kept], example["rejected_ids"][:kept]
    expected = [sequence_log_prob(base, example["prompt_ids"], ids) for ids in (chosen, rejected)]
    np.testing.assert_allclose([example["ref_chosen_logps"], example["ref_rejected_logps"]], expected, rtol=1e-5)
    # The virtual tokens move these log-probs, so a reference that kept them would differ.
    assert not np.isclose(sequence_log_prob(model, example["prompt_ids"], chosen), expected[0], rtol=1e-3)


def test_an_explicit_ref_model_is_the_reference_and_stays_frozen(tiny_checkpoints, tokenizer_dir, tmp_path):
    ref_model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen3"))
    ref_before = {key: np.asarray(value) for key, value in ref_model.state_dict().items()}
    trainer = DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), ref_model=ref_model,
                         args=config(tmp_path, max_steps=2, bf16=False),  # compared in float32 below
                         train_dataset=PREFERENCES[:8], processing_class=tokenizer_for(tokenizer_dir))
    example = trainer.train_dataset[1]
    kept = 20 - len(example["prompt_ids"])  # keep_start truncation to max_length
    expected = sequence_log_prob(ref_model, example["prompt_ids"], example["rejected_ids"][:kept])
    np.testing.assert_allclose(example["ref_rejected_logps"], expected, rtol=1e-5)
    trainer.train()
    first_loss = logged(trainer.state.log_history, "loss")[0]
    assert np.isfinite(first_loss) and not np.isclose(first_loss, np.log(2), atol=1e-3)  # policy != reference
    assert all(np.array_equal(np.asarray(value), ref_before[key]) for key, value in ref_model.state_dict().items())


def test_evaluate_on_new_data_after_full_fine_tuning_scores_against_the_kept_reference_as_trl(tiny_checkpoints,
                                                                                                tokenizer_dir,
                                                                                                tmp_path):
    """Full fine-tuning with TRL's default ``precompute_ref_log_probs=False``: TRL keeps a second, frozen model as
    ``ref_model``, so ``evaluate()`` on data it never saw after training scores it against the initial weights."""
    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    path = tiny_checkpoints.path("qwen2")
    settings = dict(comparison_settings("sigmoid"), max_steps=2)
    new_data = [{"prompt": "nine ten", "chosen": " one two three", "rejected": " the"},
                {"prompt": "the lazy", "chosen": " dog jumps", "rejected": " quick brown fox jumps over"}] * 2
    theirs = trl.DPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(PREFERENCES),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    theirs._get_train_sampler = lambda *args, **kwargs: SequentialSampler(theirs.train_dataset)
    theirs.train()
    expected = theirs.evaluate(eval_dataset=datasets.Dataset.from_list(new_data))
    ours = DPOTrainer(model=str(path), args=DPOConfig(output_dir=str(tmp_path / "ours"),
                                                      train_sampling_strategy="sequential", **settings),
                      train_dataset=PREFERENCES, processing_class=tokenizer_for(tokenizer_dir))
    assert isinstance(theirs.ref_model, transformers.PreTrainedModel)
    assert isinstance(ours.ref_model, torchlike.CausalLM) and ours.ref_model.module is not ours.model.module
    ours.train()
    found = ours.evaluate(eval_dataset=new_data)
    compared = [key for key in expected if key not in ("eval_runtime", "eval_samples_per_second",
                                                       "eval_steps_per_second", "epoch")]
    assert "eval_loss" in compared and "eval_rewards/margins" in compared
    for key in compared:
        np.testing.assert_allclose(found[key], expected[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_the_same_object_as_model_and_ref_model_is_refused(tiny_checkpoints, tokenizer_dir, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    with pytest.raises(ValueError, match="cannot be the same object"):
        DPOTrainer(model=model, ref_model=model, args=config(tmp_path), train_dataset=PREFERENCES,
                   processing_class=tokenizer_for(tokenizer_dir))


def test_dataset_num_proc_tokenises_in_processes_with_the_same_result(tokenizer_dir):
    import datasets

    tokenizer = tokenizer_for(tokenizer_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datasets' multiprocessing notices
        parallel = prepare_preference_examples(datasets.Dataset.from_list(PREFERENCES[:4]), tokenizer, max_length=20,
                                               num_proc=2)
    assert parallel == prepare_preference_examples(PREFERENCES[:4], tokenizer, max_length=20)


def test_train_dataset_is_a_dataset_with_trls_token_columns(tiny_checkpoints, tokenizer_dir, tmp_path):
    import datasets
    import trl

    tokenizer = tokenizer_for(tokenizer_dir)
    trainer = DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=config(tmp_path, max_steps=1),
                         train_dataset=PREFERENCES[:4], processing_class=tokenizer)
    theirs = trl.DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tokenizer),
                                             datasets.Dataset.from_list(PREFERENCES[:4]), tokenizer,
                                             trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True), "train")
    ours = trainer.train_dataset
    assert isinstance(ours, datasets.Dataset) and len(ours) == 4
    assert {"prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"} <= \
        set(ours.column_names)
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[column] == theirs[column]
