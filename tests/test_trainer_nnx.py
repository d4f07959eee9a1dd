"""The Trainer on a plain Flax NNX module (the JAX AI stack's miniGPT): JAX-native ``loss_fn`` and
transformers' ``compute_loss_func`` conventions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import torchlike
from tests.helpers.logs import logged
from tests.helpers.training import training_arguments

VOCAB, LENGTH = 32, 16


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rngs: nnx.Rngs):
        self.layer_norm1 = nnx.LayerNorm(embed_dim, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, decode=False, rngs=rngs)
        self.layer_norm2 = nnx.LayerNorm(embed_dim, rngs=rngs)
        self.linear1 = nnx.Linear(embed_dim, ff_dim, rngs=rngs)
        self.linear2 = nnx.Linear(ff_dim, embed_dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.mha(self.layer_norm1(x), mask=mask)
        return x + self.linear2(nnx.relu(self.linear1(self.layer_norm2(x))))


class MiniGPT(nnx.Module):
    """The JAX AI stack tutorial's miniGPT, at test size."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.token_emb = nnx.Embed(VOCAB, 32, rngs=rngs)
        self.pos_emb = nnx.Embed(LENGTH, 32, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(32, 2, 64, rngs)])
        self.output = nnx.Linear(32, VOCAB, rngs=rngs)

    def __call__(self, inputs):
        x = self.token_emb(inputs) + self.pos_emb(jnp.arange(inputs.shape[1]))[None]
        mask = nnx.make_causal_mask(inputs)
        for block in self.blocks:
            x = block(x, mask)
        return self.output(x)


def counting_sequences(count: int, seed: int) -> np.ndarray:
    """Sequences that count up from a random start (mod VOCAB): learnable in a few steps."""
    starts = np.random.default_rng(seed).integers(0, VOCAB, count)
    return ((starts[:, None] + np.arange(LENGTH)[None]) % VOCAB).astype(np.int32)


def test_minigpt_trains_with_a_jax_native_loss_fn(tmp_path):
    def loss_fn(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["inputs"][:, 1:]).mean()

    data = [{"inputs": row} for row in counting_sequences(64, seed=0)]
    trainer = torchlike.Trainer(model=MiniGPT(), args=training_arguments(tmp_path, max_steps=40, learning_rate=3e-3,
                                                                         per_device_train_batch_size=8),
                                train_dataset=data, loss_fn=loss_fn)
    trainer.train()
    losses = logged(trainer.state.log_history, "loss")
    assert losses[0] > 3.0 and losses[-1] < 0.5 * losses[0]


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """transformers' ForCausalLMLoss in jax.numpy: shifted labels, -100 ignored, summed / num_items_in_batch."""
    logits, targets = outputs[:, :-1], labels[:, 1:]
    valid = targets != -100
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    return jnp.where(valid, nll, 0.0).sum() / num_items_in_batch


def padded_label_rows(count: int, seed: int) -> list[dict]:
    rows, rng = [], np.random.default_rng(seed)
    for tokens in counting_sequences(count, seed):
        labels = tokens.copy()
        labels[int(rng.integers(3, LENGTH)):] = -100  # unequal numbers of label tokens per row
        rows.append({"inputs": tokens, "labels": labels})
    return rows


def test_compute_loss_func_gets_the_step_item_count_so_accumulation_equals_one_big_batch(tmp_path):
    rows = padded_label_rows(16, seed=1)
    runs = {}
    for name, batch, accumulation in (("whole", 8, 1), ("accumulated", 2, 4)):
        model = MiniGPT(seed=3)
        args = training_arguments(tmp_path / name, per_device_train_batch_size=batch,
                                  gradient_accumulation_steps=accumulation, max_steps=2, optim="sgd", learning_rate=0.1,
                                  train_sampling_strategy="sequential")
        trainer = torchlike.Trainer(model=model, args=args, train_dataset=rows, compute_loss_func=causal_lm_loss)
        trainer.train()
        runs[name] = (logged(trainer.state.log_history, "loss"), nnx.state(model, nnx.Param))
    np.testing.assert_allclose(runs["accumulated"][0], runs["whole"][0], rtol=1e-5)
    for whole, accumulated in zip(nnx.to_flat_state(runs["whole"][1]), nnx.to_flat_state(runs["accumulated"][1]),
                                  strict=True):
        np.testing.assert_allclose(accumulated[1].get_value(), whole[1].get_value(), atol=1e-5)

    # transformers counts every label != -100 for a model it does not know to be a causal LM (labels[..., 1:]
    # only for its *ForCausalLM classes and torchlike's CausalLM); a "shift_labels" column would be used as is.
    first = MiniGPT(seed=3)
    by_hand = sum(float(causal_lm_loss(first(jnp.stack([r["inputs"]])), jnp.stack([r["labels"]]), 1.0))
                  for r in rows[:8]) / sum(int((r["labels"] != -100).sum()) for r in rows[:8])
    assert runs["whole"][0][0] == pytest.approx(by_hand, rel=1e-5)


