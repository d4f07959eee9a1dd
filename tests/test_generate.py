"""``CausalLM.generate`` against ``transformers.generate``: greedy and repetition penalty token for
token on left-padded batches (the padding counted by the penalty as the installed transformers counts
it), sampling knobs and seeds, the KV cache size, traces, and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import torchlike
import torchlike.generation
from tests import tiny
from torchlike import version
from torchlike.adapters.rollout import sampling
from torchlike.adapters.runtime import tracing
from torchlike.generation import GenerateDecoderOnlyOutput

PROMPT_WIDTH = 20
NEW_TOKENS = 16


def left_padded_prompts(lengths=(20, 13, 17), width=PROMPT_WIDTH, seed=1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of unequal length, left-padded with the pad id 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, tiny.VOCAB, size=(len(lengths), width))
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    ids[mask == 0] = 0
    return ids, mask


def hf_generate(model, ids, mask, pad_token_id=0, **kwargs) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), pad_token_id=pad_token_id,
                             **kwargs)
    return out.numpy()


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """A tiny Qwen2 whose weights are scaled up (std 0.16) so greedy decoding wanders instead of
    repeating one token; returns ``(transformers model, torchlike model)``, both float32, with no
    default end token (so rows run to ``max_new_tokens`` unless a test passes ``eos_token_id``)."""
    return tiny.wandering_qwen2(tmp_path_factory.mktemp("varied_qwen2"))


def test_greedy_output_of_the_test_model_is_not_one_token_repeated(varied):
    _, model = varied
    ids, mask = left_padded_prompts()
    new = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)[:, PROMPT_WIDTH:]
    assert all(len(set(row.tolist())) >= 5 for row in new), new


def test_greedy_matches_transformers_token_for_token_on_a_left_padded_batch(varied):
    reference, model = varied
    ids, mask = left_padded_prompts()
    for end_tokens in (None, [2]):  # run to the end; stop rows at token 2 (one row ends early)
        expected = hf_generate(reference, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=end_tokens)
        ours = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=end_tokens)
        np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("case", ["qwen3", "llama32", "gemma3"])
def test_greedy_matches_transformers_for_every_family(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    model = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ids, mask = left_padded_prompts()  # longer than gemma3's sliding window (8)
    for penalty in (1.0, 1.3):
        expected = hf_generate(reference, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               repetition_penalty=penalty)
        ours = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=penalty)
        np.testing.assert_array_equal(ours, expected)


def test_repetition_penalty_matches_transformers_token_for_token(varied):
    reference, model = varied
    ids, mask = left_padded_prompts()
    expected = hf_generate(reference, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3)
    plain = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    ours = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3)
    np.testing.assert_array_equal(ours, expected)
    assert not np.array_equal(ours, plain)


def test_left_padding_counts_in_the_repetition_penalty_as_in_the_installed_transformers(varied, monkeypatch):
    # transformers 5.23 stopped counting each row's left padding; the pad id is chosen so that it matters: a token
    # the padded row 1 generates early without the penalty, and which its real prompt tokens never hold.
    reference, model = varied
    ids, mask = left_padded_prompts()
    free = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)[1, PROMPT_WIDTH:]
    pad = next(int(token) for token in free if token not in ids[1][mask[1] == 1])
    ids = np.where(mask == 1, ids, pad)
    expected = hf_generate(reference, ids, mask, pad_token_id=pad, max_new_tokens=NEW_TOKENS, do_sample=False,
                           repetition_penalty=1.3)
    ours = model.generate(ids, mask, pad_token_id=pad, max_new_tokens=NEW_TOKENS, do_sample=False,
                          repetition_penalty=1.3)
    np.testing.assert_array_equal(ours, expected)
    installed_rule = version.repetition_penalty_skips_left_padding()
    monkeypatch.setattr(torchlike.generation, "repetition_penalty_skips_left_padding", lambda: not installed_rule)
    other_rule = model.generate(ids, mask, pad_token_id=pad, max_new_tokens=NEW_TOKENS, do_sample=False,
                                repetition_penalty=1.3)
    assert not np.array_equal(other_rule, expected)  # the batch tells the two rules apart


def test_each_row_stops_at_its_own_end_token_and_is_padded_after_it(varied):
    reference, model = varied
    ids, mask = left_padded_prompts()
    free = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    end_token = int(free[0, PROMPT_WIDTH + 4])  # row 0 ends at its 5th new token
    expected = hf_generate(reference, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=[2, end_token])
    ours = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[2, end_token],
                          pad_token_id=0)
    np.testing.assert_array_equal(ours, expected)
    first_end = int(np.flatnonzero(ours[0, PROMPT_WIDTH:] == end_token)[0])
    assert (ours[0, PROMPT_WIDTH + first_end + 1:] == 0).all()


def test_top_k_one_sampling_equals_greedy(varied):
    _, model = varied
    ids, mask = left_padded_prompts()
    greedy = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3)
    sampled = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1, temperature=0.7,
                             repetition_penalty=1.3, seed=5)
    np.testing.assert_array_equal(sampled, greedy)


def test_the_same_seed_reproduces_and_other_seeds_differ(varied):
    _, model = varied
    ids, mask = left_padded_prompts()

    def sample(seed):
        return model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.5, top_p=0.95,
                              seed=seed)

    np.testing.assert_array_equal(sample(1), sample(1))
    assert not np.array_equal(sample(1), sample(2))
    assert not np.array_equal(sample(None), sample(None))


def test_sampled_row_i_draws_the_stream_seed_i_on_either_engine(varied):
    from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest

    _, model = varied
    ids, mask = left_padded_prompts()
    settings = {"do_sample": True, "temperature": 1.5, "top_p": 0.95, "repetition_penalty": 1.3}
    out = model.generate(ids, mask, max_new_tokens=8, seed=7, num_return_sequences=2, **settings)
    paged = model.generate(ids, mask, max_new_tokens=8, seed=7, num_return_sequences=2, rollout_engine="paged",
                           **settings)
    np.testing.assert_array_equal(paged, out)
    # Row i = 2 * prompt + sample, asked of the paged engine alone and in another order: the same tokens.
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=2, page_size=4))
    sampling_settings = sampling.SamplingSettings.from_mapping({**sampling.SamplingSettings.defaults(), **settings})
    for row in (5, 0, 3):
        prompt = ids[row // 2][mask[row // 2] == 1]
        penalised = () if version.repetition_penalty_skips_left_padding() else ids[row // 2][mask[row // 2] == 0]
        request = RolloutRequest(prompt, 8, seed=7, first_sample=row, penalised_ids=penalised)
        [output] = engine.generate([request], sampling_settings)
        np.testing.assert_array_equal(output.token_ids[0], out[row, PROMPT_WIDTH:])


def test_sampled_tokens_stay_inside_top_k(varied):
    reference, model = varied
    ids, mask = left_padded_prompts()
    out = model.generate(ids, mask, max_new_tokens=1, do_sample=True, top_k=3, temperature=2.0, seed=0,
                         num_return_sequences=8)
    with torch.no_grad():
        logits = reference(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[:, -1]
    allowed = torch.topk(logits, 3).indices.numpy()
    for row, token in enumerate(out[:, -1]):
        assert token in allowed[row // 8]


def test_sampled_tokens_follow_the_softmax_and_never_take_an_excluded_token():
    """``sampling.sample_categorical`` over 2,500 tokens (three blocks of its running sums, the last padded): the
    frequencies of 60,000 draws equal the softmax within 5 standard deviations; ``-inf`` tokens are never drawn."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    scores = rng.normal(size=2500).astype(np.float32) * 2.5
    scores[rng.choice(2500, 500, replace=False)] = -np.inf
    probs = np.asarray(jax.nn.softmax(jnp.asarray(scores)), np.float64)
    draws = 60_000
    keys = jax.vmap(lambda index: jax.random.fold_in(jax.random.key(3), index))(jnp.arange(draws))
    tokens = jax.jit(jax.vmap(lambda key: sampling.sample_categorical(key, jnp.asarray(scores)[None])[0]))(keys)
    frequencies = np.bincount(np.asarray(tokens), minlength=2500) / draws
    assert frequencies[np.isinf(scores)].sum() == 0
    spread = np.sqrt(probs * (1 - probs) / draws) + 1 / draws
    assert np.all(np.abs(frequencies - probs) <= 5 * spread)
    # Rows of one batch draw from their own rows' scores; a row whose only token with weight is in its first block
    # (the later blocks all zero) draws it every time.
    batch = jnp.asarray(np.stack([scores, np.where(np.arange(2500) == 7, 0.0, -np.inf).astype(np.float32)]))
    drawn = jax.jit(jax.vmap(lambda key: sampling.sample_categorical(key, batch)))(keys[:2000])
    assert (np.asarray(drawn[:, 1]) == 7).all()
    assert len(set(np.asarray(drawn[:, 0]).tolist())) > 100


