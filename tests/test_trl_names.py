"""Every public name of the installed TRL is importable from ``torchlike.trl`` or listed below as not yet provided, and
TRL's data utilities at the top level give TRL's results."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import trl

import torchlike.trl
from tests import tiny
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for

#: Public names of TRL 1.16 that ``torchlike.trl`` does not provide yet (issue 43), with what stands in the way. A name
#: that lands must leave this table (the test checks each is still missing), and a name a new TRL adds fails the test
#: until it is provided or listed.
NOT_YET: dict[str, str] = {}

EXAMPLES = [
    {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]},
    {"prompt": "The sky is", "completion": " blue."},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
     "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]},
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
     "rejected": [{"role": "assistant", "content": "b"}]},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"text": "The sky is blue."},
]
# Not compared: an example whose keys disagree (a text prompt beside conversational responses), where TRL's
# is_conversational reads whichever key a set pops first (it changes with PYTHONHASHSEED), and an empty message list,
# where TRL's raises IndexError.


def _provided(name: str) -> bool:
    """Whether ``from torchlike.trl import <name>`` works: an attribute, or a submodule."""
    return hasattr(torchlike.trl, name) or importlib.util.find_spec(f"torchlike.trl.{name}") is not None


def test_every_public_trl_name_is_provided_or_listed_as_not_yet():
    names = set(trl.__all__)
    assert set(NOT_YET) <= names, "listed as missing, but TRL has no such name"
    still_missing = {name for name in names if not _provided(name)}
    assert still_missing == set(NOT_YET)
    functions = {name for name in names - set(NOT_YET) if importlib.util.find_spec(f"trl.{name}") is None}
    assert functions <= set(torchlike.trl.__all__)


@pytest.mark.parametrize("name", ["is_conversational", "is_conversational_from_value", "maybe_convert_to_chatml",
                                  "maybe_extract_prompt"])
def test_a_data_utility_gives_trls_result_on_every_format(name):
    ours, theirs = getattr(torchlike.trl, name), getattr(trl, name)
    for example in EXAMPLES:
        assert ours(dict(example)) == theirs(dict(example)), example


def test_maybe_extract_prompt_replaces_a_prompt_of_the_other_kind_as_trl():
    example = {"prompt": "hi", "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
               "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}
    assert torchlike.trl.maybe_extract_prompt(dict(example)) == trl.maybe_extract_prompt(dict(example))
    assert torchlike.trl.maybe_extract_prompt(dict(example))["prompt"] == [{"role": "user", "content": "hi"}]


def test_extract_prompt_splits_text_and_conversations_as_trl():
    for example in [example for example in EXAMPLES if set(example) == {"chosen", "rejected"}]:
        assert torchlike.trl.extract_prompt(dict(example)) == trl.extract_prompt(dict(example))


def test_prepare_multimodal_messages_places_the_images_as_trl():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is this?"},
                {"role": "assistant", "content": "A cat."}]
    for images in (["image-1"], ["image-1", "image-2"], []):
        assert torchlike.trl.prepare_multimodal_messages(messages, images=images) == \
            trl.prepare_multimodal_messages(messages, images=images)


PAIRS = {"prompt": ["The sky is", "The sun is", "Grass is"], "chosen": [" blue.", " hot.", " green."],
         "rejected": [" green.", " cold.", " blue."], "source": ["a", "b", "c"]}


@pytest.mark.parametrize("columns", [("prompt", "chosen", "rejected", "source"), ("chosen", "rejected")],
                         ids=["explicit prompt and another column", "implicit prompt"])
def test_unpairing_a_dataset_gives_trls_rows_columns_and_kind(columns):
    dataset = datasets.Dataset.from_dict({name: PAIRS[name] for name in columns})
    ours, theirs = torchlike.trl.unpair_preference_dataset(dataset), trl.unpair_preference_dataset(dataset)
    assert isinstance(ours, datasets.Dataset)
    assert ours.column_names == theirs.column_names
    assert ours.to_list() == theirs.to_list()
    splits = datasets.DatasetDict({"train": dataset, "test": dataset.select([0])})
    ours, theirs = (module.maybe_unpair_preference_dataset(splits) for module in (torchlike.trl, trl))
    assert {name: split.to_list() for name, split in ours.items()} == \
        {name: split.to_list() for name, split in theirs.items()}


def test_an_unpaired_dataset_is_left_as_it_is():
    dataset = torchlike.trl.unpair_preference_dataset(datasets.Dataset.from_dict(PAIRS))
    assert torchlike.trl.maybe_unpair_preference_dataset(dataset) is dataset
    rows = dataset.to_list()
    assert torchlike.trl.maybe_unpair_preference_dataset(rows) is rows


def test_unpairing_a_list_of_rows_gives_the_datasets_rows():
    rows = datasets.Dataset.from_dict(PAIRS).to_list()
    assert torchlike.trl.unpair_preference_dataset(rows) == \
        trl.unpair_preference_dataset(datasets.Dataset.from_dict(PAIRS)).to_list()
    with pytest.raises(TypeError, match="takes num_proc and desc only; got \\['batch_size'\\]"):
        torchlike.trl.unpair_preference_dataset(rows, batch_size=2)


CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"prompt": [{"role": "user", "content": "hi"}]},
    {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I think"}]},
    {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]},
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
     "rejected": [{"role": "assistant", "content": "b"}]},
    {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
     "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]},
    {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
     "label": True, "source": "kept out of the rendering"},
    {"prompt": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "3"}],
     "completion": [{"role": "assistant", "content": "It is 3."}]},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_dir):
    return tokenizer_for(tokenizer_dir, tiny.TOOL_CHAT_TEMPLATE)


@pytest.mark.parametrize("tools", [None, [], TOOLS], ids=["no tools", "empty tools", "tools"])
def test_apply_chat_template_renders_every_dataset_type_as_trl(chat_tokenizer, tools):
    for example in CONVERSATIONS + EXAMPLES:
        for name in ("maybe_apply_chat_template", *(["apply_chat_template"] if
                                                    torchlike.trl.is_conversational(example) else [])):
            ours = getattr(torchlike.trl, name)(dict(example), chat_tokenizer, tools=tools)
            assert ours == getattr(trl, name)(dict(example), chat_tokenizer, tools=tools), (name, example)
    prompt = torchlike.trl.apply_chat_template(CONVERSATIONS[1], chat_tokenizer, tools=tools)["prompt"]
    assert ("Tools: add" in prompt) == bool(tools)


def test_apply_chat_template_passes_the_rows_and_the_callers_template_arguments_as_trl(tokenizer_dir):
    # Llama's templates render tool boilerplate for tools=[]; TRL passes None then.
    tokenizer = tokenizer_for(tokenizer_dir, "{% if tools is not none %}[tools]{% endif %}"
                                             "{% for m in messages %}{{ m['content'] }}{{ sep }}{% endfor %}"
                                             "{% if add_generation_prompt %}>{% endif %}")
    example = {**CONVERSATIONS[3], "chat_template_kwargs": {"sep": "|"}}
    rendered = torchlike.trl.apply_chat_template(dict(example), tokenizer)
    assert rendered == trl.apply_chat_template(dict(example), tokenizer) == {"prompt": "hi|", "completion": "yo|"}
    assert torchlike.trl.apply_chat_template(dict(CONVERSATIONS[3]), tokenizer, sep="/") == \
        trl.apply_chat_template(dict(CONVERSATIONS[3]), tokenizer, sep="/") == {"prompt": "hi/", "completion": "yo/"}
    assert torchlike.trl.apply_chat_template(dict(example), tokenizer, tools=[]) == rendered


def test_apply_chat_template_refuses_what_trl_refuses_with_its_messages(chat_tokenizer):
    bad_keys = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}]}
    bad_role = {"prompt": [{"role": "system", "content": "hi"}]}
    for example, error in ((bad_keys, KeyError), (bad_role, ValueError)):
        with pytest.raises(error) as theirs:
            trl.apply_chat_template(dict(example), chat_tokenizer)
        with pytest.raises(error) as ours:
            torchlike.trl.apply_chat_template(dict(example), chat_tokenizer)
        assert str(ours.value) == str(theirs.value)


TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"


def test_chat_template_utils_has_trls_functions_with_trls_signatures():
    import trl.chat_template_utils as theirs

    import torchlike.trl.chat_template_utils as ours

    names = [name for name, value in vars(theirs).items()
             if inspect.isfunction(value) and value.__module__ == theirs.__name__ and not name.startswith("_")]
    assert sorted(names) == sorted(ours.__all__)
    for name in names:
        assert list(inspect.signature(getattr(ours, name)).parameters) == \
            list(inspect.signature(getattr(theirs, name)).parameters), name


@pytest.mark.parametrize("template", [None, CHAT_TEMPLATE, tiny.TOOL_CHAT_TEMPLATE, "qwen3.jinja", "qwen2_5.jinja"])
def test_tool_calling_checks_and_training_templates_agree_with_trl(tokenizer_dir, template):
    import trl.chat_template_utils as theirs

    import torchlike.trl.chat_template_utils as ours

    if template is not None and template.endswith(".jinja"):
        template = (TRL_TEMPLATES / template).read_text()
    tokenizer = tokenizer_for(tokenizer_dir, template)
    assert ours.supports_tool_calling(tokenizer) == theirs.supports_tool_calling(tokenizer)
    if template is None:
        return
    if ours.supports_tool_calling(tokenizer):
        assert ours.is_chat_template_prefix_preserving(tokenizer) == \
            theirs.is_chat_template_prefix_preserving(tokenizer)
    assert ours.has_generation_markers(template) == theirs.has_generation_markers(template)
    assert _outcome(ours.get_training_chat_template, tokenizer) == \
        _outcome(theirs.get_training_chat_template, tokenizer)


def _outcome(function, *args):
    """What ``function(*args)`` returns, or the type and message of what it raises."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - the comparison covers TRL's errors too
        return type(error), str(error)


