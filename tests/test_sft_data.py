"""SFT data preparation matches the real ``trl.SFTTrainer`` token for token; batches have fixed shapes, real masks."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings

import datasets
import jax
import numpy as np
import pytest
import transformers

from tests import tiny
from torchlike.training.batches import collate_rows
from torchlike.trl.data.sft_data import SFTDataWarning, collate_sft_batch, iter_sft_examples
from torchlike.trl.data_utils import pad_token_id_for

# ChatML, as Qwen renders it. `extra_text` is read from a per-row `chat_template_kwargs` column.
CHATML = (
    "{%- if extra_text is defined %}{{- extra_text }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# The same output, with the assistant content and its end-of-turn token inside {% generation %} markers.
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "one two three four five six seven eight nine ten one two three four five six seven eight nine ten",
    "tiny tests</s>",  # already ends with eos: not appended twice
]
PROMPT_COMPLETION = [
    {"prompt": "the quick brown", "completion": " fox jumps over the lazy dog"},
    {"prompt": "hello", "completion": " world"},
    {"prompt": "one two three four five six seven eight nine ten one two three", "completion": " four five"},
    {"prompt": "the quick bro", "completion": "wn fox"},  # tokens merge across the boundary
]
MESSAGES = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "one two"}, {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": "jumps over"}, {"role": "user", "content": "the lazy"},
     {"role": "assistant", "content": "dog"}],
]
CONV_PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "the quick brown fox"}],
     "completion": [{"role": "assistant", "content": "jumps over the lazy dog"}]},
    {"prompt": [{"role": "system", "content": "tiny"}, {"role": "user", "content": "one two"}],
     "completion": [{"role": "assistant", "content": "three four"}]},
]


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and the TRL reference
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """tests/tiny.py's BPE tokenizer plus a newline and the ChatML special tokens, saved once."""
    from tokenizers import decoders

    directory = tiny.build_tokenizer(tmp_path_factory.mktemp("sft_tokenizer"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()  # so decode() gives the text back
    tokenizer.add_tokens(["\n"])  # the tiny alphabet has no newline byte
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def make_tokenizer(chat_tokenizer_dir):
    """A fresh tokenizer per call (TRL sets pad and eos tokens on the one it is given)."""

    def make(chat_template: str | None = None, add_bos: bool = False):
        tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
        tokenizer.chat_template = chat_template
        if add_bos:  # Llama-style: tokenizer(text) starts with <s>
            from tokenizers import processors

            tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
        return tokenizer

    return make


@pytest.fixture(scope="module")
def hf_model():
    return tiny.build_hf_model(tiny.CASES["qwen2"]())


@pytest.fixture
def trl_prepare(hf_model, tmp_path):
    """The dataset ``trl.SFTTrainer`` trains on: (input_ids, labels != -100) per example."""

    def prepare(dataset, tokenizer, formatting_func=None, trl_only=None, **config):
        from trl import SFTConfig, SFTTrainer

        config.setdefault("max_length", 1024)
        args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, **config,
                         **(trl_only or {}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = SFTTrainer(model=hf_model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 formatting_func=formatting_func)
        rows = list(trainer.train_dataset)
        return [list(row["input_ids"]) for row in rows], [[int(x != -100) for x in row["labels"]] for row in rows]

    return prepare


def prepared(dataset, tokenizer, **kwargs) -> list[dict]:
    """Every prepared example (the rows ``SFTTrainer.train_dataset`` holds without packing)."""
    return list(iter_sft_examples(dataset, tokenizer, **kwargs))


def loss_mask(example) -> list[int]:
    """1 where the prepared example's token is a prediction target (TRL's ``labels != -100``)."""
    return [int(label != -100) for label in example["labels"]]


def ours(dataset, tokenizer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SFTDataWarning)
        examples = prepared(dataset, tokenizer, **kwargs)
    for example in examples:
        assert len(example["input_ids"]) == len(example["labels"])
        assert all(label in (-100, token) for label, token in zip(example["labels"], example["input_ids"], strict=True))
    return [e["input_ids"] for e in examples], [loss_mask(e) for e in examples]


def assert_same_as_trl(trl_prepare, make_tokenizer, rows, template=None, formatting_func=None, **config):
    """Same dataset through TRL and torchlike, each with its own fresh tokenizer: identical ids and masks."""
    expected_ids, expected_mask = trl_prepare(datasets.Dataset.from_list(rows), make_tokenizer(template),
                                              formatting_func=formatting_func, **config)
    got_ids, got_mask = ours(datasets.Dataset.from_list(rows), make_tokenizer(template),
                             formatting_func=formatting_func, **config)
    assert got_ids == expected_ids
    assert got_mask == expected_mask
    assert expected_ids, "the comparison must cover at least one example"
    return got_ids, got_mask


# ---------------------------------------------------------------------------------------------------------------------
# Token-for-token parity with trl.SFTTrainer, format by format
# ---------------------------------------------------------------------------------------------------------------------


def test_language_modeling_text_appends_eos_once_and_truncates(trl_prepare, make_tokenizer):
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, [{"text": t} for t in TEXTS], max_length=20)
    eos = make_tokenizer().eos_token_id
    assert ids[1][-1] == eos and ids[3].count(eos) == 1
    assert len(ids[2]) == 20 and all(all(m) for m in mask)


def test_custom_dataset_text_field(trl_prepare, make_tokenizer):
    rows = [{"content": t, "other": "x"} for t in TEXTS]
    assert_same_as_trl(trl_prepare, make_tokenizer, rows, dataset_text_field="content")


def test_keep_end_truncation(trl_prepare, make_tokenizer):
    with pytest.warns(FutureWarning, match="keep_end"):
        ids, _ = assert_same_as_trl(trl_prepare, make_tokenizer, [{"text": t} for t in TEXTS], max_length=8,
                                    truncation_mode="keep_end")
    assert ids[0][-1] == make_tokenizer().eos_token_id


def test_standard_prompt_completion_masks_the_prompt(trl_prepare, make_tokenizer):
    with pytest.warns(SFTDataWarning, match="not a prefix"):
        prepared(PROMPT_COMPLETION, make_tokenizer())
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, PROMPT_COMPLETION, max_length=24)
    tokenizer = make_tokenizer()
    prompt_len = len(tokenizer("hello")["input_ids"])
    assert mask[1] == [0] * prompt_len + [1] * (len(ids[1]) - prompt_len)
    assert tokenizer.decode([t for t, m in zip(ids[1], mask[1], strict=True) if m]) == " world</s>"


def test_standard_prompt_completion_full_loss_when_completion_only_loss_false(trl_prepare, make_tokenizer):
    _, mask = assert_same_as_trl(trl_prepare, make_tokenizer, PROMPT_COMPLETION, completion_only_loss=False)
    assert all(all(m) for m in mask)


@pytest.mark.filterwarnings("ignore:.*not a prefix")
def test_prompt_longer_than_max_length_is_dropped_like_trl_with_a_warning(trl_prepare, make_tokenizer):
    tokenizer = make_tokenizer()
    prompt_len = len(tokenizer(PROMPT_COMPLETION[2]["prompt"])["input_ids"])
    max_length = 10
    assert prompt_len > max_length
    with pytest.warns(SFTDataWarning, match=rf"Example 2 is dropped.*prompt is {prompt_len} tokens.*max_length=10"):
        kept = prepared(PROMPT_COMPLETION, tokenizer, max_length=max_length)
    assert len(kept) == 3
    assert_same_as_trl(trl_prepare, make_tokenizer, PROMPT_COMPLETION, max_length=max_length)


def test_tokenizer_that_adds_bos(trl_prepare, make_tokenizer):
    def bos_tokenizer(template=None):
        return make_tokenizer(template, add_bos=True)

    ids, mask = assert_same_as_trl(trl_prepare, bos_tokenizer, PROMPT_COMPLETION[:3], max_length=40)
    assert all(row[0] == bos_tokenizer().bos_token_id for row in ids) and not any(m[0] for m in mask)
    ids, _ = assert_same_as_trl(trl_prepare, bos_tokenizer, [{"text": t} for t in TEXTS])
    assert ids[1][0] == bos_tokenizer().bos_token_id


def test_conversational_messages_full_loss(trl_prepare, make_tokenizer):
    rows = [{"messages": m} for m in MESSAGES]
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows, template=CHATML)
    im_end = make_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert im_end in ids[0] and make_tokenizer().eos_token_id not in ids[0]  # conversational: no eos appended
    assert all(all(m) for m in mask)


