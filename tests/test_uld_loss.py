"""GOLD's Universal Logit Distillation loss (``torchlike.adapters.losses.uld``) and its tokenizer-side inputs
(``torchlike.trl.experimental.gold.uld_inputs``) against the real TRL 1.16 ``ULDLoss`` and helpers, on one tiny batch:
two byte-level tokenizers trained on different texts (so a word or a multi-byte character is split differently on
each side), three rows (one with a prompt, one whose answer starts at index 0, one without student labels) and seeded
random float32 logits."""

from __future__ import annotations

import functools
import importlib
import os
import types
from dataclasses import replace

import datasets
import jax
import numpy as np
import pytest
import torch
import transformers

from torchlike.adapters.losses.uld import (
    ULDLossSettings,
    hybrid_vocabulary,
    prepare_uld_alignment,
    uld_loss,
)
from torchlike.testing import build_tokenizer, build_word_tokenizer
from torchlike.trl.experimental.gold import uld_inputs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_gold = importlib.import_module("trl.experimental.gold.gold_trainer")
trl_utils = importlib.import_module("trl.experimental.utils")

#: The student splits "cafébar" as "caf|é|bar" and the teacher as "ca|fé|b|a|r", so the two align only after "café";
#: "☕" is one student token and three teacher bytes.
STUDENT_CORPUS = ["caf bar ☕ naïve crème", "caf caf bar bar ☕ ☕", "é é naïve"] * 3
TEACHER_CORPUS = ["ca fé über naïve", "ca ca fé fé über", "crème crè"] * 3
STUDENT_VOCAB, TEACHER_VOCAB = 300, 272  # the logits' vocabularies, wider than the tokenizers'
WIDTH = 32  # both sides' sequence width
GROUP_WIDTH = 8
#: (prompt, completion): a prompted row, a text row (prompt "": both answers start at index 0) and a row whose student
#: labels are all dropped.
ROWS = [("Q:", " Oui cafébar ☕ naïve."), ("", "cafébar über ☕"), ("Q:", " crème")]
NO_LABEL_ROW = 2


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """``(student, teacher)`` fast byte-level BPE tokenizers with different merges and vocabulary sizes."""
    folder = tmp_path_factory.mktemp("uld_tokenizers")
    student = build_tokenizer(folder / "student", corpus=STUDENT_CORPUS, vocab_size=296, any_text=True,
                              pad_token="<pad>")
    teacher = build_tokenizer(folder / "teacher", corpus=TEACHER_CORPUS, vocab_size=270, any_text=True,
                              pad_token="<pad>")
    return transformers.AutoTokenizer.from_pretrained(student), transformers.AutoTokenizer.from_pretrained(teacher)


def right_padded(rows: list[list], width: int, value) -> np.ndarray:
    return np.array([list(row) + [value] * (width - len(row)) for row in rows], np.int64)


@pytest.fixture(scope="module")
def batch(tokenizers):
    """The micro-batch as GOLD hands it to ``ULDLoss``: the student's rows tokenised by TRL's
    ``_prepare_dataset_with_original_text`` (right-padded to ``WIDTH``), the teacher's by TRL's
    ``build_teacher_inputs_from_texts`` (padded on to ``WIDTH``), and seeded random logits."""
    student_tokenizer, teacher_tokenizer = tokenizers
    dataset = datasets.Dataset.from_list([{"prompt": prompt, "completion": completion} for prompt, completion in ROWS])
    args = types.SimpleNamespace(dataset_num_proc=None, dataset_text_field="text", max_length=None,
                                 use_extended_uld=True)
    student_rows = trl_gold.GOLDTrainer._prepare_dataset_with_original_text(
        None, dataset, student_tokenizer, args, packing=False, formatting_func=None, dataset_name="train")
    labels = [[-100 if masked == 0 else token for token, masked in zip(row["input_ids"], row["completion_mask"],
                                                                       strict=True)] for row in student_rows]
    labels[NO_LABEL_ROW] = [-100] * len(labels[NO_LABEL_ROW])
    teacher = trl_gold.build_teacher_inputs_from_texts(
        teacher_tokenizer, [row["original_prompt_text"] for row in student_rows],
        [row["original_completion_text"] for row in student_rows], use_extended_uld=True)
    teacher_ids, teacher_labels, _, teacher_offsets = (value.numpy() for value in teacher)
    padding = ((0, 0), (0, WIDTH - teacher_ids.shape[1]))
    generator = np.random.default_rng(0)
    return {
        "student_input_ids": right_padded([row["input_ids"] for row in student_rows], WIDTH,
                                          student_tokenizer.pad_token_id),
        "student_labels": right_padded(labels, WIDTH, -100),
        "student_byte_offsets": np.stack([trl_utils.pad_byte_offsets(row["byte_offsets"], WIDTH, "right").numpy()
                                          for row in student_rows]),
        "teacher_input_ids": np.pad(teacher_ids, padding, constant_values=teacher_tokenizer.pad_token_id),
        "teacher_labels": np.pad(teacher_labels, padding, constant_values=-100),
        "teacher_byte_offsets": np.pad(teacher_offsets, (*padding, (0, 0))),
        "student_logits": (2.0 * generator.standard_normal((len(ROWS), WIDTH, STUDENT_VOCAB))).astype(np.float32),
        "teacher_logits": (2.0 * generator.standard_normal((len(ROWS), WIDTH, TEACHER_VOCAB))).astype(np.float32),
    }


