"""GRPO's entropy settings, reference syncing (GRPO and DPO), cast_lm_head_to_fp32, GRPO's logs and TRL's checks.

The entropy loss is held against the real ``GRPOTrainer._compute_loss`` on a stand-in trainer (as in
``test_rl_math``), with a stub model family whose "hidden states" are fixed logits, so torchlike's whole step loss
(``grpo_losses.grpo_step_loss``) and its gradient are compared, not only the formula. End-to-end comparisons with TRL
are in ``test_grpo_vs_trl`` (entropy bonus) and ``test_dpo_trainer`` (WPO weighting, synced reference).
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import TrainerCallback
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

import torchlike
from tests.tiny import PROMPTS, scripted_rollout, token_reward
from torchlike.adapters.losses import grpo as grpo_losses
from torchlike.adapters.losses import logprobs as chunked_logprobs
from torchlike.adapters.model import nnx_state
from torchlike.adapters.training.train_step import cast_floating
from torchlike.peft import LoraConfig
from torchlike.trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

BATCH, PROMPT, COMPLETION, VOCAB = 6, 3, 7, 11
ACCUMULATION, STEPS_PER_GENERATION = 2, 4
PAIRS = [{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog"},
         {"prompt": "one two", "chosen": " three four", "rejected": " five"}] * 4


# --- the entropy bonus and the high-entropy mask against TRL's _compute_loss -------------------------------------

class _Accelerator:
    """Single-process accelerate: gathers, pads and reductions return their input."""

    num_processes = 1
    sync_gradients = True

    def gather(self, tensor):
        return tensor

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


class _GRPOStandIn:
    """The attributes TRL's _compute_loss reads; its 'model' scores the completions with the given logits."""

    get_high_entropy_mask = TRLGRPOTrainer.get_high_entropy_mask

    def __init__(self, logits, temperature, *, loss_type, entropy_coef, top_entropy_quantile):
        self._logits, self._temperature = logits, temperature
        self.loss_type, self.beta, self.importance_sampling_level = loss_type, 0.0, "token"
        self.epsilon_low = self.epsilon_high = 0.2
        self.max_completion_length = COMPLETION
        self.current_gradient_accumulation_steps = ACCUMULATION
        self.off_policy_mask_threshold = None
        self.top_entropy_quantile, self.entropy_coef = top_entropy_quantile, entropy_coef
        self.use_adaptive_entropy = False
        self._entropy_bonus_enabled = entropy_coef != 0.0
        self.use_vllm = self.vllm_importance_sampling_correction = self.aux_loss_enabled = False
        self.model = SimpleNamespace(training=True)
        self.accelerator = _Accelerator()
        self.args = SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=STEPS_PER_GENERATION)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logits = self._logits[:, :-1][:, -logits_to_keep:] / self._temperature
        targets = input_ids[:, 1:][:, -logits_to_keep:]
        return selective_log_softmax(logits, targets), entropy_from_logits(logits), None


def _stub_family():
    """A model family whose 'module' is the logits array itself: hidden states = logits, identity head."""
    return SimpleNamespace(hidden_states=lambda module, ids, positions, attention: module,
                           logits_from_hidden=lambda module, hidden: hidden)


def _loss_inputs(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 5, 0, 1, 6])
    mask = (np.arange(COMPLETION)[None] < lengths[:, None]).astype(np.int64)
    return {"logits": rng.normal(0, 2.0, (BATCH, PROMPT + COMPLETION, VOCAB)).astype(np.float32),
            "input_ids": rng.integers(0, VOCAB, (BATCH, PROMPT + COMPLETION)), "completion_mask": mask,
            "advantages": np.array([1.3, -0.7, 0.4, -1.1, 2.0, -0.2], np.float32),
            "old_logps": -rng.uniform(0.5, 3.0, (BATCH, COMPLETION)).astype(np.float32)}


def _trl_loss(data, temperature, **settings):
    logits = torch.tensor(data["logits"], requires_grad=True)
    stand_in = _GRPOStandIn(logits, temperature, **settings)
    mask = torch.tensor(data["completion_mask"])
    inputs = {"prompt_ids": torch.tensor(data["input_ids"][:, :PROMPT]),
              "prompt_mask": torch.ones(BATCH, PROMPT, dtype=torch.long),
              "completion_ids": torch.tensor(data["input_ids"][:, PROMPT:]), "completion_mask": mask,
              "advantages": torch.tensor(data["advantages"]),
              "old_per_token_logps": torch.tensor(data["old_logps"]),
              "num_items_in_batch": torch.tensor(3.0 * mask.sum().item())}
    loss = TRLGRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.item(), {key: values[-1] for key, values in stand_in._metrics["train"].items()}, logits.grad.numpy()


