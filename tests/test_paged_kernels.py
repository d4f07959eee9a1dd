"""Paged attention that reads pages in place (``PagedEngineConfig.attention``, ``adapters/model/paged_attention.py``):
JAX's Pallas paged-attention kernels for GPUs and TPUs, run here in Pallas' interpreter on the CPU.

The kernels' attention equals dense attention over the same keys (soft-capped and windowed too); the paged engine on
the GPU kernel draws the same tokens and log-probs as on the gathered page view, sampled (and greedy), for a
sliding-window family, a hybrid (recurrent) one and Tunix's Qwen2, Qwen3, Llama 3, Gemma 2, Gemma 3 and Gemma 4, with
prompts prefilled in chunks through the kernel; a decoder the kernels cannot serve is refused by name; and the backend
picks its own kernel by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.gemma4 import model as tunix_gemma4

import torchlike
import torchlike.peft
from tests import tiny
from torchlike.adapters.model import paged_attention
from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest
from torchlike.adapters.rollout.sampling_settings import SamplingSettings

SAMPLING = SamplingSettings(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3)


def dense_attention(q, keys, values, lengths, *, window=None, soft_cap=None):
    """Row ``r``'s query over its first ``lengths[r]`` keys ``[R, S, K, D]`` (the last ``window`` of them), numpy."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    out = np.zeros_like(q)
    for row in range(rows):
        start = 0 if window is None else max(0, lengths[row] - window)
        k, v = keys[row, start:lengths[row]], values[row, start:lengths[row]]
        for head in range(heads):
            group = head // (heads // kv_heads)
            logits = k[:, group] @ q[row, head]
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            weights = np.exp(logits - logits.max())
            out[row, head] = (weights / weights.sum()) @ v[:, group]
    return out


@pytest.mark.parametrize(("kind", "tolerance"), [("pallas_gpu", 1e-5), ("pallas_tpu", 3e-2)])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (None, 20.0), (5, None)])
def test_the_kernels_attend_over_each_rows_pages_as_dense_attention_does(kind, tolerance, window, soft_cap):
    # The TPU kernel's interpreter multiplies as a TPU does (bfloat16 passes for float32 operands): ~1e-2 apart.
    rng = np.random.default_rng(0)
    rows, heads, kv_heads, dim, pages, page_size, width = 3, 4, 2, 16, 24, 4, 4
    lengths = np.array([3, 9, 14], np.int32)  # tokens before the fed one
    page_table = rng.permutation(np.arange(1, pages))[:rows * width].reshape(rows, width).astype(np.int32)
    k_pages = rng.normal(size=(kv_heads, pages, page_size, dim)).astype(np.float32)
    v_pages = rng.normal(size=(kv_heads, pages, page_size, dim)).astype(np.float32)
    q, k, v = (rng.normal(size=(rows, 1, n, dim)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    page = page_table[np.arange(rows), lengths // page_size]
    cache = {"k_pages": jnp.asarray(k_pages), "v_pages": jnp.asarray(v_pages), "page_table": jnp.asarray(page_table),
             "kv_lengths": jnp.asarray(lengths + 1), "write_page": jnp.asarray(page),
             "write_offset": jnp.asarray(lengths % page_size), "end_index": jnp.zeros(rows, jnp.int32)}
    with paged_attention.using(kind, interpret=True):
        out, written = jax.jit(lambda q, k, v, cache: paged_attention.attend(
            q, k, v, cache, scale=0.5, window=window, soft_cap=soft_cap))(q, k, v, cache)
    # The fed token's key and value are in its page, nothing else changed.
    expected_k = k_pages.copy()
    expected_k[:, page, lengths % page_size] = k[:, 0].swapaxes(0, 1)
    np.testing.assert_array_equal(np.asarray(written["k_pages"]), expected_k)
    dense_k = expected_k[:, page_table].transpose(1, 2, 3, 0, 4).reshape(rows, width * page_size, kv_heads, dim)
    expected_v = v_pages.copy()
    expected_v[:, page, lengths % page_size] = v[:, 0].swapaxes(0, 1)
    dense_v = expected_v[:, page_table].transpose(1, 2, 3, 0, 4).reshape(rows, width * page_size, kv_heads, dim)
    expected = dense_attention(q[:, 0] * 0.5, dense_k, dense_v, lengths + 1, window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out)[:, 0], expected, atol=tolerance)


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    """Tiny float32 models by case, loaded once."""
    loaded = {}

    def load(case):
        if case not in loaded:
            loaded[case] = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32")
        return loaded[case]

    return load


def run(model, attention, settings, chunk=2048):
    rng = np.random.default_rng(0)
    requests = [RolloutRequest(rng.integers(3, tiny.VOCAB, size=length).tolist(), 10, num_samples=2, seed=3)
                for length in (5, 17, 9, 3)]
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4, attention=attention,
                                                         max_num_batched_tokens=chunk))
    outputs = engine.generate(requests, settings)
    tokens = [row.tolist() for output in outputs for row in output.token_ids]
    return engine, tokens, [row for output in outputs for row in output.logprobs]