@pytest.fixture(scope="module")
def vocabulary(tokenizers):
    student_tokenizer, teacher_tokenizer = tokenizers
    return hybrid_vocabulary(student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab(), STUDENT_VOCAB,
                             TEACHER_VOCAB)


def gold_config(tmp_path_factory, **fields) -> trl_gold.GOLDConfig:
    return trl_gold.GOLDConfig(output_dir=str(tmp_path_factory.getbasetemp() / "gold"), use_uld_loss=True,
                               bf16=False, report_to="none", **fields)


def alignment_of(batch: dict, settings: ULDLossSettings):
    return prepare_uld_alignment(batch["student_labels"], batch["teacher_labels"], batch["student_input_ids"],
                                 batch["teacher_input_ids"], settings, num_groups=WIDTH, group_width=GROUP_WIDTH,
                                 student_byte_offsets=batch["student_byte_offsets"],
                                 teacher_byte_offsets=batch["teacher_byte_offsets"])


@functools.partial(jax.jit, static_argnames="settings")
def loss_and_gradient(student_logits, teacher_logits, alignment, vocabulary, settings):
    def value(logits):
        output = uld_loss(logits, teacher_logits, alignment, settings, vocabulary)
        return output.loss, output

    (_, output), gradient = jax.value_and_grad(value, has_aux=True)(student_logits)
    return output, gradient


def trl_loss_and_gradient(config, tokenizers, batch: dict):
    """TRL's ``ULDLoss`` value, its ``last_matched_loss``/``last_unmatched_loss`` (``None`` when not set) and the
    gradient of the value in the student's logits."""
    loss_fn = trl_gold.ULDLoss(config, student_tokenizer=tokenizers[0], teacher_tokenizer=tokenizers[1])
    student_logits = torch.tensor(batch["student_logits"], requires_grad=True)
    loss = loss_fn(student_logits, torch.tensor(batch["teacher_logits"]),
                   **{name: torch.tensor(batch[name]) for name in (
                       "student_labels", "teacher_labels", "student_input_ids", "teacher_input_ids",
                       "student_byte_offsets", "teacher_byte_offsets")})
    loss.backward()
    components = [getattr(loss_fn, name, None) for name in ("last_matched_loss", "last_unmatched_loss")]
    return loss.item(), [None if value is None else value.item() for value in components], student_logits.grad.numpy()


#: GOLDConfig fields of each case, by the behaviour it checks.
CASES = {
    "extended_observed": {},
    "extended_bayesian_with_crossentropy": {"uld_token_merge_strategy": "bayesian", "uld_crossentropy_weight": 0.5},
    "positional_observed_keeping_both_eos": {"use_extended_uld": False, "uld_skip_student_eos": False,
                                             "uld_skip_teacher_eos": False},
    "positional_bayesian_with_crossentropy": {"use_extended_uld": False, "uld_token_merge_strategy": "bayesian",
                                              "uld_crossentropy_weight": 1.0},
    "extended_keeping_teacher_eos_and_temperatures": {"uld_skip_teacher_eos": False, "uld_student_temperature": 2.0,
                                                      "uld_teacher_temperature": 0.5, "uld_distillation_weight": 0.7},
    "extended_bayesian_keeping_student_eos": {"uld_token_merge_strategy": "bayesian", "uld_skip_student_eos": False},
    "hybrid_adaptive_weights_jsd": {"uld_use_hybrid_loss": True, "beta": 0.5},
    "hybrid_fixed_weights_forward_kl_bayesian": {"uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.7,
                                                 "uld_hybrid_unmatched_weight": 0.3, "beta": 0.0,
                                                 "uld_token_merge_strategy": "bayesian"},
    "hybrid_reverse_kl_positional": {"uld_use_hybrid_loss": True, "beta": 1.0, "use_extended_uld": False},
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_components_and_gradient_equal_trls_uld_loss(case, tokenizers, batch, vocabulary, tmp_path_factory):
    config = gold_config(tmp_path_factory, **CASES[case])
    settings = ULDLossSettings.from_config(config)
    expected_loss, expected_components, expected_gradient = trl_loss_and_gradient(config, tokenizers, batch)

    output, gradient = loss_and_gradient(batch["student_logits"], batch["teacher_logits"],
                                         alignment_of(batch, settings), vocabulary, settings)

    np.testing.assert_allclose(float(output.loss), expected_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gradient), expected_gradient, rtol=1e-4, atol=1e-7)
    assert bool(output.has_hybrid_components) == settings.uld_use_hybrid_loss
    if settings.uld_use_hybrid_loss:
        np.testing.assert_allclose([float(output.matched_loss), float(output.unmatched_loss)], expected_components,
                                   rtol=1e-5)


