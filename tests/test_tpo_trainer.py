"""TPOTrainer (``trl.experimental.tpo``): TRL's numbers step for step for each loss type, its data formats, checks and
messages."""

from __future__ import annotations

import types

import datasets
import numpy as np
import pytest
import trl.experimental.tpo as trl_tpo

from tests import tiny
from tests.helpers.data import PREFERENCES, message
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for
from torchlike.trl.experimental.tpo import TPOConfig, TPOTrainer
from torchlike.trl.experimental.tpo.tpo_data import prepare_triple_examples

#: TRL's logged metrics, compared at rtol 1e-4 (``rewards/accuracies`` is compared where it is not decided by noise).
METRICS = ("loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "logits/chosen", "logits/rejected",
           "mean_token_accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected")
#: The preference pairs with a gold response each (some longer than max_length, so they are cut).
TRIPLES = [{**row, "reference": gold} for row, gold in zip(
    PREFERENCES, [" fox jumps over", " three four five six", " a tiny tokenizer test", " nine ten eleven"] * 4,
    strict=True)]

FORMATS = {
    "standard, implicit prompt": [{"chosen": "the quick brown fox jumps", "rejected": "the quick brown dog",
                                   "reference": "the quick brown fox"},
                                  {"chosen": "one two three", "rejected": "one two four five",
                                   "reference": "one two three four"}],
    "conversational, explicit prompt": [{"prompt": [message("user", "the quick brown")],
                                         "chosen": [message("assistant", "fox")],
                                         "rejected": [message("assistant", "dog")],
                                         "reference": [message("assistant", "fox jumps")]}],
    "conversational, implicit prompt": [{"chosen": [message("user", "one two"), message("assistant", "three")],
                                         "rejected": [message("user", "one two"), message("assistant", "four")],
                                         "reference": [message("user", "one two"), message("assistant", "five")]}],
}


def comparison_settings(**overrides) -> dict:
    """Both trainers' settings: gradient accumulation, max_length=12 (several responses are cut), a warmup, weight
    decay and clipping (max_grad_norm below every step's norm); float32 on both sides (bf16 off), gradient
    checkpointing at its default (on)."""
    values = dict(max_length=12, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                  learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.01, adam_epsilon=1e-4,
                  logging_steps=1, seed=0, bf16=False, beta=0.2, report_to="none", save_strategy="no",
                  per_device_eval_batch_size=4)
    return {**values, **overrides}


CASES = {
    # The NLL term on the gold responses at half weight, label smoothing on the sigmoid.
    "sigmoid, label smoothing, tpo_alpha 0.5": dict(loss_type="sigmoid", label_smoothing=0.1, tpo_alpha=0.5),
    "hinge": dict(loss_type="hinge"),
    # Length-normalised log-probabilities.
    "ipo": dict(loss_type="ipo"),
    # tpo_alpha 0: no gold rows in the batch (TRL's collator drops them), so entropy and num_tokens change too.
    "tpo-l, tpo_alpha 0": dict(loss_type="tpo-l", tpo_l_gamma=0.3, tpo_alpha=0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tpo_losses_metrics_evaluation_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                           case):
    settings = comparison_settings(**CASES[case])
    eval_data = TRIPLES[1:7]  # a partial last batch: TRL's is shorter, torchlike's is padded with empty triples
    tiny.assert_pairwise_trainer_matches_trl((trl_tpo.TPOTrainer, trl_tpo.TPOConfig), (TPOTrainer, TPOConfig),
                                             tiny_checkpoints.path("qwen2"), tokenizer_dir, tmp_path, TRIPLES,
                                             settings, eval_data, METRICS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_triple_format_is_tokenised_as_trl_does(tokenizer_dir, tmp_path, name):
    tokenizer = tokenizer_for(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    args = trl_tpo.TPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    # TRL's own preparation; it reads nothing from the trainer but its tokenising function.
    theirs = trl_tpo.TPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenize=trl_tpo.TPOTrainer._tokenize),
                                                 datasets.Dataset.from_list(FORMATS[name]), tokenizer, args, "train")
    ours = prepare_triple_examples(FORMATS[name], tokenizer)
    columns = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")
    assert ours == [{key: row[key] for key in columns} for row in theirs]


@pytest.mark.parametrize(("data", "missing"), [
    ([{"prompt": "one", "chosen": " two", "reference": " three"}], "`chosen` or `rejected`"),
    ([{"prompt": "one", "chosen": " two", "rejected": " four"}], "the `reference` (gold) column"),
    ([{"chosen": "one two", "rejected": "one four", "reference": "five six"}], "does not start with the implicit"),
], ids=["no rejected", "no reference", "reference without the prompt"])
def test_bad_triples_raise_trls_errors(tokenizer_dir, tmp_path, data, missing):
    tokenizer = tokenizer_for(tokenizer_dir)
    args = trl_tpo.TPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError) as theirs:
        trl_tpo.TPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenize=trl_tpo.TPOTrainer._tokenize),
                                            datasets.Dataset.from_list(data), tokenizer, args, "train")
    with pytest.raises(ValueError) as ours:
        prepare_triple_examples(data, tokenizer)
    assert str(ours.value) == str(theirs.value)
    assert missing in str(ours.value)


