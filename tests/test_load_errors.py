"""Bad inputs get errors that name the file or key and the fix, and saves never leave half-written output."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

import torchlike
from torchlike.adapters.checkpoint.safetensors_io import CheckpointFileError
from torchlike.adapters.families import UnknownArchitectureError
from torchlike.adapters.model import tunix_model
from torchlike.adapters.model.rope import UnsupportedRopeScalingError


@pytest.fixture
def checkpoint_copy(tiny_checkpoints, tmp_path):
    """A private copy of the tiny Qwen2 checkpoint that a test may damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints.path("qwen2"), target)
    return target


@pytest.fixture
def sharded_copy(tiny_checkpoints, tmp_path):
    target = tmp_path / "sharded"
    torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")).save_pretrained(
        target, max_shard_size="40KB")
    return target


def test_missing_config_json_names_the_file(checkpoint_copy):
    (checkpoint_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found.*save_pretrained"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    expected = r"model_type='gpt2'.*Supported architectures: .*Qwen2ForCausalLM"
    with pytest.raises(UnknownArchitectureError, match=expected):
        torchlike.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_mamba_checkpoint_names_its_architecture_and_the_file(tmp_path):
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)
    transformers.MambaForCausalLM(config).save_pretrained(tmp_path)
    expected = (rf"{tmp_path}/config\.json: architecture \['MambaForCausalLM'\] \(model_type='mamba'\) is not "
                r"supported\. Supported architectures: Qwen2ForCausalLM, .*Gemma3ForCausalLM")
    with pytest.raises(UnknownArchitectureError, match=expected):
        torchlike.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_another_architectures_config_with_fields_its_class_refuses_still_names_the_architecture(checkpoint_copy):
    # A Qwen2 config.json relabelled as Mamba keeps its layer_types, which MambaConfig cannot set.
    config = json.loads((checkpoint_copy / "config.json").read_text())
    assert "layer_types" in config
    config.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match=r"config\.json: architecture \['MambaForCausalLM'\] "
                                                       r"\(model_type='mamba'\) is not supported\. Supported"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_unknown_model_type_lists_the_supported_ones(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config.update(model_type="my_custom_lm", architectures=["MyCustomLM"])
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match=r"my_custom_lm.*Supported architectures: .*LlamaForCausalLM"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_truncated_safetensors_names_the_file_and_says_to_download_again(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    expected = r"model\.safetensors is truncated or corrupted.*download or save it again"
    with pytest.raises(CheckpointFileError, match=expected):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_corrupted_safetensors_header_names_the_file(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors has a corrupted safetensors header"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_index_naming_a_missing_shard_lists_it(sharded_copy):
    victim = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointFileError, match=rf"names shard\(s\) \['{victim.name}'\].*Download the missing"):
        torchlike.AutoModelForCausalLM.from_pretrained(sharded_copy)


def test_tensor_shape_disagreeing_with_config_names_key_shapes_and_config_fields(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(tunix_model.WeightShapeError,
                       match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(64, 128\) but config\.json "
                             r"implies \(64, 96\).*intermediate_size"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_missing_tensors_are_listed_by_their_hf_names(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config.pop("layer_types", None)
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(tunix_model.MissingWeightsError, match=r"model\.layers\.2\..*num_hidden_layers"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_unknown_dtype_string_lists_the_accepted_names(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"Unknown dtype 'float17'.*bfloat16"):
        torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float17")


def test_unsupported_rope_scaling_type_names_it_and_the_supported_types(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32}
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedRopeScalingError, match=r"'yarn' is not supported.*'default', 'linear', 'llama3'"):
        torchlike.AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_output_directory_that_is_a_file_is_refused_before_writing(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    target = tmp_path / "model_out"
    target.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="is an existing file"):
        model.save_pretrained(target)
    assert target.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_out"]


def _fail_after(count, monkeypatch):
    real = tunix_model.materialize_hf_tensor
    calls = {"n": 0}

    def failing(sources, spec):
        calls["n"] += 1
        if calls["n"] > count:
            raise OSError("disk full (simulated)")
        return real(sources, spec)

    monkeypatch.setattr(tunix_model, "materialize_hf_tensor", failing)


def test_a_crash_mid_save_leaves_no_directory_behind(tiny_checkpoints, tmp_path, monkeypatch):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    _fail_after(5, monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    assert list(tmp_path.iterdir()) == []


def test_a_crash_mid_save_keeps_the_previous_save_intact(tiny_checkpoints, tmp_path, monkeypatch):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    model.save_pretrained(tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    _fail_after(5, monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        model.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
