"""The paged rollout engine (``torchlike.adapters.rollout``): greedy tokens equal ``transformers.generate`` for every
family with slots refilled mid-run and with prompts prefilled in chunks, sampled tokens independent of slots, request
order, page size and prefill chunk size (and equal to the static sampler's), one prefill per prompt group, long
prompts prefilled chunk by chunk between decode calls, pages that track the live tokens, a pool smaller than a
static batch would need, completions preempted when the pool runs out and resumed token for token, a pool sized
from the device's free memory, and async scheduling (each decode call dispatched before the last one is read) giving
the synchronous tokens and log-probs bit for bit."""

from __future__ import annotations

import logging
from dataclasses import replace

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import torchlike
from tests import tiny
from torchlike.adapters.lora import runtime as lora_runtime
from torchlike.adapters.rollout import (
    EngineContext,
    EngineStats,
    PagedEngine,
    PagedEngineConfig,
    RolloutRequest,
    StaticEngine,
    build_engine,
    paged,
)
from torchlike.adapters.rollout.pages import pages_within_memory
from torchlike.adapters.rollout.sampling import cache_size
from torchlike.adapters.rollout.sampling_settings import SamplingSettings
from torchlike.adapters.runtime import tracing
from torchlike.adapters.runtime.tracing import TRACE_COUNTS
from torchlike.trl import GRPOConfig

FAMILIES = ["qwen2", "qwen3", "llama3", "gemma2", "gemma3", "gemma4", "qwen3_moe"]
PROMPT_LENGTHS = (5, 17, 9, 30, 3)
NEW_TOKENS = 10
SAMPLING = SamplingSettings(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3)


def prompts(lengths=PROMPT_LENGTHS, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, tiny.VOCAB, size=length).tolist() for length in lengths]


def hf_greedy(reference, prompt: list[int], eos: int | None) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def wandering_qwen2(tmp_path_factory):
    """A tiny Qwen2 whose weights are scaled up so sampled and greedy tokens wander (not one token repeated)."""
    return tiny.wandering_qwen2(tmp_path_factory.mktemp("wandering_qwen2"))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_with_slots_refilled_early_end_and_chunked_prefill(tiny_checkpoints, family):
    path = tiny_checkpoints.path(family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    reference.generation_config.eos_token_id = None
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    cases = prompts()
    free_running = [hf_greedy(reference, prompt, None) for prompt in cases]
    # An end token the first completion meets half-way, so at least one completion ends early.
    eos = free_running[0][NEW_TOKENS // 2]
    expected = [hf_greedy(reference, prompt, eos) for prompt in cases]
    # Whole prompts, then (for the families with sliding windows, and one without) chunks of 6 tokens: shorter than
    # the prompts of 9, 17 and 30 tokens and than Gemma 2/3's sliding window (8), so a window spans chunks.
    for chunk in (2048, 6) if family in ("qwen2", "gemma2", "gemma3", "gemma4") else (2048,):
        engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=2, page_size=4, max_num_batched_tokens=chunk),
                             eos_token_ids=[eos])
        outputs = engine.generate([RolloutRequest(prompt, NEW_TOKENS) for prompt in cases], SamplingSettings())
        got = [output.token_ids[0].tolist() for output in outputs]
        assert got == [row[:len(ours)] for row, ours in zip(expected, got, strict=True)]
        assert [len(row) for row in got] == [row.index(eos) + 1 if eos in row else NEW_TOKENS for row in expected]
        assert outputs[0].ended == [True]
        assert engine.stats.prefills == len(cases)  # more requests (5) than slots (2): slots were refilled
        chunks = engine.stats.prefill_chunks
        assert [sum(tokens for request, tokens, _ in chunks if request == index) for index in range(len(cases))] == \
            [len(prompt) for prompt in cases]
        assert max(tokens for _, tokens, _ in chunks) <= chunk


