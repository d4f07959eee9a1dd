"""DPO (TRL 1.16's ``DPOTrainer``): the DPO losses as pure JAX functions that give TRL's numbers, the log-probabilities
of chosen and rejected sequences in one forward pass, and the step loss with TRL's metrics.

:func:`dpo_loss` reproduces ``DPOTrainer._compute_loss`` (every loss type, f-divergences, LD-DPO, WPO weights) to
float32 rounding, including the gradients (what TRL detaches is under ``jax.lax.stop_gradient`` here). Tunix's
``dpo_loss_fn`` runs the model itself, has only the sigmoid loss, and applies ``label_smoothing`` to it as cDPO, which
TRL 1.16 no longer does; so the formulas are ours. Shapes: ``B`` preference pairs, ``T`` positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..families import Family
from ..lora import runtime as lora_runtime
from . import logprobs
from . import router as router_loss
from .settings import LossSettings, check_choice, runtime_field

__all__ = ["DPO_LOSSES", "DPO_LOSS_TYPES", "DPOLossSettings", "F_DIVERGENCES", "F_DIVERGENCE_LOSS_TYPES",
           "F_DIVERGENCE_TYPES", "dpo_loss", "dpo_step_loss", "length_desensitised_log_probs", "masked_mean",
           "reference_pass", "wpo_weights"]

#: DPO loss types built on the chosen-minus-rejected score, the only ones with an f-divergence generalisation.
F_DIVERGENCE_LOSS_TYPES: frozenset[str] = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust",
                                                     "discopop", "sft"})
#: Loss types that read the whole batch (``aot`` sorts within it, ``sft`` is a token mean) rather than one pair.
BATCH_LOSS_TYPES: tuple[str, ...] = ("aot", "aot_unpaired", "sft")
#: Loss types that divide by the completion lengths.
LENGTH_LOSS_TYPES: tuple[str, ...] = ("ipo", "sigmoid_norm", "sft")


@dataclass(frozen=True)
class DPOLossSettings(LossSettings):
    """The settings of the DPO loss, named as their ``DPOConfig`` fields (:meth:`from_config`), defaults TRL's.

    Args:
        beta: the DPO temperature (``tau`` for IPO).
        loss_type: one of :data:`DPO_LOSS_TYPES` or a list of them (held as a tuple).
        loss_weights: one weight per loss type; ``None`` weighs each 1.0 (held as a tuple).
        label_smoothing: ``eps`` of ``robust``, ``exo_pair`` (must be > 0), ``aot``, ``aot_unpaired``.
        f_divergence_type: one of :data:`F_DIVERGENCE_TYPES`; other than ``"reverse_kl"`` only with
            :data:`F_DIVERGENCE_LOSS_TYPES`.
        f_alpha_divergence_coef: ``alpha`` of ``"alpha_divergence"``.
        discopop_tau: DiscoPOP temperature.
        ld_alpha: LD-DPO's weight of the tail past the shorter response (:func:`length_desensitised_log_probs`);
            ``None`` sums every token.
        use_weighting: WPO's pair weights (:func:`wpo_weights`).
        router_aux_loss_coef: runtime value: the weight of a mixture-of-experts model's router load-balancing loss
            (0: not added).

    Raises:
        ValueError: a loss type or f-divergence not implemented, not one weight per loss type, an f-divergence with a
            loss type that has none, or ``exo_pair`` without ``label_smoothing``.
    """

    beta: float = 0.1
    loss_type: str | Sequence[str] = ("sigmoid",)
    loss_weights: Sequence[float] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: float | None = None
    use_weighting: bool = False
    router_aux_loss_coef: float = runtime_field(0.0)

    def __post_init__(self) -> None:
        loss_types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        weights = (1.0,) * len(loss_types) if self.loss_weights is None else tuple(self.loss_weights)
        object.__setattr__(self, "loss_type", loss_types)
        object.__setattr__(self, "loss_weights", weights)
        if len(weights) != len(loss_types):
            raise ValueError(f"loss_weights has {len(weights)} entries for {len(loss_types)} loss types "
                             f"{list(loss_types)}; give one weight per loss type.")
        for name in loss_types:
            check_choice("loss_type", name, DPO_LOSS_TYPES)
        check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl" and not set(loss_types) <= F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} only works with the loss types "
                             f"{sorted(F_DIVERGENCE_LOSS_TYPES)}; got {list(loss_types)}.")
        if "exo_pair" in loss_types and self.label_smoothing == 0.0:
            raise ValueError("loss_type='exo_pair' needs label_smoothing > 0 (the EXO paper recommends 1e-3).")

    def only(self, loss_types: Sequence[tuple[str, float]]) -> DPOLossSettings:
        """These settings with ``loss_type`` and ``loss_weights`` replaced by the given ``(name, weight)`` pairs."""
        names, weights = zip(*loss_types, strict=True)
        return dataclasses.replace(self, loss_type=names, loss_weights=weights)


# --- Sequence log-probabilities and pair weights ----------------------------------------------------------------

def length_desensitised_log_probs(chosen_per_token_logps: jax.Array, rejected_per_token_logps: jax.Array,
                                  chosen_mask: jax.Array, rejected_mask: jax.Array, ld_alpha: float
                                  ) -> tuple[jax.Array, jax.Array]:
    """LD-DPO sequence log-probabilities (``DPOConfig.ld_alpha``): the tail past the shorter response is down-weighted.

    With ``l = min(len_chosen, len_rejected)`` per pair and ``k`` the index of a completion token among its
    sequence's completion tokens (1-based): ``logp = sum_{k <= l} logp_k + ld_alpha * sum_{k > l} logp_k``.

    Args:
        chosen_per_token_logps: ``[B, T]`` (0 outside the completion).
        rejected_per_token_logps: ``[B, T]``.
        chosen_mask: ``[B, T]``, 1 on the chosen completion's tokens.
        rejected_mask: ``[B, T]``.
        ld_alpha: weight of the tail, in ``[0, 1]``.

    Returns:
        ``(chosen [B], rejected [B])`` float32.
    """
    shared = jnp.minimum(chosen_mask.sum(axis=-1), rejected_mask.sum(axis=-1))[:, None]

    def weighted(per_token_logps: jax.Array, mask: jax.Array) -> jax.Array:
        position = jnp.cumsum(mask, axis=-1)
        in_shared = (position > 0) & (position <= shared)
        per_token_logps = per_token_logps.astype(jnp.float32)
        return (per_token_logps * in_shared).sum(-1) + ld_alpha * (per_token_logps * (position > shared)).sum(-1)

    return weighted(chosen_per_token_logps, chosen_mask), weighted(rejected_per_token_logps, rejected_mask)


def wpo_weights(per_token_logps: jax.Array, log_sum_squared_probs: jax.Array, completion_mask: jax.Array
                ) -> jax.Array:
    """WPO's sequence weights (``DPOConfig.use_weighting``, Eq. 2 of the WPO paper), as ``DPOTrainer._compute_loss``.

    ``w = exp(sum_t m_t (logp_t - log sum_v p_v**2) / max(sum_t m_t, 1))``, without gradient; TRL multiplies each
    pair's loss by ``w_chosen * w_rejected``.

    Args:
        per_token_logps: ``[N, T]`` log-probabilities of the completion tokens (plain, not LD-DPO weighted).
        log_sum_squared_probs: ``[N, T]`` (:func:`token_log_sum_squared_probs`).
        completion_mask: ``[N, T]``, 1 on the completion tokens.

    Returns:
        ``[N]`` float32.
    """
    mask = completion_mask.astype(jnp.float32)
    aligned = jax.lax.stop_gradient((per_token_logps.astype(jnp.float32) - log_sum_squared_probs) * mask)
    return jnp.exp(aligned.sum(-1) / jnp.maximum(mask.sum(-1), 1.0))



# --- DPO loss (DPOTrainer._compute_loss) ---------------------------------------------------------------------------

class PairTerms(NamedTuple):
    """What each per-pair loss of :data:`DPO_LOSSES` reads, ``[B]`` float32 each.

    Args:
        chosen_logps, rejected_logps: the policy's sequence log-probabilities.
        ref_chosen_logps, ref_rejected_logps: the reference's.
        chosen_log_ratios, rejected_log_ratios: ``c = logp_chosen - ref_chosen``, ``r = logp_rejected -
            ref_rejected``.
        chosen_scores, rejected_scores: ``s_c = f'(c)``, ``s_r = f'(r)`` (the f-divergence's; ``c``, ``r`` for the
            reverse KL).
        chosen_lengths, rejected_lengths: completion tokens per sequence, or ``None``.
        sft_chosen_logps: plain sums of the chosen tokens' log-probabilities (``sft``).
    """

    chosen_logps: jax.Array
    rejected_logps: jax.Array
    ref_chosen_logps: jax.Array
    ref_rejected_logps: jax.Array
    chosen_log_ratios: jax.Array
    rejected_log_ratios: jax.Array
    chosen_scores: jax.Array
    rejected_scores: jax.Array
    chosen_lengths: jax.Array | None
    rejected_lengths: jax.Array | None
    sft_chosen_logps: jax.Array

    @property
    def score(self) -> jax.Array:
        """``d = s_c - s_r``."""
        return self.chosen_scores - self.rejected_scores

    @property
    def length_normalised_score(self) -> jax.Array:
        """``s_c / n_c - s_r / n_r`` (lengths at least 1)."""
        return (self.chosen_scores / jnp.maximum(self.chosen_lengths, 1.0)
                - self.rejected_scores / jnp.maximum(self.rejected_lengths, 1.0))


def _smoothed(margin: jax.Array, settings: DPOLossSettings) -> jax.Array:
    """``-(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)``."""
    beta, eps = settings.beta, settings.label_smoothing
    return -jax.nn.log_sigmoid(beta * margin) * (1 - eps) - jax.nn.log_sigmoid(-beta * margin) * eps


def sigmoid_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``sigmoid``: ``-log sigmoid(beta d)`` (TRL 1.16 no longer smooths it)."""
    return -jax.nn.log_sigmoid(s.beta * p.score)


