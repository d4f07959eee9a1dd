"""adapters.losses (grpo, dpo, logprobs) give TRL 1.16's GRPO advantages, GRPO losses, DPO losses and
log-probabilities, with their gradients.

The losses are checked against the real ``GRPOTrainer._compute_loss`` and ``DPOTrainer._compute_loss``, called as
unbound functions on a stand-in object that carries only the attributes they read and returns fixed log-probabilities
in place of a model. The advantage computation sits in the middle of TRL's generation method, so
``_trl_advantages`` below transcribes its lines (grpo_trainer.py 2756-2805, TRL 1.16.0) around TRL's own ``nanstd``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import entropy_from_logits, nanstd, selective_log_softmax

from torchlike.adapters.losses import advantages, dpo, grpo, logprobs

RTOL, ATOL = 1e-5, 1e-6


def _close(ours, theirs, rtol=RTOL, atol=ATOL):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=rtol, atol=atol, equal_nan=True)


# --- fixed inputs --------------------------------------------------------------------------------------------------

BATCH, LENGTH = 6, 7


def _grpo_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """Log-probabilities, masks (one row fully masked, as mask_truncated_completions leaves it) and advantages."""
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 5, 0, 1, 6])
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.float32)
    logps = (-rng.uniform(0.05, 3.0, (BATCH, LENGTH))).astype(np.float32)
    return {
        "logps": logps,
        "old_logps": (logps + rng.normal(0, 0.3, (BATCH, LENGTH))).astype(np.float32),
        "ref_logps": (logps + rng.normal(0, 0.5, (BATCH, LENGTH))).astype(np.float32),
        "entropies": rng.uniform(0, 4, (BATCH, LENGTH)).astype(np.float32),
        "advantages": np.array([1.3, -0.7, 0.4, -1.1, 2.0, -0.2], np.float32),
        "mask": mask,
    }


# --- TRL's GRPO loss on a stand-in trainer ----------------------------------------------------------------------

class _Accelerator:
    """Single-process accelerate: gathers and reductions return their input."""

    device = torch.device("cpu")
    num_processes = 1

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


class _GRPOStandIn:
    """The attributes GRPOTrainer._compute_loss reads; the 'model' returns fixed log-probabilities and entropies."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def __init__(self, logps, entropies, *, loss_type, beta, epsilon, epsilon_high, importance_sampling_level,
                 max_completion_length, gradient_accumulation_steps, steps_per_generation, delta=None,
                 off_policy_mask_threshold=None, use_bias_correction_kl=True):
        self._logps, self._entropies = logps, entropies
        self.loss_type, self.beta, self.importance_sampling_level = loss_type, beta, importance_sampling_level
        self.epsilon_low, self.epsilon_high = epsilon, epsilon_high
        self.max_completion_length = max_completion_length
        self.current_gradient_accumulation_steps = gradient_accumulation_steps
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.top_entropy_quantile = 1.0
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self._entropy_bonus_enabled = self.aux_loss_enabled = False
        self.model = SimpleNamespace(training=True)
        self.accelerator = _Accelerator()
        self.args = SimpleNamespace(delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                                    steps_per_generation=steps_per_generation, sapo_temperature_pos=1.0,
                                    sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                    vespo_lambda_neg=2.0)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._logps, self._entropies, None


GRADIENT_ACCUMULATION, STEPS_PER_GENERATION = 2, 4


