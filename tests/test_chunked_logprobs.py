"""The chunked log-prob path: each family's trunk + head is its forward pass; SFT, DPO and GRPO losses and gradients
computed a block of positions at a time equal the whole-sequence computation; and the chunked program's memory does
not hold a ``[B, T, V]`` float32 copy of the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from torchlike.adapters.families import family_for_config
from torchlike.adapters.losses import grpo as grpo_losses
from torchlike.adapters.losses import logprobs as chunked_logprobs
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.losses.dpo import DPOLossSettings, dpo_step_loss
from torchlike.adapters.model import tunix_model
from torchlike.testing import tiny_config

VOCAB = 2048  # large against a block: one 8-position block's logits are 1/8 of the sequence's
BLOCK = 8  # divides none of the scored lengths below, so the last block is padded
ROWS, LENGTH, COMPLETION = 2, 62, 29  # SFT scores 61 positions, GRPO 29: 8 blocks (3 padding), 4 blocks (3 padding)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def build(family: str, **overrides):
    config = tiny_config(family, **overrides)
    family_table = family_for_config(config)
    return family_table, family_table.build_model(config, jnp.float32, nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
    return build("qwen2", vocab_size=VOCAB)


def token_batch(length: int = LENGTH, seed: int = 0) -> dict:
    """Two rows, the first right-padded, the second left-padded."""
    rng = np.random.default_rng(seed)
    mask = np.ones((ROWS, length), np.int32)
    mask[0, length - 9:] = 0
    mask[1, :5] = 0
    ids = np.where(mask == 1, rng.integers(3, VOCAB, (ROWS, length)), 0).astype(np.int32)
    loss_mask = mask * (rng.random((ROWS, length)) < 0.8)
    return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(loss_mask)}


def value_and_grads(loss, module, batch):
    """``loss(module, batch)``'s outputs and the gradient of its first output with respect to every parameter."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def first(params):
        out = loss(nnx.merge(graphdef, params, rest), batch)
        return out[0], out

    grads, out = jax.jit(jax.grad(first, has_aux=True))(params)
    return out, grads


def assert_same(chunked, whole):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE), chunked, whole)


def scan_count(loss, module, batch) -> int:
    """How many ``scan``s over rematerialised blocks the traced loss holds (0 when it runs unchunked)."""
    graphdef, state = nnx.split(module)

    def count(jaxpr) -> int:
        found = 0
        for eqn in jaxpr.eqns:
            inner = [getattr(value, "jaxpr", value) for value in eqn.params.values()]
            if eqn.primitive.name == "scan":
                found += any("checkpoint" in str(body) or "remat" in str(body) for body in inner)
            found += sum(count(body) for body in inner if hasattr(body, "eqns"))
        return found

    return count(jax.make_jaxpr(lambda state: loss(nnx.merge(graphdef, state), batch)[0])(state).jaxpr)


@pytest.mark.parametrize("case", ["qwen2", "qwen2_tied", "qwen3", "llama3", "llama32", "gemma2", "gemma3"])
def test_trunk_then_head_is_the_family_forward_pass(case):
    name, _, tied = case.partition("_")
    family, module = build(name, **({"tie_word_embeddings": True} if tied else {}))
    norm_type = type(module.final_norm)
    tokens, positions, attention = tunix_model.causal_inputs(np.asarray(token_batch(24)["input_ids"]),
                                                             np.asarray(token_batch(24)["attention_mask"]))

    @nnx.jit
    def both(module):
        split = family.logits_from_hidden(module, family.hidden_states(module, tokens, positions, attention))
        return family.forward(module, tokens, positions, attention), split

    forward, split = both(module)
    assert split.dtype == forward.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(split), np.asarray(forward))
    assert type(module.final_norm) is norm_type  # the recording class is gone again


def test_block_length_pads_less_than_a_block_and_auto_fits_the_byte_budget():
    assert chunked_logprobs.block_length(8, ROWS, 61, VOCAB) == 8  # 8 blocks, 3 positions of padding
    assert chunked_logprobs.block_length(10, ROWS, 61, VOCAB) == 9  # 7 equal blocks rather than 6 + 1
    assert chunked_logprobs.block_length(None, ROWS, 61, VOCAB) == 61
    budget = chunked_logprobs.LOGITS_BLOCK_BYTES
    auto = chunked_logprobs.block_length("auto", 8, 4096, 151_936)
    assert 8 * auto * 151_936 * 4 <= budget and auto > 1
    assert chunked_logprobs.block_length("auto", 8, 64, 128) == 64  # tiny shapes: one block, nothing chunked
    with pytest.raises(ValueError, match="positive number"):
        chunked_logprobs.block_length(0, ROWS, 61, VOCAB)