def test_sampled_tokens_do_not_depend_on_slots_order_or_page_size(wandering_qwen2):
    _, model = wandering_qwen2
    requests = [RolloutRequest(prompt, NEW_TOKENS, num_samples=3, seed=11 + index)
                for index, prompt in enumerate(prompts())]
    few = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=2, page_size=4), eos_token_ids=[7])
    many = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=16, page_size=8), eos_token_ids=[7])
    first = few.generate(requests, SAMPLING)
    second = many.generate(requests[::-1], SAMPLING)[::-1]
    for one, other in zip(first, second, strict=True):
        assert [row.tolist() for row in one.token_ids] == [row.tolist() for row in other.token_ids]
        np.testing.assert_allclose(np.concatenate(one.logprobs), np.concatenate(other.logprobs), atol=1e-5)
    # The samples of one prompt differ from each other (each has its own stream).
    assert len({tuple(row.tolist()) for row in first[1].token_ids}) > 1


def test_sampled_tokens_do_not_depend_on_the_prefill_chunk_size(wandering_qwen2):
    _, model = wandering_qwen2
    requests = [RolloutRequest(prompt, NEW_TOKENS, num_samples=2, seed=3 + index)
                for index, prompt in enumerate(prompts())]
    results = []
    for chunk in (64, 4):  # whole prompts; chunks of 4 (every prompt but the last one of 3 tokens chunked)
        engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4,
                                                             max_num_batched_tokens=chunk), eos_token_ids=[7])
        results.append(engine.generate(requests, SAMPLING))
    whole = results[0]
    for chunked in results[1:]:
        for one, other in zip(whole, chunked, strict=True):
            assert [row.tolist() for row in one.token_ids] == [row.tolist() for row in other.token_ids]
            np.testing.assert_allclose(np.concatenate(one.logprobs), np.concatenate(other.logprobs), atol=1e-5)


def test_a_long_prompt_is_prefilled_in_chunks_with_decodes_between_them(wandering_qwen2):
    _, model = wandering_qwen2
    short, long = prompts((5, 30))
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=1,
                                                         max_num_batched_tokens=8))
    engine.generate([RolloutRequest(short, NEW_TOKENS, num_samples=2), RolloutRequest(long, NEW_TOKENS)], SAMPLING)
    chunks = [(tokens, decode_calls) for request, tokens, decode_calls in engine.stats.prefill_chunks
              if request == 1]
    assert [tokens for tokens, _ in chunks] == [3, 8, 8, 8, 3]  # the first round's 8 tokens start with the short one
    decode_calls = [calls for _, calls in chunks]
    # The short prompt's completions advanced between every two chunks of the long prompt.
    assert all(later > earlier for earlier, later in zip(decode_calls, decode_calls[1:], strict=False))


def test_paged_engine_equals_the_static_batch_sampler(wandering_qwen2):
    _, model = wandering_qwen2
    requests = [RolloutRequest(prompt, NEW_TOKENS, num_samples=2, seed=3 + index)
                for index, prompt in enumerate(prompts())]
    paged = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4), eos_token_ids=[7])
    static = StaticEngine(model.module, eos_token_ids=[7])
    for ours, theirs in zip(paged.generate(requests, SAMPLING), static.generate(requests, SAMPLING), strict=True):
        assert [row.tolist() for row in ours.token_ids] == [row.tolist() for row in theirs.token_ids]
        assert ours.ended == theirs.ended
        np.testing.assert_allclose(np.concatenate(ours.logprobs), np.concatenate(theirs.logprobs), atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async_scheduling"])
def test_each_program_compiles_once_per_trace_and_a_second_call_compiles_nothing(wandering_qwen2, async_scheduling):
    """The pool and the penalty memory start committed to the device, as the programs' outputs that replace them
    are: an uncommitted first version compiled the programs that take it a second time, on the same trace (the
    pool's within the next call). So do a decode call's row arguments, which a call dispatched ahead takes from the
    call before it."""
    _, model = wandering_qwen2
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=3,
                                                         async_scheduling=async_scheduling), eos_token_ids=[7])
    requests = [RolloutRequest(prompt, NEW_TOKENS - 1, num_samples=2, seed=5) for prompt in prompts()]
    lowered = []

    def listen(event: str, duration: float, fun_name: str = "", **_: object) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and fun_name.endswith("_program)"):
            lowered.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        traces = TRACE_COUNTS["generate"]
        engine.generate(requests, SAMPLING)
        assert len(lowered) == TRACE_COUNTS["generate"] - traces, lowered
        lowered.clear()
        engine.generate(requests, SAMPLING)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == []
    assert (engine.stats.decode_calls_ahead > 0) == async_scheduling