def _trl_grpo(data, *, on_policy=False, num_items_in_batch, **settings):
    """TRL's training loss (one micro-batch of an accumulation window), metrics and d loss / d logps."""
    logps = torch.tensor(data["logps"], requires_grad=True)
    mask = torch.tensor(data["mask"], dtype=torch.long)
    stand_in = _GRPOStandIn(logps, torch.tensor(data["entropies"]), max_completion_length=LENGTH,
                            gradient_accumulation_steps=GRADIENT_ACCUMULATION,
                            steps_per_generation=STEPS_PER_GENERATION, **settings)
    inputs = {
        "prompt_ids": torch.zeros(BATCH, 2, dtype=torch.long), "prompt_mask": torch.ones(BATCH, 2, dtype=torch.long),
        "completion_ids": torch.zeros(BATCH, LENGTH, dtype=torch.long), "completion_mask": mask,
        "advantages": torch.tensor(data["advantages"]), "ref_per_token_logps": torch.tensor(data["ref_logps"]),
        "num_items_in_batch": torch.tensor(float(num_items_in_batch)),
    }
    if not on_policy:
        inputs["old_per_token_logps"] = torch.tensor(data["old_logps"])
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in stand_in._metrics["train"].items()}
    return loss.detach(), metrics, logps.grad


def _our_grpo(data, *, on_policy=False, num_items_in_batch, epsilon, **settings):
    """Our loss, scaled for gradient accumulation as grpo_loss's docstring says TRL does, with its gradient."""
    loss_type = settings["loss_type"]
    token_normalised = loss_type in ("dapo", "cispo", "vespo")
    divisor = 1 if token_normalised else GRADIENT_ACCUMULATION

    def loss_fn(logps):
        loss, metrics = grpo.grpo_loss(
            logps, None if on_policy else jnp.asarray(data["old_logps"]), jnp.asarray(data["ref_logps"]),
            jnp.asarray(data["advantages"]), jnp.asarray(data["mask"]),
            grpo.GRPOLossSettings(epsilon=epsilon, max_completion_length=LENGTH, **settings),
            per_token_entropy=jnp.asarray(data["entropies"]),
            num_items_in_batch=max(num_items_in_batch, 1) * GRADIENT_ACCUMULATION / STEPS_PER_GENERATION)
        return loss / divisor, metrics

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(data["logps"]))
    return loss, metrics, grad


