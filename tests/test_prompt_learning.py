"""Prompt tuning, P-tuning and prefix tuning against the real ``peft`` and ``trl``: logits with the same virtual-token
weights, adapter files both ways, SFT training only the prompt parameters, and SFT losses step for step."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

import torchlike
from tests import tiny
from tests.helpers.data import WORDS
from tests.helpers.logs import logged
from torchlike import peft as ours_peft
from torchlike.trl import SFTConfig, SFTTrainer

# (peft config class, torchlike config class, options): each kind with its peft-default encoder, and prefix tuning
# with its projection MLP.
KINDS = {
    "prompt_tuning": ("PromptTuningConfig", {}),
    "p_tuning": ("PromptEncoderConfig", {"encoder_hidden_size": 32}),
    "prefix_tuning": ("PrefixTuningConfig", {}),
    "prefix_projection": ("PrefixTuningConfig", {"prefix_projection": True, "encoder_hidden_size": 16}),
}
VIRTUAL_TOKENS = 5


def configs(kind: str) -> tuple:
    """``(peft config, torchlike config)`` of ``kind`` with the same fields."""
    name, options = KINDS[kind]
    fields = dict(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL_TOKENS, **options)
    return getattr(peft, name)(**fields), getattr(ours_peft, name)(**fields)


def copy_prompt_encoder(reference, model) -> None:
    """Gives the torchlike adapter the virtual-token weights of the ``peft`` one: its ``embedding`` table and the
    linear layers of its ``mlp_head`` (P-tuning) or ``transform`` (prefix projection), transposed to ``(in, out)``."""
    source = reference.prompt_encoder["default"]
    target = model.module.prompt_encoder
    target.embedding.set_value(jnp.asarray(source.embedding.weight.detach().numpy()))  # a copy: torch trains in place
    head = getattr(source, "mlp_head", None) or getattr(source, "transform", None) or []
    linears = [layer for layer in head if isinstance(layer, torch.nn.Linear)]
    assert len(linears) == len(target.mlp_kernels)
    for kernel, bias, linear in zip(target.mlp_kernels, target.mlp_biases, linears, strict=True):
        kernel.set_value(jnp.asarray(linear.weight.detach().numpy().T))
        bias.set_value(jnp.asarray(linear.bias.detach().numpy()))


def right_padded_batch() -> tuple[np.ndarray, np.ndarray]:
    """``tiny.padded_batch`` without its left-padded row: ``peft`` gives virtual and real tokens the positions
    ``0 .. n + T - 1`` whatever the padding, torchlike counts real tokens, as for the base model."""
    ids, mask, _ = tiny.padded_batch()
    return ids[[0, 2]], mask[[0, 2]]


def peft_logits(reference, ids, mask) -> np.ndarray:
    with torch.no_grad():
        return reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def valid_max_diff(ours, theirs, mask) -> float:
    """The largest difference over real tokens (and the virtual ones in front, when the logits cover them)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    virtual = ours.shape[1] - mask.shape[1]
    valid = np.concatenate([np.ones((mask.shape[0], virtual), bool), mask.astype(bool)], axis=1)
    return float(np.abs(ours - theirs)[valid].max())


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def qwen2_path(tiny_checkpoints):
    return tiny_checkpoints.path("qwen2")


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_peft_with_the_same_virtual_token_weights(kind, qwen2_path):
    peft_config, config = configs(kind)
    torch.manual_seed(0)
    reference = peft.get_peft_model(hf_model(qwen2_path), peft_config).eval()
    model = ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), config)
    copy_prompt_encoder(reference, model)
    ids, mask = right_padded_batch()
    logits = model(ids, mask).logits
    prepended = VIRTUAL_TOKENS if kind in ("prompt_tuning", "p_tuning") else 0
    assert logits.shape == (2, prepended + ids.shape[1], tiny.VOCAB)
    assert valid_max_diff(logits, peft_logits(reference, ids, mask), mask) <= 1e-4
    # peft's model fields, filled from the model config (prefix tuning: key/value heads times their size)
    assert (config.num_layers, config.token_dim, config.num_attention_heads) == (
        peft_config.num_layers, peft_config.token_dim, peft_config.num_attention_heads)


@pytest.mark.parametrize("case", ["qwen3", "llama32", "mistral", "phi3", "gpt_neox", "granite", "olmo2", "smollm3"])
@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_logits_equal_peft_on_each_family_with_prompt_learning(case, kind, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    peft_config, config = configs(kind)
    torch.manual_seed(0)
    reference = peft.get_peft_model(hf_model(path), peft_config).eval()
    model = ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path), config)
    copy_prompt_encoder(reference, model)
    ids, mask = right_padded_batch()
    assert valid_max_diff(model(ids, mask).logits, peft_logits(reference, ids, mask), mask) <= 1e-4