def test_logits_processors_match_transformers():
    from transformers.generation import logits_process as hf

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, tiny.VOCAB, generator=generator) * 3
    history = torch.randint(0, tiny.VOCAB, (4, 12), generator=generator)
    seen = np.zeros((4, tiny.VOCAB), bool)
    np.put_along_axis(seen, history.numpy(), True, axis=1)
    logits = scores.numpy()

    def same(ours, theirs):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=1e-6)

    same(sampling.apply_repetition_penalty(logits, seen, 1.3), hf.RepetitionPenaltyLogitsProcessor(1.3)(history,
                                                                                                          scores))
    # generate's rule from transformers 5.23: each row's left padding (the first 1 of its mask) is not counted.
    mask = np.ones((4, 12), np.int64)
    for row, padding in enumerate((0, 3, 11, 12)):  # the last row has no real token: transformers counts it all
        mask[row, :padding] = 0
    counted = sampling.penalised_prompt_positions(mask, skip_left_padding=True).astype(bool)
    assert counted.sum(axis=1).tolist() == [12, 9, 1, 12]
    np.testing.assert_array_equal(sampling.penalised_prompt_positions(mask, skip_left_padding=False), 1)
    if version.repetition_penalty_skips_left_padding():
        ignored = torch.tensor(mask != 0).int().argmax(dim=1)
        seen_after_padding = np.zeros((4, tiny.VOCAB), bool)
        for row in range(4):
            seen_after_padding[row, history[row].numpy()[counted[row]]] = True
        same(sampling.apply_repetition_penalty(logits, seen_after_padding, 1.3),
             hf.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=ignored)(history, scores.clone()))
    same(sampling.apply_temperature(logits, 0.7), hf.TemperatureLogitsWarper(0.7)(history, scores))
    same(sampling.top_p_filter(logits, 0.8), hf.TopPLogitsWarper(0.8)(history, scores))
    same(sampling.min_p_filter(logits, 0.1), hf.MinPLogitsWarper(0.1)(history, scores))
    values, token_ids = sampling.top_k_candidates(logits, 5)
    kept = np.isfinite(hf.TopKLogitsWarper(5)(history, scores).numpy())
    for row in range(4):
        assert set(np.asarray(token_ids[row]).tolist()) == set(np.flatnonzero(kept[row]).tolist())
    # top-p over top-k candidates keeps what transformers keeps over the whole vocabulary.
    chained = hf.TopPLogitsWarper(0.5)(history, hf.TopKLogitsWarper(20)(history, scores)).numpy()
    values, token_ids = sampling.top_k_candidates(logits, 20)
    filtered = np.asarray(sampling.top_p_filter(values, 0.5))
    for row in range(4):
        kept_ids = np.asarray(token_ids[row])[np.isfinite(filtered[row])]
        assert set(kept_ids.tolist()) == set(np.flatnonzero(np.isfinite(chained[row])).tolist())


