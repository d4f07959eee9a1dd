"""KTO's pieces under the trainer: the config and its field table, data preparation and the KL pairing, the loss and
its metrics, each held against TRL 1.16's own code."""

from __future__ import annotations

import types
import warnings
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import trl

from tests.helpers.config_fields import unsupported_field_warnings
from tests.helpers.data import message
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for
from torchlike.adapters.losses import kto as kto_math
from torchlike.trl.data.kto_data import (
    check_desirability_balance,
    collate_unpaired_batch,
    padded_length,
    prepare_unpaired_examples,
)
from torchlike.trl.trainer import kto_config
from torchlike.trl.trainer.kto_config import KTOConfig
from torchlike.trl.trainer.kto_fields import KTO_FIELD_SUPPORT

LONG_PROMPT = "one two three four five six seven eight nine ten"  # 13 tokens: fills max_length=12

UNPAIRED = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog", "label": True},
            {"prompt": "one two", "completion": " three four five", "label": False},
            {"prompt": LONG_PROMPT, "completion": " eleven", "label": True},
            {"prompt": "hello world, this is", "completion": " a tiny tokenizer</s>", "label": True},
            {"prompt": "seven eight", "completion": " nine ten", "label": False},
            {"prompt": "the lazy", "completion": " fox", "label": False},
            {"prompt": "one", "completion": " two three", "label": True},
            {"prompt": "this is", "completion": " a tiny dog", "label": False}]

