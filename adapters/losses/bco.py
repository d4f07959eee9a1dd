"""TRL 1.0.0's Binary Classifier Optimization loss (``trl.experimental.bco.BCOTrainer.bco_loss``) on unpaired
examples, its running reward shift (``RunningMoments``) and its metrics.

Each example's implied reward is ``r = beta * (logp - ref_logp)``; with the running mean ``delta`` of every reward
seen so far in training (updated with the micro-batch's own rewards before its loss, as TRL does), a desirable
example's loss is ``-log sigmoid(r - delta)`` and an undesirable one's ``-log sigmoid(-(r - delta))``, the latter
times its density-ratio weight under underlying distribution matching (UDM). The loss is the mean over the batch.

TRL's BCO metrics are sums over each micro-batch (``rewards/chosen_sum``, ``logps/...``, ``logits/...``) with the
example counts, divided at logging time over every micro-batch since the last log. A step loss here returns each sum
as the metric and its count as its ``present/<name>`` indicator; ``finish_metrics`` divides the averaged pair
back into TRL's ratio (and drops it when no micro-batch counted an example); ``adapters.training.step_metrics``
holds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..families import Family
from ..lora import runtime as lora_runtime
from ..training.step_metrics import PRESENCE_PREFIX
from . import logprobs
from . import router as router_loss
from .settings import LossSettings, runtime_field

__all__ = ["RUNNING_NAME", "BCOLossSettings", "RunningMoments", "bco_loss", "bco_step_loss", "completion_scores",
           "policy_rewards", "reference_pass"]

#: The file of a checkpoint holding the running reward moments (TRL's name).
RUNNING_NAME = "running.json"


@dataclass
class RunningMoments:
    """TRL's ``RunningMoments``: the running mean, variance and standard deviation of every reward seen in training.

    The update is TRL's, in its precisions: the batch's moments in float32, the running mean accumulated in Python
    floats. ``count`` starts at ``1e-24`` (an empty prior), so the first update takes the batch's moments.
    """

    mean: float = 0.0
    std: float = 1.0
    var: float = 1.0
    count: float = 1e-24

    def update(self, values: np.ndarray) -> None:
        """Merges a batch of rewards (``[N]``, ``N > 0``) into the moments (TRL's ``RunningMoments.update``)."""
        values = np.asarray(values, np.float32)
        batch_count = values.size
        batch_mean = values.mean(dtype=np.float32)
        batch_var = np.square(values - batch_mean, dtype=np.float32).mean(dtype=np.float32)
        shift = np.float32(batch_mean - np.float32(self.mean))
        total_count = self.count + batch_count
        new_sum = batch_var * np.float32(batch_count)
        old_sum = np.float32(self.var * self.count + shift ** 2 * self.count * batch_count / total_count)
        self.mean += float(np.float32(shift * batch_count / total_count))
        new_var = np.float32((old_sum + new_sum) / total_count)
        self.std = float(np.sqrt(np.float32(new_var * total_count / (total_count - 1))))
        self.var = float(new_var)
        self.count = total_count

    def save_to_json(self, json_path: str | os.PathLike) -> None:
        """Writes the moments as TRL does (sorted keys, two-space indent)."""
        with open(json_path, "w", encoding="utf-8") as file:
            file.write(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, json_path: str | os.PathLike) -> RunningMoments:
        """The moments a :meth:`save_to_json` (or TRL's) wrote."""
        with open(json_path, encoding="utf-8") as file:
            return cls(**json.load(file))


@dataclass(frozen=True)
class BCOLossSettings(LossSettings):
    """The settings of the BCO loss, named as their ``BCOConfig`` fields (:meth:`from_config`).

    Args:
        beta: temperature of the implied reward ``beta * log(pi / pi_ref)``.
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).
    """

    beta: float = 0.1
    router_aux_loss_coef: float = runtime_field(0.0)


def _masked_sum(values: jax.Array, weights: jax.Array) -> jax.Array:
    return (values * weights).sum()


def bco_loss(
    policy_logps: jax.Array,
    reference_logps: jax.Array,
    labels: jax.Array,
    delta: jax.Array,
    *,
    settings: BCOLossSettings,
    rejected_weights: jax.Array | None = None,
    row_mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The BCO loss of a batch of unpaired examples and TRL's reward metrics, as ``BCOTrainer.bco_loss`` and
    ``get_batch_loss_metrics``.

    With rewards ``r = beta * (logp - ref_logp)``: desirable losses ``-log sigmoid(r - delta)``, undesirable ones
    ``w * -log sigmoid(delta - r)`` (``w`` the UDM weight, 1 without UDM); the loss is their mean over the real rows.

    Args:
        policy_logps: ``[B]`` summed completion log-probabilities under the policy.
        reference_logps: ``[B]`` under the reference model.
        labels: ``[B]`` True (or 1) for desirable completions.
        delta: ``[B]`` (or a scalar) the running reward mean after this batch's update (the same on every row).
        settings: the loss settings.
        rejected_weights: ``[B]`` the UDM density-ratio weight of each undesirable example; ``None``: 1.
        row_mask: ``[B]`` 1 for real examples, 0 for rows padding a partial batch; ``None``: all real.

    Returns:
        ``(loss, metrics)``, float32. ``metrics``: ``delta`` and the sums ``rewards/chosen``, ``logps/chosen``,
        ``rewards/rejected``, ``logps/rejected``, each sum with its example count as ``present/<name>`` (and
        ``delta`` with 1 when the batch has an example), see the module docstring.
    """
    real = jnp.ones(policy_logps.shape, jnp.float32) if row_mask is None else row_mask.astype(jnp.float32)
    desirable = labels.astype(bool).astype(jnp.float32) * real
    undesirable = real - desirable
    policy_logps = policy_logps.astype(jnp.float32)
    rewards = settings.beta * (policy_logps - reference_logps.astype(jnp.float32))
    shifted = rewards - jax.lax.stop_gradient(jnp.broadcast_to(delta, rewards.shape).astype(jnp.float32))
    weights = jnp.ones_like(rewards) if rejected_weights is None else rejected_weights.astype(jnp.float32)
    losses = desirable * -jax.nn.log_sigmoid(shifted) + undesirable * weights * -jax.nn.log_sigmoid(-shifted)
    count = real.sum()
    loss = jnp.where(count > 0, losses.sum() / jnp.maximum(count, 1.0), 0.0)

    rewards, logps = jax.lax.stop_gradient(rewards), jax.lax.stop_gradient(policy_logps)
    sums = {"rewards/chosen": _masked_sum(rewards, desirable), "logps/chosen": _masked_sum(logps, desirable),
            "rewards/rejected": _masked_sum(rewards, undesirable), "logps/rejected": _masked_sum(logps, undesirable)}
    counts = {name: desirable.sum() if name.endswith("chosen") else undesirable.sum() for name in sums}
    present = (count > 0).astype(jnp.float32)
    metrics = {"delta": _masked_sum(jnp.broadcast_to(delta, rewards.shape).astype(jnp.float32), real)
               / jnp.maximum(count, 1.0), PRESENCE_PREFIX + "delta": present, **sums,
               **{PRESENCE_PREFIX + name: value for name, value in counts.items()}}
    return loss, metrics


def completion_scores(family: Family, module, batch: Mapping[str, jax.Array], with_metrics: bool,
                      block_size: logprobs.BlockSize = "auto") -> tuple[jax.Array, logprobs.TokenScores]:
    """``(summed completion log-probabilities [B], per-token scores [B, T-1])`` of the batch's rows.

    The rows run with position ids ``0 .. T-1``, as ``transformers`` numbers right-padded rows, so the logits at
    padding positions are those TRL sums into its ``logits/*`` metrics.
    """
    input_ids = batch["input_ids"]
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    scores = logprobs.next_token_scores(
        family, module, {"input_ids": input_ids, "attention_mask": batch["attention_mask"], "position_ids": positions},
        with_metrics=with_metrics, block_size=block_size)
    mask = batch["completion_mask"][:, 1:].astype(bool)
    return jnp.where(mask, scores.log_probs, 0.0).sum(-1), scores


def _logit_sums(logit_means: jax.Array, attention_mask: jax.Array, vocab_size: int) -> jax.Array:
    """``[B]``: each row's logits summed over the vocabulary and the positions of TRL's batch, padded to its longest
    row ``L`` (positions ``0 .. L-1``, padding included). ``logit_means`` ``[B, T-1]`` covers positions ``0 .. T-2``,
    so the batch needs a padding column past its longest row."""
    longest = attention_mask.sum(-1).max()
    in_block = (jnp.arange(logit_means.shape[1]) < longest).astype(jnp.float32)
    return (jax.lax.stop_gradient(logit_means) * in_block).sum(-1) * vocab_size


def bco_step_loss(family: Family, settings: BCOLossSettings, vocab_size: int,
                  block_size: logprobs.BlockSize = "auto") -> Callable:
    """The BCO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    ``value`` is TRL's ``BCOTrainer`` loss of the micro-batch (:func:`bco_loss`) with the batch's ``delta`` column;
    ``weight`` is 1 when the micro-batch holds an example, so accumulated micro-batches are averaged, as TRL divides
    by the accumulation steps. ``metrics``: :func:`bco_loss`'s and the sums ``logits/chosen`` and ``logits/rejected``
    of every logit of TRL's padded batch (with their counts). With ``settings.router_aux_loss_coef`` the router
    load-balancing loss of the forward pass is added times it, unlogged: TRL 1.0.0's BCOTrainer logs no ``aux_loss``.

    Args:
        family: the model's adapter family (its forward pass).
        settings: the loss settings.
        vocab_size: the logits' width (the logit sums are vocabulary means times it).
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`).

    The batch holds ``input_ids``, ``attention_mask``, ``completion_mask`` ``[B, T]`` (``T`` at least one past the
    longest row), ``label``, ``ref_logps`` and ``delta`` ``[B]``, and under UDM ``udm_weight`` ``[B]``.
    """

    def loss(module, batch, num_items_in_batch=None):
        real = batch["attention_mask"].any(-1).astype(jnp.float32)
        labels = batch["label"]
        (policy_logps, scores), aux_loss = router_loss.run_with_router_loss(
            family, lambda module: completion_scores(family, module, batch, True, block_size), module,
            batch["attention_mask"], settings.router_aux_loss_coef)
        value, metrics = bco_loss(policy_logps, batch["ref_logps"], labels, batch["delta"], settings=settings,
                                  rejected_weights=batch.get("udm_weight"), row_mask=real)
        logit_sums = _logit_sums(scores.logit_means, batch["attention_mask"], vocab_size)
        desirable = labels.astype(bool).astype(jnp.float32) * real
        metrics = {**metrics, "logits/chosen": _masked_sum(logit_sums, desirable),
                   PRESENCE_PREFIX + "logits/chosen": desirable.sum(),
                   "logits/rejected": _masked_sum(logit_sums, real - desirable),
                   PRESENCE_PREFIX + "logits/rejected": (real - desirable).sum()}
        if aux_loss is not None:
            value = value + settings.router_aux_loss_coef * aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss


def policy_rewards(family: Family, settings: BCOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """``(module, batch) -> rewards [B]``: ``beta * (logp - ref_logp)`` of the batch's rows under ``module``, without
    gradient: the rewards the running moments take in before the step's loss reads ``delta``."""

    def rewards(module, batch):
        policy_logps = completion_scores(family, module, batch, False, block_size)[0]
        return settings.beta * (policy_logps - batch["ref_logps"].astype(jnp.float32))

    return rewards


def reference_pass(family: Family, lora: str, mesh, block_size: logprobs.BlockSize = "auto") -> Callable:
    """``(module, batch, num_items_in_batch=None) -> (ref_logps [B],)``: the summed completion log-probabilities of a
    reference (TRL's ``compute_reference_log_probs``), run with its adapter in mode ``lora`` and replicated over
    ``mesh`` so that every process reads all rows."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def reference_log_probs(module, batch, num_items_in_batch=None):
        with lora_runtime.lora_mode(lora):
            logps = completion_scores(family, module, batch, False, block_size)[0]
            return (jax.lax.with_sharding_constraint(logps, replicated),)

    return reference_log_probs