def test_logprobs_are_log_softmax_of_the_transformers_logits(varied):
    reference, model = varied
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        expected = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8,
                                      do_sample=False, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True)
    out = model.generate(ids, mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                         output_logprobs=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    np.testing.assert_array_equal(out.sequences, expected.sequences.numpy())
    log_probs = torch.stack(expected.logits, dim=1).log_softmax(-1)
    picked = log_probs.gather(-1, expected.sequences[:, PROMPT_WIDTH:, None])[..., 0].numpy()
    np.testing.assert_allclose(out.logprobs, picked, atol=1e-4)


def test_a_second_call_with_the_same_shapes_does_not_trace_again(varied):
    """The static engine's programs (the paged engine's buckets are tests/test_rollout_engine.py's)."""
    _, model = varied
    ids, mask = left_padded_prompts()
    model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.9, repetition_penalty=1.1, seed=0,
                   rollout_engine="static")
    before = dict(tracing.TRACE_COUNTS)
    model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.9, repetition_penalty=1.1, seed=0,
                   rollout_engine="static")
    assert tracing.TRACE_COUNTS == before


def test_other_values_and_lengths_in_the_same_buckets_reuse_the_program(varied):
    _, model = varied
    ids, mask = left_padded_prompts()
    model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.9, repetition_penalty=1.1, seed=0,
                   rollout_engine="static")
    before = dict(tracing.TRACE_COUNTS)
    longer_ids, longer_mask = left_padded_prompts(lengths=(25, 9, 30), width=30)  # bucket 32, like width 20
    model.generate(longer_ids, longer_mask, max_new_tokens=11, do_sample=True, top_p=0.5, temperature=0.3,
                   repetition_penalty=1.7, seed=9, eos_token_id=[2, 3, 4], rollout_engine="static")
    assert tracing.TRACE_COUNTS == before


