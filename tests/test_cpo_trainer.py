"""CPOTrainer (``trl.experimental.cpo``): TRL's numbers step for step for each loss type, its checks and messages."""

from __future__ import annotations

import pytest
import trl.experimental.cpo as trl_cpo

from tests import tiny
from tests.helpers.data import PREFERENCES
from tests.helpers.models import with_config
from torchlike.trl.experimental.cpo import CPOConfig, CPOTrainer

METRICS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss")


def comparison_settings(**overrides) -> dict:
    """Both trainers' settings: gradient accumulation, max_length=12 (several responses are cut), a warmup, weight
    decay and clipping (max_grad_norm below every step's norm); float32 on both sides (bf16 off)."""
    values = dict(max_length=12, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                  learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.01, adam_epsilon=1e-4,
                  logging_steps=1, seed=0, bf16=False, beta=0.2, report_to="none", save_strategy="no",
                  per_device_eval_batch_size=4)
    return {**values, **overrides}


CASES = {
    "sigmoid, label smoothing, AlphaPO rewards": dict(loss_type="sigmoid", label_smoothing=0.1, alpha=0.2),
    "hinge": dict(loss_type="hinge"),
    "ipo, cpo_alpha 0.5": dict(loss_type="ipo", cpo_alpha=0.5),
    # alphapo: simpo with cpo_alpha=0 (no NLL term).
    "simpo (alphapo)": dict(loss_type="alphapo", simpo_gamma=0.3),
    # TRL adds a mixture-of-experts model's router loss when the model config sets output_router_logits (its only
    # switch), times the config's router_aux_loss_coef (here far above its default, so that dropping it shows).
    "sigmoid, Qwen3-MoE with its router loss": dict(loss_type="sigmoid", model="qwen3_moe", model_config=dict(
        output_router_logits=True, router_aux_loss_coef=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpo_losses_metrics_evaluation_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                           case):
    options = dict(CASES[case])
    path = tiny_checkpoints.path(options.pop("model", "qwen2"))
    if "model_config" in options:
        path = with_config(path, tmp_path / "model", **options.pop("model_config"))
    settings = comparison_settings(**options)
    eval_data = PREFERENCES[1:7]  # a partial last batch: TRL's is shorter, torchlike's is padded with empty pairs
    tiny.assert_pairwise_trainer_matches_trl((trl_cpo.CPOTrainer, trl_cpo.CPOConfig), (CPOTrainer, CPOConfig), path,
                                             tokenizer_dir, tmp_path, PREFERENCES, settings, eval_data, METRICS)


def test_alphapo_becomes_simpo_without_the_nll_term_as_in_trl(tmp_path):
    theirs = trl_cpo.CPOConfig(output_dir=str(tmp_path), loss_type="alphapo", use_cpu=True)
    ours = CPOConfig(output_dir=str(tmp_path), loss_type="alphapo")
    assert (ours.loss_type, ours.cpo_alpha) == (theirs.loss_type, theirs.cpo_alpha) == ("simpo", 0.0)


def test_kto_pair_is_trls_error(tiny_checkpoints, tmp_path):
    import transformers

    path = tiny_checkpoints.path("qwen2")
    with pytest.raises(ValueError) as theirs:
        trl_cpo.CPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(path), train_dataset=PREFERENCES,
                           args=trl_cpo.CPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                                  loss_type="kto_pair"))
    with pytest.raises(ValueError) as ours:
        CPOTrainer(model=str(path), train_dataset=PREFERENCES,
                   args=CPOConfig(output_dir=str(tmp_path), report_to="none", loss_type="kto_pair"))
    assert str(ours.value) == str(theirs.value)


def test_an_unknown_loss_type_is_trls_error_before_training(tiny_checkpoints, tmp_path):
    import types

    import torch

    # TRL raises in the first step's cpo_loss, which reads only these trainer attributes.
    trainer = types.SimpleNamespace(alpha=0.0, loss_type="bogus", beta=0.1, label_smoothing=0.0,
                                    accelerator=types.SimpleNamespace(device="cpu"))
    with pytest.raises(ValueError) as theirs:
        trl_cpo.CPOTrainer.cpo_loss(trainer, torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError) as ours:
        CPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES,
                   args=CPOConfig(output_dir=str(tmp_path), report_to="none", loss_type="bogus"))
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("loss_type", ["hinge", "ipo"])
def test_label_smoothing_with_hinge_or_ipo_warns_as_trl(tiny_checkpoints, tokenizer_dir, tmp_path, loss_type):
    import torchlike

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.warns(UserWarning, match=f"You are using the {loss_type} loss type that does not support label "
                                         "smoothing. The `label_smoothing` parameter will be ignored."):
        CPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES[:4], processing_class=tokenizer,
                   args=CPOConfig(output_dir=str(tmp_path), report_to="none", loss_type=loss_type,
                                  label_smoothing=0.1))


def test_without_a_pad_token_the_eos_token_pads_and_the_model_learns_it(tiny_checkpoints, tokenizer_dir, tmp_path):
    import torchlike

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = None
    trainer = CPOTrainer(model=str(tiny_checkpoints.path("qwen2")), train_dataset=PREFERENCES[:4],
                         processing_class=tokenizer, args=CPOConfig(output_dir=str(tmp_path), report_to="none"))
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.pad_token_id == trainer.model.config.pad_token_id == tokenizer.eos_token_id
