"""DPO on Tunix modules: the log-probabilities of chosen and rejected sequences in one forward pass, and TRL's
``DPOTrainer`` step loss (``adapters.rl_math.dpo_loss``: every loss type, f-divergences, LD-DPO, WPO weights) with
its metrics. Beside :mod:`adapters.tunix_grpo`, which does the same for GRPO."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from ..lora import runtime as lora_runtime
from . import logprobs as chunked_logprobs
from . import rl_math
from . import router as router_loss

__all__ = ["masked_mean", "preference_loss", "reference_pass"]

#: Loss types that read the whole batch (``aot`` sorts within it, ``sft`` is a token mean) rather than one pair.
_BATCH_LOSS_TYPES = ("aot", "aot_unpaired", "sft")


def _pair_token_log_probs(family, module, batch: dict, with_metrics: bool = False,
                          block_size: chunked_logprobs.BlockSize = "auto", with_log_sum_sq_probs: bool = False
                          ) -> tuple[chunked_logprobs.TokenScores, jax.Array]:
    """One forward pass over the chosen rows stacked on the rejected rows (``2B``, TRL's layout).

    Returns:
        ``(scores, mask)``: the per-token scores ``[2B, T-1]`` of ``chunked_logprobs.next_token_scores`` (the
        metrics' too with ``with_metrics``, ``log_sum_sq_probs`` with ``with_log_sum_sq_probs``), position ``t``
        predicting token ``t + 1``, with their log-probabilities zeroed outside ``mask``, the shifted completion mask.
    """
    def stacked(name: str) -> jax.Array:
        return jnp.concatenate([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])

    scores = chunked_logprobs.next_token_scores(
        family, module, {"input_ids": stacked("input_ids"), "attention_mask": stacked("attention_mask")},
        with_metrics=with_metrics, block_size=block_size, with_log_sum_sq_probs=with_log_sum_sq_probs)
    mask = stacked("completion_mask")[:, 1:]
    return scores._replace(log_probs=jnp.where(mask.astype(bool), scores.log_probs, 0.0)), mask


def _sequence_log_probs(per_token: jax.Array, mask: jax.Array, ld_alpha: float | None) -> tuple[jax.Array, jax.Array]:
    """``(chosen [B], rejected [B])`` summed completion log-probabilities (LD-DPO weighted with ``ld_alpha``)."""
    chosen, rejected = jnp.split(per_token, 2)
    if ld_alpha is None:
        return chosen.sum(-1), rejected.sum(-1)
    chosen_mask, rejected_mask = jnp.split(mask, 2)
    return rl_math.length_desensitised_log_probs(chosen, rejected, chosen_mask, rejected_mask, ld_alpha)


def masked_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(values * weights) / max(sum(weights), 1)``: a mean over the entries ``weights`` selects."""
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def _token_metrics(scores: chunked_logprobs.TokenScores, mask: jax.Array) -> dict[str, jax.Array]:
    """TRL's per-token metrics: completion-token means of the entropy, of the logits' vocabulary mean (chosen and
    rejected) and of whether the chosen token is the most likely one."""
    mask = mask.astype(jnp.float32)
    chosen_mask, rejected_mask = jnp.split(mask, 2)
    chosen_logits, rejected_logits = jnp.split(scores.logit_means, 2)
    return {
        "entropy": masked_mean(scores.entropies, mask),
        "logits/chosen": masked_mean(chosen_logits, chosen_mask),
        "logits/rejected": masked_mean(rejected_logits, rejected_mask),
        "mean_token_accuracy": masked_mean(jnp.split(scores.top1, 2)[0], chosen_mask),
    }


def preference_loss(family, *, beta: float, loss_type: Sequence[str], loss_weights: Sequence[float] | None = None,
                    label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                    f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
                    ld_alpha: float | None = None, use_weighting: bool = False,
                    block_size: chunked_logprobs.BlockSize = "auto", router_aux_loss_coef: float = 0.0) -> Callable:
    """The DPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._loss``).

    ``value`` is TRL's ``DPOTrainer`` loss of the micro-batch: ``sum_i loss_weights[i] * mean over pairs of
    loss_type[i]``, each pair's losses times its WPO weight ``w_chosen * w_rejected`` with ``use_weighting``
    (``rl_math.wpo_weights``). Rows that pad a partial batch (all-zero masks) are left out of the means; ``weight``
    is 1 when the micro-batch holds a pair, so accumulated micro-batches are averaged, as TRL divides by the
    accumulation steps.
    ``metrics`` are TRL's: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected``, ``entropy``, ``logits/chosen``, ``logits/rejected``,
    ``mean_token_accuracy``, and ``num_tokens`` (the micro-batch's tokens; ``DPOTrainer.log`` makes it a running
    total). With ``router_aux_loss_coef`` (a mixture-of-experts model) the load-balancing loss of the policy's
    forward pass over the real tokens of the ``2B`` rows is added times it and logged as ``aux_loss``, as TRL adds
    ``outputs.aux_loss``.

    Args:
        family: the model's adapter family (its forward pass).
        beta, loss_type, loss_weights, label_smoothing, f_divergence_type, f_alpha_divergence_coef, discopop_tau,
            ld_alpha, use_weighting: the ``DPOConfig`` fields of the same names.
        block_size: positions per block of the log-prob computation (``adapters.chunked_logprobs.BlockSize``:
            ``"auto"``, a number, or ``None`` for the whole sequence at once).
        router_aux_loss_coef: the weight of the router's load-balancing loss (0: not added).

    The batch holds ``collate_preference_batch``'s columns with ``ref_chosen_logps``/``ref_rejected_logps``.
    """
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(loss_type)
    settings = dict(beta=beta, label_smoothing=label_smoothing, f_divergence_type=f_divergence_type,
                    f_alpha_divergence_coef=f_alpha_divergence_coef, discopop_tau=discopop_tau)
    per_pair = [(name, weight) for name, weight in zip(loss_type, weights, strict=True)
                if name not in _BATCH_LOSS_TYPES]
    whole_batch = [(name, weight) for name, weight in zip(loss_type, weights, strict=True)
                   if name in _BATCH_LOSS_TYPES]
    # dpo_loss returns the metrics too; a zero-weight sigmoid yields them when every loss type reads the whole batch.
    pair_types, pair_weights = zip(*(per_pair or [("sigmoid", 0.0)]), strict=True)

    def one_pair(chosen, rejected, ref_chosen, ref_rejected, chosen_length, rejected_length):
        return rl_math.dpo_loss(chosen[None], rejected[None], ref_chosen[None], ref_rejected[None],
                                loss_type=list(pair_types), loss_weights=list(pair_weights),
                                chosen_lengths=chosen_length[None], rejected_lengths=rejected_length[None], **settings)

    def loss(module, batch, num_items_in_batch=None):
        def forward(module):
            return _pair_token_log_probs(family, module, batch, with_metrics=True, block_size=block_size,
                                         with_log_sum_sq_probs=use_weighting)

        rows_mask = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        (scores, mask), aux_loss = router_loss.run_with_router_loss(family, forward, module, rows_mask,
                                                                    router_aux_loss_coef)
        per_token = scores.log_probs
        chosen, rejected = _sequence_log_probs(per_token, mask, ld_alpha)
        ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        # TRL's ipo and sigmoid_norm divide by the unshifted completion lengths, its sft by the scored tokens.
        chosen_length, rejected_length = (batch[f"{key}_completion_mask"].sum(-1) for key in ("chosen", "rejected"))
        pair_losses, pair_metrics = jax.vmap(one_pair)(chosen, rejected, ref_chosen, ref_rejected, chosen_length,
                                                       rejected_length)
        pair_weights = jnp.ones_like(real)
        if use_weighting:
            chosen_weights, rejected_weights = jnp.split(rl_math.wpo_weights(per_token, scores.log_sum_sq_probs,
                                                                             mask), 2)
            pair_weights = chosen_weights * rejected_weights
        value = masked_mean(pair_losses * pair_weights, real)
        if whole_batch:  # exact with padding rows for sft (they add no token); aot sorts them in (see the warning)
            names, batch_weights = zip(*whole_batch, strict=True)
            chosen_mask, rejected_mask = jnp.split(mask, 2)
            # sft's loss is one value for every pair, so its weighted mean is that value times the mean weight.
            value += rl_math.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type=list(names),
                                      loss_weights=list(batch_weights), chosen_lengths=chosen_mask.sum(-1),
                                      rejected_lengths=rejected_mask.sum(-1),
                                      sft_chosen_logps=jnp.split(per_token, 2)[0].sum(-1),
                                      **settings)[0] * masked_mean(pair_weights, real)
        metrics = {key: masked_mean(values, real) for key, values in pair_metrics.items()}
        tokens = (batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum()).astype(jnp.float32)
        metrics = {**metrics, **_token_metrics(scores, mask), "num_tokens": tokens}
        if aux_loss is not None:
            value = value + router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss


def reference_pass(family, lora: str, mesh, ld_alpha: float | None) -> Callable:
    """``(module, batch, num_items_in_batch=None) -> (chosen [B], rejected [B])``: the summed completion
    log-probabilities of a reference (LD-DPO weighted with ``ld_alpha``), run with its adapter in mode ``lora`` and
    replicated over ``mesh`` so that every process reads all rows."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def reference_log_probs(module, batch, num_items_in_batch=None):
        with lora_runtime.lora_mode(lora):
            scores, mask = _pair_token_log_probs(family, module, batch)
        return tuple(jax.lax.with_sharding_constraint(logps, replicated)
                     for logps in _sequence_log_probs(scores.log_probs, mask, ld_alpha))

    return reference_log_probs