def _our_loss(data, temperature, *, loss_type, entropy_coef, top_entropy_quantile):
    """torchlike's step loss of one micro-batch, scaled as the train step scales it (value / summed weights of the
    accumulation window), with its gradient."""
    settings = grpo_losses.GRPOLossSettings(
        loss_type=loss_type, beta=0.0, epsilon=0.2, epsilon_high=0.2, importance_sampling_level="token",
        max_completion_length=COMPLETION, temperature=temperature, use_bias_correction_kl=True,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef)
    step_loss = grpo_losses.grpo_step_loss(_stub_family(), settings, block_size=None)
    mask = data["completion_mask"]
    token_sum = loss_type in grpo_losses.NUM_ITEMS_NORMALISED_LOSSES
    batch = {"input_ids": jnp.asarray(data["input_ids"]),
             "attention_mask": jnp.ones((BATCH, PROMPT + COMPLETION), jnp.int32),
             "completion_mask": jnp.asarray(mask), "advantages": jnp.asarray(data["advantages"]),
             "old_logps": jnp.asarray(data["old_logps"]),
             "num_items": jnp.full(BATCH, 3.0 * mask.sum() * ACCUMULATION / STEPS_PER_GENERATION),
             "step_weight": jnp.full(BATCH, 1.0 / ACCUMULATION if token_sum else 1.0)}

    def scaled(logits):
        value, weight, metrics = step_loss(logits, batch)
        return value / (weight * ACCUMULATION), metrics

    (loss, metrics), grad = jax.value_and_grad(scaled, has_aux=True)(jnp.asarray(data["logits"]))
    return float(loss), metrics, np.asarray(grad)


@pytest.mark.parametrize(("loss_type", "entropy_coef", "top_entropy_quantile"), [
    ("grpo", 0.05, 1.0), ("grpo", 0.05, 0.3), ("dapo", 0.2, 0.5), ("dapo", 0.0, 0.4)])
def test_entropy_bonus_and_high_entropy_mask_match_trl_compute_loss(loss_type, entropy_coef, top_entropy_quantile):
    data, temperature = _loss_inputs(), 0.7
    settings = dict(loss_type=loss_type, entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile)
    their_loss, their_metrics, their_grad = _trl_loss(data, temperature, **settings)
    our_loss, our_metrics, our_grad = _our_loss(data, temperature, **settings)

    np.testing.assert_allclose(our_loss, their_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(our_grad, their_grad, rtol=1e-5, atol=1e-6)
    assert set(our_metrics) == set(their_metrics)
    for key, value in their_metrics.items():
        np.testing.assert_allclose(float(our_metrics[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)


# --- cast_lm_head_to_fp32 ----------------------------------------------------------------------------------------

def test_cast_lm_head_to_fp32_runs_the_head_in_float32_on_bf16_hidden_states(tiny_checkpoints):
    model = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(3, 60, (2, 10)), jnp.int32),
             "attention_mask": jnp.ones((2, 10), jnp.int32), "completion_mask": jnp.ones((2, 4), jnp.int32)}
    family, module = model.family, model.module

    def log_probs(lm_head_in_float32):
        return np.asarray(grpo_losses.completion_scores(family, module, batch, 1.0, None, compute_dtype=jnp.bfloat16,
                                                       lm_head_in_float32=lm_head_in_float32).log_probs)

    bf16_hidden = chunked_logprobs.hidden_states(family, cast_floating(module, jnp.bfloat16), batch)
    weight = np.asarray(model.state_dict()["lm_head.w"], np.float64)
    logits = np.asarray(bf16_hidden, np.float64)[:, -5:-1] @ weight
    logits -= logits.max(-1, keepdims=True)
    expected = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(expected, np.asarray(batch["input_ids"])[:, -4:, None], -1)[..., 0]

    np.testing.assert_allclose(log_probs(True), expected, rtol=0, atol=2e-5)
    assert np.abs(log_probs(False) - expected).max() > 1e-3  # the bf16 head rounds the logits


# --- sync_ref_model -----------------------------------------------------------------------------------------------

def _params(module) -> dict[str, np.ndarray]:
    return {path: np.array(variable.get_value()) for path, variable in nnx_state.flat_variables(module).items()}


class _PolicyAtStep(TrainerCallback):
    """Keeps the policy's parameters at the end of each step."""

    def __init__(self, module_of):
        self.module_of, self.steps = module_of, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = _params(self.module_of())


def _expected_mix(initial, policy, alpha):
    return {path: (initial[path] * np.float32(1 - alpha) + policy[path] * np.float32(alpha)).astype(initial[path].dtype)
            for path in initial}


def _assert_params_equal(actual, expected):
    assert set(actual) == set(expected)
    for path, value in expected.items():
        # float32 rounding only: XLA may fuse the multiply-add into one rounding (the policy moved by ~1e-2).
        np.testing.assert_allclose(actual[path], value, rtol=1e-6, atol=1e-8, err_msg=path)


def _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=3, learning_rate=1e-2, logging_steps=1, report_to="none",
                  save_strategy="no", bf16=False, shuffle_dataset=False)
    values.update(overrides)
    peft_config = values.pop("peft_config", None)
    reward_funcs = values.pop("reward_funcs", token_reward)
    train_dataset = values.pop("train_dataset", [{"prompt": p} for p in PROMPTS])
    return GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=reward_funcs,
                       args=GRPOConfig(**values), train_dataset=train_dataset,
                       processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir),
                       rollout_func=scripted_rollout, peft_config=peft_config)