def test_each_new_program_is_counted_and_logged(varied, caplog):
    _, model = varied
    before = tracing.TRACE_COUNTS["generate"]
    with caplog.at_level("INFO", logger=tracing.__name__):
        model.generate([[5, 6, 7]], max_new_tokens=2, do_sample=False,  # batch 1: a shape no other test uses
                       rollout_engine="static")
    assert tracing.TRACE_COUNTS["generate"] == before + 1
    assert "tracing the generation program: batch 1, prompt bucket 16, new-token bucket 16" in caplog.text


def test_the_kv_cache_can_never_be_too_small():
    for prompt in range(1, 3000, 7):
        for new in (1, 2, 15, 16, 17, 100, 1023, 1024, 1025, 4097):
            assert sampling.cache_size(prompt, new) >= prompt + new


def test_sampling_settings_are_generation_config_fields_with_its_defaults():
    config = transformers.GenerationConfig()
    defaults = config._get_default_generation_params()
    for name, value in sampling.SamplingSettings.defaults().items():
        assert name in config.to_dict()
        assert defaults.get(name) == value, name


def test_prompts_and_new_tokens_at_bucket_edges_match_transformers(varied):
    reference, model = varied
    for width, new in ((16, 16), (17, 47)):
        ids, mask = left_padded_prompts(lengths=(width, width - 5), width=width)
        expected = hf_generate(reference, ids, mask, max_new_tokens=new, do_sample=False)
        ours = model.generate(ids, mask, max_new_tokens=new, do_sample=False)
        assert ours.shape == (2, width + new)
        np.testing.assert_array_equal(ours, expected)


def test_defaults_come_from_the_generation_config(varied, monkeypatch):
    _, model = varied
    ids, mask = left_padded_prompts()
    assert model.generate(ids, mask).shape[1] == PROMPT_WIDTH + 20  # transformers' max_length=20
    greedy = model.generate(ids, mask, max_new_tokens=5, do_sample=False)
    monkeypatch.setattr(model.generation_config, "max_new_tokens", 5)
    monkeypatch.setattr(model.generation_config, "do_sample", True)
    monkeypatch.setattr(model.generation_config, "top_k", 1)
    np.testing.assert_array_equal(model.generate(ids, mask), greedy)
    call_config = transformers.GenerationConfig(max_new_tokens=3)
    assert model.generate(ids, mask, generation_config=call_config).shape[1] == PROMPT_WIDTH + 3
    assert model.generate(ids, mask, generation_config=call_config, max_new_tokens=4).shape[1] == PROMPT_WIDTH + 4


def test_inputs_may_be_lists_numpy_jax_or_torch_and_torch_comes_back_as_torch(varied):
    import jax.numpy as jnp

    _, model = varied
    ids, mask = left_padded_prompts()
    expected = model.generate(ids, mask, max_new_tokens=4, do_sample=False)
    for variant in (ids.tolist(), jnp.asarray(ids)):
        np.testing.assert_array_equal(model.generate(variant, mask.tolist(), max_new_tokens=4, do_sample=False),
                                      expected)
    out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=4,
                         do_sample=False)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    np.testing.assert_array_equal(out.numpy(), expected)