def _assert_grpo_matches(data, **settings):
    # The generation batch has more loss tokens than this micro-batch, as with steps_per_generation > 1.
    num_items = 3 * int(data["mask"].sum())
    their_loss, their_metrics, their_grad = _trl_grpo(data, num_items_in_batch=num_items, **settings)
    our_loss, our_metrics, our_grad = _our_grpo(data, num_items_in_batch=num_items, **settings)
    _close(our_loss, their_loss)
    _close(our_grad, their_grad)
    assert set(our_metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        _close(our_metrics[name], value, atol=1e-6)
    return our_metrics


# --- GRPO loss -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_grpo_loss_matches_trl_for_every_loss_type_and_level(loss_type, importance_sampling_level):
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28
    _assert_grpo_matches(_grpo_inputs(), loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                         beta=0.04, epsilon=0.2, epsilon_high=epsilon_high)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
def test_grpo_loss_on_policy_matches_trl(loss_type):
    metrics = _assert_grpo_matches(_grpo_inputs(1), on_policy=True, loss_type=loss_type,
                                   importance_sampling_level="token", beta=0.0, epsilon=0.2, epsilon_high=0.2)
    assert "kl" not in metrics


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_two_sided_clipping_delta_matches_trl(importance_sampling_level):
    data = _grpo_inputs(2)
    data["old_logps"] = data["logps"] - np.float32(0.6)  # ratio e^0.6 = 1.82 > delta on every token
    _assert_grpo_matches(data, loss_type="grpo", importance_sampling_level=importance_sampling_level, beta=0.04,
                         epsilon=0.2, epsilon_high=0.2, delta=1.5)


def test_off_policy_mask_and_kl_without_bias_correction_match_trl():
    _assert_grpo_matches(_grpo_inputs(3), loss_type="dapo", importance_sampling_level="token", beta=0.1, epsilon=0.2,
                         epsilon_high=0.28, off_policy_mask_threshold=0.05, use_bias_correction_kl=False)


def test_off_policy_ratios_are_not_one_and_clipping_is_reported():
    data = _grpo_inputs()
    metrics = _assert_grpo_matches(data, loss_type="dapo", importance_sampling_level="token", beta=0.0, epsilon=0.2,
                                   epsilon_high=0.2)
    ratio = np.exp(data["logps"] - data["old_logps"])[data["mask"] > 0]
    assert np.abs(ratio - 1).min() > 0
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert float(metrics["clip_ratio/region_mean"]) == pytest.approx(
        float(metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"]), rel=1e-6)


def test_grpo_loss_jits_with_static_settings():
    data = _grpo_inputs()
    settings = grpo.GRPOLossSettings(loss_type="dapo")
    loss_fn = jax.jit(lambda lp, old, adv, mask: grpo.grpo_loss(lp, old, None, adv, mask, settings)[0])
    eager = grpo.grpo_loss(jnp.asarray(data["logps"]), jnp.asarray(data["old_logps"]), None,
                           jnp.asarray(data["advantages"]), jnp.asarray(data["mask"]), settings)[0]
    _close(loss_fn(data["logps"], data["old_logps"], data["advantages"], data["mask"]), np.asarray(eager))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_type": "ppo"}, "loss_type='ppo' is not a recognised value. Accepted values: 'grpo'"),
    ({"importance_sampling_level": "word"}, "importance_sampling_level='word'"),
    ({"loss_type": "dr_grpo"}, "max_completion_length"),
    ({"beta": 0.1}, "ref_per_token_logps"),
])
def test_grpo_loss_rejects_bad_settings(kwargs, message):
    data = _grpo_inputs()
    with pytest.raises(ValueError, match=message):
        grpo.grpo_loss(jnp.asarray(data["logps"]), None, None, jnp.asarray(data["advantages"]),
                       jnp.asarray(data["mask"]), grpo.GRPOLossSettings(**kwargs))


# --- Advantages ----------------------------------------------------------------------------------------------------

NUM_GENERATIONS = 4


def _trl_advantages(rewards_per_func, reward_weights, num_generations, scale_rewards, multi_objective_aggregation):
    """Transcription of GRPOTrainer._generate_and_score_completions (TRL 1.16.0, lines 2756-2805 and 2826-2829)."""
    rewards_per_func = torch.tensor(rewards_per_func)
    num_funcs = rewards_per_func.shape[1]
    weights = torch.tensor(reward_weights, dtype=torch.float32)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
        if scale_rewards in ["group", "none"]:
            if num_generations > 1:
                std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
                std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
            else:
                std_rewards = torch.zeros_like(rewards)
        else:
            std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean_grouped_rewards
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, num_generations, num_funcs)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, num_funcs)
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    logged = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable_mask] = torch.nan
    metrics = {"reward": torch.nanmean(logged), "reward_std": nanstd(logged),
               "frac_reward_zero_std": is_std_zero.float().mean(),
               "rewards_per_func/mean": torch.stack([torch.nanmean(rewards_per_func[:, i]) for i in range(num_funcs)]),
               "rewards_per_func/std": torch.stack([nanstd(rewards_per_func[:, i]) for i in range(num_funcs)])}
    return advantages, metrics


def _rewards_per_func() -> np.ndarray:
    """Three prompts x 4 completions x 2 reward functions, with None (NaN) rewards, a constant group and an
    unscorable completion."""
    rng = np.random.default_rng(7)
    rewards = rng.normal(0, 1, (3 * NUM_GENERATIONS, 2)).astype(np.float32)
    rewards[1, 0] = np.nan  # one function did not apply
    rewards[4:8, 0] = 0.5  # a group whose first reward is constant
    rewards[4:8, 1] = np.nan  # ... and whose second reward never applies: zero std
    rewards[9] = np.nan  # unscorable: every function returned None
    return rewards


