"""SFTTrainer's TRL surface beyond the data path: NEFTune, the DFT loss, the prepared train_dataset, args given as
TrainingArguments, aux_loss_enabled, the model tags and TRL's refusals."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import torchlike
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.model import neftune
from torchlike.adapters.training import train_step
from torchlike.trl import SFTConfig, SFTTrainer

DATA = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog"},
        {"prompt": "one two", "completion": " three four five six"},
        {"prompt": "hello", "completion": " world"},
        {"prompt": "seven eight nine", "completion": " ten"}] * 2


def config(tmp_path, **overrides) -> SFTConfig:
    values = dict(output_dir=str(tmp_path / "out"), max_length=32, per_device_train_batch_size=4, max_steps=3,
                  learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no")
    values.update(overrides)
    return SFTConfig(**values)


@pytest.fixture
def model_path(tiny_checkpoints):
    return str(tiny_checkpoints.path("qwen2"))


def losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# --- NEFTune -----------------------------------------------------------------------------------------------------


def embedding_noise_probe(batch_length):
    """A step loss whose metric is the largest change NEFTune makes to the embeddings of the batch."""

    def loss(module, batch, num_items_in_batch=None):
        tokens = batch["input_ids"].astype("int32")
        noisy = module.embedder.encode(tokens)
        clean = module.embedder.input_embedding[...][tokens]  # Qwen2's encode without noise: a table lookup
        change = abs(noisy - clean).max()
        parameters = sum(leaf.sum() for leaf in jax_leaves(nnx.state(module, nnx.Param)))
        return 0.0 * parameters, 1.0, {"change": change}

    return neftune.with_neftune(loss, 5.0, batch_length)


def jax_leaves(state):
    import jax

    return jax.tree.leaves(state)


def test_neftune_noise_has_transformers_magnitude_in_train_steps_only(tiny_checkpoints):
    import torch
    from transformers.integrations.neftune import neftune_post_forward_hook

    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    mask = np.zeros((1, 4, 24), np.int32)
    mask[0, :, :10] = 1
    mask[0, 1, :17] = 1  # the batch's longest row: TRL pads the batch to 17 positions
    batch = {"input_ids": np.full((1, 4, 24), 5, np.int32), "attention_mask": mask}
    loss = embedding_noise_probe(neftune.batch_length)
    hidden = model.config.hidden_size
    expected = 5.0 / np.sqrt(17 * hidden)

    embedding = torch.nn.Embedding(128, hidden)
    embedding.neftune_noise_alpha = 5.0
    clean = embedding(torch.full((4, 17), 5))
    torch_change = (neftune_post_forward_hook(embedding, None, clean) - clean).abs().max().item()
    assert 0.97 * expected < torch_change <= expected  # transformers' formula, L = the padded batch length

    step = train_step.make_train_step(loss, nnx.Param)
    optimizer = nnx.Optimizer(model.module, optax.sgd(0.0), wrt=nnx.Param)
    change = float(step(model.module, optimizer, batch, np.int32(0))["change"])
    assert 0.97 * expected < change <= expected * (1 + 1e-6)
    again = float(step(model.module, optimizer, batch, np.int32(0))["change"])
    assert again == change  # the noise of step i is a function of (seed, i)
    eval_step = train_step.make_eval_step(loss)
    assert float(eval_step(model.module, {key: value[0] for key, value in batch.items()})[2]["change"]) == 0.0


def test_neftune_length_is_trl_batch_length():
    import jax.numpy as jnp

    mask = jnp.asarray([[1] * 5 + [0] * 5, [1] * 7 + [0] * 3])
    assert int(neftune.batch_length({"attention_mask": mask})) == 7  # padded to the longest row
    assert int(neftune.batch_length({"attention_mask": mask}, pad_to_multiple_of=4)) == 8
    assert int(neftune.batch_length({"attention_mask": mask}, padding_free=True)) == 12  # one flattened row


def test_neftune_changes_training_deterministically_and_leaves_generation_alone(model_path, tokenizer, tmp_path):
    def run(alpha):
        trainer = SFTTrainer(model=model_path, args=config(tmp_path, neftune_noise_alpha=alpha, bf16=False),
                             train_dataset=DATA, processing_class=tokenizer)
        return trainer, losses(trainer)

    trainer, noisy = run(5.0)
    _, plain = run(None)
    assert noisy != plain and noisy == run(5.0)[1]
    embedder = trainer.model.module.embedder
    assert type(embedder).__bases__ == (nnx.Module,)  # Tunix's own Embedder again: the hook left with the trace
    assert trainer.evaluate(eval_dataset=DATA)["eval_loss"] == trainer.evaluate(eval_dataset=DATA)["eval_loss"]


# --- DFT ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_loss_equals_trl_compute_loss(model_path, tokenizer, tokenizer_dir, tmp_path, loss_type):
    import datasets
    import torch
    import transformers
    import trl

    # bf16 off: a float32 comparison of one batch's loss with TRL's.
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_length=32,
                           loss_type=loss_type, report_to="none"),
        train_dataset=datasets.Dataset.from_list(DATA),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    inputs = reference.data_collator([reference.train_dataset[i] for i in range(len(DATA))])
    with torch.no_grad():
        expected = reference.compute_loss(reference.model, inputs).item()

    trainer = SFTTrainer(model=model_path, args=config(tmp_path, bf16=False, loss_type=loss_type,
                                                       per_device_eval_batch_size=len(DATA)),
                         train_dataset=DATA, processing_class=tokenizer)
    np.testing.assert_allclose(trainer.evaluate(eval_dataset=DATA)["eval_loss"], expected, rtol=1e-5)


def test_dft_loss_weights_each_token_by_its_detached_probability():
    import jax
    import jax.numpy as jnp

    class Family:
        @staticmethod
        def hidden_states(module, tokens, positions, attention):
            return module["hidden"]

        @staticmethod
        def logits_from_hidden(module, hidden):
            return hidden

    hidden = jax.random.normal(jax.random.key(0), (2, 5, 7))
    batch = {"input_ids": jnp.asarray([[1, 2, 3, 4, 5], [6, 5, 4, 3, 2]]), "attention_mask": jnp.ones((2, 5)),
             "loss_mask": jnp.asarray([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])}

    def dft(module):
        value, weight, _ = sft_loss.sft_step_loss(Family, loss_type="dft")(module, batch)
        return value / weight

    log_probs = jnp.take_along_axis(jax.nn.log_softmax(hidden[:, :-1]), batch["input_ids"][:, 1:, None], -1)[..., 0]
    mask = batch["loss_mask"][:, 1:]
    expected = -(log_probs * jnp.exp(log_probs) * mask).sum() / mask.sum()  # TRL: -log p * p.detach()
    np.testing.assert_allclose(dft({"hidden": hidden}), expected, rtol=1e-6)
    gradient = jax.grad(lambda h: dft({"hidden": h}))(hidden)
    expected_gradient = jax.grad(lambda h: -(jnp.take_along_axis(jax.nn.log_softmax(h[:, :-1]),
                                                                 batch["input_ids"][:, 1:, None], -1)[..., 0]
                                             * jnp.exp(log_probs) * mask).sum() / mask.sum())(hidden)
    np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-5, atol=1e-7)


# --- the prepared dataset ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [DATA, [{"text": "the quick brown fox"}, {"text": "one two three"}] * 4],
                         ids=["prompt_completion", "text"])
@pytest.mark.parametrize("packing", [False, True])
def test_train_dataset_is_trl_prepared_dataset(model_path, tokenizer, tokenizer_dir, tmp_path, rows, packing):
    import datasets
    import torch
    import transformers
    import trl

    settings = dict(max_length=16, packing=packing)
    reference = trl.SFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", **settings),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer = SFTTrainer(model=model_path, args=config(tmp_path, **settings), train_dataset=rows,
                         processing_class=tokenizer)
    ours, theirs = trainer.train_dataset, reference.train_dataset
    assert isinstance(ours, datasets.Dataset)
    assert ours.column_names == theirs.column_names
    assert ours[:4] == theirs[:4]
    assert len(ours) == len(theirs)


# --- constructor -------------------------------------------------------------------------------------------------


def test_training_arguments_become_an_sft_config_keeping_their_values(model_path, tokenizer, tmp_path):
    args = torchlike.TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1e-3, max_steps=2,
                                       hub_token="secret", report_to="none")
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=DATA, processing_class=tokenizer)
    assert isinstance(trainer.args, SFTConfig)
    assert trainer.args.learning_rate == 1e-3 and trainer.args.hub_token == "secret"
    # TrainingArguments' own values are kept, as TRL's SFTConfig(**args.to_dict()) keeps them
    assert trainer.args.gradient_checkpointing is False and trainer.args.logging_steps == args.logging_steps
    assert trainer.args.max_length == 1024  # SFT's fields take their defaults


def test_aux_loss_and_model_tags_follow_trl(model_path, tokenizer, tokenizer_dir, tmp_path):
    trainer = SFTTrainer(model=model_path, args=config(tmp_path), train_dataset=DATA, processing_class=tokenizer)
    assert trainer.aux_loss_enabled is False and trainer.router_aux_loss_coef == 0.0  # a dense model
    assert trainer.model.model_tags == ["trl", "sft"] == SFTTrainer._tag_names


def test_trl_refusals_keep_trl_wording(model_path, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        SFTTrainer(model=model_path, args=config(tmp_path), processing_class=tokenizer)
    with pytest.raises(ValueError, match="appears to be vision-related .* not seem to be a vision-language model"):
        SFTTrainer(model=model_path, args=config(tmp_path), processing_class=tokenizer,
                   train_dataset=[{"images": [], "messages": []}])
    with pytest.raises(ValueError, match="`compute_loss_func` together with `loss_type='dft'`"):
        SFTTrainer(model=model_path, args=config(tmp_path, loss_type="dft"), processing_class=tokenizer,
                   train_dataset=DATA, compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0.0)