def test_right_padded_rows_are_moved_to_the_left_with_a_warning(varied):
    _, model = varied
    ids, mask = left_padded_prompts()
    right_ids = np.stack([np.roll(row, -int((m == 0).sum())) for row, m in zip(ids, mask, strict=True)])
    right_mask = np.stack([np.roll(m, -int((m == 0).sum())) for m in mask])
    with pytest.warns(UserWarning, match="right-padded"):
        out = model.generate(right_ids, right_mask, max_new_tokens=4, do_sample=False)
    np.testing.assert_array_equal(out, model.generate(ids, mask, max_new_tokens=4, do_sample=False))


def test_text_prompts_are_tokenized_and_left_padded(varied, tokenizer_dir):
    _, model = varied
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = "<pad>"  # id 0, for the reference batch; generate pads text prompts itself
    prompts = ["hello world", "the quick brown fox jumps"]
    batch = tokenizer(prompts, return_tensors="np", padding=True, padding_side="left")
    out = model.generate(prompts, tokenizer=tokenizer, max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=4, do_sample=False,
                              pad_token_id=0)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate(prompts, max_new_tokens=4)


def test_num_return_sequences_repeats_each_prompt(varied):
    _, model = varied
    ids, mask = left_padded_prompts()
    out = model.generate(ids, mask, max_new_tokens=4, do_sample=True, num_return_sequences=2, seed=0)
    assert out.shape == (6, PROMPT_WIDTH + 4)
    np.testing.assert_array_equal(out[::2, :PROMPT_WIDTH], ids)
    np.testing.assert_array_equal(out[1::2, :PROMPT_WIDTH], ids)


def test_a_peft_model_generates_with_its_adapter(varied):
    import jax
    from flax import nnx

    from torchlike.peft import LoraConfig, get_peft_model

    _, base = varied
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for index, (_, variable) in enumerate(nnx.to_flat_state(nnx.state(model.module, nnx.LoRAParam))):
        value = variable.get_value()
        variable.set_value(jax.random.normal(jax.random.key(index), value.shape, value.dtype) * 0.3)
    ids, mask = left_padded_prompts()
    adapted = model.generate(ids, mask, max_new_tokens=8, do_sample=False)
    np.testing.assert_array_equal(adapted, model.merge_and_unload().generate(ids, mask, max_new_tokens=8,
                                                                             do_sample=False))
    plain = base.generate(ids, mask, max_new_tokens=8, do_sample=False)
    assert not np.array_equal(adapted, plain)
    with model.disable_adapter():
        np.testing.assert_array_equal(model.generate(ids, mask, max_new_tokens=8, do_sample=False), plain)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"do_sample": True, "temperature": 0.0}, "temperature must be > 0 when do_sample=True"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be a non-negative integer"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"num_beams": 2}, "beam search is not supported"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"eos_token_id": 10_000}, "eos_token_id must be token ids"),
])
def test_bad_settings_get_clear_errors(varied, arguments, message):
    _, model = varied
    with pytest.raises(ValueError, match=message):
        model.generate([[5, 6, 7]], **{"max_new_tokens": 2, **arguments})


def test_bad_inputs_get_clear_errors(varied):
    _, model = varied
    with pytest.raises(TypeError, match="unsupported arguments"):
        model.generate([[5, 6, 7]], max_new_tokens=2, no_repeat_ngram_size=3)
    with pytest.raises(ValueError, match="all padding"):
        model.generate([[5, 6, 7], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate([[5, 6, -100]], max_new_tokens=2)
    with pytest.raises(ValueError, match="does not match"):
        model.generate([[5, 6, 7]], [[1, 1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="needs prompts"):
        model.generate(max_new_tokens=2)
    with pytest.raises(ValueError, match="rollout_engine='vllm'"):
        model.generate([[5, 6, 7]], max_new_tokens=2, rollout_engine="vllm")