def test_conversational_messages_assistant_only_loss(trl_prepare, make_tokenizer):
    rows = [{"messages": m} for m in MESSAGES]
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows, template=CHATML_GENERATION,
                                   assistant_only_loss=True)
    tokenizer = make_tokenizer()
    trained = tokenizer.decode([t for t, m in zip(ids[1], mask[1], strict=True) if m])
    assert trained == "jumps over<|im_end|>dog<|im_end|>"


def test_warns_when_the_end_of_turn_token_is_outside_the_generation_markers(make_tokenizer):
    template = CHATML_GENERATION.replace(
        "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}",
        "{%- generation %}{{- message['content'] }}{%- endgeneration %}{{- '<|im_end|>' }}")
    with pytest.warns(SFTDataWarning, match="end-of-turn token"):
        prepared([{"messages": MESSAGES[0]}], make_tokenizer(template), assistant_only_loss=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SFTDataWarning)
        prepared([{"messages": MESSAGES[0]}], make_tokenizer(CHATML_GENERATION), assistant_only_loss=True)


def test_conversational_prompt_completion(trl_prepare, make_tokenizer):
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, CONV_PROMPT_COMPLETION, template=CHATML)
    trained = make_tokenizer().decode([t for t, m in zip(ids[1], mask[1], strict=True) if m])
    assert trained == "three four<|im_end|>\n"  # after the generation prompt '<|im_start|>assistant\n'


