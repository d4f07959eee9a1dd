"""The hybrid decoders (Qwen3-Next, Qwen3.5 dense and MoE: gated DeltaNet layers beside gated attention) against
``transformers``: the DeltaNet kernels, fp32 logits past one DeltaNet chunk on padded rows, greedy tokens on both
rollout engines (refilled slots, chunked prefill), the export round trip, the PEFT adapter, the published
``Qwen3_5ForConditionalGeneration`` checkpoint and the MoE variants' router loss."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import torchlike
from tests import tiny
from tests.helpers.models import randomize_lora_, valid_max_diff
from torchlike.adapters.model import linear_attention
from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest, StaticEngine
from torchlike.adapters.rollout.sampling import init_cache
from torchlike.adapters.rollout.sampling_settings import SamplingSettings
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.testing import tiny_config

LENGTH = 80  # past transformers' DeltaNet chunk (64), so the state crosses a chunk boundary
NEW_TOKENS = 8


def long_padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three rows of 80 positions: right-padded (70 tokens), left-padded (71), full."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, tiny.VOCAB, size=(3, LENGTH))
    mask = np.ones((3, LENGTH), np.int64)
    mask[0, 70:] = 0
    mask[1, :9] = 0
    ids[mask == 0] = 0
    return ids, mask, np.maximum(np.cumsum(mask, axis=-1) - 1, 0)


def test_the_chunked_and_recurrent_gated_delta_rules_equal_transformers_torch_kernels():
    from transformers.models.qwen3_next import modeling_qwen3_next as reference

    rng = np.random.default_rng(0)
    batch, length, heads, key_dim, value_dim = 2, 150, 3, 8, 6
    q, k = (rng.standard_normal((batch, length, heads, key_dim)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((batch, length, heads, value_dim)).astype(np.float32)
    g = -np.abs(rng.standard_normal((batch, length, heads))).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.standard_normal((batch, length, heads))))).astype(np.float32)
    state = rng.standard_normal((batch, heads, key_dim, value_dim)).astype(np.float32) * 0.1
    expected, expected_state = reference.torch_chunk_gated_delta_rule(
        *map(torch.tensor, (q, k, v, g, beta)), initial_state=torch.tensor(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    q, k = linear_attention.l2_normalise(jnp.asarray(q)), linear_attention.l2_normalise(jnp.asarray(k))
    for rule in (linear_attention.chunk_gated_delta_rule, linear_attention.recurrent_gated_delta_rule):
        out, final = rule(q, k, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(state))
        np.testing.assert_allclose(np.asarray(out), expected.numpy(), atol=2e-5, err_msg=rule.__name__)
        np.testing.assert_allclose(np.asarray(final), expected_state.numpy(), atol=2e-5, err_msg=rule.__name__)


def test_the_causal_convolution_continues_across_calls_as_one_call():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 20, 5)).astype(np.float32)
    weight = rng.standard_normal((5, 4)).astype(np.float32)
    expected = torch.nn.functional.conv1d(torch.tensor(x).transpose(1, 2), torch.tensor(weight)[:, None, :],
                                          padding=3, groups=5)[:, :, :20].transpose(1, 2).numpy()
    whole, _ = linear_attention.causal_conv1d(jnp.asarray(x), jnp.asarray(weight), None, None)
    first, state = linear_attention.causal_conv1d(jnp.asarray(x[:, :13]), jnp.asarray(weight), None, None)
    second, _ = linear_attention.causal_conv1d(jnp.asarray(x[:, 13:]), jnp.asarray(weight), None, state)
    np.testing.assert_allclose(np.asarray(whole), expected, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), expected, atol=1e-5)


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    loaded = {}

    def reference(case: str):
        if case not in loaded:
            path = tiny_checkpoints.path(case)
            loaded[case] = path, transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
        return loaded[case]

    return reference


@pytest.mark.parametrize("case", tiny.HYBRID_CASES)
def test_fp32_logits_equal_transformers_past_one_deltanet_chunk_on_padded_rows(case, references):
    path, reference = references(case)
    ids, mask, positions = long_padded_batch()
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ours = np.asarray(model(ids, attention_mask=mask).logits)
    assert valid_max_diff(ours, tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4


def test_the_gated_attention_and_the_offset_norms_change_the_logits_the_parity_test_checks(tiny_checkpoints):
    """The parity test would fail if the attention output gates or the ``1 + weight`` norms were wrong."""
    from torchlike.adapters.model import native_decoder

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen3_5"), dtype="float32")
    ids, mask, _ = long_padded_batch()
    honoured = np.asarray(model(ids, attention_mask=mask).logits)
    for layer in model.module.layers:  # each head's gate columns zeroed: every gate a constant sigmoid(0)
        if hasattr(layer, "attn"):
            spec, kernel = layer.attn.spec, layer.attn.q_proj.kernel
            per_head = kernel.get_value().reshape(spec.hidden_size, spec.num_heads, 2, spec.head_dim)
            kernel.set_value(per_head.at[:, :, 1].set(0.0).reshape(kernel.shape))
    assert valid_max_diff(np.asarray(model(ids, attention_mask=mask).logits), honoured, mask) > 1e-2
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen3_5"), dtype="float32")
    norms = [norm for norm in model.module.iter_modules() if isinstance(norm[1], native_decoder.Norm)]
    for _, norm in norms:
        norm.offset = 0.0
    assert valid_max_diff(np.asarray(model(ids, attention_mask=mask).logits), honoured, mask) > 1e-2


def _hf_greedy(reference, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", tiny.HYBRID_CASES)
def test_greedy_tokens_equal_transformers_on_both_engines_with_refilled_slots_and_chunked_prefill(case, tmp_path):
    reference, model = tiny.wandering_model(case, tmp_path)
    reference.generation_config.eos_token_id = model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny.VOCAB, size=length).tolist() for length in (5, 13, 11)]
    expected = [_hf_greedy(reference, prompt) for prompt in prompts]

    width = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):  # left-padded, as generate takes them
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    static = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert np.asarray(static)[:, width:].tolist() == expected

    # Two slots for three prompts (a slot is refilled); prompts of 13 and 11 tokens prefilled in chunks of 6.
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=2, page_size=4, max_num_batched_tokens=6,
                                                         decode_steps=2))
    outputs = engine.generate([RolloutRequest(prompt, NEW_TOKENS) for prompt in prompts], SamplingSettings())
    assert [output.token_ids[0].tolist() for output in outputs] == expected
    assert sum(1 for request, _, _ in engine.stats.prefill_chunks if request == 1) > 1
    assert max(live for live, _ in engine.stats.decode_rows) == 2  # both slots decoded together, then one refilled


def test_sampled_completions_of_the_paged_engine_equal_the_static_ones(tmp_path):
    """Prompt sharing: each request's state after prefill is copied to its completions, which then diverge."""
    _, model = tiny.wandering_model("qwen3_5", tmp_path)
    rng = np.random.default_rng(2)
    requests = [RolloutRequest(rng.integers(3, tiny.VOCAB, size=length).tolist(), NEW_TOKENS, num_samples=3,
                               seed=3 + index) for index, length in enumerate((6, 17, 9))]
    settings = SamplingSettings(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    paged = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4, max_num_batched_tokens=8),
                        eos_token_ids=[7])
    static = StaticEngine(model.module, eos_token_ids=[7])
    for ours, theirs in zip(paged.generate(requests, settings), static.generate(requests, settings), strict=True):
        assert [row.tolist() for row in ours.token_ids] == [row.tolist() for row in theirs.token_ids]
        # Chunked prefill feeds later chunks token by token (the recurrent form), the static sampler in one chunk.
        np.testing.assert_allclose(np.concatenate(ours.logprobs), np.concatenate(theirs.logprobs), atol=1e-4)
        assert len({tuple(row.tolist()) for row in ours.token_ids}) > 1  # the completions diverged