def test_the_template_checks_see_what_tool_calling_needs(tokenizer_dir):
    import torchlike.trl.chat_template_utils as ours

    qwen3 = tokenizer_for(tokenizer_dir, (TRL_TEMPLATES / "qwen3.jinja").read_text())
    assert torchlike.trl.supports_tool_calling(qwen3)
    assert not ours.is_chat_template_prefix_preserving(qwen3)  # Qwen 3 drops earlier thinking
    training = torchlike.trl.get_training_chat_template(qwen3)
    assert training == (TRL_TEMPLATES / "qwen3_training.jinja").read_text()
    assert ours.is_chat_template_prefix_preserving(tokenizer_for(tokenizer_dir, training))
    assert not torchlike.trl.supports_tool_calling(tokenizer_for(tokenizer_dir, CHAT_TEMPLATE))


def test_the_template_data_functions_say_to_install_trl_when_it_is_missing(tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # what an uninstalled trl looks like
    with pytest.raises(ImportError, match="get_training_chat_template uses TRL's own chat templates.*pip install"):
        torchlike.trl.get_training_chat_template(tokenizer_for(tokenizer_dir, CHAT_TEMPLATE))


def test_add_response_schema_gives_the_tokenizer_trls_parser(tokenizer_dir):
    theirs = trl.add_response_schema(tokenizer_for(tokenizer_dir, (TRL_TEMPLATES / "qwen2_5.jinja").read_text()))
    ours = torchlike.trl.add_response_schema(tokenizer_for(tokenizer_dir,
                                                           (TRL_TEMPLATES / "qwen2_5.jinja").read_text()))
    for attribute in ("response_schema", "response_template"):
        assert getattr(ours, attribute, None) == getattr(theirs, attribute, None)
    assert getattr(ours, "response_schema", None) or getattr(ours, "response_template", None)


def test_clone_chat_template_gives_the_model_and_tokenizer_what_trl_gives(tiny_checkpoints, tokenizer_dir, tmp_path):
    import transformers

    source = tiny.build_tool_tokenizer(tmp_path / "source", corpus=["hello world"] * 4)
    path = tiny_checkpoints.path("qwen2")
    for multiple in (64, None):
        model, tokenizer, added = torchlike.trl.clone_chat_template(
            torchlike.AutoModelForCausalLM.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(
                tokenizer_dir), str(source), resize_to_multiple_of=multiple)
        reference, reference_tokenizer, reference_added = trl.clone_chat_template(
            transformers.AutoModelForCausalLM.from_pretrained(path),
            transformers.AutoTokenizer.from_pretrained(tokenizer_dir), str(source), resize_to_multiple_of=multiple)
        assert added == reference_added and added
        assert tokenizer.get_vocab() == reference_tokenizer.get_vocab()
        assert tokenizer.chat_template == reference_tokenizer.chat_template == tiny.TOOL_CHAT_TEMPLATE
        assert tokenizer.eos_token == reference_tokenizer.eos_token == "<|im_end|>"
        assert model.config.vocab_size == reference.config.vocab_size == len(tokenizer.vocab)
        assert model.config.eos_token_id == reference.config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
        assert model.get_input_embeddings().num_embeddings == reference.get_input_embeddings().num_embeddings
        model.save_pretrained(tmp_path / "saved")
        assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config.vocab_size == \
            reference.config.vocab_size


def _token_rows(count: int, seed: int = 0) -> dict[str, list]:
    """Rows of 0-9 tokens with an attention mask and labels beside them."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 10, count)
    ids = [rng.integers(1, 100, length).tolist() for length in lengths]
    return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids],
            "labels": [[-100] + row[1:] if row else [] for row in ids]}


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_pack_dataset_packs_every_column_as_trl(strategy):
    dataset = datasets.Dataset.from_dict(_token_rows(40))
    for map_kwargs in (None, {"batch_size": 7}):
        ours = torchlike.trl.pack_dataset(dataset, 6, strategy, map_kwargs)
        theirs = trl.pack_dataset(dataset, 6, strategy, map_kwargs)
        assert isinstance(ours, datasets.Dataset)
        assert ours.column_names == theirs.column_names
        assert ours.to_list() == theirs.to_list()
    assert torchlike.trl.pack_dataset(dataset.to_list(), 6, strategy, {"batch_size": 7}) == \
        trl.pack_dataset(dataset, 6, strategy, {"batch_size": 7}).to_list()
    splits = datasets.DatasetDict({"train": dataset, "test": dataset.select(range(5))})
    ours, theirs = (module.pack_dataset(splits, 6, strategy) for module in (torchlike.trl, trl))
    assert {name: split.to_list() for name, split in ours.items()} == \
        {name: split.to_list() for name, split in theirs.items()}


def test_pack_dataset_keeps_the_datasets_format_as_trl():
    dataset = datasets.Dataset.from_dict(_token_rows(12)).with_format("numpy", columns=["input_ids", "labels"])
    ours, theirs = (module.pack_dataset(dataset, 8, "bfd") for module in (torchlike.trl, trl))
    assert ours.format == theirs.format
    assert ours.format["columns"] == ["input_ids", "labels", "seq_lengths"]
    assert [row["input_ids"].tolist() for row in ours] == [row["input_ids"].tolist() for row in theirs]


def test_pack_dataset_refuses_what_trl_refuses():
    rows = _token_rows(4)
    bad = [datasets.Dataset.from_dict({**rows, "source": ["a"] * 4}),
           datasets.Dataset.from_dict({**rows, "labels": [[1]] * 4})]
    for dataset in bad:
        with pytest.raises((TypeError, ValueError)) as theirs:
            trl.pack_dataset(dataset, 6)
        with pytest.raises(type(theirs.value), match=str(theirs.value)):
            torchlike.trl.pack_dataset(dataset, 6)
    with pytest.raises(ValueError, match="Invalid packing strategy 'greedy'"):
        torchlike.trl.pack_dataset(datasets.Dataset.from_dict(rows), 6, "greedy")


@pytest.mark.parametrize("module", ["trainer", "models"])
def test_trl_trainer_and_models_names_are_provided(module):
    theirs, ours = importlib.import_module(f"trl.{module}"), importlib.import_module(f"torchlike.trl.{module}")
    names = {name for name in dir(theirs) if not name.startswith("_") and not inspect.ismodule(getattr(theirs, name))}
    assert names <= set(ours.__all__)
    for name in ours.__all__:
        value = getattr(ours, name)
        if hasattr(torchlike.trl, name):
            assert value is getattr(torchlike.trl, name), name  # one object, whichever path imports it
        if inspect.isfunction(getattr(theirs, name, None)):
            assert list(inspect.signature(value).parameters) == \
                list(inspect.signature(getattr(theirs, name)).parameters), name


def test_torch_only_model_helpers_are_refused_naming_torchlikes_way(tiny_checkpoints):
    from torchlike.trl import models
    from torchlike.trl.trainer import add_fused_lm_head

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    with models.unwrap_model_for_generation(model, None) as unwrapped:
        assert unwrapped is model
    for call, way in ((lambda: models.prepare_deepspeed(model, None), "mesh_shape"),
                      (lambda: models.prepare_fsdp(model, None), "mesh_shape"),
                      (lambda: models.get_act_offloading_ctx_manager(model), "gradient_checkpointing"),
                      (lambda: models.enable_selective_activation_checkpointing(model), "gradient_checkpointing"),
                      (lambda: add_fused_lm_head(model), "Leave the call out")):
        with pytest.raises(ValueError, match=way):
            call()


def test_disable_dropout_in_model_takes_lora_dropout_out_of_training(tiny_checkpoints, tmp_path):
    from torchlike.peft import LoraConfig, get_peft_model
    from torchlike.trl import SFTConfig, SFTTrainer
    from torchlike.trl.trainer import disable_dropout_in_model

    def trainer_for(model):
        return SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none"),
                          train_dataset=[{"input_ids": [1, 2, 3]}])

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj"])
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")), lora)
    assert trainer_for(model)._lora_dropout()
    disable_dropout_in_model(model)
    assert not trainer_for(model)._lora_dropout()
    assert model.active_peft_config.lora_dropout == 0.1  # what save_pretrained writes, as peft's after TRL's call


def test_ensure_master_addr_port_sets_what_trls_sets(monkeypatch):
    from trl.trainer.utils import ensure_master_addr_port as theirs

    from torchlike.trl.trainer import ensure_master_addr_port as ours

    for environment, arguments in (({"MASTER_PORT": "1234"}, {}), ({"MASTER_ADDR": "10.0.0.1"}, {"port": 99}),
                                   ({}, {"addr": "host", "port": 7})):
        results = []
        for function in (ours, theirs):
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                monkeypatch.delenv(name, raising=False)
            for name, value in environment.items():
                monkeypatch.setenv(name, value)
            function(**arguments)
            results.append((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
        assert results[0] == results[1], environment


@pytest.mark.parametrize("package", ["cpo", "orpo", "gkd", "online_dpo", "gmpo", "async_grpo", "tpo", "a2po", "sdft",
                                     "sdpo", "iw_opd", "gold"])
def test_each_shipped_experimental_package_has_the_names_of_trls(package):
    theirs = importlib.import_module(f"trl.experimental.{package}")
    ours = importlib.import_module(f"torchlike.trl.experimental.{package}")
    names = {name for name in dir(theirs) if not name.startswith("_") and not inspect.ismodule(getattr(theirs, name))}
    assert names and names <= set(ours.__all__)
    assert all(getattr(ours, name) is not None for name in names)
