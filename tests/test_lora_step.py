"""The merged LoRA train step (``lora_step``): the same losses and factors as Qwix's factored step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import torchlike
from tests import tiny
from tests.helpers.models import randomize_lora_
from torchlike.adapters.lora import runtime as lora_runtime
from torchlike.adapters.losses import sft as sft_loss
from torchlike.adapters.training import train_step
from torchlike.peft import LoraConfig, get_peft_model
from torchlike.trl import SFTConfig
from torchlike.trl.trainer.sft_trainer import SFTTrainer


def lora_model(path, **config):
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **config}))
    randomize_lora_(model, seed=5)  # B != 0, so the delta (and dA) are not trivially zero
    return model


def run_steps(model, merged_scale, steps=3):
    """Losses, grad norms and final factors of ``steps`` SGD steps on one padded batch."""
    optimizer = nnx.Optimizer(model.module, optax.sgd(0.2), wrt=nnx.LoRAParam)
    step = train_step.make_train_step(sft_loss.sft_step_loss(model.family), nnx.LoRAParam,
                                     merged_lora_scale=merged_scale)
    ids, mask, _ = tiny.padded_batch()
    batch = {"input_ids": ids[None], "attention_mask": mask[None], "loss_mask": mask[None]}
    metrics = [jax.device_get(step(model.module, optimizer, batch, np.int32(i))) for i in range(steps)]
    factors = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model.module, nnx.LoRAParam))}
    return [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics], factors


@pytest.mark.parametrize("case", ["qwen2", "gemma3_mha"])  # Linear + einsum kernels; Gemma's fused, reordered kv
def test_merged_step_gives_the_losses_gradients_and_factors_of_the_factored_step(case, tiny_checkpoints):
    path = tiny_checkpoints.path(case)
    factored_model, merged_model = lora_model(path), lora_model(path)
    assert lora_runtime.mergeable(merged_model.module)
    factored = run_steps(factored_model, None)
    merged = run_steps(merged_model, merged_model.active_peft_config.scale)
    np.testing.assert_allclose(merged[0], factored[0], rtol=2e-5)
    np.testing.assert_allclose(merged[1], factored[1], rtol=2e-4)
    assert factored[0][-1] < factored[0][0]  # the steps did train
    for key, value in factored[2].items():  # fp32 sums in another order: differences far below the updates
        np.testing.assert_allclose(merged[2][key], value, rtol=0, atol=2e-4 * np.abs(value).max(), err_msg=str(key))


def test_the_merged_step_leaves_the_base_weights_and_the_eval_outputs_consistent(tiny_checkpoints):
    model = lora_model(tiny_checkpoints.path("qwen2"))
    base_before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model.module, nnx.Param))
                   if not isinstance(v, nnx.LoRAParam)}
    run_steps(model, model.active_peft_config.scale, steps=2)
    for key, value in nnx.to_flat_state(nnx.state(model.module, nnx.Param)):
        if key in base_before:
            np.testing.assert_array_equal(np.asarray(value.get_value()), base_before[key], err_msg=str(key))
    # The merged forward and Qwix's factored (eval) forward agree after training.
    ids, mask, _ = tiny.padded_batch()
    tokens, positions, attention = torchlike.adapters.model.tunix_model.causal_inputs(ids, mask)
    with lora_runtime.merged_lora(model.active_peft_config.scale):
        merged_logits = np.asarray(model.family.forward(model.module, tokens, positions, attention))
    valid = mask.astype(bool)
    np.testing.assert_allclose(merged_logits[valid], np.asarray(model(ids, mask).logits)[valid], rtol=1e-4, atol=1e-4)


def _dot_generals(jaxpr):
    """Every dot_general equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _dot_generals(inner)


@pytest.mark.parametrize("mode, weight_gradients", [("merged", False), ("factored", False), ("full", True)])
def test_the_merged_step_takes_factor_gradients_without_weight_gradients(mode, weight_gradients, tiny_checkpoints):
    """Full fine-tuning forms each layer's [in, out] gradient summed over the tokens; the merged step's custom
    VJP (like Qwix's factored ops) takes the factors' gradients from thin products instead."""
    model = lora_model(tiny_checkpoints.path("qwen2"))
    ids, mask, _ = tiny.padded_batch()
    tokens, positions, attention = torchlike.adapters.model.tunix_model.causal_inputs(ids, mask)
    graphdef, params, rest = nnx.split(model.module, nnx.Param if mode == "full" else nnx.LoRAParam, ...)

    def loss(params):
        module = nnx.merge(graphdef, params, rest)
        with lora_runtime.merged_lora(2.0) if mode == "merged" else lora_runtime.lora_mode(lora_runtime.EVAL):
            return model.family.forward(module, tokens, positions, attention).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    kernels = {tuple(sorted(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model.module, nnx.Param))
               if not isinstance(v, nnx.LoRAParam) and v.get_value().ndim >= 2}

    def contracted(eqn) -> int:
        return int(np.prod([eqn.invars[0].aval.shape[axis] for axis in eqn.params["dimension_numbers"][0][0]]))

    over_tokens = [eqn for eqn in _dot_generals(jaxpr) if tuple(sorted(eqn.outvars[0].aval.shape)) in kernels
                   and contracted(eqn) >= tokens.shape[1]]
    assert bool(over_tokens) == weight_gradients


def sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path, lora_step="auto", bf16=False, **lora):
    return SFTTrainer(model=str(tiny_checkpoints.path("qwen2")),
                      args=SFTConfig(output_dir=str(tmp_path / "out"), max_length=32, per_device_train_batch_size=4,
                                     max_steps=4, learning_rate=1e-2, logging_steps=1, report_to="none",
                                     save_strategy="no", lora_step=lora_step, bf16=bf16),
                      train_dataset=[{"prompt": "the quick brown", "completion": " fox jumps over"}] * 8,
                      processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))


def test_lora_step_auto_merges_on_cpu_and_factored_or_dropout_do_not(tiny_checkpoints, tokenizer_dir, tmp_path):
    assert sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path)._merged_lora_scale() == 2.0
    assert sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path, "factored")._merged_lora_scale() is None
    assert sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path, lora_dropout=0.1)._merged_lora_scale() is None
    with pytest.raises(ValueError, match=r"lora_step='merged' cannot apply lora_dropout=0.1"):
        sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path, "merged", lora_dropout=0.1)._merged_lora_scale()
    with pytest.raises(ValueError, match=r"lora_step='fused' must be 'auto', 'merged' or 'factored'"):
        SFTConfig(output_dir=str(tmp_path), lora_step="fused")


def test_lora_sft_gives_the_same_losses_with_merged_and_factored_steps(tiny_checkpoints, tokenizer_dir, tmp_path):
    runs = {}
    for choice in ("merged", "factored"):  # with TRL's default bf16 (float32 is compared in the tests above)
        trainer = sft_trainer(tiny_checkpoints, tokenizer_dir, tmp_path / choice, choice, bf16=True)
        trainer.train()
        runs[choice] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(runs["merged"]) == 4 and runs["merged"][-1] < runs["merged"][0]
    assert runs["merged"][0] == pytest.approx(runs["factored"][0], rel=1e-6)
    # Later steps: AdamW's g / sqrt(v) turns fp32 rounding in near-zero gradients into +-lr updates.
    np.testing.assert_allclose(runs["merged"], runs["factored"], rtol=3e-3)


def test_quantised_base_weights_are_not_mergeable(tiny_checkpoints):
    with pytest.warns(UserWarning):
        model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2")),
                               LoraConfig(r=4, target_modules="all-linear", quantize_base="int8"))
    assert not lora_runtime.mergeable(model.module)


def test_lora_linear_gradients_equal_autodiff_of_the_merged_product():
    keys = jax.random.split(jax.random.key(3), 5)
    x, w = jax.random.normal(keys[0], (12, 8)), jax.random.normal(keys[1], (8, 6))
    a, b = jax.random.normal(keys[2], (8, 3)), jax.random.normal(keys[3], (3, 6))
    probe = jax.random.normal(keys[4], (12, 6))

    def ours(x, a, b):
        return (lora_runtime.lora_linear(1.5, x, w, a, b) * probe).sum()

    def reference(x, a, b):
        return ((x @ (w + 1.5 * a @ b)) * probe).sum()

    np.testing.assert_allclose(ours(x, a, b), reference(x, a, b), rtol=1e-6)
    for got, want in zip(jax.grad(ours, argnums=(0, 1, 2))(x, a, b), jax.grad(reference, argnums=(0, 1, 2))(x, a, b),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The base weight is frozen: its cotangent is zero, never the [in, out] product over the tokens.
    assert not np.any(jax.grad(lambda w_: (lora_runtime.lora_linear(1.5, x, w_, a, b) * probe).sum())(w))


@pytest.mark.parametrize("dropout", [0.5, 0.0])
def test_each_micro_batch_of_a_step_draws_its_own_lora_dropout_mask(tiny_checkpoints, dropout):
    """The micro-batches of one step run in a scan that carries the LoRA dropout stream from one to the next: two
    copies of one micro-batch get two masks, so their mean loss is not the loss of that micro-batch alone, which the
    first copy draws (without dropout the two are equal; a step that reset the stream for each micro-batch fails
    here)."""
    losses = []
    for copies in (1, 2):
        model = lora_model(tiny_checkpoints.path("qwen2"), lora_dropout=dropout)
        optimizer = nnx.Optimizer(model.module, optax.sgd(0.0), wrt=nnx.LoRAParam)
        step = train_step.make_train_step(sft_loss.sft_step_loss(model.family), nnx.LoRAParam, lora=True)
        ids, mask, _ = tiny.padded_batch()
        batch = {name: np.stack([value] * copies) for name, value in (("input_ids", ids), ("attention_mask", mask),
                                                                       ("loss_mask", mask))}
        losses.append(float(jax.device_get(step(model.module, optimizer, batch, np.int32(0)))["loss"]))
    if dropout:
        assert abs(losses[1] - losses[0]) > 1e-4 * abs(losses[0]), losses
    else:
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
