"""save_pretrained writes what transformers loads: same logits, same tensors bit for bit, valid shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

import torchlike
from tests import tiny


def _all_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["qwen2", "qwen3_tied", "llama32"])
def test_saved_tensors_equal_the_originals_bit_for_bit(case, dtype, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints.path(case, dtype=dtype)
    model = torchlike.AutoModelForCausalLM.from_pretrained(source)  # dtype "auto": the checkpoint's
    model.save_pretrained(tmp_path / "out")

    original, saved = _all_tensors(source), _all_tensors(tmp_path / "out")
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype == dtype, name
        assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("case", ["qwen2", "llama32"])
def test_transformers_reloads_the_export_with_the_same_logits(case, tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case))
    model.save_pretrained(tmp_path / "out")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="float32").eval()
    ids, mask, positions = tiny.padded_batch()
    expected = tiny.hf_logits(reloaded, ids, mask, positions)
    logits = np.asarray(model(ids, attention_mask=mask).logits)
    valid = mask.astype(bool)
    assert np.abs(logits[valid] - expected[valid]).max() <= 1e-4


def test_export_writes_config_generation_config_and_pt_metadata(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="bfloat16")
    model.save_pretrained(tmp_path / "out")

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_sharded_export_has_a_valid_index_that_transformers_and_torchlike_load(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints.path("qwen3")
    model = torchlike.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _all_tensors(source).values())
    assert not (tmp_path / "sharded" / "model.safetensors").exists()

    ids, mask, positions = tiny.padded_batch()
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()
    from_sharded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype="float32").eval()
    np.testing.assert_array_equal(tiny.hf_logits(from_sharded, ids, mask, positions),
                                  tiny.hf_logits(reference, ids, mask, positions))
    reloaded = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    np.testing.assert_array_equal(np.asarray(reloaded(ids, mask).logits), np.asarray(model(ids, mask).logits))


def test_saving_again_replaces_stale_shards_and_keeps_other_files(tiny_checkpoints, tmp_path):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    out = tmp_path / "out"
    model.save_pretrained(out, max_shard_size="40KB")
    (out / "README.md").write_text("my notes")
    model.save_pretrained(out)

    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert (out / "README.md").read_text() == "my notes"
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_tokenizer_files_are_saved_when_a_tokenizer_is_given(tiny_checkpoints, tokenizer_dir, tmp_path):
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    model.save_pretrained(tmp_path / "out", tokenizer=tokenizer)

    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reloaded("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_push_to_hub_uploads_a_complete_checkpoint_folder(tiny_checkpoints, monkeypatch):
    import huggingface_hub

    uploaded = {}

    class RecordingApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            uploaded["created"] = repo_id

        def upload_folder(self, repo_id, folder_path, **kwargs):
            from pathlib import Path

            uploaded["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            uploaded["model"] = transformers.AutoModelForCausalLM.from_pretrained(folder_path)
            return "https://hub/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    assert model.push_to_hub("me/tiny") == "https://hub/commit/1"
    assert uploaded["created"] == "me/tiny"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(uploaded["files"])
    assert uploaded["model"].num_parameters() == model.num_parameters()
