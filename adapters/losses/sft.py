"""The next-token (causal LM) loss: TRL's SFT loss, and the built-in loss of torchlike's ``Trainer`` for a causal LM.

:func:`sft_step_loss` is a step loss as ``adapters.training.train_step.make_train_step`` takes one: ``(module, batch,
num_items_in_batch) -> (summed token loss, number of loss tokens, aux)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..families import Family
from . import logprobs
from . import router as router_loss
from .settings import check_choice

__all__ = ["SFT_LOSS_TYPES", "sft_step_loss"]


#: ``loss_type`` values of :func:`sft_step_loss` (TRL's ``SFTConfig.loss_type``).
SFT_LOSS_TYPES: tuple[str, ...] = ("nll", "dft")


def sft_step_loss(family: Family, block_size: logprobs.BlockSize = "auto", loss_type: str = "nll",
                  router_aux_loss_coef: float = 0.0, with_metrics: bool = False) -> Callable:
    """``loss(module, batch, num_items_in_batch) -> (summed token loss, number of loss tokens, aux)``.

    ``batch`` holds ``input_ids``, ``attention_mask`` and ``loss_mask`` of shape ``[B, T]`` (and ``position_ids``
    for packed rows, :func:`tunix_model.batch_positions_and_attention`); the label of position ``t`` is
    ``input_ids[t]``, predicted from position ``t - 1``, counted when ``loss_mask[t]`` and ``attention_mask[t]`` are
    both 1 (TRL's ``completion_mask`` alignment). The log-probs are computed ``block_size`` positions at a time
    (:func:`logprobs.next_token_scores`).

    The token loss is, for ``loss_type="nll"``, ``-log p`` and, for ``"dft"`` (Dynamic Fine-Tuning, TRL's
    ``SFTTrainer.compute_loss``), ``-log p * stop_gradient(p)``: each token's NLL weighted by its own probability.

    With ``router_aux_loss_coef`` (a mixture-of-experts family), the batch's load-balancing loss over its real tokens
    (:func:`router_loss.load_balancing_loss`, logged as ``aux_loss``) is added as ``Qwen3MoeForCausalLM.forward``
    adds it: ``mean token loss + coef * aux_loss``. It is weighted by the batch's loss tokens, so with gradient
    accumulation the step adds the token-weighted mean of the micro-batches' aux losses (TRL: their plain mean).

    With ``with_metrics``, ``aux`` adds TRL's SFT metrics over the batch's loss tokens: ``entropy`` (the mean entropy
    of the next-token distribution) and ``mean_token_accuracy`` (the share of tokens that are the most likely one),
    and ``num_tokens``, the batch's real tokens (its attention mask), which the trainer adds up into TRL's running
    total.

    Raises:
        ValueError: an unknown ``loss_type``, or ``router_aux_loss_coef`` for a family without a router.
    """
    check_choice("loss_type", loss_type, SFT_LOSS_TYPES)
    router_loss.check_router(family, router_aux_loss_coef)

    def loss(module, batch, num_items_in_batch=None):
        def scores(module):
            return logprobs.next_token_scores(family, module, batch, block_size=block_size, with_metrics=with_metrics)

        found, aux = router_loss.run_with_router_loss(family, scores, module, batch["attention_mask"],
                                                      router_aux_loss_coef)
        picked = found.log_probs
        weights = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).astype(jnp.float32)
        token_loss = -picked
        if loss_type == "dft":
            token_loss = token_loss * jax.lax.stop_gradient(jnp.exp(picked))
        value, count = (token_loss * weights).sum(), weights.sum()
        metrics = {}
        if with_metrics:
            valid = jnp.maximum(count, 1.0)
            metrics = {"entropy": jax.lax.stop_gradient((found.entropies * weights).sum()) / valid,
                       "mean_token_accuracy": (found.top1 * weights).sum() / valid,
                       "num_tokens": batch["attention_mask"].sum().astype(jnp.float32)}
        if aux is None:
            return value, count, metrics
        return value + router_aux_loss_coef * aux * count, count, {**metrics, "aux_loss": aux}

    return loss