def test_the_texts_align_into_groups_of_several_tokens_on_both_sides(batch):
    plan = alignment_of(batch, ULDLossSettings())
    student_widths, teacher_widths = (side.scalar_mask.sum(-1) + 1 for side in (plan.student, plan.teacher))

    assert ((student_widths > 1) & (teacher_widths > 1) & plan.group_mask).any()
    assert ((student_widths == 1) & (teacher_widths > 2) & plan.group_mask).any()  # "☕": one token against three


def test_rows_without_labels_or_left_empty_count_zero_in_the_mean(batch):
    plan = alignment_of(batch, ULDLossSettings())

    assert plan.row_valid.tolist() == [True, True, False]
    assert not plan.group_mask[NO_LABEL_ROW].any()


def test_bayesian_drops_the_first_group_of_an_answer_starting_at_index_0(batch):
    observed = alignment_of(batch, ULDLossSettings())
    bayesian = alignment_of(batch, ULDLossSettings(uld_token_merge_strategy="bayesian"))
    first_width, second_width = observed.student.scalar_mask[1, :2].sum(-1) + 1

    assert batch["student_labels"][1, 0] != -100 and batch["teacher_labels"][1, 0] != -100
    assert bayesian.group_mask[1].sum() == observed.group_mask[1].sum() - 1
    # The row's first bayesian group is the observed second; its base is that group's last token, whose predicting
    # logits sit one position earlier.
    assert bayesian.student.base_positions[1, 0] == first_width + second_width - 2


def test_matched_components_come_from_the_last_row_that_ran_the_hybrid_loss(tokenizers, batch, vocabulary,
                                                                           tmp_path_factory):
    """TRL overwrites ``last_matched_loss`` row by row: without row 1's labels, row 0's components remain."""
    config = gold_config(tmp_path_factory, **CASES["hybrid_adaptive_weights_jsd"])
    settings = ULDLossSettings.from_config(config)
    first_row_only = {**batch, "student_labels": batch["student_labels"].copy()}
    first_row_only["student_labels"][1] = -100
    _, expected_components, _ = trl_loss_and_gradient(config, tokenizers, first_row_only)

    both, _ = loss_and_gradient(batch["student_logits"], batch["teacher_logits"], alignment_of(batch, settings),
                                vocabulary, settings)
    first, _ = loss_and_gradient(batch["student_logits"], batch["teacher_logits"],
                                 alignment_of(first_row_only, settings), vocabulary, settings)

    np.testing.assert_allclose([float(first.matched_loss), float(first.unmatched_loss)], expected_components,
                               rtol=1e-5)
    assert float(both.matched_loss) != pytest.approx(float(first.matched_loss))


def test_the_teacher_logits_get_no_gradient(batch, vocabulary):
    settings = ULDLossSettings(uld_use_hybrid_loss=True)
    alignment = alignment_of(batch, settings)

    gradient = jax.jit(jax.grad(lambda teacher: uld_loss(batch["student_logits"], teacher, alignment, settings,
                                                         vocabulary).loss))(batch["teacher_logits"])

    assert not np.asarray(gradient).any()


def test_a_group_wider_than_group_width_is_refused(batch):
    with pytest.raises(ValueError, match="group_width"):
        prepare_uld_alignment(batch["student_labels"], batch["teacher_labels"], batch["student_input_ids"],
                              batch["teacher_input_ids"], ULDLossSettings(), num_groups=WIDTH, group_width=2,
                              student_byte_offsets=batch["student_byte_offsets"],
                              teacher_byte_offsets=batch["teacher_byte_offsets"])


def test_more_groups_than_num_groups_are_refused(batch):
    with pytest.raises(ValueError, match="num_groups"):
        prepare_uld_alignment(batch["student_labels"], batch["teacher_labels"], batch["student_input_ids"],
                              batch["teacher_input_ids"], ULDLossSettings(), num_groups=3, group_width=GROUP_WIDTH,
                              student_byte_offsets=batch["student_byte_offsets"],
                              teacher_byte_offsets=batch["teacher_byte_offsets"])