def test_a_plain_module_without_a_loss_is_refused_with_both_conventions(tmp_path):
    trainer = torchlike.Trainer(model=MiniGPT(), args=training_arguments(tmp_path),
                                train_dataset=[{"inputs": counting_sequences(1, 0)[0]}])
    with pytest.raises(ValueError, match="loss_fn=.*compute_loss_func="):
        trainer.train()


def test_label_names_name_the_label_column_given_to_compute_loss_func(tmp_path):
    rows = padded_label_rows(16, seed=2)
    renamed = [{"inputs": row["inputs"], "targets": row["labels"]} for row in rows]
    runs = []
    for data, label_names in ((rows, None), (renamed, ["targets"])):
        args = training_arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                                  optim="sgd", learning_rate=0.1, train_sampling_strategy="sequential",
                                  label_names=label_names)
        trainer = torchlike.Trainer(model=MiniGPT(seed=3), args=args, train_dataset=data,
                                    compute_loss_func=causal_lm_loss)
        trainer.train()
        runs.append(logged(trainer.state.log_history, "loss"))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)


def test_remove_unused_columns_gives_the_collator_only_what_the_model_and_loss_read(tmp_path):
    rows = [{**row, "source": "counting", "length": np.int32(LENGTH)} for row in padded_label_rows(8, seed=4)]
    seen = {}
    for remove in (True, False):
        def collate(examples, remove=remove):
            seen[remove] = sorted(examples[0])
            return {key: np.stack([example[key] for example in examples]) for key in ("inputs", "labels")}

        args = training_arguments(tmp_path, max_steps=1, remove_unused_columns=remove)
        trainer = torchlike.Trainer(model=MiniGPT(), args=args, train_dataset=rows, data_collator=collate,
                                    compute_loss_func=causal_lm_loss)
        trainer.train()
    # MiniGPT.__call__(inputs) plus the label column, as transformers keeps the forward's arguments and label_names.
    assert seen == {True: ["inputs", "labels"], False: ["inputs", "labels", "length", "source"]}


def test_a_jax_native_loss_fn_gets_every_column(tmp_path):
    def loss_fn(model, batch):
        logits = model(batch["tokens"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]).mean()
        return loss * batch["weight"].mean()

    data = [{"tokens": row, "weight": np.float32(1.0)} for row in counting_sequences(8, seed=0)]
    trainer = torchlike.Trainer(model=MiniGPT(), args=training_arguments(tmp_path, max_steps=1), train_dataset=data,
                                loss_fn=loss_fn)
    assert trainer.train().global_step == 1


def test_resuming_a_plain_module_restores_its_parameters_and_continues_exactly(tmp_path):
    def loss_fn(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["inputs"][:, 1:]).mean()

    data = [{"inputs": row} for row in counting_sequences(32, seed=0)]
    args = training_arguments(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, learning_rate=3e-3)
    module = MiniGPT(seed=0)
    trainer = torchlike.Trainer(model=module, args=args, train_dataset=data, loss_fn=loss_fn)
    trainer.train()
    assert trainer.model is module  # the object the user passed, trained in place

    resumed = torchlike.Trainer(model=MiniGPT(seed=5), args=args, train_dataset=data, loss_fn=loss_fn)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert logged(resumed.state.log_history, "loss")[-2:] == logged(trainer.state.log_history, "loss")[-2:]
    for (path, first), (_, second) in zip(nnx.to_flat_state(nnx.state(module, nnx.Param)),
                                          nnx.to_flat_state(nnx.state(resumed.model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(second.get_value(), first.get_value(), err_msg=str(path))


def test_save_model_on_a_plain_module_says_how_to_keep_its_parameters(tmp_path):
    trainer = torchlike.Trainer(model=MiniGPT(), args=training_arguments(tmp_path), loss_fn=lambda model, batch: 0.0)
    with pytest.raises(NotImplementedError, match="plain MiniGPT.*save_strategy"):
        trainer.save_model()
