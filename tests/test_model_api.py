"""The CausalLM surface a transformers user expects: inputs, dtypes, parameters, repr, loading options."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoints):
    return torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))


def test_forward_accepts_lists_numpy_jax_and_torch_inputs(qwen2):
    ids = [[5, 6, 7, 8], [9, 10, 11, 12]]
    expected = np.asarray(qwen2(np.array(ids)).logits)
    for variant in (ids, jnp.asarray(ids), torch.tensor(ids)):
        np.testing.assert_array_equal(np.asarray(qwen2(variant, attention_mask=np.ones((2, 4))).logits), expected)
    assert qwen2.forward(ids)["logits"].shape == (2, 4, tiny.VOCAB)
    assert qwen2([5, 6, 7]).logits.shape == (1, 3, tiny.VOCAB)


def test_ragged_input_ids_get_a_clear_error(qwen2):
    with pytest.raises(ValueError, match="pad the rows"):
        qwen2([[1, 2, 3], [4]])


def test_parameter_counts_match_transformers(qwen2, tiny_checkpoints):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    assert qwen2.num_parameters() == reference.num_parameters()
    assert qwen2.num_parameters(only_trainable=True) == reference.num_parameters(only_trainable=True)
    names = dict(qwen2.named_parameters())
    assert names["layers.0.attn.q_proj.w"].shape == (64, 4, 16)
    assert sum(int(np.prod(p.shape)) for p in qwen2.parameters()) == reference.num_parameters()


def test_repr_shows_the_module_tree_and_parameter_count(qwen2):
    text = repr(qwen2)
    assert f"parameters={qwen2.num_parameters():,}" in text
    assert "(q_proj): Einsum(w=(64, 4, 16))" in text and "(0-1): 2 x DecoderLayer(" in text


@pytest.mark.parametrize(
    "spelling, expected",
    [("bfloat16", ml_dtypes.bfloat16), ("bf16", ml_dtypes.bfloat16), (torch.float16, np.float16),
     (jnp.bfloat16, ml_dtypes.bfloat16), (np.float32, np.float32), ("torch.float32", np.float32)],
)
def test_dtype_accepts_strings_numpy_jax_and_torch_dtypes(spelling, expected, tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype=spelling)
    assert model.dtype == np.dtype(expected)
    assert all(p.dtype == np.dtype(expected) for p in model.parameters())


def test_dtype_auto_keeps_the_checkpoint_dtype(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2", dtype=torch.bfloat16),
                                                           dtype="auto")
    assert model.dtype == np.dtype(ml_dtypes.bfloat16)


def test_generation_config_is_read_from_generation_config_json(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    model.generation_config.temperature = 0.3
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path / "out")
    assert torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "out").generation_config.temperature == 0.3


def test_trl_keyword_arguments_are_accepted(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints.path("qwen2"), revision=None, trust_remote_code=False, attn_implementation="sdpa",
        device_map=None, torch_dtype=torch.bfloat16,
    )
    assert model.dtype == np.dtype(ml_dtypes.bfloat16)


def test_config_overrides_are_applied_like_transformers(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), eos_token_id=7)
    assert model.config.eos_token_id == 7
    with pytest.raises(TypeError, match="not_an_option"):
        torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), not_an_option=1)


def test_trust_remote_code_on_an_architecture_without_custom_code_loads_as_in_transformers(tiny_checkpoints):
    # transformers ignores the flag for a repository without custom code (TRL scripts pass --trust_remote_code).
    path = tiny_checkpoints.path("qwen2")
    trusted = torchlike.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    plain = torchlike.AutoModelForCausalLM.from_pretrained(path)
    assert sorted(trusted.state_dict()) == sorted(plain.state_dict())
    np.testing.assert_array_equal(np.asarray(trusted.lm_head.weight), np.asarray(plain.lm_head.weight))


def test_auto_tokenizer_passes_trust_remote_code_to_transformers(tokenizer_dir):
    trusted = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    plain = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert trusted.get_vocab() == plain.get_vocab()
    assert trusted("hello world").input_ids == plain("hello world").input_ids


def custom_code_repository(folder):
    """A repository whose architecture exists only as its own modelling code (``auto_map``), as on the Hub."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["TinyCustomForCausalLM"], "model_type": "tiny_custom", "hidden_size": 64,
        "auto_map": {"AutoConfig": "configuration_tiny.TinyCustomConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"}}))
    return folder


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_a_repository_with_custom_code_is_refused_in_transformers_words_with_the_reason(tmp_path, trust_remote_code):
    import transformers

    folder = custom_code_repository(tmp_path / "custom")
    with pytest.raises(ValueError) as theirs:  # transformers (untrusted): its words about custom code
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with pytest.raises(ValueError) as ours:
        torchlike.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code)
    words = f"The repository {folder} contains custom code which must be executed to correctly load the model."
    assert words in str(theirs.value) and words in str(ours.value)
    assert "modeling_tiny.TinyCustomForCausalLM" in str(ours.value) and "is PyTorch" in str(ours.value)
    assert "Qwen2ForCausalLM" in str(ours.value)  # what does load
    with pytest.raises(ValueError, match="contains custom code"):
        torchlike.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=trust_remote_code)