def test_extended_uld_without_byte_offsets_is_refused(batch):
    with pytest.raises(ValueError, match="Byte offsets are required"):
        prepare_uld_alignment(batch["student_labels"], batch["teacher_labels"], batch["student_input_ids"],
                              batch["teacher_input_ids"], ULDLossSettings(), num_groups=WIDTH,
                              group_width=GROUP_WIDTH)


def test_settings_refuse_one_hybrid_weight_without_the_other():
    with pytest.raises(ValueError, match="both be None"):
        ULDLossSettings(uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.5)


def test_hybrid_vocabulary_pairs_tokens_spelled_the_same(tokenizers, vocabulary):
    student_vocab, teacher_vocab = (tokenizer.get_vocab() for tokenizer in tokenizers)
    id_to_teacher_token = {index: token for token, index in teacher_vocab.items()}
    pairs = dict(zip(vocabulary.teacher_matched_ids.tolist(), vocabulary.student_matched_ids.tolist(), strict=True))

    assert pairs == {index: student_vocab[token] for index, token in id_to_teacher_token.items()
                     if token in student_vocab}
    assert len(vocabulary.teacher_matched_ids) + len(vocabulary.teacher_unmatched_ids) == TEACHER_VOCAB
    assert len(vocabulary.student_matched_ids) + len(vocabulary.student_unmatched_ids) == STUDENT_VOCAB


# --- the tokenizer-side inputs ---------------------------------------------------------------------------------------

TEXTS = ["Un café ☕ naïve.", " über  crème 東京\n", "", "a</s>b 😀😀", "cafébar"]


def test_byte_offsets_equal_trls_encode_with_byte_offsets(tokenizers):
    for tokenizer in tokenizers:
        expected = trl_utils.encode_with_byte_offsets(tokenizer.backend_tokenizer, TEXTS, add_special_tokens=False)
        assert uld_inputs.encode_with_byte_offsets(tokenizer.backend_tokenizer, TEXTS) == expected


def test_a_tokenizer_that_is_not_byte_level_is_refused(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(build_word_tokenizer(tmp_path, vocab_size=16))

    with pytest.raises(NotImplementedError, match="ByteLevel"):
        uld_inputs.encode_with_byte_offsets(tokenizer.backend_tokenizer, ["t4 t5"])


@pytest.mark.parametrize("use_extended_uld", [True, False])
def test_teacher_inputs_equal_trls_build_teacher_inputs_from_texts(tokenizers, use_extended_uld):
    prompts, completions = ["Q: cafébar?", "", "<s>Q:</s>"], [" Oui ☕ naïve.", "über 😀", ""]
    expected = trl_gold.build_teacher_inputs_from_texts(tokenizers[1], prompts, completions, use_extended_uld)

    ours = uld_inputs.build_teacher_inputs_from_texts(tokenizers[1], prompts, completions, use_extended_uld)

    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.dtype == theirs.numpy().dtype
        np.testing.assert_array_equal(mine, theirs.numpy())


def test_sampled_completion_offsets_equal_trls_on_policy_offsets(tokenizers, batch):
    student_tokenizer = tokenizers[0]
    trainer = types.SimpleNamespace(use_uld_loss=True, teacher_tokenizer=tokenizers[1], _tokenizer=student_tokenizer,
                                    uld_loss_fn=types.SimpleNamespace(use_extended_uld=True))
    labels = batch["student_labels"].copy()
    labels[0, -6:] = batch["student_input_ids"][0, -6:]  # padding labelled too: its piece "<pad>" counts 5
    sampled = {"input_ids": torch.tensor(batch["student_input_ids"]), "labels": torch.tensor(labels)}
    trl_gold.GOLDTrainer._maybe_add_completion_byte_offsets(trainer, sampled)

    ours = uld_inputs.completion_byte_offsets(student_tokenizer, batch["student_input_ids"], labels)

    np.testing.assert_array_equal(ours, sampled["byte_offsets"].numpy())


def test_settings_read_every_field_from_golds_config(tmp_path_factory):
    config = gold_config(tmp_path_factory, uld_crossentropy_weight=0.25, beta=0.1, uld_use_hybrid_loss=True,
                         uld_hybrid_matched_weight=0.6, uld_hybrid_unmatched_weight=0.4)

    assert ULDLossSettings.from_config(config) == replace(
        ULDLossSettings(), uld_crossentropy_weight=0.25, beta=0.1, uld_use_hybrid_loss=True,
        uld_hybrid_matched_weight=0.6, uld_hybrid_unmatched_weight=0.4)