def test_the_recurrent_layers_cache_a_fixed_size_state_not_a_growing_one(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen3_5"), dtype="float32")
    short, long = init_cache(model.module, 2, 16), init_cache(model.module, 2, 4096)
    linear = [index for index, kind in enumerate(model.module.config.layer_types) if kind == "linear_attention"]
    for index in linear:
        assert set(short[f"layer_{index}"]) == {"conv", "recurrent", "end_index"}
        for part in ("conv", "recurrent"):
            assert short[f"layer_{index}"][part].shape == long[f"layer_{index}"][part].shape
    assert long["layer_1"]["k"].shape[1] == 4096  # the attention layer's cache grows with the length


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", tiny.HYBRID_CASES)
def test_save_pretrained_round_trips_bit_exact_and_transformers_reloads_it(case, dtype, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(case, dtype=dtype)
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype=str(dtype).removeprefix("torch."))
    model.save_pretrained(tmp_path)
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, output_loading_info=True,
                                                                       attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if dtype == torch.float32:
        ids, mask, positions = tiny.padded_batch()
        ours = np.asarray(model(ids, attention_mask=mask).logits)
        assert valid_max_diff(ours, tiny.hf_logits(reloaded.eval(), ids, mask, positions), mask) <= 1e-4


# The recurrent mixer's projections the adapter reaches, where they are not Qwen3.5's in_proj_z and out_proj (PEFT
# refuses LoRA on Nemotron-H's Mamba-2 out_proj).
RECURRENT_PROJECTIONS = {"qwen3_next": {"in_proj_qkvz", "out_proj"}, "lfm2": {"in_proj", "out_proj"},
                         "nemotron_h": {"in_proj"}}


@pytest.mark.parametrize("case", tiny.HYBRID_CASES)
def test_the_peft_adapter_loads_in_peft_with_the_same_logits(case, references, tmp_path):
    path, _ = references(case)
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
                           LoraConfig(r=4, lora_alpha=16, target_modules=tiny.lora_targets(case),
                                      task_type="CAUSAL_LM"))
    randomize_lora_(model)
    model.save_pretrained(tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager"),
        tmp_path / "adapter").eval()
    adapted = {name.removesuffix(".lora_A").rsplit(".", 1)[-1] for name, _ in reference.named_modules()
               if name.endswith("lora_A")}
    assert RECURRENT_PROJECTIONS.get(case, {"in_proj_z", "out_proj"}) <= adapted
    ids, mask, positions = tiny.padded_batch()
    ours = np.asarray(model(ids, attention_mask=mask).logits)
    assert valid_max_diff(ours, tiny.hf_logits(reference, ids, mask, positions), mask) <= 1e-4