def test_a_prompt_group_is_prefilled_once_not_once_per_completion(wandering_qwen2):
    _, model = wandering_qwen2
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4))
    outputs = engine.generate([RolloutRequest(prompt, 6, num_samples=8, seed=1) for prompt in prompts()[:3]],
                              SAMPLING)
    assert [len(output.token_ids) for output in outputs] == [8, 8, 8]
    assert engine.stats.prefills == 3  # not 24


def test_pages_in_use_track_the_live_tokens_and_are_all_freed(wandering_qwen2):
    _, model = wandering_qwen2
    page_size, slots, decode_steps = 4, 4, 8
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=slots, page_size=page_size,
                                                         decode_steps=decode_steps), eos_token_ids=[7])
    requests = [RolloutRequest(prompt, NEW_TOKENS, num_samples=2, seed=index)
                for index, prompt in enumerate(prompts())]
    engine.generate(requests, SAMPLING)
    stats = engine.stats
    in_use = np.array(stats.pages_in_use_per_step)
    live = np.array(stats.live_tokens_per_step)
    assert (in_use * page_size >= live).all()
    # Beyond the live tokens: per live completion its partly filled page and the pages its next decode call may
    # fill, and per prompt shared by live completions its partly filled page.
    ahead = 1 + -(-(decode_steps - 1) // page_size)
    assert (in_use * page_size - live < (slots * ahead + slots) * page_size).all()
    assert stats.peak_pages_in_use < stats.pages
    # Completions of different length: the pages held fall as completions end.
    assert in_use[-1] < in_use.max()
    # As they end, the decode program shrinks (the CPU's floor is one row): never more than twice the live rows.
    assert engine.min_decode_rows == paged.min_decode_rows("cpu") == 1
    assert all(live <= rows < 2 * live for live, rows in stats.decode_rows)
    assert {rows for _, rows in stats.decode_rows} >= {slots, slots // 2}


def test_on_an_accelerator_the_decode_program_shrinks_down_to_eight_rows_and_short_rows_share_one_view(
        wandering_qwen2, caplog):
    """A long tail of few completions runs on the power of two rows that holds them, never fewer than a GPU's or
    TPU's floor of 8 (the floor set here on the CPU's engine); rows of fewer than ``paged.MIN_VIEW`` tokens gather
    that many columns, so the tail compiles one decode program per row count."""
    _, model = wandering_qwen2
    assert paged.min_decode_rows("tpu") == paged.min_decode_rows("gpu") == 8
    slots = 32
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=slots, page_size=4, decode_steps=4))
    engine.min_decode_rows = paged.min_decode_rows("tpu")
    # Completions of 1 to 24 tokens, none ending early (no eos): the live count falls at known calls.
    requests = [RolloutRequest(prompt, 1 + index * 23 // 19, seed=index)
                for index, prompt in enumerate(prompts((4, 9, 6, 3) * 5))]
    with caplog.at_level(logging.INFO, logger=tracing.__name__):
        outputs = engine.generate(requests, SAMPLING)
    assert [len(output.token_ids[0]) for output in outputs] == [request.max_new_tokens for request in requests]
    rows_run = [rows for _, rows in engine.stats.decode_rows]
    assert all(rows == max(8, 1 << (live - 1).bit_length()) for live, rows in engine.stats.decode_rows)
    assert rows_run[0] == slots and rows_run[-1] == 8
    assert min(live for live, _ in engine.stats.decode_rows) < 4
    # Rows of 4 to 33 tokens: one view of paged.MIN_VIEW (64) columns, so one decode program per row count.
    decode_programs = [record.getMessage() for record in caplog.records
                       if "engine program decode," in record.getMessage()]
    assert len(decode_programs) == len(set(rows_run)) == 3, decode_programs
    assert all(f"view {paged.MIN_VIEW}," in message for message in decode_programs), decode_programs


def test_prompts_shorter_than_64_tokens_share_one_prefill_program_with_the_tokens_of_their_own_buckets(
        wandering_qwen2, monkeypatch):
    """Prompts of 5 and 20 tokens (the 16- and 32-token buckets) prefill separately in programs of
    ``paged.MIN_PREFILL_WIDTH`` columns, and draw the tokens they draw prefilled alone at their own bucket."""
    _, model = wandering_qwen2
    widths = []
    prefill = paged._prefill

    def recording(programs, module, tables, pool, prompt_ids, *args):
        widths.append(prompt_ids.shape[1])
        return prefill(programs, module, tables, pool, prompt_ids, *args)

    requests = [RolloutRequest(prompt, 6, seed=index) for index, prompt in enumerate(prompts((5, 20)))]
    config = PagedEngineConfig(max_num_seqs=2, page_size=4, max_prefill_requests=1)
    monkeypatch.setattr(paged, "_prefill", recording)
    shared = PagedEngine(model.module, config).generate(requests, SAMPLING)
    assert widths == [paged.MIN_PREFILL_WIDTH] * 2 == [64, 64]
    monkeypatch.setattr(paged, "MIN_PREFILL_WIDTH", 1)  # each prompt at its own bucket: 16 and 32 columns
    alone = PagedEngine(model.module, config).generate(requests, SAMPLING)
    assert widths[2:] == [16, 32]
    assert [[np.asarray(tokens).tolist() for tokens in output.token_ids] for output in shared] == \
        [[np.asarray(tokens).tolist() for tokens in output.token_ids] for output in alone]


def test_a_pool_smaller_than_the_static_batch_runs_the_workload(wandering_qwen2):
    _, model = wandering_qwen2
    cases = prompts((20, 24, 18, 22, 19, 23, 21, 17))
    requests = [RolloutRequest(prompt, NEW_TOKENS, num_samples=4, seed=index) for index, prompt in enumerate(cases)]
    static_tokens = len(cases) * 4 * cache_size(max(map(len, cases)), NEW_TOKENS)  # 32 rows x 48 slots
    budget = 160  # tokens: 10 pages of 16, a tenth of the static batch's 1,536
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=16, kv_cache_tokens=budget),
                         eos_token_ids=[7])
    outputs = engine.generate(requests, SAMPLING)
    assert budget * 9 < static_tokens
    assert engine.stats.peak_pages_in_use * 16 <= budget
    expected = StaticEngine(model.module, eos_token_ids=[7]).generate(requests, SAMPLING)
    assert [[row.tolist() for row in output.token_ids] for output in outputs] == \
        [[row.tolist() for row in output.token_ids] for output in expected]