@pytest.mark.parametrize("multi_objective_aggregation", grpo.MULTI_OBJECTIVE_AGGREGATIONS)
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_grpo_advantages_match_trl(scale_rewards, multi_objective_aggregation):
    rewards_per_func, weights = _rewards_per_func(), [1.0, 0.5]
    mode = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    theirs, their_metrics = _trl_advantages(rewards_per_func, weights, NUM_GENERATIONS, mode,
                                            multi_objective_aggregation)
    ours, our_metrics = grpo.grpo_advantages(rewards_per_func, NUM_GENERATIONS, reward_weights=weights,
                                                scale_rewards=scale_rewards,
                                                multi_objective_aggregation=multi_objective_aggregation)
    _close(ours, theirs)
    assert set(our_metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        _close(our_metrics[name], value)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_of_combined_rewards_match_trl(scale_rewards):
    rewards_per_func = _rewards_per_func()
    theirs, _ = _trl_advantages(rewards_per_func, [1.0, 1.0], NUM_GENERATIONS, scale_rewards, "sum_then_normalize")
    ours = grpo.group_advantages(advantages.combine_rewards(rewards_per_func), NUM_GENERATIONS, scale_rewards)
    _close(ours, theirs)


def test_decoupled_group_advantages_match_trl():
    rewards_per_func = _rewards_per_func()
    theirs, _ = _trl_advantages(rewards_per_func, [2.0, 1.0], NUM_GENERATIONS, "group", "normalize_then_sum")
    _close(grpo.decoupled_group_advantages(rewards_per_func, NUM_GENERATIONS, [2.0, 1.0]), theirs)


def test_combine_rewards_weighs_skips_none_and_marks_unscorable_rows():
    rewards = advantages.combine_rewards(np.array([[1.0, 2.0], [np.nan, 2.0], [np.nan, np.nan]], np.float32),
                                      [0.5, 2.0])
    np.testing.assert_allclose(np.asarray(rewards), [4.5, 4.0, np.nan])


def test_std_is_unbiased_and_the_epsilon_is_trls():
    advantages = grpo.group_advantages(np.array([0.0, 1.0], np.float32), 2, "group")
    std = math.sqrt(0.5)  # Bessel-corrected: ((0.5**2 + 0.5**2) / (2 - 1)) ** 0.5
    np.testing.assert_allclose(np.asarray(advantages), [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4)], rtol=1e-6)


def test_unscorable_completions_and_constant_groups_get_zero_advantage():
    advantages = np.asarray(grpo.group_advantages(np.array([1.0, np.nan, 3.0, 2.0, 2.0, 2.0], np.float32), 3))
    assert advantages[1] == 0.0 and np.all(advantages[3:] == 0.0)
    assert advantages[0] < 0 < advantages[2]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: grpo.group_advantages(np.zeros(6, np.float32), 4), "groups of num_generations=4"),
    (lambda: grpo.group_advantages(np.zeros(4, np.float32), 2, "global"), "scale_rewards='global'"),
    (lambda: advantages.combine_rewards(np.zeros((4, 2), np.float32), [1.0]), "one weight per reward function"),
    (lambda: grpo.grpo_advantages(np.zeros((4, 1), np.float32), 2, multi_objective_aggregation="max"),
     "multi_objective_aggregation='max'"),
])
def test_advantages_reject_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- Log-probabilities ---------------------------------------------------------------------------------------------

def _logits(seed: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (3, 5, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (3, 5))
    mask = (np.arange(5)[None] < np.array([5, 2, 0])[:, None]).astype(np.int32)
    return logits, tokens, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_match_trl_selective_log_softmax(temperature):
    logits, tokens, mask = _logits()
    theirs = selective_log_softmax(torch.tensor(logits), torch.tensor(tokens), temperature=temperature,
                                   row_mask=torch.tensor(mask))
    _close(logprobs.token_log_probs(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask), temperature), theirs)
    _close(logprobs.sequence_log_probs(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask), temperature),
           theirs.sum(-1))


def test_token_log_probs_of_bfloat16_logits_are_float32():
    logits, tokens, _ = _logits()
    assert logprobs.token_log_probs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens)).dtype == jnp.float32