# name -> (examples, KTOConfig settings): the KL chunks (per_device_train_batch_size=3) leave a partial last chunk,
# and the long prompt is dropped (max_length=12 unless set; the chat template adds ~17 tokens) before they are formed.
FORMATS = {
    "unpaired standard": (UNPAIRED, {}),
    "unpaired conversational": ([{"prompt": [message("user", row["prompt"])],
                                  "completion": [message("assistant", row["completion"])], "label": row["label"]}
                                 for row in UNPAIRED], {"max_length": 26}),
    "paired, explicit prompt": ([{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog"},
                                 {"prompt": LONG_PROMPT, "chosen": " a", "rejected": " b"},
                                 {"prompt": "one two", "chosen": " three</s>", "rejected": " four five"},
                                 {"prompt": "seven", "chosen": " eight", "rejected": " nine ten"}], {}),
    "paired conversational, implicit prompt": (
        [{"chosen": [message("user", "one two"), message("assistant", "three")],
          "rejected": [message("user", "one two"), message("assistant", "four")]},
         {"chosen": [message("user", "the quick"), message("assistant", "brown fox")],
          "rejected": [message("user", "the quick"), message("assistant", "lazy dog")]}], {"max_length": 26}),
    "unpaired standard, two processes": (UNPAIRED, {"dataset_num_proc": 2}),
    "unpaired standard, apo_zero_unpaired (no KL)": (UNPAIRED, {"loss_type": "apo_zero_unpaired"}),
}


@pytest.fixture
def tokenizer(tokenizer_dir):
    return tokenizer_for(tokenizer_dir, CHAT_TEMPLATE)


# --- (a) data preparation: TRL's own KTOTrainer prepares the same examples -------------------------------------------

def trl_prepared(path, tokenizer, data, tmp_path, settings):
    """The columns the real ``trl.KTOTrainer`` (on a tiny transformers model) prepares from ``data``."""
    import datasets
    import transformers

    args = trl.KTOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=3,
                         **{"max_length": 12, **settings})
    trainer = trl.KTOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(path), args=args,
                             train_dataset=datasets.Dataset.from_list(data), processing_class=tokenizer)
    return trainer.train_dataset


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_is_prepared_and_kl_paired_as_trl_does(tiny_checkpoints, tokenizer, tmp_path, name):
    data, settings = FORMATS[name]
    theirs = trl_prepared(tiny_checkpoints.path("qwen2"), tokenizer, data, tmp_path, settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped long prompt
        ours = prepare_unpaired_examples(data, tokenizer, max_length=settings.get("max_length", 12),
                                         kl_chunk_size=None if "loss_type" in settings else 3,
                                         num_proc=settings.get("dataset_num_proc"))
    columns = ["prompt_ids", "completion_ids", "label"] + ([] if "loss_type" in settings else ["KL_completion_ids"])
    assert set(columns) <= set(theirs.column_names)
    assert ours == [{key: row[key] for key in columns} for row in theirs]


def test_the_kl_completion_is_the_previous_examples_within_each_chunk(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        examples = prepare_unpaired_examples(UNPAIRED, tokenizer, max_length=12, kl_chunk_size=3)
    completions = [example["completion_ids"] for example in examples]  # 7 kept: chunks of 3, 3 and 1
    assert [example["KL_completion_ids"] for example in examples] == [
        completions[2], completions[0], completions[1], completions[5], completions[3], completions[4], completions[6]]


def test_the_collator_pads_every_batch_to_one_length_with_trls_columns(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        examples = prepare_unpaired_examples(UNPAIRED, tokenizer, max_length=12, kl_chunk_size=3)
    length = padded_length(examples, max_length=12, pad_to_multiple_of=8)
    assert length == 16
    batch = collate_unpaired_batch(examples[:2], pad_token_id=0, length=length, max_length=8)
    assert {key: value.shape for key, value in batch.items()} == {
        **dict.fromkeys(["input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
                         "KL_completion_mask"], (2, 16)), "label": (2,)}
    first = examples[0]  # 3 prompt + 8 completion tokens, cut to the first 8
    assert batch["input_ids"][0].tolist() == (first["prompt_ids"] + first["completion_ids"])[:8] + [0] * 8
    assert batch["attention_mask"][0].tolist() == [1] * 8 + [0] * 8
    assert batch["completion_mask"][0].tolist() == [0] * 3 + [1] * 5 + [0] * 8
    assert batch["KL_input_ids"][0].tolist()[:8] == (first["prompt_ids"] + first["KL_completion_ids"])[:8]
    assert batch["label"].tolist() == [True, False]


# --- (d) bad input --------------------------------------------------------------------------------------------------

def test_data_without_label_names_the_columns_and_the_expected_format(tokenizer):
    data = [{"prompt": "the quick brown", "completion": " fox", "score": 1.0}]
    with pytest.raises(ValueError) as error:
        prepare_unpaired_examples(data, tokenizer, max_length=12, kl_chunk_size=2)
    message = str(error.value)
    assert "has no 'label' column" in message and "['prompt', 'completion', 'score']" in message
    assert "boolean 'label'" in message and "paired preference" in message


def test_unpaired_data_without_prompt_is_refused_with_the_reason(tokenizer):
    with pytest.raises(ValueError, match="has no 'prompt' column, and its prompt cannot be extracted"):
        prepare_unpaired_examples([{"completion": " fox", "label": True}], tokenizer, max_length=12, kl_chunk_size=2)


def test_labels_that_are_not_booleans_are_refused(tokenizer):
    data = [{"prompt": "the", "completion": " fox", "label": "good"}]
    with pytest.raises(ValueError, match=r"Example 0: 'label' should be True .* found 'good'"):
        prepare_unpaired_examples(data, tokenizer, max_length=12, kl_chunk_size=2)


def test_unbalanced_labels_warn_as_trl_does():
    with pytest.warns(UserWarning, match=r"desirable_weight in \[3.0, 3.99\] or undesirable_weight in "
                                         r"\[0.25, 0.33\]"):
        check_desirability_balance([True, False, False, False], 1.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_desirability_balance([True, False, False, False], 3.0, 1.0)
        check_desirability_balance([True, False], 1.0, 1.0)


# --- (b) the loss and its metrics: TRL's KTOTrainer._compute_loss on the same log-probabilities ---------------------

VOCAB, LENGTH = 32, 8


def entropy_and_logit_means(input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stand-ins for the per-position entropy and vocabulary-mean logit ``[B, T-1]`` of a forward pass."""
    positions = np.arange(input_ids.shape[1] - 1)
    return (1.0 + 0.01 * input_ids[:, 1:] + 0.1 * positions).astype(np.float32), \
        np.sin(input_ids[:, :-1] + positions).astype(np.float32)


class FusedHeadStandIn:
    """Stands in for TRL's model with its fused LM head: the log-probability of each next completion token is
    ``-softplus(weights[token])`` (0 off the completion), so the loss is differentiable in ``weights``."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache=False):
        log_probs = torch.where(labels[:, 1:] != -100, -F.softplus(self.weights[input_ids[:, 1:]]), 0.0)
        entropy, mean_logits = (torch.from_numpy(values) for values in entropy_and_logit_means(input_ids.numpy()))
        return types.SimpleNamespace(log_probs=log_probs, entropy=entropy, mean_logits=mean_logits)


def loss_batch(labels, seed, kl_shift):
    """A right-padded batch with varied prompt and completion lengths; ``kl_shift`` moves the reference KL
    log-probabilities, so the KL estimate is positive or clamped to 0."""
    rng = np.random.default_rng(seed)
    size = len(labels)
    batch = {"label": np.asarray(labels)}
    for prefix in ("", "KL_"):
        lengths, prompts = rng.integers(4, LENGTH + 1, size), rng.integers(1, 3, size)
        positions = np.arange(LENGTH)
        batch[f"{prefix}input_ids"] = np.where(positions < lengths[:, None], rng.integers(3, VOCAB, (size, LENGTH)), 0)
        batch[f"{prefix}attention_mask"] = (positions < lengths[:, None]).astype(np.int64)
        batch[f"{prefix}completion_mask"] = ((positions >= prompts[:, None]) & (positions < lengths[:, None])
                                             ).astype(np.int64)
    batch["ref_logps"] = rng.normal(-8.0, 2.0, size).astype(np.float32)
    batch["ref_KL_logps"] = (rng.normal(-8.0, 2.0, size) + kl_shift).astype(np.float32)
    return batch


def trl_kto_micro_batches(weights: np.ndarray, batches: list[dict], loss_type, beta, desirable, undesirable):
    """TRL's ``KTOTrainer._compute_loss`` (precomputed reference log-probs) on each batch: the losses, the gradient
    of their sum in ``weights``, and the metrics as ``KTOTrainer.log`` averages them."""
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), precompute_ref_logps=True, calculate_KL=loss_type == "kto",
        beta=beta, loss_type=loss_type, desirable_weight=desirable, undesirable_weight=undesirable,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda values: values))
    trainer._compute_kl_logps = types.MethodType(trl.KTOTrainer._compute_kl_logps, trainer)
    leaf = torch.tensor(weights, requires_grad=True)
    losses = [trl.KTOTrainer._compute_loss(trainer, FusedHeadStandIn(leaf),
                                           {key: torch.from_numpy(value) for key, value in batch.items()}, False)
              for batch in batches]
    sum(losses).backward()
    metrics = {key: sum(values) / len(values) for key, values in trainer._metrics["train"].items()
               if key != "num_tokens"}
    return [loss.item() for loss in losses], leaf.grad.numpy(), metrics


def our_kto_micro_batch(weights, batch, settings, padding_rows):
    """``kto_loss`` and ``kto_token_metrics`` on the same log-probabilities, with all-zero rows padding the batch."""
    batch = {key: np.concatenate([value, np.zeros((padding_rows, *value.shape[1:]), value.dtype)])
             for key, value in batch.items()}
    real = jnp.asarray(batch["attention_mask"].any(-1))

    def sequence_log_probs(prefix):
        mask = jnp.asarray(batch[f"{prefix}completion_mask"][:, 1:], bool)
        return jnp.where(mask, -jax.nn.softplus(weights[batch[f"{prefix}input_ids"][:, 1:]]), 0.0).sum(-1)

    loss, metrics = kto_math.kto_loss(sequence_log_probs(""), jnp.asarray(batch["ref_logps"]),
                                      jnp.asarray(batch["label"]), sequence_log_probs("KL_"),
                                      jnp.asarray(batch["ref_KL_logps"]), settings=settings, row_mask=real)
    entropies, logit_means = entropy_and_logit_means(batch["input_ids"])
    return loss, {**metrics, **kto_math.kto_token_metrics(jnp.asarray(entropies), jnp.asarray(logit_means),
                                                          jnp.asarray(batch["completion_mask"][:, 1:]),
                                                          jnp.asarray(batch["label"]))}


@pytest.mark.parametrize(("loss_type", "desirable", "undesirable"),
                         [("kto", 1.0, 1.0), ("kto", 1.33, 0.75), ("apo_zero_unpaired", 1.0, 1.0),
                          ("apo_zero_unpaired", 0.8, 1.5)])
def test_kto_loss_gradients_and_metrics_equal_trls(loss_type, desirable, undesirable):
    beta = 0.3
    weights = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32)
    # A mixed batch with a positive KL estimate, a mixed one whose estimate is clamped to 0, and a desirable-only one
    # (TRL records no rewards/rejected, logps/rejected, logits/rejected or margins for it).
    batches = [loss_batch([True, False, True, False, False], 0, kl_shift=-3.0),
               loss_batch([False, True, False, True], 1, kl_shift=6.0),
               loss_batch([True, True, True], 2, kl_shift=0.0)]
    expected_losses, expected_grad, expected_metrics = trl_kto_micro_batches(weights, batches, loss_type, beta,
                                                                             desirable, undesirable)
    settings = kto_math.KTOLossSettings(beta=beta, loss_type=loss_type, desirable_weight=desirable,
                                        undesirable_weight=undesirable)

    def total(weights):
        outputs = [our_kto_micro_batch(weights, batch, settings, padding_rows=2) for batch in batches]
        return sum(loss for loss, _ in outputs), outputs

    (_, outputs), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(weights))
    np.testing.assert_allclose([float(loss) for loss, _ in outputs], expected_losses, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    # The step metrics averaged over micro-batches, as the Trainer logs them, then finished as TRL's log.
    averaged = {key: float(np.mean([float(metrics[key]) for _, metrics in outputs])) for key in outputs[0][1]}
    ours = kto_math.finish_metrics(averaged)
    assert set(ours) == set(expected_metrics)
    for key, value in expected_metrics.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    if loss_type == "kto":
        assert 0.0 < expected_metrics["kl"]  # one batch estimates a positive KL, one is clamped to 0


def test_metrics_no_micro_batch_recorded_are_not_logged():
    logs = {"loss": 0.5, "rewards/rejected": 0.0, "present/rewards/rejected": 0.0, "eval_logps/chosen": -3.0,
            "eval_present/logps/chosen": 0.5}
    assert kto_math.finish_metrics(logs) == {"loss": 0.5, "eval_logps/chosen": -6.0}


# --- (c) KTOConfig and its field table (its field walk: test_config_parity.py) --------------------------------------

def test_trl_default_changes_are_spelled_out():
    config = KTOConfig()
    assert (config.learning_rate, config.logging_steps, config.gradient_checkpointing, config.bf16,
            config.train_sampling_strategy) == (1e-6, 10, True, True, "sequential")


def test_accepted_values_are_the_ones_kto_loss_computes():
    assert kto_config.LOSS_TYPES is kto_math.KTO_LOSS_TYPES
    assert kto_config.KL_LOSS_TYPES is kto_math.KL_LOSS_TYPES


NON_DEFAULT = {"neftune_noise_alpha": 5.0, "trust_remote_code": True,
               "remove_unused_columns": False, "precompute_ref_batch_size": 16,
               "activation_offloading": True}


def _applied(**kwargs):
    return unsupported_field_warnings(KTOConfig, **kwargs)


def test_every_ignored_or_refused_field_has_a_sample_value():
    assert set(NON_DEFAULT) == {name for name, support in KTO_FIELD_SUPPORT.items() if support.status != "honoured"}


@pytest.mark.parametrize("name", [name for name, support in KTO_FIELD_SUPPORT.items() if support.status == "ignored"])
def test_setting_an_ignored_field_warns_naming_it(name):
    messages = [m for m in _applied(**{name: NON_DEFAULT[name]}) if m.startswith(f"{name}=")]
    assert len(messages) == 1 and KTO_FIELD_SUPPORT[name].reason in messages[0], messages


@pytest.mark.parametrize("name", [name for name, support in KTO_FIELD_SUPPORT.items() if support.status == "refused"])
def test_setting_a_refused_field_raises_naming_it(name):
    with pytest.raises(ValueError) as error:
        _applied(**{name: NON_DEFAULT[name]})
    assert f"{name}=" in str(error.value) and KTO_FIELD_SUPPORT[name].reason in str(error.value)


def test_defaults_and_honoured_settings_neither_warn_nor_raise():
    assert _applied(loss_type="kto", beta=0.2, desirable_weight=1.33, undesirable_weight=0.8, max_length=256,
                    dataset_num_proc=2, sync_ref_model=True, ref_model_sync_steps=4, disable_dropout=False) == []


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"loss_type": "bco"}, ["loss_type='bco'", "'kto', 'apo_zero_unpaired'"]),
    ({"train_sampling_strategy": "random"}, ["estimates the KL divergence term", "Got "
                                             "`train_sampling_strategy='random'`"]),
    ({"per_device_train_batch_size": 1}, ["Actual (not effective) batch size must be > 1", "apo_zero_unpaired"]),
    ({"max_length": 0}, ["max_length=0"]),
])
def test_bad_values_are_explained(kwargs, needles):
    with pytest.raises(ValueError) as error:
        KTOConfig(**kwargs)
    for needle in needles:
        assert needle in str(error.value)


def test_apo_zero_unpaired_needs_no_kl_pairing():
    config = KTOConfig(loss_type="apo_zero_unpaired", per_device_train_batch_size=1, train_sampling_strategy="random")
    assert not config.estimates_kl and KTOConfig().estimates_kl


def test_command_lines_parse_like_trl_scripts():
    import transformers

    (config,) = transformers.HfArgumentParser(KTOConfig).parse_args_into_dataclasses([
        "--output_dir", "out", "--loss_type", "apo_zero_unpaired", "--desirable_weight", "1.5", "--beta", "0.2",
        "--pad_to_multiple_of", "16"])
    assert (config.loss_type, config.desirable_weight, config.beta, config.pad_to_multiple_of) == (
        "apo_zero_unpaired", 1.5, 0.2, 16)