def test_conversational_prompt_completion_with_assistant_only_loss(trl_prepare, make_tokenizer):
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, CONV_PROMPT_COMPLETION, template=CHATML_GENERATION,
                                   assistant_only_loss=True)
    trained = make_tokenizer().decode([t for t, m in zip(ids[0], mask[0], strict=True) if m])
    assert trained == "jumps over the lazy dog<|im_end|>"  # the completion mask AND the assistant mask


def test_sharegpt_conversations_are_converted_to_chatml(trl_prepare, make_tokenizer):
    rows = [{"conversations": [{"from": m["role"], "value": m["content"]} for m in conv]} for conv in MESSAGES]
    original = [dict(row) for row in rows]
    assert_same_as_trl(trl_prepare, make_tokenizer, rows, template=CHATML)
    as_messages = ours([{"messages": m} for m in MESSAGES], make_tokenizer(CHATML))
    assert ours(rows, make_tokenizer(CHATML)) == as_messages
    assert rows == original  # the caller's data is not modified


def test_per_row_chat_template_kwargs(trl_prepare, make_tokenizer):
    rows = [{"messages": m, "chat_template_kwargs": {"extra_text": "one two "}} for m in MESSAGES]
    ids, _ = assert_same_as_trl(trl_prepare, make_tokenizer, rows, template=CHATML)
    plain, _ = ours([{"messages": m} for m in MESSAGES], make_tokenizer(CHATML))
    assert ids[0] != plain[0]


def test_formatting_func(trl_prepare, make_tokenizer):
    rows = [{"question": "one two", "answer": "three four"}, {"question": "hello", "answer": "world"}]

    def formatting_func(example):
        return f"{example['question']} the {example['answer']}"

    ids, _ = assert_same_as_trl(trl_prepare, make_tokenizer, rows, formatting_func=formatting_func)
    assert make_tokenizer().decode(ids[1]) == "hello the world</s>"