# Completions longer than their prompts in a pool of 5 pages of 4 tokens: a seventh of the pool the engine sizes
# for them unconstrained, a third of what that run holds at its peak, and as much as one completion needs alone.
SHORT_PROMPTS = (3, 5, 4, 6)
LONG_COMPLETIONS = 11
TIGHT_POOL = PagedEngineConfig(max_num_seqs=4, page_size=4, kv_cache_tokens=20)


def long_completions() -> list[RolloutRequest]:
    return [RolloutRequest(prompt, LONG_COMPLETIONS, num_samples=4, seed=3 + index)
            for index, prompt in enumerate(prompts(SHORT_PROMPTS))]


def assert_same_completions(outputs, expected) -> None:
    for ours, theirs in zip(outputs, expected, strict=True):
        assert [row.tolist() for row in ours.token_ids] == [row.tolist() for row in theirs.token_ids]
        assert ours.ended == theirs.ended
        np.testing.assert_allclose(np.concatenate(ours.logprobs), np.concatenate(theirs.logprobs), atol=1e-5)


@pytest.mark.parametrize("settings", [SamplingSettings(), SAMPLING], ids=["greedy", "sampled_with_penalty"])
def test_a_pool_too_small_for_the_batch_preempts_and_returns_the_unconstrained_completions(wandering_qwen2,
                                                                                          settings):
    """Preempted completions are prefilled again with the tokens they drew and go on with their own streams and
    penalty memory: every token and log-prob is the unconstrained run's."""
    _, model = wandering_qwen2
    unconstrained = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4), eos_token_ids=[7])
    expected = unconstrained.generate(long_completions(), settings)
    engine = PagedEngine(model.module, TIGHT_POOL, eos_token_ids=[7])
    outputs = engine.generate(long_completions(), settings)
    assert_same_completions(outputs, expected)
    stats = engine.stats
    assert stats.pages * 7 <= unconstrained.stats.pages and stats.pages * 3 <= unconstrained.stats.peak_pages_in_use
    assert stats.preemptions > 0
    assert stats.recomputed_tokens > stats.preemptions * min(SHORT_PROMPTS)  # prompts and drawn tokens
    assert stats.peak_pages_in_use <= stats.pages