def test_lora_on_qwen3_next_mlp_names_is_refused_as_peft_would_adapt_the_fused_experts(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen3_next"), dtype="float32")
    with pytest.raises(ValueError, match="target_parameters"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], task_type="CAUSAL_LM"))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny ``Qwen3_5ForConditionalGeneration`` as Qwen publishes Qwen3.5 (text decoder under
    ``model.language_model.``, a vision tower under ``model.visual.``), every parameter random."""
    config = transformers.Qwen3_5Config(
        text_config=tiny_config("qwen3_5").to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    # Every parameter random, as random_model(every_parameter=True) draws a causal LM's (norms around 1).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(1.0 + 0.2 * torch.randn(parameter.shape) if "norm" in name
                            else 0.08 * torch.randn(parameter.shape))
    path = tmp_path_factory.mktemp("qwen3_5_published")
    model.save_pretrained(path)
    return path, model


def test_the_published_qwen3_5_loads_generates_text_and_writes_its_vision_weights_back(published, tmp_path):
    path, reference = published
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ids, mask, positions = long_padded_batch()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert valid_max_diff(np.asarray(model(ids, attention_mask=mask).logits), expected, mask) <= 1e-4

    prompt = ids[2:, :12]
    with torch.no_grad():
        greedy = reference.generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    ours = model.generate(prompt, np.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert np.asarray(ours).tolist() == greedy.tolist()

    model.save_pretrained(tmp_path)
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(exported) == sorted(original) and any(key.startswith("model.visual.") for key in original)
    for key, value in original.items():
        assert np.array_equal(exported[key], value), key
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3_5ForConditionalGeneration"


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_moe"])
def test_the_moe_router_loss_equals_transformers_aux_loss(case, tiny_checkpoints):
    from torchlike.adapters.families import family_for_config
    from torchlike.adapters.losses.router import run_with_router_loss
    from torchlike.adapters.model.tunix_model import causal_inputs

    path = tiny_checkpoints.path(case)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask, _ = long_padded_batch()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             output_router_logits=True).aux_loss.item()
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    family = family_for_config(model.config)
    tokens, positions, attention = causal_inputs(ids, mask)
    _, aux = run_with_router_loss(family, lambda module: family.forward(module, tokens, positions, attention),
                                  model.module, jnp.asarray(mask), 1.0)
    np.testing.assert_allclose(float(aux), expected, rtol=1e-5)


def test_sft_trains_the_published_qwen3_5_on_text_and_leaves_its_vision_weights_as_they_were(published, tokenizer_dir,
                                                                                             tmp_path):
    from tests.helpers.data import prompt_completion_data
    from torchlike.trl import SFTConfig, SFTTrainer

    path, _ = published
    trainer = SFTTrainer(model=str(path), args=SFTConfig(output_dir=str(tmp_path / "run"), max_steps=3,
                                                         per_device_train_batch_size=2, learning_rate=1e-3,
                                                         max_length=32, logging_steps=1, report_to="none",
                                                         save_strategy="no"),
                         train_dataset=prompt_completion_data(6),
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(np.isfinite(losses))
    trainer.save_model(tmp_path / "trained")
    original, trained = load_file(path / "model.safetensors"), load_file(tmp_path / "trained" / "model.safetensors")
    assert sorted(trained) == sorted(original)
    for key, value in original.items():
        if key.startswith("model.visual."):
            assert np.array_equal(trained[key], value), key
    moved = [key for key in original if key.startswith("model.language_model.layers.0.linear_attn.")
             and not np.array_equal(trained[key], original[key])]
    assert moved  # the text decoder's DeltaNet layer trained


def test_the_published_qwen3_5_moe_loads_with_transformers_logits_and_round_trips_bit_exact(tmp_path):
    config = transformers.Qwen3_5MoeConfig(
        text_config=tiny_config("qwen3_5_moe").to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2))
    torch.manual_seed(1)
    reference = transformers.Qwen3_5MoeForConditionalGeneration._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.copy_(1.0 + 0.2 * torch.randn(parameter.shape) if "norm" in name
                            else 0.08 * torch.randn(parameter.shape))
    reference.eval().save_pretrained(tmp_path / "published")
    model = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype="float32")
    ids, mask, _ = tiny.padded_batch()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert valid_max_diff(np.asarray(model(ids, attention_mask=mask).logits), expected, mask) <= 1e-4
    model.save_pretrained(tmp_path / "exported")
    original = load_file(tmp_path / "published" / "model.safetensors")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert any(".mlp.experts.0." in key for key in original)
    assert any(key.startswith("model.visual.") for key in original)
    for key, value in original.items():
        assert np.array_equal(exported[key], value), key