@pytest.mark.parametrize("packing", [False, True])
def test_formatting_func_runs_once_per_example(make_tokenizer, packing):
    """The trainer's data path formats each example once: the ``text`` column TRL keeps reuses the tokenised text."""
    from torchlike.trl.data.sft_data import prepare_sft_dataset

    rows = [{"question": "one two", "answer": "three four"}, {"question": "hello", "answer": "world"}]
    calls = []

    def formatting_func(example):
        calls.append(example["question"])
        return f"{example['question']} the {example['answer']}"

    prepared = prepare_sft_dataset(rows, make_tokenizer(), formatting_func=formatting_func, max_length=32,
                                   packing=packing)
    assert calls == ["one two", "one two", "hello"]  # the first example is also read once to detect the format
    if not packing:
        assert prepared["text"] == ["one two the three four</s>", "hello the world</s>"]


def test_eos_token_override(trl_prepare, make_tokenizer):
    ids, _ = assert_same_as_trl(trl_prepare, make_tokenizer, [{"text": t} for t in TEXTS[:2]],
                                eos_token="<|im_end|>")
    assert ids[0][-1] == make_tokenizer().convert_tokens_to_ids("<|im_end|>")
    tokenizer = make_tokenizer()
    prepared([{"text": "hello"}], tokenizer, eos_token="<|im_end|>")
    assert tokenizer.eos_token == "</s>"  # not modified


def test_pretokenized_input_ids(trl_prepare, make_tokenizer):
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10]}, {"input_ids": [11, 12, 13]}]
    ids, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows, max_length=4)
    assert ids == [[5, 6, 7, 8], [11, 12, 13]] and mask == [[1] * 4, [1] * 3]


def test_pretokenized_completion_mask_follows_completion_only_loss(trl_prepare, make_tokenizer):
    rows = [{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [11, 12, 13], "completion_mask": [0, 1, 1]}]
    _, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows, completion_only_loss=True)
    assert mask == [[0, 0, 1, 1, 1], [0, 1, 1]]
    # TRL's rule: None means "prompt-completion columns only", so the mask is ignored; torchlike says so.
    _, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows)
    assert mask == [[1] * 5, [1] * 3]
    with pytest.warns(SFTDataWarning, match="completion_only_loss=True"):
        prepared(rows, make_tokenizer())


def test_pretokenized_assistant_masks_and_labels(trl_prepare, make_tokenizer):
    rows = [{"input_ids": [5, 6, 7, 8, 9], "assistant_masks": [0, 1, 1, 0, 1]}]
    _, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows)
    assert mask == [[0, 1, 1, 0, 1]]
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}]
    _, mask = assert_same_as_trl(trl_prepare, make_tokenizer, rows, max_length=4)
    assert mask == [[0, 0, 1, 1]]