@pytest.mark.parametrize("kind", list(KINDS))
def test_adapter_saved_by_torchlike_loads_in_peft_with_the_same_logits(kind, qwen2_path, tmp_path):
    _, config = configs(kind)
    model = ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), config, seed=1)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == config.peft_type

    reference = peft.PeftModel.from_pretrained(hf_model(qwen2_path), tmp_path).eval()
    ids, mask = right_padded_batch()
    expected = model(ids, mask).logits
    assert valid_max_diff(expected, peft_logits(reference, ids, mask), mask) <= 1e-4
    reloaded = ours_peft.PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                                                   tmp_path)
    assert valid_max_diff(reloaded(ids, mask).logits, expected, mask) <= 1e-6
    assert reloaded.is_trainable is False and reloaded.num_parameters(only_trainable=True) == 0


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_adapter_saved_by_peft_loads_in_torchlike_with_the_same_logits(kind, qwen2_path, tmp_path):
    peft_config, _ = configs(kind)
    torch.manual_seed(0)
    reference = peft.get_peft_model(hf_model(qwen2_path), peft_config).eval()
    reference.save_pretrained(tmp_path)
    model = ours_peft.PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), tmp_path)
    ids, mask = right_padded_batch()
    assert valid_max_diff(model(ids, mask).logits, peft_logits(reference, ids, mask), mask) <= 1e-4
    with pytest.raises(ValueError, match="Cannot set a prompt learning adapter to trainable"):
        ours_peft.PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), tmp_path,
                                            is_trainable=True)


def test_a_p_tuning_lstm_adapter_saved_by_peft_loads_in_torchlike(qwen2_path, tmp_path):
    torch.manual_seed(0)
    reference = peft.get_peft_model(hf_model(qwen2_path), peft.PromptEncoderConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL_TOKENS, encoder_reparameterization_type="LSTM",
        encoder_hidden_size=16)).eval()
    reference.save_pretrained(tmp_path)  # the LSTM's output, which torchlike feeds without the LSTM
    model = ours_peft.PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), tmp_path)
    ids, mask = right_padded_batch()
    assert valid_max_diff(model(ids, mask).logits, peft_logits(reference, ids, mask), mask) <= 1e-4


def test_disable_adapter_gives_the_base_model_outputs(qwen2_path):
    base = torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path)
    model = ours_peft.get_peft_model(base, configs("prompt_tuning")[1])
    ids, mask = right_padded_batch()
    with model.disable_adapter():
        np.testing.assert_array_equal(np.asarray(model(ids, mask).logits), np.asarray(base(ids, mask).logits))


def text_data(count: int, seed: int = 0) -> list[dict]:
    """TRL's ``text`` format, 2-12 words a row: every token is in the loss, the first one too (predicted from the
    last virtual token), and every batch is padded."""
    rng = np.random.default_rng(seed)
    words = WORDS.split()
    return [{"text": " ".join(rng.choice(words, int(rng.integers(2, 13))))} for _ in range(count)]


SETTINGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-2, max_length=32,
                logging_steps=1, seed=0, bf16=False, report_to="none", save_strategy="no")


def flat_parameters(module) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(variable.get_value())
            for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_sft_trains_only_the_prompt_parameters_with_trl_and_peft_losses(kind, qwen2_path, tokenizer_dir, tmp_path):
    import datasets
    import trl
    from torch.utils.data import SequentialSampler

    peft_config, config = configs(kind)
    data = text_data(24)
    # transformers drops the prefix cache under gradient checkpointing (TRL's default) and then fails on the
    # attention mask's shape, so TRL's prefix-tuning run goes without it; torchlike keeps TRL's default throughout.
    torch.manual_seed(0)
    reference = trl.SFTTrainer(
        model=hf_model(qwen2_path), args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, max_steps=3,
                                                       gradient_checkpointing=kind != "prefix_tuning", **SETTINGS),
        train_dataset=datasets.Dataset.from_list(data), peft_config=peft_config,
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    # P-tuning comes as a PeftModel, the others as a peft_config.
    model, config = (ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), config),
                     None) if kind == "p_tuning" else (str(qwen2_path), config)
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "ours"), max_steps=3,
                                                     train_sampling_strategy="sequential", **SETTINGS),
                         train_dataset=data, peft_config=config,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    copy_prompt_encoder(reference.model, trainer.model)
    before = flat_parameters(trainer.model.module)
    reference.train()
    trainer.train()

    after = flat_parameters(trainer.model.module)
    prompt = {name for name in after if name.startswith("prompt_encoder.")}
    assert prompt and all(not np.array_equal(before[name], after[name]) for name in prompt)
    for name in set(after) - prompt:  # the base weights are bit-identical
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert trainer.model.num_parameters(only_trainable=True) == sum(after[name].size for name in prompt)
    trainer.save_model(str(tmp_path / "saved"))  # the trained adapter, in peft's files
    assert json.loads((tmp_path / "saved" / "adapter_config.json").read_text())["peft_type"] == peft_config.peft_type

    expected, ours = reference.state.log_history, trainer.state.log_history
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert len(logged(expected, key)) == 3, key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)


