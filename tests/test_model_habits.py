"""A PyTorch user's first habits on a model (``to``, ``half``, ``eval``, ``requires_grad_``, embeddings, resizing,
gradient checkpointing, ``print_trainable_parameters``), each held against transformers or peft on the same tiny
Qwen2."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import peft
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from torchlike.peft import LoraConfig, PeftModel, get_peft_model

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def load(tiny_checkpoints, case: str = "qwen2", **kwargs) -> torchlike.CausalLM:
    return torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), **kwargs)


def load_reference(tiny_checkpoints, case: str = "qwen2") -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype=torch.float32,
                                                             attn_implementation="eager")


def valid_logits(logits, mask) -> np.ndarray:
    return np.asarray(logits, dtype=np.float32)[mask.astype(bool)]


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoints):
    """A model the tests only read."""
    return load(tiny_checkpoints)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """The transformers model the tests only read."""
    return load_reference(tiny_checkpoints)


def test_loaded_models_are_in_eval_mode_and_train_eval_return_the_model(tiny_checkpoints, reference):
    model = load(tiny_checkpoints)
    assert model.training is reference.training is False
    assert model.train() is model and model.training is True
    assert model.eval() is model and model.training is False
    assert model.train(False) is model and model.training is False


def test_train_mode_must_be_a_bool_with_torchs_message(tiny_checkpoints, reference):
    with pytest.raises(ValueError) as expected:
        reference.train("yes")
    with pytest.raises(ValueError) as found:
        load(tiny_checkpoints).train("yes")
    assert str(found.value) == str(expected.value)


def test_peft_models_start_in_training_mode_and_loaded_frozen_adapters_in_eval_as_in_peft(tiny_checkpoints, tmp_path):
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj"])
    expected = peft.get_peft_model(load_reference(tiny_checkpoints), peft.LoraConfig(**config))
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(**config))
    assert model.training is expected.training is True
    model.save_pretrained(tmp_path)
    frozen = PeftModel.from_pretrained(load(tiny_checkpoints), tmp_path)
    expected_frozen = peft.PeftModel.from_pretrained(load_reference(tiny_checkpoints), tmp_path)
    assert frozen.training is expected_frozen.training is False
    assert model.eval() is model and model.training is False and model.base_model.training is False
    assert model.train() is model and model.base_model.training is True


def test_to_a_torch_dtype_casts_in_place_returns_the_model_and_runs_as_loaded_in_that_dtype(tiny_checkpoints,
                                                                                            padded_batch):
    reference = load_reference(tiny_checkpoints)
    assert reference.to(torch.bfloat16) is reference
    model = load(tiny_checkpoints)
    float32_values = {name: np.asarray(array) for name, array in model.named_parameters()}
    assert model.to(torch.bfloat16) is model
    assert model.dtype == BFLOAT16 and str(reference.dtype) == "torch.bfloat16"
    for name, array in model.named_parameters():
        assert array.dtype == BFLOAT16
        np.testing.assert_array_equal(np.asarray(array), float32_values[name].astype(BFLOAT16))
    ids, mask, _ = padded_batch
    loaded = load(tiny_checkpoints, dtype="bfloat16")
    np.testing.assert_array_equal(valid_logits(model(ids, mask).logits, mask),
                                  valid_logits(loaded(ids, mask).logits, mask))


@pytest.mark.parametrize("cast, expected", [
    (lambda model: model.half(), np.float16),
    (lambda model: model.bfloat16(), ml_dtypes.bfloat16),
    (lambda model: model.to(dtype=torch.float16), np.float16),
    (lambda model: model.to("cpu", torch.bfloat16), ml_dtypes.bfloat16),
    (lambda model: model.bfloat16().float(), np.float32),
], ids=["half", "bfloat16", "to-dtype-keyword", "to-device-and-dtype", "float"])
def test_dtype_casts_give_transformers_dtypes_and_return_the_model(cast, expected, tiny_checkpoints):
    reference = load_reference(tiny_checkpoints)
    model = load(tiny_checkpoints)
    assert cast(reference) is reference and cast(model) is model
    assert model.dtype == np.dtype(expected)
    assert str(reference.dtype).removeprefix("torch.") == np.dtype(expected).name
    assert {np.dtype(array.dtype) for array in model.parameters()} == {np.dtype(expected)}


def test_to_the_cpu_is_the_model_itself_on_a_cpu(qwen2, reference):
    assert reference.to("cpu") is reference and reference.cpu() is reference
    assert qwen2.to("cpu") is qwen2 and qwen2.to(torch.device("cpu")) is qwen2 and qwen2.cpu() is qwen2
    assert qwen2.dtype == np.float32


def test_a_move_to_another_device_is_refused_with_the_reason_and_the_alternative(qwen2):
    with pytest.raises(ValueError, match=r"do not move between devices.*from_pretrained\(\.\.\., mesh="):
        qwen2.to("cuda")
    with pytest.raises(ValueError, match="'mps' has no JAX platform"):
        qwen2.to("mps")
    with pytest.raises(TypeError, match=r"to\(tensor\) is not supported"):
        qwen2.to(torch.zeros(1))


def test_a_cast_peft_model_casts_its_base_and_keeps_their_arrays_shared(tiny_checkpoints):
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert model.to(torch.bfloat16) is model
    assert model.dtype == BFLOAT16 and model.base_model.dtype == BFLOAT16
    assert all(array.dtype == BFLOAT16 for array in model.parameters())
    assert model.get_parameter("layers.0.mlp.up_proj.kernel") is model.base_model.get_parameter(
        "layers.0.mlp.up_proj.kernel")


def test_casting_a_quantized_model_is_refused_as_transformers_refuses_bitsandbytes(tiny_checkpoints):
    model = get_peft_model(load(tiny_checkpoints, "gemma3"),
                           LoraConfig(r=4, target_modules=["gate_proj"], quantize_base="nf4",
                                      quantization_tile_size=16))
    with pytest.raises(ValueError, match="cannot cast a quantized"):
        model.half()


def test_requires_grad_false_freezes_the_count_as_in_transformers(tiny_checkpoints):
    reference = load_reference(tiny_checkpoints)
    model = load(tiny_checkpoints)
    assert reference.requires_grad_(False) is reference and model.requires_grad_(False) is model
    assert model.num_parameters(only_trainable=True) == reference.num_parameters(only_trainable=True) == 0
    assert model.num_parameters() == reference.num_parameters()
    reference.requires_grad_(True)
    assert model.requires_grad_(True).num_parameters(only_trainable=True) == reference.num_parameters(
        only_trainable=True)


def test_requires_grad_false_on_a_peft_model_freezes_the_adapter_as_in_peft(tiny_checkpoints):
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    expected = peft.get_peft_model(load_reference(tiny_checkpoints), peft.LoraConfig(**config))
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(**config))
    assert expected.requires_grad_(False) is expected and model.requires_grad_(False) is model
    assert model.get_nb_trainable_parameters() == expected.get_nb_trainable_parameters()
    assert model.get_nb_trainable_parameters()[0] == 0


def test_requires_grad_true_on_a_peft_model_is_refused_with_the_reason(tiny_checkpoints):
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="would make the base weights trainable too"):
        model.requires_grad_(True)


def test_config_and_generation_config_are_the_checkpoints_as_in_transformers(qwen2, reference):
    assert type(qwen2.config) is type(reference.config)
    assert qwen2.config.vocab_size == reference.config.vocab_size == tiny.VOCAB
    assert qwen2.config.hidden_size == reference.config.hidden_size
    assert qwen2.generation_config.to_dict() == reference.generation_config.to_dict()


def test_device_is_the_torch_cpu_device_so_inputs_to_model_device_work(qwen2, reference, padded_batch):
    assert qwen2.device == reference.device == torch.device("cpu")
    ids, mask, _ = padded_batch
    inputs = {"input_ids": torch.tensor(ids).to(qwen2.device), "attention_mask": torch.tensor(mask).to(qwen2.device)}
    assert qwen2(**inputs).logits.shape == (*ids.shape, tiny.VOCAB)


@pytest.mark.parametrize("case", ["qwen2", "qwen2_tied"])
def test_num_parameters_match_transformers(case, tiny_checkpoints):
    model, reference = load(tiny_checkpoints, case), load_reference(tiny_checkpoints, case)
    for options in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert model.num_parameters(**options) == reference.num_parameters(**options), options


@pytest.mark.parametrize("case", ["qwen2", "qwen2_tied"])
def test_input_and_output_embeddings_match_transformers(case, tiny_checkpoints):
    model, reference = load(tiny_checkpoints, case), load_reference(tiny_checkpoints, case)
    embeddings, expected = model.get_input_embeddings(), reference.get_input_embeddings()
    assert model.get_input_embeddings() is embeddings
    assert (embeddings.num_embeddings, embeddings.embedding_dim) == (expected.num_embeddings, expected.embedding_dim)
    np.testing.assert_array_equal(np.asarray(embeddings.weight), expected.weight.detach().numpy())
    head, expected_head = model.get_output_embeddings(), reference.get_output_embeddings()
    assert (head.in_features, head.out_features) == (expected_head.in_features, expected_head.out_features)
    np.testing.assert_array_equal(np.asarray(head.weight), expected_head.weight.detach().numpy())
    assert (head.weight is embeddings.weight) == (expected_head.weight is expected.weight)
    assert repr(embeddings) == repr(expected) and repr(head) == repr(expected_head)
    assert model.lm_head is head and repr(model.lm_head) == repr(reference.lm_head)  # transformers' attribute
    np.testing.assert_array_equal(np.asarray(model.lm_head.weight), reference.lm_head.weight.detach().numpy())


@pytest.mark.parametrize("case", ["qwen2", "qwen2_tied"])
def test_resize_token_embeddings_matches_transformers_and_exports_what_transformers_reloads(
        case, tiny_checkpoints, padded_batch, tmp_path):
    model, reference = load(tiny_checkpoints, case), load_reference(tiny_checkpoints, case)
    ids, mask, positions = padded_batch
    old_rows = np.asarray(model.get_input_embeddings().weight)
    before = valid_logits(model(ids, mask).logits, mask)
    resized = model.resize_token_embeddings(tiny.VOCAB + 20, pad_to_multiple_of=16)
    expected = reference.resize_token_embeddings(tiny.VOCAB + 20, pad_to_multiple_of=16)
    assert resized is model.get_input_embeddings()
    assert resized.num_embeddings == expected.num_embeddings == 160
    assert model.config.vocab_size == reference.config.vocab_size == 160
    rows = np.asarray(resized.weight)
    np.testing.assert_array_equal(rows[:tiny.VOCAB], old_rows)
    # Both draw about the mean with 1e-9 times the rows' covariance: the draws differ far below the rows' spread.
    np.testing.assert_allclose(rows[tiny.VOCAB:], expected.weight.detach().numpy()[tiny.VOCAB:], atol=1e-4)
    np.testing.assert_allclose(rows[tiny.VOCAB:].mean(axis=0), old_rows.mean(axis=0), atol=1e-5)
    head, expected_head = model.get_output_embeddings().weight, reference.get_output_embeddings().weight
    assert head.shape == tuple(expected_head.shape) == (160, 64)
    np.testing.assert_allclose(np.asarray(head), expected_head.detach().numpy(), atol=1e-4)

    after = valid_logits(model(ids, mask).logits, mask)
    np.testing.assert_allclose(after[:, :tiny.VOCAB], before, atol=1e-5)  # old tokens score as before
    ids = ids.copy()
    ids[2, -3:] = [130, 145, 159]  # new tokens
    logits = valid_logits(model(ids, mask).logits, mask)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert reloaded.config.vocab_size == 160
    np.testing.assert_allclose(valid_logits(tiny.hf_logits(reloaded, ids, mask, positions), mask), logits, atol=1e-5)


def test_resize_token_embeddings_cuts_rows_and_without_a_size_returns_the_embeddings(tiny_checkpoints):
    model = load(tiny_checkpoints)
    old_rows = np.asarray(model.get_input_embeddings().weight)
    assert model.resize_token_embeddings() is model.get_input_embeddings()
    assert model.resize_token_embeddings(100).num_embeddings == 100 == model.config.vocab_size
    np.testing.assert_array_equal(np.asarray(model.get_input_embeddings().weight), old_rows[:100])
    assert model([[1, 2, 99]]).logits.shape == (1, 3, 100)
    with pytest.raises(ValueError, match="which is not and integer"):
        model.resize_token_embeddings(120, pad_to_multiple_of=8.0)


def test_resize_without_mean_resizing_draws_new_rows_from_the_initializer_range(tiny_checkpoints):
    model = load(tiny_checkpoints)
    rows = np.asarray(model.resize_token_embeddings(tiny.VOCAB + 64, mean_resizing=False).weight)[tiny.VOCAB:]
    assert abs(rows.mean()) < 0.005 and abs(rows.std() - model.config.initializer_range) < 0.1 * \
        model.config.initializer_range


def test_resize_on_a_peft_model_is_refused_with_the_order_to_follow(tiny_checkpoints):
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(\.\.\.\) before get_peft_model"):
        model.resize_token_embeddings(tiny.VOCAB + 8)


def test_gradient_checkpointing_switches_as_in_transformers(tiny_checkpoints):
    model, reference = load(tiny_checkpoints), load_reference(tiny_checkpoints)
    assert model.is_gradient_checkpointing is reference.is_gradient_checkpointing is False
    assert model.gradient_checkpointing_enable({"use_reentrant": False}) is None
    reference.gradient_checkpointing_enable({"use_reentrant": False})
    assert model.is_gradient_checkpointing is reference.is_gradient_checkpointing is True
    model.gradient_checkpointing_disable()
    reference.gradient_checkpointing_disable()
    assert model.is_gradient_checkpointing is reference.is_gradient_checkpointing is False


def test_print_trainable_parameters_prints_peft_text_exactly(tiny_checkpoints, capsys):
    config = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    expected = peft.get_peft_model(load_reference(tiny_checkpoints), peft.LoraConfig(**config))
    model = get_peft_model(load(tiny_checkpoints), LoraConfig(**config))
    assert model.get_nb_trainable_parameters() == expected.get_nb_trainable_parameters()
    capsys.readouterr()
    expected.print_trainable_parameters()
    expected_text = capsys.readouterr().out
    model.print_trainable_parameters()
    assert capsys.readouterr().out == expected_text


def test_a_trainer_refuses_a_frozen_model_as_torchs_optimizer_does(tiny_checkpoints, tmp_path):
    model = load(tiny_checkpoints).requires_grad_(False)
    args = torchlike.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                       report_to="none")
    trainer = torchlike.Trainer(model, args, train_dataset=tiny.padded_examples(2))
    with pytest.raises(ValueError, match="optimizer got an empty parameter list: the model is frozen"):
        trainer.train()