def test_grpo_sync_ref_model_mixes_the_policy_into_the_reference_every_sync_steps(tiny_checkpoints, tokenizer_dir,
                                                                                   tmp_path):
    trainer = _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
                    ref_model_mixup_alpha=0.3)
    initial = _params(trainer.reference.module)
    policy = _PolicyAtStep(lambda: trainer._module)
    trainer.add_callback(policy)
    trainer.train()

    # Synced after step 2 only (step 3 is not a multiple of 2): 0.3 x policy(step 2) + 0.7 x initial.
    _assert_params_equal(_params(trainer.reference.module), _expected_mix(initial, policy.steps[2], 0.3))


def test_dpo_sync_ref_model_mixes_the_policy_into_the_reference_every_sync_steps(tiny_checkpoints, tokenizer_dir,
                                                                                  tmp_path):
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=20, per_device_train_batch_size=2, max_steps=3,
                     learning_rate=1e-2, report_to="none", save_strategy="no", bf16=False, sync_ref_model=True,
                     ref_model_sync_steps=2, ref_model_mixup_alpha=0.6)
    trainer = DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=args, train_dataset=PAIRS,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    initial = _params(trainer.reference.module)
    policy = _PolicyAtStep(lambda: trainer._module)
    trainer.add_callback(policy)
    trainer.train()

    _assert_params_equal(_params(trainer.reference.module), _expected_mix(initial, policy.steps[2], 0.6))


# --- GRPO logs ----------------------------------------------------------------------------------------------------

def test_grpo_run_ending_between_logging_steps_logs_its_last_rewards_in_the_summary(tiny_checkpoints, tokenizer_dir,
                                                                                    tmp_path):
    trainer = _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, logging_steps=2, max_steps=3)
    rewards = []
    score = trainer.reward_scorer.rewards

    def recording(*args):
        table = score(*args)
        rewards.append(table)
        return table

    trainer.reward_scorer.rewards = recording
    trainer.train()
    step_entry, summary = trainer.state.log_history[-2:]

    # As TRL: the summary (train_runtime...) carries the rollout metrics gathered after the last logging step.
    assert step_entry["step"] == 2 and "train_runtime" in summary
    np.testing.assert_allclose(step_entry["reward"], np.mean([r.mean() for r in rewards[:2]]), rtol=1e-6)
    np.testing.assert_allclose(summary["reward"], rewards[2].mean(), rtol=1e-6)
    np.testing.assert_allclose(summary["rewards/token_reward/mean"], rewards[2].mean(), rtol=1e-6)


def test_grpo_warns_in_trls_words_when_every_reward_function_returns_none(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                         caplog):
    def sometimes_none(completion_ids, **kwargs):
        return [None if index == 1 else 1.0 for index in range(len(completion_ids))]

    trainer = _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, max_steps=1, reward_funcs=sometimes_none)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    # Through Python's logging, as TRL's logger emits it.
    message = next(record.getMessage() for record in caplog.records if "returned None" in record.getMessage())
    assert message.startswith("All reward functions returned None for the following kwargs:\n")
    assert message.endswith("\nPlease ensure that at least one reward function returns a valid reward.")
    assert f"'prompt': '{PROMPTS[0]}'" in message


def test_grpo_adds_trl_model_tags(tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = _grpo(tiny_checkpoints, tokenizer_dir, tmp_path)
    assert trainer.model.model_tags == ["trl", "grpo"]
    assert trainer.aux_loss_enabled is False  # TRL's attribute (a dense model: False in TRL too)


def test_dpo_adds_trl_model_tags(tiny_checkpoints, tokenizer_dir, tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), max_length=20, report_to="none")
    trainer = DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=args, train_dataset=PAIRS,
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    assert trainer.model.model_tags == ["trl", "dpo"]
    assert trainer.aux_loss_enabled is False  # TRL's attribute (a dense model: False in TRL too)


# --- TRL's checks, in its words -----------------------------------------------------------------------------------

def test_grpo_without_reward_functions_raises_trls_no_reward_source_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided. Pass `reward_funcs`"):
        _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, reward_funcs=[])