def test_a_preempted_hybrid_completion_rebuilds_its_recurrent_state_by_prefilling_again(tmp_path):
    _, model = tiny.wandering_model("qwen3_5", tmp_path)
    settings = SamplingSettings()
    expected = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4),
                           eos_token_ids=[7]).generate(long_completions(), settings)
    engine = PagedEngine(model.module, TIGHT_POOL, eos_token_ids=[7])
    outputs = engine.generate(long_completions(), settings)
    assert engine.stats.preemptions > 0
    for ours, theirs in zip(outputs, expected, strict=True):
        assert [row.tolist() for row in ours.token_ids] == [row.tolist() for row in theirs.token_ids]
        # A prefill reads the drawn tokens as a chunk, decode one at a time (the DeltaNet's two forms).
        np.testing.assert_allclose(np.concatenate(ours.logprobs), np.concatenate(theirs.logprobs), atol=1e-4)


# --------------------------------------------------------------------------- async scheduling


def generate_both_ways(module, config: PagedEngineConfig, requests: list[RolloutRequest],
                       settings: SamplingSettings) -> tuple[tuple[list, EngineStats], tuple[list, EngineStats]]:
    """``(outputs, stats)`` of ``config`` with async scheduling off, then on."""
    results = []
    for async_scheduling in (False, True):
        engine = PagedEngine(module, replace(config, async_scheduling=async_scheduling), eos_token_ids=[7])
        results.append((engine.generate(requests, settings), engine.stats))
    return results[0], results[1]


def assert_identical_completions(outputs, expected) -> None:
    """The same tokens, ends and log-probs, bit for bit."""
    for ours, theirs in zip(outputs, expected, strict=True):
        assert [row.tolist() for row in ours.token_ids] == [row.tolist() for row in theirs.token_ids]
        assert ours.ended == theirs.ended
        np.testing.assert_array_equal(np.concatenate(ours.logprobs), np.concatenate(theirs.logprobs))


def test_async_scheduling_dispatches_every_call_of_an_unchanged_batch_ahead_with_the_synchronous_tokens(
        wandering_qwen2):
    """Every completion admitted at once, so nothing waits: each decode call after the first is dispatched before
    the previous one is read; rows that end by their end token run masked in the next call and draw nothing."""
    _, model = wandering_qwen2
    config = PagedEngineConfig(max_num_seqs=16, page_size=16, decode_steps=2)
    (expected, synchronous), (outputs, stats) = generate_both_ways(model.module, config, long_completions(), SAMPLING)
    assert_identical_completions(outputs, expected)
    assert synchronous.decode_calls_ahead == synchronous.ended_row_steps == 0
    assert stats.decode_calls_ahead == stats.decode_calls - 1
    assert stats.ended_row_steps > 0  # rows that ended within a call ran masked in the one dispatched after it
    assert stats.slot_steps == synchronous.slot_steps  # ...and drew nothing there
    # The page table is uploaded only when a page was taken or freed.
    assert stats.page_table_uploads < stats.decode_calls