def test_pretokenized_numpy_arrays_and_missing_masks(make_tokenizer):
    rows = [{"input_ids": np.array([5, 6, 7]), "completion_mask": np.array([0, 1, 1])}]
    (example,) = prepared(rows, make_tokenizer(), completion_only_loss=True)
    assert example == {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
    # datasets fills a column missing from a row with None: that row has no mask.
    rows = datasets.Dataset.from_list([{"input_ids": [5, 6], "completion_mask": [0, 1]}, {"input_ids": [7, 8]}])
    assert ours(rows, make_tokenizer(), completion_only_loss=True)[1] == [[0, 1], [1, 1]]


# ---------------------------------------------------------------------------------------------------------------------
# Inputs: IterableDataset streaming, lists of dicts
# ---------------------------------------------------------------------------------------------------------------------


def test_iterable_dataset_streams_lazily_and_matches_trl(trl_prepare, make_tokenizer):
    pulled = []

    def generate():
        for i, text in enumerate(TEXTS * 25):
            pulled.append(i)
            yield {"text": text}

    stream = datasets.IterableDataset.from_generator(generate)
    iterator = iter_sft_examples(stream, make_tokenizer(), max_length=16)
    first = next(iterator)
    assert len(pulled) < 10, "the whole dataset was read before the first example came out"
    assert first["input_ids"] == make_tokenizer()(TEXTS[0] + "</s>")["input_ids"][:16]

    expected_ids, expected_mask = trl_prepare(datasets.IterableDataset.from_generator(generate), make_tokenizer(),
                                              max_length=16, trl_only={"max_steps": 1})
    got_ids, got_mask = ours(datasets.IterableDataset.from_generator(generate), make_tokenizer(), max_length=16)
    assert (got_ids, got_mask) == (expected_ids, expected_mask) and len(got_ids) == 100


def test_list_of_dicts_equals_dataset(make_tokenizer):
    for rows in ([{"text": t} for t in TEXTS], PROMPT_COMPLETION):
        assert ours(rows, make_tokenizer()) == ours(datasets.Dataset.from_list(rows), make_tokenizer())


# ---------------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------------


def test_unrecognised_columns_list_found_columns_and_formats(make_tokenizer):
    with pytest.raises(ValueError, match=r"no recognised column.*\['question', 'answer'\].*Accepted formats") as info:
        prepared([{"question": "a", "answer": "b"}], make_tokenizer())
    for fmt in ("'prompt' and 'completion'", "'messages'", "'conversations'", "'input_ids'", "formatting_func",
                "dataset_text_field"):
        assert fmt in str(info.value)
    with pytest.raises(ValueError, match=r"'text' column but dataset_text_field='content'"):
        prepared([{"text": "a"}], make_tokenizer(), dataset_text_field="content")
    with pytest.raises(ValueError, match="Prompt-only data is for GRPO"):
        prepared([{"prompt": "a"}], make_tokenizer())


def test_conversational_data_without_chat_template(make_tokenizer):
    with pytest.raises(ValueError, match=r"no chat template.*tokenizer\.chat_template = .*chat_template_path"):
        prepared([{"messages": MESSAGES[0]}], make_tokenizer(None))


def test_assistant_only_loss_needs_generation_markers(make_tokenizer):
    with pytest.raises(ValueError, match=r"assistant_only_loss=True.*\{% generation %\}.*no such markers"):
        prepared([{"messages": MESSAGES[0]}], make_tokenizer(CHATML), assistant_only_loss=True)


def test_assistant_only_loss_needs_conversational_data(make_tokenizer):
    with pytest.raises(ValueError, match=r"needs conversational data.*'text'"):
        prepared([{"text": "hello"}], make_tokenizer(CHATML_GENERATION), assistant_only_loss=True)
    with pytest.raises(ValueError, match="no assistant token"):
        prepared([{"messages": [{"role": "user", "content": "hello"}]}],
                             make_tokenizer(CHATML_GENERATION), assistant_only_loss=True)


def test_every_example_truncated_away_is_an_error(make_tokenizer):
    rows = [{"prompt": "one two three four five six seven eight", "completion": " nine"}]
    with pytest.warns(SFTDataWarning, match="Example 0 is dropped"):
        with pytest.raises(ValueError, match=r"All 1 examples.*dropped.*max_length=3 \(keep_start\)"):
            prepared(rows, make_tokenizer(), max_length=3)


def test_empty_dataset(make_tokenizer):
    empty_stream = datasets.IterableDataset.from_generator(lambda: iter(()))
    for empty in ([], datasets.Dataset.from_list([]), empty_stream):
        with pytest.raises(ValueError, match="dataset is empty"):
            prepared(empty, make_tokenizer())


def test_bad_arguments_and_rows(make_tokenizer):
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match=r"eos_token='<nope>' is not in the tokenizer's vocabulary"):
        prepared([{"text": "a"}], tokenizer, eos_token="<nope>")
    with pytest.raises(ValueError, match=r"truncation_mode='middle'.*keep_start"):
        prepared([{"text": "a"}], tokenizer, truncation_mode="middle")
    with pytest.raises(ValueError, match="max_length should be a positive int"):
        prepared([{"text": "a"}], tokenizer, max_length=0)
    with pytest.raises(ValueError, match="formatting_func.*completion_only_loss"):
        prepared(PROMPT_COMPLETION, tokenizer, formatting_func=lambda e: e["prompt"])
    with pytest.raises(ValueError, match=r"Example 1 is 'prompt_completion' data.*first example is 'text'"):
        prepared([{"text": "a"}, {"prompt": "b", "completion": "c"}], tokenizer)
    with pytest.raises(ValueError, match=r"Example 1: prompt and completion should both be strings"):
        prepared([PROMPT_COMPLETION[0], CONV_PROMPT_COMPLETION[0]], tokenizer)
    with pytest.raises(ValueError, match=r"Example 0: 'labels' differ from 'input_ids' at positions \[0, 1\]"):
        prepared([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]}], tokenizer)
    with pytest.raises(TypeError, match=r"Example 0 should be a dict.*found a str"):
        prepared(["hello"], tokenizer)