def hinge_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``hinge``: ``relu(1 - beta d)``."""
    return jax.nn.relu(1 - s.beta * p.score)


def ipo_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``ipo``: ``(s_c / n_c - s_r / n_r - 1 / (2 beta))**2`` with ``n`` the completion lengths."""
    return (p.length_normalised_score - 1 / (2 * s.beta)) ** 2


def sigmoid_norm_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``sigmoid_norm``: ``-log sigmoid(beta (s_c / n_c - s_r / n_r))``."""
    return -jax.nn.log_sigmoid(s.beta * p.length_normalised_score)


def exo_pair_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``exo_pair``: ``q log(q / (1 - eps)) + (1 - q) log((1 - q) / eps)``, ``q = sigmoid(beta d)``."""
    beta, eps, score = s.beta, s.label_smoothing, p.score
    return (jax.nn.sigmoid(beta * score) * (jax.nn.log_sigmoid(beta * score) - math.log1p(-eps))
            + jax.nn.sigmoid(-beta * score) * (jax.nn.log_sigmoid(-beta * score) - math.log(eps)))


def nca_pair_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``nca_pair``: ``-log sigmoid(beta c) - log sigmoid(-beta c) / 2 - log sigmoid(-beta r) / 2``."""
    beta = s.beta
    return (-jax.nn.log_sigmoid(beta * p.chosen_log_ratios) - 0.5 * jax.nn.log_sigmoid(-beta * p.chosen_log_ratios)
            - 0.5 * jax.nn.log_sigmoid(-beta * p.rejected_log_ratios))


def robust_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``robust``: ``(-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps)``."""
    beta, eps, score = s.beta, s.label_smoothing, p.score
    return ((-(1 - eps) * jax.nn.log_sigmoid(beta * score) + eps * jax.nn.log_sigmoid(-beta * score))
            / (1 - 2 * eps))


