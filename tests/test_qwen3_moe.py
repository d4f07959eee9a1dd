"""Qwen3 MoE: tiny HF checkpoints (one dense layer, then sparse layers of 4 experts with 2 chosen per token) load and
match transformers in fp32, save back bit for bit in the on-disk per-expert layout, round-trip state dicts, export
attention LoRA adapters, generate token for token, and add transformers' load-balancing loss in training."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchlike
from tests import tiny
from tests.helpers.models import max_diff_on_real_tokens, randomize_lora_, reference_model, with_config
from torchlike.adapters.families import UnsupportedConfigError, family_for_config
from torchlike.adapters.families.qwen3_moe import SparseMoeBlock, sparse_layers
from torchlike.adapters.losses import router as router_loss
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.model import tunix_model
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.trl import SFTConfig
from torchlike.trl.trainer.sft_trainer import SFTTrainer

TOLERANCE = 1e-4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def load(path: Path, **kwargs) -> torchlike.CausalLM:
    return torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32", **kwargs)


def logits(model) -> np.ndarray:
    ids, mask, _ = tiny.padded_batch()
    return np.asarray(model(ids, attention_mask=mask).logits)


def forward_on(model, ids, mask):
    """``module -> logits`` of the batch through ``model``'s family, as ``Family.router_logits`` runs it."""
    return lambda module: model.family.forward(module, *tunix_model.causal_inputs(ids, mask))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints.path("qwen3_moe")


@pytest.fixture(scope="module")
def model(checkpoint) -> torchlike.CausalLM:
    return load(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint) -> transformers.PreTrainedModel:
    return reference_model(checkpoint)


def test_logits_match_transformers_with_tokens_routed_to_different_experts(model, reference):
    ids, mask, positions = tiny.padded_batch()
    ours, record = model.family.router_logits(forward_on(model, ids, mask), model.module)
    assert max_diff_on_real_tokens(ours, tiny.hf_logits(reference, ids, mask, positions)) <= TOLERANCE
    assert len(record.logits) == 2 and record.top_k == 2  # the two sparse layers
    for layer_logits in record.logits:
        picks = np.sort(np.argsort(-np.asarray(layer_logits), axis=-1)[..., :2], axis=-1)[mask.astype(bool)]
        pairs = {tuple(pair) for pair in picks}
        print(f"expert pairs chosen across {len(picks)} tokens: {sorted(pairs)}")
        assert len(pairs) >= 3 and len(set(picks.ravel())) >= 3


@pytest.mark.parametrize(("changes", "sparse"), [
    ({}, [False, True, True]),
    ({"mlp_only_layers": [], "decoder_sparse_step": 2}, [False, True, False]),
    ({"mlp_only_layers": [3], "decoder_sparse_step": 2, "num_hidden_layers": 4}, [False, True, False, False]),
], ids=["mlp_only_layers", "decoder_sparse_step", "both"])
def test_dense_layers_are_where_transformers_puts_them(changes, sparse):
    config = tiny.tiny_config("qwen3_moe", **changes)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    assert [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in reference.model.layers] == sparse
    module = tunix_model.build_abstract_model(family_for_config(config), config, jnp.float32)
    assert sparse_layers(config) == sparse
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in module.layers] == sparse
    shapes = [layer.mlp.gate_proj.shape if isinstance(layer.mlp, SparseMoeBlock) else layer.mlp.gate_proj.kernel.shape
              for layer in module.layers]
    assert shapes == [(4, 64, 32) if is_sparse else (64, 128) for is_sparse in sparse]


def test_norm_topk_prob_false_is_honoured(checkpoint, tmp_path):
    changed = with_config(checkpoint, tmp_path / "plain", norm_topk_prob=False)
    ours = logits(load(changed))
    ids, mask, positions = tiny.padded_batch()
    assert max_diff_on_real_tokens(ours, logits(load(checkpoint))) > 1e-2
    assert max_diff_on_real_tokens(ours, tiny.hf_logits(reference_model(changed), ids, mask, positions)) <= TOLERANCE