def test_an_unknown_loss_type_is_trls_error_before_training(tiny_checkpoints, tmp_path):
    # TRL raises in the first step's _compute_loss; torchlike when the trainer is built, with TRL's words.
    with pytest.raises(ValueError, match=r"Unknown loss type: bogus. Should be one of \['sigmoid', 'hinge', 'ipo', "
                                         r"'tpo-l'\]"):
        TPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=TRIPLES,
                   args=TPOConfig(output_dir=str(tmp_path), report_to="none", loss_type="bogus"))


@pytest.mark.parametrize("loss_type", ["hinge", "ipo"])
def test_label_smoothing_with_hinge_or_ipo_warns_as_trl(tiny_checkpoints, tokenizer_dir, tmp_path, loss_type):
    with pytest.warns(UserWarning, match=f"You are using the {loss_type} loss type that does not support label "
                                         "smoothing. The `label_smoothing` parameter will be ignored."):
        TPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=TRIPLES[:4],
                   processing_class=tokenizer_for(tokenizer_dir),
                   args=TPOConfig(output_dir=str(tmp_path), report_to="none", loss_type=loss_type,
                                  label_smoothing=0.1))


def test_without_a_pad_token_the_eos_token_pads_as_in_trl(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = tokenizer_for(tokenizer_dir)
    tokenizer.pad_token = None
    trainer = TPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=TRIPLES[:4],
                         processing_class=tokenizer, args=TPOConfig(output_dir=str(tmp_path), report_to="none"))
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.pad_token_id == trainer.model.config.pad_token_id == tokenizer.eos_token_id
    # TRL's attributes, and its prepared dataset with the gold responses' ids.
    assert (trainer.beta, trainer.loss_type, trainer.tpo_alpha, trainer.tpo_l_gamma) == (0.01, "sigmoid", 1.0, 0.5)
    assert set(trainer.train_dataset.column_names) == {"prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"}


def test_tpo_alpha_zero_leaves_the_gold_rows_out_of_the_batch(tiny_checkpoints, tokenizer_dir, tmp_path):
    examples = prepare_triple_examples(TRIPLES[:4], tokenizer_for(tokenizer_dir))
    for alpha, expected in ((1.0, {"chosen", "rejected", "reference"}), (0.0, {"chosen", "rejected"})):
        trainer = TPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=TRIPLES[:4],
                             processing_class=tokenizer_for(tokenizer_dir),
                             args=TPOConfig(output_dir=str(tmp_path), report_to="none", tpo_alpha=alpha))
        batch = trainer.data_collator(examples)
        assert {key.split("_")[0] for key in batch} == expected
        assert np.all(batch["chosen_attention_mask"].sum(-1) > 0)