def test_token_entropies_match_trl():
    logits, _, mask = _logits()
    theirs = entropy_from_logits(torch.tensor(logits) / 0.7) * torch.tensor(mask)
    _close(logprobs.token_entropies(jnp.asarray(logits), jnp.asarray(mask), temperature=0.7), theirs)


def test_temperature_must_be_positive():
    logits, tokens, _ = _logits()
    with pytest.raises(ValueError, match="temperature=0 must be positive"):
        logprobs.token_log_probs(jnp.asarray(logits), jnp.asarray(tokens), temperature=0)


# --- DPO loss on a stand-in trainer --------------------------------------------------------------------------------

PAIRS, DPO_LENGTH = 4, 6


def _dpo_inputs(seed: int = 5) -> dict[str, np.ndarray]:
    """Pairs laid out as TRL batches them, [chosen; rejected], with a 2-token prompt and varied completion lengths."""
    rng = np.random.default_rng(seed)
    completion_lengths = np.array([4, 1, 3, 2, 2, 4, 1, 3])
    position = np.arange(DPO_LENGTH)[None]
    completion_mask = ((position >= 2) & (position < 2 + completion_lengths[:, None])).astype(np.int64)
    shifted = completion_mask[:, 1:]
    return {
        "per_token_logps": (-rng.uniform(0.1, 2.5, (2 * PAIRS, DPO_LENGTH - 1)) * shifted).astype(np.float32),
        "completion_mask": completion_mask,
        "ref_chosen_logps": (-rng.uniform(1, 6, PAIRS)).astype(np.float32),
        "ref_rejected_logps": (-rng.uniform(1, 6, PAIRS)).astype(np.float32),
    }


class _FusedHeadModel:
    """Stands in for a model with TRL's fused LM head: returns the fixed per-token log-probabilities."""

    def __init__(self, per_token_logps):
        self.per_token_logps = per_token_logps

    def __call__(self, **kwargs):
        shape = self.per_token_logps.shape
        return SimpleNamespace(log_probs=self.per_token_logps, entropy=torch.zeros(shape),
                               mean_logits=torch.zeros(shape), is_top1=torch.zeros(shape, dtype=torch.bool),
                               aux_loss=None)


def _trl_dpo(data, *, loss_type, loss_weights=None, beta=0.1, label_smoothing=0.1, f_divergence_type="reverse_kl",
             f_alpha_divergence_coef=0.5, ld_alpha=None):
    per_token_logps = torch.tensor(data["per_token_logps"], requires_grad=True)
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, use_weighting=False, ld_alpha=ld_alpha, beta=beta, label_smoothing=label_smoothing,
        loss_types=list(loss_type), loss_weights=loss_weights or [1.0] * len(loss_type),
        f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
        args=SimpleNamespace(discopop_tau=0.05), _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1)
    inputs = {
        "input_ids": torch.zeros(2 * PAIRS, DPO_LENGTH, dtype=torch.long),
        "attention_mask": torch.ones(2 * PAIRS, DPO_LENGTH, dtype=torch.long),
        "completion_mask": torch.tensor(data["completion_mask"]),
        "ref_chosen_logps": torch.tensor(data["ref_chosen_logps"]),
        "ref_rejected_logps": torch.tensor(data["ref_rejected_logps"]),
    }
    # The fused head's masked positions are constant zeros: no gradient reaches them.
    head_output = per_token_logps * torch.tensor(data["completion_mask"][:, 1:])
    loss = DPOTrainer._compute_loss(stand_in, _FusedHeadModel(head_output), inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), {name: values[-1] for name, values in stand_in._metrics["train"].items()}, \
        per_token_logps.grad