def test_sharded_safetensors_load_like_one_file(tiny_checkpoints, model):
    sharded = tiny_checkpoints.path("qwen3_moe", max_shard_size="50KB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    np.testing.assert_array_equal(logits(load(sharded)), logits(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_pretrained_writes_the_per_expert_layout_bit_for_bit(dtype, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path("qwen3_moe", dtype=dtype)
    torchlike.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "out")
    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved and "model.layers.0.mlp.gate_proj.weight" in saved
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype, name
        assert torch.equal(saved[name], tensor), name
    if dtype == torch.float32:
        ids, mask, positions = tiny.padded_batch()
        np.testing.assert_array_equal(tiny.hf_logits(reference_model(tmp_path / "out"), ids, mask, positions),
                                      tiny.hf_logits(reference_model(path), ids, mask, positions))


def test_state_dict_round_trips_and_hf_named_tensors_load(checkpoint, model):
    fresh = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=1)
    assert max_diff_on_real_tokens(logits(fresh), logits(model)) > 1e-2
    result = fresh.load_state_dict(model.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert fresh.state_dict()["layers.1.mlp.gate_proj"].shape == (4, 64, 32)
    np.testing.assert_array_equal(logits(fresh), logits(model))

    hf_named = torchlike.AutoModelForCausalLM.from_config(model.config, dtype="float32", seed=2)
    result = hf_named.load_state_dict(load_file(checkpoint / "model.safetensors"))
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(logits(hf_named), logits(model))


def test_attention_lora_adapter_and_merged_export_load_in_peft_and_transformers(checkpoint, reference, tmp_path):
    lora = get_peft_model(load(checkpoint), LoraConfig(r=4, lora_alpha=16, target_modules=ATTENTION,
                                                        task_type="CAUSAL_LM"))
    randomize_lora_(lora)
    lora.save_pretrained(tmp_path / "adapter")
    ids, mask, positions = tiny.padded_batch()
    lora_logits = logits(lora)
    adapted = peft.PeftModel.from_pretrained(reference_model(checkpoint), tmp_path / "adapter").eval()
    assert max_diff_on_real_tokens(lora_logits, tiny.hf_logits(adapted, ids, mask, positions)) <= TOLERANCE
    assert max_diff_on_real_tokens(lora_logits, tiny.hf_logits(reference, ids, mask, positions)) > 1e-2

    merged = lora.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    reloaded = reference_model(tmp_path / "merged")
    assert max_diff_on_real_tokens(tiny.hf_logits(reloaded, ids, mask, positions), lora_logits) <= TOLERANCE


@pytest.mark.parametrize(("target_modules", "named"), [
    (["q_proj", "gate_proj"], "model.layers.0.mlp.gate_proj"),
    (["experts"], "model.layers.1.mlp.experts"),
    (["model.layers.1.mlp.experts.0.down_proj"], "model.layers.1.mlp.experts.0.down_proj"),
    (["gate"], "model.layers.1.mlp.gate"),
    ("all-linear", "model.layers.0.mlp.down_proj"),
])
def test_lora_on_experts_router_or_mlp_is_refused_naming_the_module(target_modules, named, model):
    with pytest.raises(ValueError, match=rf"names {named.replace('.', '[.]')}, which LoRA cannot adapt"):
        get_peft_model(model, LoraConfig(r=4, target_modules=target_modules))


def test_greedy_generate_matches_transformers(tmp_path):
    # Weights scaled up (std 0.16) so greedy decoding wanders instead of repeating one token.
    reference = tiny.build_hf_model(tiny.CASES["qwen3_moe"]())
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" not in name:
                parameter.mul_(2.0)
    reference.save_pretrained(tmp_path)
    ids = np.random.default_rng(1).integers(3, tiny.VOCAB, size=(3, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = mask[2, :2] = 0  # left padding
    ids[mask == 0] = 0
    with torch.no_grad():
        expected = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), pad_token_id=0,
                                      eos_token_id=None, max_new_tokens=12, do_sample=False).numpy()
    ours = load(tmp_path).generate(ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    np.testing.assert_array_equal(ours, expected)
    assert len(set(expected[:, 12:].ravel())) > 3


def reference_loss(reference, ids, mask, coefficient: float) -> tuple[float, float]:
    """transformers' training loss with ``output_router_logits`` (``loss + coef * aux_loss``) and its aux loss, labels
    on every real token."""
    labels = np.where(mask.astype(bool), ids, -100)
    reference.router_aux_loss_coef = coefficient
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
                        output_router_logits=True)
    return float(out.loss), float(out.aux_loss)


def test_router_aux_loss_equals_transformers_and_is_added_to_the_loss(model, reference):
    ids, mask, _ = tiny.padded_batch()
    expected_loss, expected_aux = reference_loss(reference, ids, mask, coefficient=0.25)
    _, record = model.family.router_logits(forward_on(model, ids, mask), model.module)
    aux = router_loss.load_balancing_loss(record.logits, jnp.asarray(mask), record.top_k)
    assert abs(float(aux) - expected_aux) <= 1e-5

    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(mask)}
    value, count, metrics = sft_loss.sft_step_loss(model.family, router_aux_loss_coef=0.25)(model.module, batch)
    assert abs(float(value / count) - expected_loss) <= 1e-5
    assert abs(float(metrics["aux_loss"]) - expected_aux) <= 1e-5