@pytest.mark.parametrize("settings", [SamplingSettings(), SAMPLING], ids=["greedy", "sampled_with_penalty"])
def test_async_scheduling_with_slots_refilled_gives_the_synchronous_tokens_and_logprobs(wandering_qwen2, settings):
    """More completions than slots: the calls between admissions go synchronously, the long tail ahead."""
    _, model = wandering_qwen2
    config = PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=2)
    (expected, synchronous), (outputs, stats) = generate_both_ways(model.module, config, long_completions(), settings)
    assert_identical_completions(outputs, expected)
    assert stats.prefills == synchronous.prefills == len(SHORT_PROMPTS)
    assert 0 < stats.decode_calls_ahead < stats.decode_calls


def test_async_scheduling_with_a_pool_that_preempts_gives_the_synchronous_completions(wandering_qwen2):
    _, model = wandering_qwen2
    (expected, synchronous), (outputs, stats) = generate_both_ways(model.module, TIGHT_POOL, long_completions(),
                                                                   SAMPLING)
    assert_identical_completions(outputs, expected)
    assert stats.preemptions == synchronous.preemptions > 0
    assert stats.decode_calls_ahead > 0


def test_async_scheduling_on_a_hybrid_model_gives_the_synchronous_completions(tmp_path):
    """The recurrent slot states advance on the device from call to call as the pages do."""
    _, model = tiny.wandering_model("qwen3_5", tmp_path)
    config = PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=2)
    (expected, _), (outputs, stats) = generate_both_ways(model.module, config, long_completions(), SAMPLING)
    assert_identical_completions(outputs, expected)
    assert stats.decode_calls_ahead > 0


def test_async_scheduling_is_the_backends_default_and_a_trainer_configs_setting_reaches_the_engine(wandering_qwen2,
                                                                                                  tmp_path):
    _, model = wandering_qwen2
    assert [paged.default_async_scheduling(platform) for platform in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert PagedEngine(model.module).async_scheduling is paged.default_async_scheduling()
    # A trainer hands its rollout_* fields to the engine without the prefix (GRPOConfig.rollout_async_scheduling).
    engine = build_engine("paged", model.module, EngineContext(settings={"async_scheduling": True}))
    assert engine.async_scheduling is True
    with pytest.raises(ValueError, match="rollout_async_scheduling='yes': expected True, False or None"):
        GRPOConfig(output_dir=str(tmp_path), rollout_async_scheduling="yes")


def test_a_completion_that_cannot_fit_the_pool_alone_is_refused_naming_the_setting(wandering_qwen2):
    _, model = wandering_qwen2
    engine = PagedEngine(model.module, PagedEngineConfig(page_size=4, kv_cache_tokens=16))
    with pytest.raises(ValueError, match=r"even alone.*kv_cache_tokens=16; raise kv_cache_tokens"):
        engine.generate([RolloutRequest(prompts((30,))[0], 8)], SAMPLING)


def test_pages_within_memory_fill_the_share_of_the_device_left_beside_what_is_in_use():
    page = 64 * 4  # bytes per token x tokens per page
    # Half of 100 pages' bytes, 20 pages' bytes in use: 30 pages fit, one of them the trash page.
    assert pages_within_memory(100 * page, 20 * page, 0.5, 64, 4) == 29
    assert pages_within_memory(100 * page + page - 1, 20 * page, 1.0, 64, 4) == 79  # no partial page
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 .* raise gpu_memory_utilization"):
        pages_within_memory(100 * page, 20 * page, 0.2, 64, 4)


def test_gpu_memory_utilization_sizes_the_pool_from_the_devices_memory_stats(wandering_qwen2, monkeypatch):
    _, model = wandering_qwen2
    sized = PagedEngine(model.module, TIGHT_POOL, eos_token_ids=[7])
    expected = sized.generate(long_completions(), SamplingSettings())
    page = sized.stats.kv_bytes_per_token * TIGHT_POOL.page_size
    in_use = 1000 * page

    class Device:  # what jax reports for a GPU: a 0.5 share of its memory leaves room for 6 pages (trash included)
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 2 * (in_use + 6 * page), "bytes_in_use": in_use}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    config = PagedEngineConfig(max_num_seqs=4, page_size=4, gpu_memory_utilization=0.5)
    engine = PagedEngine(model.module, config, eos_token_ids=[7])
    outputs = engine.generate(long_completions(), SamplingSettings())
    assert engine.stats.pages == sized.stats.pages == 5
    assert_same_completions(outputs, expected)