def test_padding_free_batches_are_refused_for_virtual_tokens(qwen2_path, tokenizer_dir, tmp_path):
    trainer = SFTTrainer(model=str(qwen2_path), args=SFTConfig(output_dir=str(tmp_path), max_steps=1, packing=True,
                                                               **SETTINGS),
                         train_dataset=text_data(8), peft_config=configs("prompt_tuning")[1],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    with pytest.raises(ValueError, match="peft drops their position_ids"):
        trainer.train()


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_configs_have_peft_fields_and_defaults(kind):
    peft_config, config = configs(kind)
    theirs = {field.name: field.default for field in dataclasses.fields(peft_config)} | {"peft_version": None}
    ours = {field.name: field.default for field in dataclasses.fields(config)} | {"peft_version": None}
    assert ours == theirs
    saved = peft_config.to_dict()
    assert {key: saved[key] for key in config.to_dict()} == config.to_dict()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ours_peft.PromptEncoderConfig(num_virtual_tokens=4, encoder_reparameterization_type="LSTM"),
     "LSTM encoder is not implemented"),
    (lambda: ours_peft.PromptTuningConfig(num_virtual_tokens=4, task_type="SEQ_CLS"), "causal language models only"),
    (lambda: ours_peft.PrefixTuningConfig(num_virtual_tokens=4, modules_to_save=["lm_head"]), "only the prompt"),
    (lambda: ours_peft.PromptTuningConfig(num_virtual_tokens=4, prompt_tuning_init="TEXT"), "tokenizer_name_or_path"),
    (lambda: ours_peft.PromptTuningConfig(num_virtual_tokens=None), "num_virtual_tokens must be a positive int"),
])
def test_options_torchlike_cannot_honour_are_refused_with_the_reason(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_model_fields_that_disagree_with_the_model_are_refused(qwen2_path):
    with pytest.raises(ValueError, match="token_dim=32 disagrees with the model, which needs 64"):
        ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                                 ours_peft.PromptTuningConfig(num_virtual_tokens=4, token_dim=32))


def test_a_gemma_model_is_refused_with_the_reason(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("gemma3"))
    with pytest.raises(ValueError, match="not gemma3: its decoder scales the input embeddings"):
        ours_peft.get_peft_model(model, configs("prompt_tuning")[1])


def test_a_model_loaded_with_quantization_config_is_refused(qwen2_path):
    with pytest.warns(UserWarning):
        model = torchlike.AutoModelForCausalLM.from_pretrained(
            qwen2_path, quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match="would train on the full-precision base"):
        ours_peft.get_peft_model(model, configs("prompt_tuning")[1])


def test_text_initialisation_takes_the_word_embeddings_of_the_text(qwen2_path, tokenizer_dir):
    config = ours_peft.PromptTuningConfig(num_virtual_tokens=5, prompt_tuning_init="TEXT",
                                          prompt_tuning_init_text="hello world", tokenizer_name_or_path=tokenizer_dir)
    model = ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path), config)
    ids = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)("hello world")["input_ids"]
    ids = (ids * VIRTUAL_TOKENS)[:VIRTUAL_TOKENS]
    table = np.asarray(model.base_model.get_input_embeddings().weight)
    np.testing.assert_array_equal(np.asarray(model.module.prompt_encoder.embedding.get_value()), table[ids])


def test_generation_and_merging_are_refused_with_the_reason(qwen2_path):
    model = ours_peft.get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(qwen2_path),
                                     configs("prefix_tuning")[1])
    with pytest.raises(NotImplementedError, match="KV cache that would lack the virtual tokens"):
        model.generate(np.array([[5, 6, 7]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_and_unload()