def test_a_transformers_model_object_converts_directly():
    reference = tiny.build_hf_model(tiny.CASES["llama32"](), seed=3)
    model = torchlike.AutoModelForCausalLM.from_pretrained(reference)
    ids, mask, positions = tiny.padded_batch()
    expected = tiny.hf_logits(reference, ids, mask, positions)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(model(ids, mask).logits)[valid] - expected[valid]).max() <= 1e-4


def test_pytorch_model_bin_loads_through_weights_only_torch_load(tmp_path):
    reference = tiny.build_hf_model(tiny.CASES["qwen3"](), seed=4)
    reference.config.save_pretrained(tmp_path)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    model = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask, positions = tiny.padded_batch()
    valid = mask.astype(bool)
    expected = tiny.hf_logits(reference, ids, mask, positions)
    assert np.abs(np.asarray(model(ids, mask).logits)[valid] - expected[valid]).max() <= 1e-4


def test_pytorch_model_bin_with_arbitrary_pickles_is_refused(tmp_path):
    reference = tiny.build_hf_model(tiny.CASES["qwen3"](), seed=4)
    reference.config.save_pretrained(tmp_path)
    torch.save({"weights": reference.state_dict(), "hook": print}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"):
        torchlike.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_from_config_builds_a_random_model_transformers_can_load(tmp_path):
    config = tiny.CASES["qwen3"]()
    model = torchlike.AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32").eval()
    ids, mask, positions = tiny.padded_batch()
    valid = mask.astype(bool)
    expected = tiny.hf_logits(reloaded, ids, mask, positions)
    assert np.abs(np.asarray(model(ids, mask).logits)[valid] - expected[valid]).max() <= 1e-4


@pytest.mark.parametrize("case, neutral", [("qwen2", 1.0), ("gemma2", 0.0), ("gemma3", 0.0)])
def test_from_config_gives_norms_their_neutral_weight(case, neutral):
    """transformers initialises RMS norms to the identity: weight 1, or 0 where the norm scales by (1 + weight)."""
    config = tiny.CASES[case]()
    model = torchlike.AutoModelForCausalLM.from_config(config)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    norms = {name: array for name, array in model.named_parameters() if "norm" in name}
    assert norms and all(np.all(np.asarray(array) == neutral) for array in norms.values())
    assert all(torch.all(value == neutral) for name, value in reference.named_parameters() if "norm" in name)


def test_hub_id_offline_says_it_was_not_found_and_how_to_pass_a_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="not a local directory.*offline.*Pass the path"):
        torchlike.AutoModelForCausalLM.from_pretrained("no-such-org/no-such-model")


def test_missing_local_directory_is_reported_as_a_path(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        torchlike.AutoModelForCausalLM.from_pretrained(str(tmp_path / "nope"))


def test_auto_tokenizer_is_the_transformers_tokenizer_with_pad_falling_back_to_eos(tokenizer_dir):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerBase)
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("pad_token") is None


def test_get_parameter_returns_the_named_parameter_as_torch_does(qwen2):
    name, array = next(qwen2.named_parameters())
    assert qwen2.get_parameter(name) is array
    with pytest.raises(AttributeError, match=r"no parameter 'layers.0.attn.q_proj.ww'.*did you mean.*q_proj.w"):
        qwen2.get_parameter("layers.0.attn.q_proj.ww")


def test_get_submodule_walks_the_dotted_module_path(qwen2):
    assert qwen2.get_submodule("") is qwen2.module
    layer = qwen2.get_submodule("layers.1")
    assert layer is qwen2.module.layers[1]
    assert qwen2.get_parameter("layers.1.attn.q_proj.w") is layer.attn.q_proj.w.get_value()
    with pytest.raises(AttributeError, match="no submodule 'layers.7'"):
        qwen2.get_submodule("layers.7")


def test_model_tags_are_added_once_in_order_as_transformers_does(tiny_checkpoints):
    ours = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    assert ours.model_tags is None and theirs.model_tags is None
    for model in (ours, theirs):
        model.add_model_tags(["trl", "sft"])
        model.add_model_tags("trl")
        model.add_model_tags(["grpo"])
    assert ours.model_tags == theirs.model_tags == ["trl", "sft", "grpo"]