def test_gpu_memory_utilization_on_a_device_without_memory_stats_warns_and_sizes_as_unconstrained(wandering_qwen2):
    _, model = wandering_qwen2
    config = PagedEngineConfig(max_num_seqs=4, page_size=4, gpu_memory_utilization=0.5)
    engine = PagedEngine(model.module, config, eos_token_ids=[7])
    with pytest.warns(UserWarning, match="memory_stats.*which cpu does not report.*kv_cache_tokens=None"):
        engine.generate(long_completions(), SamplingSettings())
    unconstrained = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4), eos_token_ids=[7])
    unconstrained.generate(long_completions(), SamplingSettings())
    assert engine.stats.pages == unconstrained.stats.pages


def test_bad_requests_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        RolloutRequest([], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        RolloutRequest([1], 0)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        RolloutRequest([1], 4, num_samples=0)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        PagedEngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        PagedEngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        PagedEngineConfig(gpu_memory_utilization=1.5)


# --------------------------------------------------------------------------- streams: in-flight batching
STREAM_SAMPLING = SamplingSettings(do_sample=True, temperature=0.9, top_k=20)


def stream_batches() -> list[list[RolloutRequest]]:
    """Four generation batches whose completions end at different decode calls (unequal token limits), so a batch's
    freed slots can take the next batch's completions."""
    return [[RolloutRequest(prompt, limit, num_samples=2, seed=100 * batch + index)
             for index, (prompt, limit) in enumerate(zip(prompts((5, 9, 3, 7), seed=batch), (3, 12, 6, 9),
                                                          strict=True))]
            for batch in range(4)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async_scheduling"])
def test_four_batches_through_one_stream_equal_four_generate_calls_and_share_decode_calls(wandering_qwen2,
                                                                                        async_scheduling):
    """With async scheduling the stream's thread dispatches decode calls ahead between submissions; the tokens are
    the synchronous generate calls'."""
    _, model = wandering_qwen2
    config = PagedEngineConfig(max_num_seqs=8, page_size=4, decode_steps=2, async_scheduling=False)
    batches = stream_batches()
    separate = PagedEngine(model.module, config, eos_token_ids=[7])
    expected = [separate.generate(batch, STREAM_SAMPLING) for batch in batches]
    engine = PagedEngine(model.module, replace(config, async_scheduling=async_scheduling), eos_token_ids=[7])
    stream = engine.open_stream(STREAM_SAMPLING, version=3)
    try:
        tickets = [stream.submit(batch) for batch in batches]
        results = [ticket.result(timeout=300) for ticket in tickets]
    finally:
        stream.close()
    for outputs, theirs in zip(results, expected, strict=True):
        assert_same_completions(outputs, theirs)
        for output in outputs:  # one version: the stream's
            assert [row.tolist() for row in output.versions] == [[3] * len(row) for row in output.token_ids]
    assert all(not output.versions for outputs in expected for output in outputs)  # generate does not tag
    # A batch's freed slots decoded the next batch's completions while it still ran.
    assert max(stream.stats.decode_tickets) > 1
    assert (stream.stats.decode_calls_ahead > 0) == async_scheduling


def forward_logprobs(module, prompt: list[int], tokens: np.ndarray, temperature: float) -> np.ndarray:
    """Each completion token's ``log_softmax(logits / temperature)`` from one forward pass of ``module`` over the
    prompt and the completion."""
    ids = np.asarray([list(prompt) + tokens.tolist()], np.int32)
    length = ids.shape[1]
    mask = np.tril(np.ones((length, length), bool))[None]
    logits, _ = module(jax.numpy.asarray(ids), jax.numpy.arange(length)[None], None, jax.numpy.asarray(mask))
    logprobs = jax.nn.log_softmax(np.asarray(logits[0], np.float32) / temperature, axis=-1)
    positions = np.arange(len(prompt) - 1, length - 1)
    return np.asarray(logprobs)[positions, tokens]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async_scheduling"])
def test_a_weights_update_mid_stream_tags_the_tokens_after_it_with_the_new_version(wandering_qwen2,
                                                                                   async_scheduling):
    """The update is applied between two decode calls without draining the running completion: its tokens before
    it are the old weights', those after it the new ones', each with the log-prob its weights give it. With async
    scheduling the decode call dispatched before the update is read first, its tokens tagged with the old weights.

    The stream's thread runs the scheduler's rounds and applies an update between two of them; here the test runs the
    rounds itself (the scheduler the stream runs), so the update lands after a known number of decode calls whatever
    the machine's load. The GRPO test in test_async_rollout.py updates an open stream through its thread."""
    _, model = wandering_qwen2
    graphdef, state = nnx.split(model.module)
    other = nnx.merge(graphdef, jax.tree.map(lambda value: value * 1.25, state))
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=1,
                                                         async_scheduling=async_scheduling))
    _, long = prompts((5, 9))
    request = RolloutRequest(long, 24, seed=2)
    engine.stats = EngineStats(page_size=4)  # as open_stream starts them
    scheduler = paged._Scheduler(engine, STREAM_SAMPLING, 0)
    ticket = paged.StreamTicket([request])
    scheduler.add([request], ticket)
    try:
        with lora_runtime.lora_mode(engine.lora):
            for _ in range(6):  # prefill and admission, then decode calls of one token each
                scheduler.round()
            scheduler.update_weights(other, 1)
            while scheduler.round():
                pass
    finally:
        scheduler.finish()
    output = ticket.result(timeout=0)[0]
    tokens, versions, logprobs = output.token_ids[0], output.versions[0], output.logprobs[0]
    assert versions[0] == 0 and versions[-1] == 1 and (np.diff(versions) >= 0).all()
    assert 2 <= (versions == 0).sum() <= 8
    assert engine.stats.weight_updates == 1 and engine.stats.preemptions == 0
    assert (engine.stats.decode_calls_ahead > 0) == async_scheduling
    for version, module in ((0, model.module), (1, other)):
        mine = versions == version
        expected = forward_logprobs(module, long, tokens, STREAM_SAMPLING.temperature)[mine]
        np.testing.assert_allclose(logprobs[mine], expected, atol=1e-4)
    # The old weights would give the tokens after the update other log-probs.
    stale = forward_logprobs(model.module, long, tokens, STREAM_SAMPLING.temperature)[versions == 1]
    assert np.abs(stale - logprobs[versions == 1]).max() > 1e-2


def test_a_stream_surfaces_a_refused_submission_in_its_result_and_goes_on(wandering_qwen2):
    _, model = wandering_qwen2
    engine = PagedEngine(model.module, PagedEngineConfig(page_size=4, kv_cache_tokens=16))
    stream = engine.open_stream(STREAM_SAMPLING)
    try:
        fitting = stream.submit([RolloutRequest(prompts((5,))[0], 4)])
        refused = stream.submit([RolloutRequest(prompts((30,))[0], 8)])
        with pytest.raises(ValueError, match="even alone"):
            refused.result(timeout=300)
        assert len(fitting.result(timeout=300)[0].token_ids[0]) == 4
    finally:
        stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit([RolloutRequest(prompts((5,))[0], 4)])