def _our_dpo(data, *, loss_type, ld_alpha=None, **settings):
    mask = data["completion_mask"][:, 1:]
    lengths = data["completion_mask"].sum(-1)

    def loss_fn(per_token_logps):
        per_token_logps = per_token_logps * mask  # as token_log_probs(..., mask) zeroes them
        chosen, rejected = per_token_logps[:PAIRS], per_token_logps[PAIRS:]
        if ld_alpha is None:
            chosen_logps, rejected_logps = chosen.sum(-1), rejected.sum(-1)
        else:
            chosen_logps, rejected_logps = dpo.length_desensitised_log_probs(
                chosen, rejected, jnp.asarray(mask[:PAIRS]), jnp.asarray(mask[PAIRS:]), ld_alpha)
        return dpo.dpo_loss(chosen_logps, rejected_logps, jnp.asarray(data["ref_chosen_logps"]),
                            jnp.asarray(data["ref_rejected_logps"]),
                            dpo.DPOLossSettings(loss_type=loss_type, **settings),
                            chosen_lengths=lengths[:PAIRS], rejected_lengths=lengths[PAIRS:],
                            sft_chosen_logps=chosen.sum(-1))

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(data["per_token_logps"]))
    return loss, metrics, grad


def _assert_dpo_matches(data, **settings):
    their_loss, their_metrics, their_grad = _trl_dpo(data, **settings)
    our_loss, our_metrics, our_grad = _our_dpo(data, **settings)
    _close(our_loss, their_loss)
    _close(our_grad, their_grad)
    for name, value in our_metrics.items():
        _close(value, their_metrics[name])
    return our_metrics


@pytest.mark.parametrize("loss_type", dpo.DPO_LOSS_TYPES)
def test_dpo_loss_matches_trl_for_every_loss_type(loss_type):
    _assert_dpo_matches(_dpo_inputs(), loss_type=[loss_type], label_smoothing=0.1)


@pytest.mark.parametrize("f_divergence_type", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_dpo_f_divergences_match_trl(f_divergence_type):
    _assert_dpo_matches(_dpo_inputs(), loss_type=["sigmoid", "ipo"], loss_weights=[0.8, 0.2],
                        f_divergence_type=f_divergence_type, f_alpha_divergence_coef=0.3)


def test_dpo_mixed_losses_with_length_desensitisation_match_trl():
    _assert_dpo_matches(_dpo_inputs(6), loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0],
                        ld_alpha=0.5)


def test_sigmoid_dpo_metrics_and_smoothing():
    data = _dpo_inputs()
    metrics = _assert_dpo_matches(data, loss_type=["sigmoid"], beta=0.5, label_smoothing=0.3)
    chosen = data["per_token_logps"][:PAIRS].sum(-1) - data["ref_chosen_logps"]
    rejected = data["per_token_logps"][PAIRS:].sum(-1) - data["ref_rejected_logps"]
    assert float(metrics["rewards/accuracies"]) == pytest.approx(float(np.mean(chosen > rejected)))
    assert float(metrics["rewards/margins"]) == pytest.approx(float(np.mean(0.5 * (chosen - rejected))), rel=1e-5)
    loss = dpo.dpo_loss(jnp.asarray([0.0]), jnp.asarray([0.0]), jnp.asarray([0.0]), jnp.asarray([0.0]),
                        dpo.DPOLossSettings())[0]
    assert float(loss) == pytest.approx(math.log(2))  # TRL 1.16's sigmoid loss ignores label_smoothing


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_type": "orpo"}, "loss_type='orpo' is not a recognised value. Accepted values: 'sigmoid'"),
    ({"loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0]}, "one weight per loss type"),
    ({"loss_type": "exo_pair"}, "label_smoothing > 0"),
    ({"loss_type": "nca_pair", "f_divergence_type": "forward_kl"}, "only works with the loss types"),
    ({"loss_type": "ipo"}, "chosen_lengths and rejected_lengths"),
])
def test_dpo_loss_rejects_bad_settings(kwargs, message):
    logps = jnp.zeros(2)
    with pytest.raises(ValueError, match=message):
        dpo.dpo_loss(logps, logps, logps, logps, dpo.DPOLossSettings(**kwargs))