# Mistral: a sliding window on every layer (its window-sized page view); Qwen3.5: gated DeltaNet layers beside the
# kernel's attention layers; Qwen2 (biases), Qwen3 (q/k norms), Llama 3, Gemma 2 (soft-capped logits, query scalar,
# sliding and global layers), Gemma 3 (q/k norms, a rope per layer type) and Gemma 4 (k/v norms, per-layer inputs, its
# last two layers reading the first two's pages and writing none; experts and full layers whose keys are their values):
# Tunix's decoders, their attention reading the pages too.
@pytest.mark.parametrize("case", ["mistral", "qwen3_5", "qwen2", "qwen3", "llama3", "gemma2", "gemma3", "gemma4_ple",
                                  "gemma4_moe"])
def test_the_gpu_kernel_draws_the_gathered_views_tokens(models, case):
    model = models(case)
    # Sampled (with the penalty's memory); the 17-token prompt prefilled in chunks of 6 through the kernel on the
    # hybrid (its chunks continue the recurrent state too), whole prompts on the others; greedy on one family.
    runs = {"qwen3_5": ((SAMPLING, 6),), "llama3": ((SAMPLING, 2048), (SamplingSettings(), 2048))}
    for settings, chunk in runs.get(case, ((SAMPLING, 2048),)):
        _, gathered, gathered_logprobs = run(model, "gather", settings, chunk)
        engine, kernel, kernel_logprobs = run(model, "pallas_gpu", settings, chunk)
        assert engine.kernel == {"attention": "pallas_gpu", "interpret": True}
        assert kernel == gathered
        for ours, theirs in zip(kernel_logprobs, gathered_logprobs, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)
        if chunk == 6:  # the 17-token prompt was continued through the kernel in chunks
            assert max(tokens for _, tokens, _ in engine.stats.prefill_chunks) <= 6
            assert len(engine.stats.prefill_chunks) > 4


def test_the_kernel_pool_puts_the_heads_first(models):
    engine, _, _ = run(models("mistral"), "pallas_gpu", SAMPLING)
    pool = engine._take_pool(engine._pool_pages)
    layer = next(iter(pool.values()))["k"]
    assert layer.shape[0] == models("mistral").module.config.num_kv_heads
    assert layer.shape[2] == 4  # page size
    engine._keep_pool(pool, engine._pool_pages)


def test_a_decoder_the_kernels_cannot_serve_is_refused_by_name(models):
    # A Tunix decoder with a layer on Tunix's own attention (a dense KV cache only): refused when asked for, the
    # gathered view by default.
    module = models("gemma4_ple").module
    attention = module.layers[0].attn
    served = type(attention)
    attention.__class__ = tunix_gemma4.Attention
    try:
        with pytest.raises(NotImplementedError, match=r"Gemma4Decoder's attention \(Tunix's\).*attention='gather'"):
            PagedEngine(module, PagedEngineConfig(attention="pallas_gpu"))
        assert PagedEngine(module, PagedEngineConfig()).kernel["attention"] == "gather"
    finally:
        attention.__class__ = served
    with pytest.raises(NotImplementedError, match=r"attention sinks"):
        PagedEngine(models("gpt_oss").module, PagedEngineConfig(attention="pallas_tpu"))
    with pytest.raises(ValueError, match=r"PagedEngineConfig.attention must be one of"):
        PagedEngineConfig(attention="flash")


def test_each_backend_picks_its_own_kernel_and_the_cpu_keeps_the_gather():
    assert paged_attention.default_attention("cpu") == "gather"
    assert paged_attention.default_attention("gpu") == "pallas_gpu"
    assert paged_attention.default_attention("tpu") == "pallas_tpu"
    assert paged_attention.interpreted("pallas_gpu", "cpu") and not paged_attention.interpreted("pallas_gpu", "gpu")
    assert jax.default_backend() == "cpu" and paged_attention.default_attention() == "gather"


@pytest.mark.parametrize("case", ["qwen3", "mistral"])  # a Tunix decoder's attention and the native decoder's
def test_a_lora_adapted_model_reads_its_pages_through_the_kernel_with_its_adapter(tiny_checkpoints, case):
    model = torchlike.peft.get_peft_model(
        torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32"),
        torchlike.peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    rng = np.random.default_rng(0)
    model.load_state_dict({name: rng.normal(0, 0.5, value.shape).astype(np.float32)
                           for name, value in model.state_dict().items() if name.endswith("lora_b")}, strict=False)
    _, gathered, gathered_logprobs = run(model, "gather", SAMPLING)
    _, kernel, kernel_logprobs = run(model, "pallas_gpu", SAMPLING)
    assert kernel == gathered
    for ours, theirs in zip(kernel_logprobs, gathered_logprobs, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=2e-5)
    base = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path(case), dtype="float32")
    assert run(base, "gather", SAMPLING)[1] != gathered  # the adapter changes the tokens