def test_sft_loss_and_gradients_match_the_whole_sequence(model):
    family, module = model
    batch = token_batch()
    chunked, whole = (sft_loss.sft_step_loss(family, block_size=size) for size in (BLOCK, None))
    assert scan_count(chunked, module, batch) == 1 and scan_count(whole, module, batch) == 0
    assert_same(value_and_grads(chunked, module, batch), value_and_grads(whole, module, batch))


def dpo_batch() -> dict:
    chosen, rejected = token_batch(seed=1), token_batch(seed=2)
    batch = {}
    for name, rows in (("chosen", chosen), ("rejected", rejected)):
        completion = rows["attention_mask"] * (jnp.arange(LENGTH) >= 20)
        batch.update({f"{name}_input_ids": rows["input_ids"], f"{name}_attention_mask": rows["attention_mask"],
                      f"{name}_completion_mask": completion})
    return {**batch, "ref_chosen_logps": jnp.array([-400.0, -380.0]), "ref_rejected_logps": jnp.array([-390.0, -410.0])}


def test_dpo_loss_metrics_and_gradients_match_the_whole_sequence(model):
    family, module = model
    batch = dpo_batch()
    settings = DPOLossSettings(beta=0.1, loss_type=["sigmoid", "sft"])
    chunked, whole = (dpo_step_loss(family, settings, block_size=size) for size in (BLOCK, None))
    assert scan_count(chunked, module, batch) == 1 and scan_count(whole, module, batch) == 0
    (value, weight, metrics), grads = value_and_grads(chunked, module, batch)
    (whole_value, whole_weight, whole_metrics), whole_grads = value_and_grads(whole, module, batch)
    assert set(metrics) == set(whole_metrics) >= {"entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"}
    assert_same((value, weight, metrics, grads), (whole_value, whole_weight, whole_metrics, whole_grads))


def grpo_batch() -> dict:
    rows = token_batch()
    completion = np.ones((ROWS, COMPLETION), np.int32)
    completion[0, 20:] = 0  # the first completion ended early
    attention = np.asarray(rows["attention_mask"]).copy()
    attention[:, -COMPLETION:] = completion
    rng = np.random.default_rng(3)
    return {"input_ids": rows["input_ids"], "attention_mask": jnp.asarray(attention),
            "completion_mask": jnp.asarray(completion), "advantages": jnp.array([1.0, -0.5]),
            "old_logps": jnp.asarray(-8 + rng.normal(size=(ROWS, COMPLETION)) * 0.1, jnp.float32),
            "ref_logps": jnp.asarray(-8 + rng.normal(size=(ROWS, COMPLETION)) * 0.1, jnp.float32),
            "num_items": jnp.full((ROWS,), float(completion.sum())), "step_weight": jnp.ones((ROWS,))}


def test_grpo_log_probs_loss_and_gradients_match_the_whole_sequence(model):
    family, module = model
    batch = grpo_batch()
    settings = grpo_losses.GRPOLossSettings(
        loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, importance_sampling_level="token",
        max_completion_length=COMPLETION, temperature=0.7, use_bias_correction_kl=False)
    chunked, whole = (grpo_losses.grpo_step_loss(family, settings, block_size=size) for size in (BLOCK, None))
    assert scan_count(chunked, module, batch) == 1 and scan_count(whole, module, batch) == 0
    assert_same(value_and_grads(chunked, module, batch), value_and_grads(whole, module, batch))
    log_probs = [grpo_losses.make_log_prob_pass(family, 0.7, block_size=size)(module, batch) for size in (BLOCK, None)]
    assert_same(*log_probs)
    assert (np.asarray(log_probs[0])[0, 20:] == 0).all() and (np.asarray(log_probs[0])[1] < 0).all()


def test_chunked_loss_and_gradient_add_no_sequence_by_vocabulary_logits_to_the_trunk(model):
    family, module = model
    batch = token_batch(248)  # enough positions that one logits copy outweighs the head's [V, H] gradient buffers
    one_copy = ROWS * 247 * VOCAB * 4  # float32 logits of the scored positions
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def temp_bytes(loss) -> int:
        grad = jax.jit(jax.grad(lambda params: loss(nnx.merge(graphdef, params, rest), batch)[0]))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    trunk = temp_bytes(lambda module, batch: (chunked_logprobs.hidden_states(family, module, batch).sum(),))
    whole = temp_bytes(sft_loss.sft_step_loss(family, block_size=None))
    chunked = temp_bytes(sft_loss.sft_step_loss(family, block_size=BLOCK))
    assert whole - trunk > one_copy, (trunk, whole, one_copy)
    assert chunked - trunk < one_copy / 4, (trunk, chunked, one_copy)