def bco_pair_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``bco_pair``: ``-log sigmoid(beta c) - log sigmoid(-beta r)``."""
    return -jax.nn.log_sigmoid(s.beta * p.chosen_log_ratios) - jax.nn.log_sigmoid(-s.beta * p.rejected_log_ratios)


def sppo_hard_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``sppo_hard``: ``(c - 1 / (2 beta))**2 + (r + 1 / (2 beta))**2``."""
    return (p.chosen_log_ratios - 0.5 / s.beta) ** 2 + (p.rejected_log_ratios + 0.5 / s.beta) ** 2


def aot_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``aot``: the smoothed sigmoid loss of ``sort(logp_c - logp_r) - sort(ref_c - ref_r)`` (sorted in the batch)."""
    return _smoothed(jnp.sort(p.chosen_logps - p.rejected_logps) - jnp.sort(p.ref_chosen_logps - p.ref_rejected_logps),
                     s)


def aot_unpaired_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``aot_unpaired``: the smoothed sigmoid loss of ``sort(c) - sort(r)`` (sorted in the batch)."""
    return _smoothed(jnp.sort(p.chosen_log_ratios) - jnp.sort(p.rejected_log_ratios), s)


def apo_zero_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``apo_zero``: ``1 - sigmoid(beta c) + sigmoid(beta r)``."""
    return 1 - jax.nn.sigmoid(s.beta * p.chosen_log_ratios) + jax.nn.sigmoid(s.beta * p.rejected_log_ratios)


def apo_down_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``apo_down``: ``sigmoid(beta c) + 1 - sigmoid(beta (c - r))``."""
    return (jax.nn.sigmoid(s.beta * p.chosen_log_ratios) + 1
            - jax.nn.sigmoid(s.beta * (p.chosen_log_ratios - p.rejected_log_ratios)))