def test_library_does_not_import_trl():
    code = "import sys, torchlike.trl.data.sft_data; assert 'trl' not in sys.modules, 'trl was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------------------------
# Fixed-shape batches
# ---------------------------------------------------------------------------------------------------------------------


def test_collate_shapes_padding_and_masks_match_trl_collator(make_tokenizer):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    examples = prepared(PROMPT_COMPLETION[:3], make_tokenizer(), max_length=64)
    batch = collate_sft_batch(examples, pad_token_id=0, length=64)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "input_ids": ((3, 64), np.int32), "attention_mask": ((3, 64), np.int32), "loss_mask": ((3, 64), np.int32)}
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == example["input_ids"]
        assert (batch["input_ids"][row, n:] == 0).all() and (batch["attention_mask"][row, n:] == 0).all()
        assert batch["attention_mask"][row, :n].all()
        assert batch["loss_mask"][row].tolist() == loss_mask(example) + [0] * (64 - n)
    assert 0 < batch["loss_mask"].sum() < batch["attention_mask"].sum()  # a real loss mask, not the padding mask

    trl_rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    reference = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=64)(trl_rows)
    hf_labels = np.where(batch["loss_mask"] != 0, batch["input_ids"], -100)
    np.testing.assert_array_equal(hf_labels, reference["labels"].numpy())
    np.testing.assert_array_equal(batch["input_ids"], reference["input_ids"].numpy())
    np.testing.assert_array_equal(batch["attention_mask"], reference["attention_mask"].numpy())


def test_collate_rejects_an_example_longer_than_length():
    with pytest.raises(ValueError, match=r"Example 0 of the batch has 5 tokens, more than the padded length 4"):
        collate_sft_batch([{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1] * 5}], pad_token_id=0, length=4)


def _masked_nll(batch, logits):
    """Token-normalised next-token NLL: logits at t-1 score input_ids[t] where loss_mask[t] is 1."""
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = batch["input_ids"][:, 1:]
    nll = -np.take_along_axis(logp[:, :-1], targets[..., None], axis=-1)[..., 0]
    weights = batch["loss_mask"][:, 1:]
    return np.where(weights != 0, nll, 0.0).sum() / weights.sum()


def test_partial_batch_padding_adds_rows_that_contribute_nothing(make_tokenizer):
    examples = prepared(PROMPT_COMPLETION[:3], make_tokenizer(), max_length=64)
    collate = functools.partial(collate_sft_batch, pad_token_id=7, length=64)
    batch = collate(examples)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    full = collate_rows(collate, examples, np.array([0, 1, 2] + [-1] * 5), mesh, "training")  # the trainer's fill
    assert {k: v.shape for k, v in full.items()} == {k: (8, 64) for k in batch}
    assert all(full[k].dtype == batch[k].dtype for k in batch)
    assert not full["input_ids"][3:].any()
    assert not full["attention_mask"][3:].any() and not full["loss_mask"][3:].any()
    for key in batch:
        np.testing.assert_array_equal(full[key][:3], batch[key])

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 64, 131))
    assert _masked_nll(full, logits) == pytest.approx(_masked_nll(batch, logits[:3]), rel=1e-12)


def test_pad_token_id_falls_back_to_eos(make_tokenizer):
    tokenizer = make_tokenizer()
    assert tokenizer.pad_token is None
    assert pad_token_id_for(tokenizer) == tokenizer.eos_token_id
    assert pad_token_id_for(tokenizer, eos_token="<|im_end|>") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.pad_token = "<pad>"
    assert pad_token_id_for(tokenizer) == 0