def test_grpo_without_train_dataset_raises_trls_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=token_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), report_to="none"),
                    processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))


def test_dpo_without_train_dataset_raises_trls_error(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=DPOConfig(output_dir=str(tmp_path)))


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo"])
def test_grpo_sequence_level_ratio_with_a_token_summed_loss_warns_as_trl(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                         loss_type, caplog):
    with caplog.at_level(logging.WARNING):
        _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, importance_sampling_level="sequence", loss_type=loss_type)
    assert [record.levelno for record in caplog.records
            if f"the `'{loss_type}'` loss sums per-token contributions" in record.getMessage()] == [logging.WARNING]


def test_grpo_sequence_level_ratio_with_grpo_loss_does_not_warn(tiny_checkpoints, tokenizer_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, importance_sampling_level="sequence", loss_type="grpo")
    assert not [record for record in caplog.records if "loss sums per-token contributions" in record.getMessage()]


def test_grpo_with_image_column_refuses_the_text_model(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="The dataset appears to be vision-related"):
        _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, train_dataset=[{"prompt": p, "image": None} for p in PROMPTS])


def test_dpo_with_images_column_refuses_the_text_model(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="The dataset appears to be vision-related"):
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=DPOConfig(output_dir=str(tmp_path)),
                   train_dataset=[{**pair, "images": []} for pair in PAIRS],
                   processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))


def test_dpo_precompute_ref_log_probs_on_an_iterable_dataset_raises_trls_error(tiny_checkpoints, tokenizer_dir,
                                                                              tmp_path):
    import datasets

    stream = datasets.Dataset.from_list(PAIRS).to_iterable_dataset()
    with pytest.raises(ValueError, match="`precompute_ref_log_probs=True` is not supported with IterableDataset"):
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")),
                   args=DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True), train_dataset=stream,
                   processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))


def test_dpo_evaluate_on_new_data_after_full_fine_tuning_with_precomputed_reference_raises_trls_error(
        tiny_checkpoints, tokenizer_dir, tmp_path):
    import datasets
    import transformers
    import trl

    path = tiny_checkpoints.path("qwen2")
    settings = dict(max_steps=1, per_device_train_batch_size=4, max_length=20, precompute_ref_log_probs=True,
                    report_to="none", save_strategy="no")
    theirs = trl.DPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(path),
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings),
                            train_dataset=datasets.Dataset.from_list(PAIRS),
                            processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    theirs.train()
    with pytest.raises(ValueError) as expected:
        theirs.evaluate(eval_dataset=datasets.Dataset.from_list(PAIRS[:2]))
    ours = DPOTrainer(model=str(path), args=DPOConfig(output_dir=str(tmp_path / "ours"), **settings),
                      train_dataset=PAIRS, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
    ours.train()
    with pytest.raises(ValueError) as found:
        ours.evaluate(eval_dataset=PAIRS[:2])
    assert str(found.value) == str(expected.value)
    assert "Cannot compute reference log-probs for a dataset passed to `evaluate()`" in str(found.value)


def test_dpo_sync_ref_model_with_precomputed_reference_raises_trls_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="You cannot use `sync_ref_model=True` together with"):
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")),
                   args=DPOConfig(output_dir=str(tmp_path), sync_ref_model=True, precompute_ref_log_probs=True),
                   train_dataset=PAIRS, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))


def test_dpo_use_weighting_with_a_sorting_loss_raises_trls_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(NotImplementedError, match="WPO-style weighting is not implemented for 'aot'"):
        DPOTrainer(model=str(tiny_checkpoints.path("qwen2")),
                   args=DPOConfig(output_dir=str(tmp_path), use_weighting=True, loss_type=["aot"]),
                   train_dataset=PAIRS, processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))


def test_grpo_sync_ref_model_without_a_reference_raises_trls_error(tiny_checkpoints, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="You passed `sync_ref_model=True` while `beta=0.0`"):
        _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, sync_ref_model=True)


@pytest.mark.parametrize("trainer", ["grpo", "dpo"])
def test_sync_ref_model_with_lora_raises_trls_not_implemented_error(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                    trainer):
    lora = LoraConfig(r=4, target_modules=["q_proj"])
    with pytest.raises(NotImplementedError, match="You passed `sync_ref_model=True` while using a PEFT model"):
        if trainer == "grpo":
            _grpo(tiny_checkpoints, tokenizer_dir, tmp_path, beta=0.1, sync_ref_model=True, peft_config=lora)
        else:
            DPOTrainer(model=str(tiny_checkpoints.path("qwen2")),
                       args=DPOConfig(output_dir=str(tmp_path), sync_ref_model=True), train_dataset=PAIRS,
                       processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir), peft_config=lora)