def discopop_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``discopop``: ``-log sigmoid(z) (1 - m) + exp(-z) m`` with ``z = beta d``, ``m = sigmoid(z / tau)``."""
    logits = s.beta * p.score
    modulation = jax.nn.sigmoid(logits / s.discopop_tau)
    return -jax.nn.log_sigmoid(logits) * (1 - modulation) + jnp.exp(-logits) * modulation


def sft_loss(p: PairTerms, s: DPOLossSettings) -> jax.Array:
    """``sft``: the mean negative log-probability of the chosen tokens, ``-sum(logp_chosen) / sum(n_c)``, the same
    value for every pair."""
    return jnp.broadcast_to(-p.sft_chosen_logps.sum() / p.chosen_lengths.sum(), p.chosen_logps.shape)


#: ``loss_type`` -> its ``[B]`` per-pair losses (TRL's ``per_sequence_loss``), TRL 1.16's list in its order.
DPO_LOSSES: dict[str, Callable[[PairTerms, DPOLossSettings], jax.Array]] = {
    "sigmoid": sigmoid_loss, "hinge": hinge_loss, "ipo": ipo_loss, "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss, "robust": robust_loss, "bco_pair": bco_pair_loss, "sppo_hard": sppo_hard_loss,
    "aot": aot_loss, "aot_unpaired": aot_unpaired_loss, "apo_zero": apo_zero_loss, "apo_down": apo_down_loss,
    "discopop": discopop_loss, "sft": sft_loss, "sigmoid_norm": sigmoid_norm_loss,
}
#: DPO ``loss_type`` values (TRL 1.16's list, all implemented).
DPO_LOSS_TYPES: tuple[str, ...] = tuple(DPO_LOSSES)


def reverse_kl_scores(log_ratios: jax.Array, alpha: float) -> jax.Array:
    """``"reverse_kl"``: ``f'(u) = log u``, the log-ratio itself (DPO)."""
    return log_ratios


def forward_kl_scores(log_ratios: jax.Array, alpha: float) -> jax.Array:
    """``"forward_kl"``: ``f'(u) = 1 - 1 / u``."""
    return 1 - jnp.exp(-log_ratios)


def js_divergence_scores(log_ratios: jax.Array, alpha: float) -> jax.Array:
    """``"js_divergence"``: ``f'(u) = log(2u / (1 + u)) = log 2 + log sigmoid(log u)``."""
    return math.log(2) + jax.nn.log_sigmoid(log_ratios)


def alpha_divergence_scores(log_ratios: jax.Array, alpha: float) -> jax.Array:
    """``"alpha_divergence"``: ``f'(u) = (u^(alpha - 1) - 1) / (alpha - 1)`` (exponent capped at 80), the reverse KL
    as ``alpha -> 1``."""
    if abs(alpha - 1.0) < 1e-6:
        return log_ratios
    return (jnp.exp(jnp.minimum((alpha - 1.0) * log_ratios, 80.0)) - 1.0) / (alpha - 1.0)


