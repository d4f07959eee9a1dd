"""state_dict / load_state_dict: torch's semantics, with every surgery rule exercised."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchlike
from tests import tiny
from tests.helpers.models import randomize_lora_, valid_max_diff
from torchlike.peft import LoraConfig, get_peft_model

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.fixture
def base(tiny_checkpoints):
    return torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))


@pytest.fixture
def zeros(tiny_checkpoints):
    """The same architecture with every parameter zeroed, to see what a load really copies."""
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    for name, array in model.state_dict().items():
        model.load_state_dict({name: np.zeros(array.shape, np.float32)}, strict=False)
    return model


def logits(model):
    ids, mask, _ = tiny.padded_batch()
    return np.asarray(model(ids, mask).logits)


def test_state_dict_keys_are_flat_dotted_strings_of_the_models_own_arrays(base):
    state = base.state_dict()
    assert all(isinstance(key, str) for key in state) and "layers.1.attn.q_proj.w" in state
    assert state["layers.1.attn.q_proj.w"] is dict(base.named_parameters())["layers.1.attn.q_proj.w"]
    assert state.metadata["family"] == "qwen2"


def test_lora_added_since_the_save_is_reported_missing_and_the_base_loads(base, zeros, tmp_path):
    torchlike.save(base.state_dict(), tmp_path / "base")
    model = get_peft_model(zeros, LORA)
    missing, unexpected = model.load_state_dict(torchlike.load(tmp_path / "base"), strict=False)
    lora_keys = sorted(name for name in model.state_dict() if "_lora_" in name)
    assert sorted(missing) == lora_keys and unexpected == []
    for name, array in base.state_dict().items():
        np.testing.assert_array_equal(np.asarray(model.state_dict()[name]), np.asarray(array))
    np.testing.assert_array_equal(logits(model), logits(base))


def test_strict_load_lists_the_lora_keys_in_torchs_message_layout(base, zeros, tmp_path):
    torchlike.save(base.state_dict(), tmp_path / "base")
    model = get_peft_model(zeros, LORA)
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(torchlike.load(tmp_path / "base"))
    message = str(error.value)
    assert message.startswith("Error(s) in loading state_dict for PeftModel:\n\tMissing key(s) in state_dict: ")
    assert '"layers.0.attn.q_proj.w_lora_a"' in message and "Unexpected" not in message


def test_lora_in_the_checkpoint_but_not_the_model_is_unexpected(base, tmp_path):
    model = get_peft_model(base, LORA)
    torchlike.save(model.state_dict(), tmp_path / "lora")
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    result = fresh.load_state_dict(torchlike.load(tmp_path / "lora"), strict=False)
    assert result.missing_keys == [] and sorted(result.unexpected_keys) == sorted(
        name for name in model.state_dict() if "_lora_" in name)


def test_merge_lora_folds_the_checkpoint_adapter_into_a_fresh_base(base, tmp_path):
    model = get_peft_model(base, LORA)
    randomize_lora_(model, seed=5)
    torchlike.save(model.state_dict(), tmp_path / "lora")
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    result = fresh.load_state_dict(torchlike.load(tmp_path / "lora"), merge_lora=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    ids, mask, _ = tiny.padded_batch()
    assert valid_max_diff(fresh(ids, mask).logits, model(ids, mask).logits, mask) <= 1e-5


def test_merge_lora_without_metadata_says_what_is_missing(base):
    model = get_peft_model(base, LORA)
    plain = dict(model.state_dict())  # a plain dict: no rank/alpha metadata
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    with pytest.raises(ValueError, match="merge_lora=True needs the adapter's scale"):
        fresh.load_state_dict(plain, merge_lora=True)


def test_int_and_str_key_parts_and_nested_dicts_are_normalised(base, zeros):
    state = base.state_dict()
    tuple_keys = {tuple(int(p) if p.isdigit() else p for p in name.split(".")): v for name, v in state.items()}
    assert zeros.load_state_dict(tuple_keys) == ([], [])
    np.testing.assert_array_equal(logits(zeros), logits(base))
    nested: dict = {}
    for name, value in state.items():
        node = nested
        *parents, leaf = [int(p) if p.isdigit() else p for p in name.split(".")]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    assert fresh.load_state_dict(nested) == ([], [])


@pytest.mark.parametrize("prefix", ["model.", "base_model.model."])
def test_known_prefixes_are_stripped(base, zeros, prefix):
    zeros.load_state_dict({prefix + name: value for name, value in base.state_dict().items()})
    np.testing.assert_array_equal(logits(zeros), logits(base))


def test_a_transformers_torch_state_dict_loads_through_the_family_table(zeros, tiny_checkpoints):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    assert zeros.load_state_dict(reference.state_dict()) == ([], [])
    ids, mask, positions = tiny.padded_batch()
    assert valid_max_diff(zeros(ids, mask).logits, tiny.hf_logits(reference.eval(), ids, mask, positions), mask) <= 1e-4


def test_a_safetensors_file_dict_loads_through_the_family_table(tiny_checkpoints, base):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    target = torchlike.AutoModelForCausalLM.from_config(model.config)
    tensors = load_file(tiny_checkpoints.path("gemma3") / "model.safetensors")
    assert target.load_state_dict(tensors) == ([], [])  # gemma's k/v stack into one kv_einsum
    np.testing.assert_array_equal(logits(target), logits(model))


def test_values_are_cast_to_the_models_dtype_unless_assign(base):
    bf16 = {name: np.asarray(value).astype(ml_dtypes.bfloat16) for name, value in base.state_dict().items()}
    base.load_state_dict(bf16)
    assert all(v.dtype == np.float32 for v in base.state_dict().values())
    base.load_state_dict(bf16, assign=True)
    assert all(v.dtype == np.dtype(ml_dtypes.bfloat16) for v in base.state_dict().values())


def test_torch_tensors_are_accepted_as_values(base, zeros):
    as_torch = {name: torch.from_numpy(np.array(value)) for name, value in base.state_dict().items()}
    zeros.load_state_dict(as_torch)
    np.testing.assert_array_equal(logits(zeros), logits(base))


def test_key_map_renames_checkpoint_keys(base, zeros):
    renamed = {name.replace("attn", "self_attention"): value for name, value in base.state_dict().items()}
    assert zeros.load_state_dict(renamed, key_map={r"\.self_attention\.": ".attn."}) == ([], [])
    np.testing.assert_array_equal(logits(zeros), logits(base))


def test_key_map_that_maps_two_keys_to_one_is_refused(base):
    state = {"layers.0.input_layernorm.w": np.ones(64, np.float32),
             "layers.0.post_attention_layernorm.w": np.ones(64, np.float32)}
    expected = (r"checkpoint keys 'layers\.0\.input_layernorm\.w' \(as is\) and "
                r"'layers\.0\.post_attention_layernorm\.w' \(key_map\) both map to 'layers\.0\.input_layernorm\.w'.*"
                r"Drop one of them from the state dict, or change key_map")
    with pytest.raises(ValueError, match=expected):
        base.load_state_dict(state, strict=False, key_map={"post_attention": "input"})


def test_key_map_onto_the_hf_name_of_a_loaded_parameter_is_refused(base):
    before = np.asarray(base.state_dict()["layers.0.attn.q_proj.w"])
    state = {"model.layers.0.self_attn.q_proj.weight": np.ones((64, 64), np.float32),
             "layers.0.attn.query.weight": np.zeros((64, 64), np.float32)}
    expected = (r"'model\.layers\.0\.self_attn\.q_proj\.weight' \(HF name translated\) and "
                r"'layers\.0\.attn\.query\.weight' \(key_map then HF name translated\) both map to "
                r"'layers\.0\.attn\.q_proj\.w'")
    with pytest.raises(ValueError, match=expected):
        base.load_state_dict(state, strict=False,
                             key_map={r"^layers\.0\.attn\.query": "model.layers.0.self_attn.q_proj"})
    np.testing.assert_array_equal(np.asarray(base.state_dict()["layers.0.attn.q_proj.w"]), before)


def test_a_prefixed_and_an_hf_named_copy_of_one_parameter_are_refused(base):
    state = {"model.layers.0.attn.q_proj.w": np.ones((64, 4, 16), np.float32),
             "model.layers.0.self_attn.q_proj.weight": np.ones((64, 64), np.float32)}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.attn\.q_proj\.w' \(prefix 'model\.' stripped\) and "
                                         r"'model\.layers\.0\.self_attn\.q_proj\.weight' \(HF name translated\) "
                                         r"both map to 'layers\.0\.attn\.q_proj\.w'"):
        base.load_state_dict(state, strict=False)


def test_two_copies_of_a_lora_factor_the_model_lacks_are_refused(base):
    factor = np.zeros((64, 4), np.float32)
    state = {"layers.0.attn.q_proj.w_lora_a": factor, "base_model.model.layers.0.attn.q_proj.w_lora_a": factor}
    with pytest.raises(ValueError, match=r"both map to 'layers\.0\.attn\.q_proj\.w_lora_a'"):
        base.load_state_dict(state, strict=False)


def test_shape_mismatch_raises_even_when_not_strict_and_names_the_lora_rank(base, tmp_path):
    rank8 = get_peft_model(base, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"]))
    torchlike.save(rank8.state_dict(), tmp_path / "r8")
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    rank16 = get_peft_model(fresh, LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj"]))
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.attn\.q_proj\.w_lora_a: copying a param "
                                           r"with shape \(64, 8\) from checkpoint, the shape in current model is "
                                           r"\(64, 16\)\. Likely cause: LoRA rank 8 in checkpoint, 16 in model"):
        rank16.load_state_dict(torchlike.load(tmp_path / "r8"), strict=False)


def test_ignore_mismatched_sizes_skips_and_reports_them(base):
    state = dict(base.state_dict())
    state["embedder.input_embedding"] = np.zeros((tiny.VOCAB + 8, 64), np.float32)
    before = np.asarray(base.state_dict()["embedder.input_embedding"])
    result = base.load_state_dict(state, ignore_mismatched_sizes=True)
    assert result.mismatched_keys == ["embedder.input_embedding"] and result.missing_keys == []
    np.testing.assert_array_equal(np.asarray(base.state_dict()["embedder.input_embedding"]), before)


def test_result_unpacks_like_torch_and_prints_all_matched(base):
    result = base.load_state_dict(base.state_dict())
    missing, unexpected = result
    assert (missing, unexpected) == ([], []) and repr(result) == "<All keys matched successfully>"


def test_a_non_dict_state_dict_is_a_type_error(base):
    with pytest.raises(TypeError, match="Expected state_dict to be dict-like, got <class 'list'>"):
        base.load_state_dict([1, 2, 3])


def test_a_value_of_the_wrong_type_names_the_key(base):
    with pytest.raises(RuntimeError, match='parameter named "final_norm.w", expected torch.Tensor'):
        base.load_state_dict({"final_norm.w": [1.0] * 64}, strict=False)
    with pytest.raises(RuntimeError, match="dtype object"):
        base.load_state_dict({"final_norm.w": np.array([object()] * 64)}, strict=False)


def test_a_checkpoint_from_another_family_is_refused(tiny_checkpoints, base, tmp_path):
    llama = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("llama3"))
    torchlike.save(llama.state_dict(), tmp_path / "llama")
    with pytest.raises(ValueError, match="holds a llama3 model but this model is qwen2"):
        base.load_state_dict(torchlike.load(tmp_path / "llama"), strict=False)
    gemma = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    with pytest.raises(ValueError, match="none of the checkpoint's .* keys match this qwen2 model"):
        base.load_state_dict({k: v for k, v in gemma.state_dict().items() if ".attn." in k}, strict=False)


def test_lazy_load_restores_only_the_keys_the_model_needs(base, tmp_path, monkeypatch):
    model = get_peft_model(base, LORA)
    torchlike.save(model.state_dict(), tmp_path / "lora")
    checkpoint = torchlike.load(tmp_path / "lora")
    requested = []
    real_restore = type(checkpoint).restore

    def recording_restore(self, targets, dtypes=None):
        requested.extend(targets)
        return real_restore(self, targets, dtypes)

    monkeypatch.setattr(type(checkpoint), "restore", recording_restore)
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(base.name_or_path)
    fresh.load_state_dict(checkpoint, strict=False)
    assert sorted(requested) == sorted(fresh.state_dict())
    assert all(isinstance(value, jax.Array) for value in fresh.state_dict().values())