def test_router_aux_loss_is_refused_for_a_dense_family():
    family = family_for_config(tiny.CASES["qwen3"]())
    with pytest.raises(ValueError, match="no router"):
        sft_loss.sft_step_loss(family, router_aux_loss_coef=0.01)


def test_lora_sft_logs_the_loss_with_the_router_aux_loss(checkpoint, reference, tokenizer_dir, tmp_path):
    data = [{"text": "the quick brown fox jumps over the lazy dog"}, {"text": "one two three four five"},
            {"text": "hello world, this is a tiny tokenizer"}, {"text": "six seven eight nine ten"}]
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=32, per_device_train_batch_size=4, max_steps=3,
                     learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", bf16=False)
    trainer = SFTTrainer(model=load(checkpoint), args=args, train_dataset=data,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, task_type="CAUSAL_LM"))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    rows = [row["input_ids"] for row in trainer.train_dataset]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int64)
    mask = np.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, :len(row)], mask[index, :len(row)] = row, 1
    # TRL's default: the config's coefficient, whatever output_router_logits the config says.
    coefficient = reference.config.router_aux_loss_coef
    expected_loss, expected_aux = reference_loss(reference, ids, mask, coefficient=coefficient)
    assert len(logs) == 3 and np.isfinite([entry["loss"] for entry in logs]).all()
    assert abs(logs[0]["aux_loss"] - expected_aux) <= 1e-5
    assert abs(logs[0]["loss"] - expected_loss) <= 1e-5


def test_the_final_log_carries_the_unlogged_steps_metrics_as_trls(checkpoint, tokenizer_dir, tmp_path):
    """With fewer steps than ``logging_steps`` TRL's only log is the run's final one, and its ``log`` adds the metrics
    recorded since the last log: the router's ``aux_loss``, ``entropy``, ``mean_token_accuracy`` and ``num_tokens``."""
    import datasets
    import trl

    rows = [{"prompt": "the quick brown", "completion": " fox jumps"}, {"prompt": "one two", "completion": " three"}]
    settings = dict(max_steps=2, per_device_train_batch_size=2, report_to="none", save_strategy="no", bf16=False)
    expected = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows * 2),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    expected.train()
    trainer = SFTTrainer(model=str(checkpoint), args=SFTConfig(output_dir=str(tmp_path / "ours"), **settings),
                         train_dataset=rows * 2,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    (theirs,), (ours,) = expected.state.log_history, trainer.state.log_history
    compared = ("train_loss", "aux_loss", "entropy", "mean_token_accuracy", "num_tokens")
    assert set(compared) <= set(theirs) and set(compared) <= set(ours)
    np.testing.assert_allclose([ours[key] for key in compared], [theirs[key] for key in compared], rtol=1e-5)


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"mlp_only_layers": [0, 1, 2]}, "no sparse layer"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_unsupported_config_is_refused(changes, message, checkpoint, tmp_path):
    path = with_config(checkpoint, tmp_path / "changed", **changes)
    with pytest.raises(UnsupportedConfigError, match=message):
        torchlike.AutoModelForCausalLM.from_pretrained(path)


def test_sft_refuses_a_router_loss_coefficient_for_a_dense_model_as_trl_does(tiny_checkpoints, tokenizer_dir,
                                                                           tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.01, report_to="none")
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        SFTTrainer(model=load(tiny_checkpoints.path("qwen3")), args=args, train_dataset=[{"text": "one two"}] * 4,
                   processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