#: ``f_divergence_type`` -> ``(log(pi / pi_ref), alpha) -> f'(pi / pi_ref)`` of the f-DPO paper, TRL 1.16's list.
F_DIVERGENCES: dict[str, Callable[[jax.Array, float], jax.Array]] = {
    "reverse_kl": reverse_kl_scores, "forward_kl": forward_kl_scores, "js_divergence": js_divergence_scores,
    "alpha_divergence": alpha_divergence_scores,
}
#: DPO ``f_divergence_type`` values.
F_DIVERGENCE_TYPES: tuple[str, ...] = tuple(F_DIVERGENCES)


def dpo_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    settings: DPOLossSettings,
    *,
    chosen_lengths: jax.Array | None = None,
    rejected_lengths: jax.Array | None = None,
    sft_chosen_logps: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of a batch of preference pairs and TRL's reward metrics, as ``DPOTrainer._compute_loss``.

    With log-ratios ``c = logp_chosen - ref_chosen``, ``r = logp_rejected - ref_rejected``, scores ``s_c = f'(c)``,
    ``s_r = f'(r)`` (``f_divergence_type``; the identity for ``"reverse_kl"``) and ``d = s_c - s_r``:

    each ``loss_type``'s per-pair losses are its entry of :data:`DPO_LOSSES` (TRL 1.16's ``sigmoid`` is not smoothed;
    ``label_smoothing`` is read by ``robust``, ``exo_pair``, ``aot`` and ``aot_unpaired`` only).

    ``loss = sum_i loss_weights[i] * mean_b(loss_i)`` over the listed ``loss_type`` values. The settings are Python
    values (static under ``jax.jit``); the lengths may be arrays.

    Args:
        policy_chosen_logps: ``[B]`` summed log-probabilities of the chosen completions under the policy
            (``sequence_log_probs``, or ``length_desensitised_log_probs`` for ``ld_alpha``).
        policy_rejected_logps: ``[B]``.
        ref_chosen_logps: ``[B]`` under the reference model.
        ref_rejected_logps: ``[B]``.
        settings: the loss settings (``ld_alpha`` and ``use_weighting`` are the step loss's).
        chosen_lengths: ``[B]`` completion tokens of each chosen sequence (``ipo``, ``sigmoid_norm``, ``sft``).
        rejected_lengths: ``[B]`` (``ipo``, ``sigmoid_norm``).
        sft_chosen_logps: ``[B]`` plain (unweighted) sums of the chosen tokens' log-probabilities, read by ``sft``;
            ``None`` uses ``policy_chosen_logps``, which is the same unless ``ld_alpha`` weighted it.

    Returns:
        ``(loss, metrics)``, float32. ``metrics``: ``"rewards/chosen"`` (mean of ``beta c``), ``"rewards/rejected"``
        (mean of ``beta r``), ``"rewards/accuracies"`` (share of pairs with ``c > r``), ``"rewards/margins"`` (mean
        of ``beta (c - r)``), ``"logps/chosen"``, ``"logps/rejected"`` (means of the policy log-probabilities).
    """
    needs_lengths = [name for name in settings.loss_type if name in LENGTH_LOSS_TYPES]
    if needs_lengths and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"DPO loss_type={needs_lengths[0]!r} needs chosen_lengths and rejected_lengths (completion "
                         "tokens per sequence).")
    chosen_logps = policy_chosen_logps.astype(jnp.float32)
    rejected_logps = policy_rejected_logps.astype(jnp.float32)
    ref_chosen_logps = ref_chosen_logps.astype(jnp.float32)
    ref_rejected_logps = ref_rejected_logps.astype(jnp.float32)
    chosen_log_ratios = chosen_logps - ref_chosen_logps
    rejected_log_ratios = rejected_logps - ref_rejected_logps
    if chosen_lengths is not None:
        chosen_lengths = jnp.asarray(chosen_lengths, jnp.float32)
    if rejected_lengths is not None:
        rejected_lengths = jnp.asarray(rejected_lengths, jnp.float32)
    scores, alpha = F_DIVERGENCES[settings.f_divergence_type], settings.f_alpha_divergence_coef
    pair = PairTerms(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_log_ratios, rejected_log_ratios,
        scores(chosen_log_ratios, alpha), scores(rejected_log_ratios, alpha), chosen_lengths, rejected_lengths,
        chosen_logps if sft_chosen_logps is None else sft_chosen_logps.astype(jnp.float32))

    loss = jnp.float32(0.0)
    for name, weight in zip(settings.loss_type, settings.loss_weights, strict=True):
        loss = loss + DPO_LOSSES[name](pair, settings).mean() * weight

    beta = settings.beta
    chosen_rewards = beta * jax.lax.stop_gradient(chosen_log_ratios)
    rejected_rewards = beta * jax.lax.stop_gradient(rejected_log_ratios)
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": jax.lax.stop_gradient(chosen_logps).mean(),
        "logps/rejected": jax.lax.stop_gradient(rejected_logps).mean(),
    }
    return loss, metrics


# --- On Tunix modules ---------------------------------------------------------------------------------------------

def _pair_token_log_probs(family, module, batch: dict, with_metrics: bool = False,
                          block_size: logprobs.BlockSize = "auto", with_log_sum_sq_probs: bool = False
                          ) -> tuple[logprobs.TokenScores, jax.Array]:
    """One forward pass over the chosen rows stacked on the rejected rows (``2B``, TRL's layout). A vision-language
    batch (``chosen_token_type_ids``/``rejected_token_type_ids`` and the pairs' ``images``) gives each pair's images
    to both of its rows, as TRL's vision collator repeats them for the chosen and the rejected sequence.

    Returns:
        ``(scores, mask)``: the per-token scores ``[2B, T-1]`` of ``logprobs.next_token_scores`` (the
        metrics' too with ``with_metrics``, ``log_sum_sq_probs`` with ``with_log_sum_sq_probs``), position ``t``
        predicting token ``t + 1``, with their log-probabilities zeroed outside ``mask``, the shifted completion mask.
    """
    def stacked(name: str) -> jax.Array:
        return jnp.concatenate([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])

    inputs = {"input_ids": stacked("input_ids"), "attention_mask": stacked("attention_mask")}
    if "chosen_token_type_ids" in batch:
        inputs["token_type_ids"] = stacked("token_type_ids")
    if "images" in batch:
        inputs["images"] = jax.tree.map(lambda images: jnp.concatenate([images, images]), batch["images"])
    scores = logprobs.next_token_scores(family, module, inputs, with_metrics=with_metrics, block_size=block_size,
                                        with_log_sum_sq_probs=with_log_sum_sq_probs)
    mask = stacked("completion_mask")[:, 1:]
    return scores._replace(log_probs=jnp.where(mask.astype(bool), scores.log_probs, 0.0)), mask


def _sequence_log_probs(per_token: jax.Array, mask: jax.Array, ld_alpha: float | None) -> tuple[jax.Array, jax.Array]:
    """``(chosen [B], rejected [B])`` summed completion log-probabilities (LD-DPO weighted with ``ld_alpha``)."""
    chosen, rejected = jnp.split(per_token, 2)
    if ld_alpha is None:
        return chosen.sum(-1), rejected.sum(-1)
    chosen_mask, rejected_mask = jnp.split(mask, 2)
    return length_desensitised_log_probs(chosen, rejected, chosen_mask, rejected_mask, ld_alpha)


def masked_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(values * weights) / max(sum(weights), 1)``: a mean over the entries ``weights`` selects."""
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def _token_metrics(scores: logprobs.TokenScores, mask: jax.Array) -> dict[str, jax.Array]:
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


def dpo_step_loss(family: Family, settings: DPOLossSettings, block_size: logprobs.BlockSize = "auto") -> Callable:
    """The DPO step loss ``(module, batch, num_items_in_batch) -> (value, weight, metrics)`` (``Trainer._step_loss``).

    ``value`` is TRL's ``DPOTrainer`` loss of the micro-batch: ``sum_i loss_weights[i] * mean over pairs of
    loss_type[i]``, each pair's losses times its WPO weight ``w_chosen * w_rejected`` with ``use_weighting``
    (:func:`wpo_weights`). Rows that pad a partial batch (all-zero masks) are left out of the means; ``weight``
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
        settings: the loss settings.
        block_size: positions per block of the log-prob computation (:data:`.logprobs.BlockSize`: ``"auto"``, a
            number, or ``None`` for the whole sequence at once).

    The batch holds ``collate_preference_batch``'s columns with ``ref_chosen_logps``/``ref_rejected_logps``; a
    vision-language batch also ``chosen_token_type_ids``/``rejected_token_type_ids`` and ``images`` (one set per
    pair).
    """
    weighted = list(zip(settings.loss_type, settings.loss_weights, strict=True))
    whole_batch = [(name, weight) for name, weight in weighted if name in BATCH_LOSS_TYPES]
    # dpo_loss returns the metrics too; a zero-weight sigmoid yields them when every loss type reads the whole batch.
    per_pair = settings.only([(name, weight) for name, weight in weighted if name not in BATCH_LOSS_TYPES]
                             or [("sigmoid", 0.0)])
    router_aux_loss_coef = settings.router_aux_loss_coef

    def one_pair(chosen, rejected, ref_chosen, ref_rejected, chosen_length, rejected_length):
        return dpo_loss(chosen[None], rejected[None], ref_chosen[None], ref_rejected[None], per_pair,
                        chosen_lengths=chosen_length[None], rejected_lengths=rejected_length[None])

    def loss(module, batch, num_items_in_batch=None):
        def forward(module):
            return _pair_token_log_probs(family, module, batch, with_metrics=True, block_size=block_size,
                                         with_log_sum_sq_probs=settings.use_weighting)

        rows_mask = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        (scores, mask), aux_loss = router_loss.run_with_router_loss(family, forward, module, rows_mask,
                                                                    router_aux_loss_coef)
        per_token = scores.log_probs
        chosen, rejected = _sequence_log_probs(per_token, mask, settings.ld_alpha)
        ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        real = batch["chosen_attention_mask"].any(-1).astype(jnp.float32)  # 0 on rows padding a partial batch
        # TRL's ipo and sigmoid_norm divide by the unshifted completion lengths, its sft by the scored tokens.
        chosen_length, rejected_length = (batch[f"{key}_completion_mask"].sum(-1) for key in ("chosen", "rejected"))
        pair_losses, pair_metrics = jax.vmap(one_pair)(chosen, rejected, ref_chosen, ref_rejected, chosen_length,
                                                       rejected_length)
        pair_weights = jnp.ones_like(real)
        if settings.use_weighting:
            chosen_weights, rejected_weights = jnp.split(wpo_weights(per_token, scores.log_sum_sq_probs, mask), 2)
            pair_weights = chosen_weights * rejected_weights
        value = masked_mean(pair_losses * pair_weights, real)
        if whole_batch:  # exact with padding rows for sft (they add no token); aot sorts them in (see the warning)
            chosen_mask, rejected_mask = jnp.split(mask, 2)
            # sft's loss is one value for every pair, so its weighted mean is that value times the mean weight.
            value += dpo_loss(chosen, rejected, ref_chosen, ref_rejected, settings.only(whole_batch),
                              chosen_lengths=chosen_mask.sum(-1), rejected_lengths=rejected_mask.sum(-1),
                              sft_chosen_logps=jnp.split(per_token, 2)[0].sum(-1))[0] * masked_mean(pair_weights, real)
        metrics = {key: masked_mean(values, real) for key, values in pair_metrics.items()}
        tokens = (batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum()).astype(jnp.float32)
        metrics = {**metrics, **_token_metrics(scores, mask), "num_tokens": tokens}
        if aux_loss is not None:
            value = value + router_aux_loss_coef * aux_loss
            metrics["aux_loss"] = aux_loss
        return value, (real.sum() > 0).astype(jnp.float32), metrics

    return loss


def reference_pass(family: Family, lora: str, mesh: jax.sharding.Mesh, settings: DPOLossSettings) -> Callable:
    """``(module, batch, num_items_in_batch=None) -> (chosen [B], rejected [B])``: the summed completion
    log-probabilities of a reference (LD-DPO weighted with ``settings.ld_alpha``), run with its adapter in mode
    ``lora`` and replicated over ``mesh`` so that every process reads all rows."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def reference_log_probs(module, batch, num_items_in_batch=None):
        with lora_runtime.lora_mode(lora):
            scores, mask = _pair_token_log_probs(family, module, batch)
        return tuple(jax.lax.with_sharding_constraint(logps, replicated)
                     for logps in _sequence_log_probs(scores.log_probs, mask, settings.ld_alpha))

    return reference_log_probs
