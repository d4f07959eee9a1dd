"""GOLD's Universal Logit Distillation (``trl.experimental.gold.GOLDTrainer`` with ``use_uld_loss=True``, TRL 1.16):
TRL's ``ULDLoss`` between a student and a frozen teacher whose tokenizers differ, split into a host-side alignment plan
(NumPy, per micro-batch, outside ``jit``) and a pure, jittable loss.

Each row's answer is its labelled span (first label, count of labels), one token shorter per side with
``uld_skip_*_eos``; a row where either side is left with no token counts 0. The two answers are aligned:

- positional ULD (``use_extended_uld=False``): group ``k`` is token ``k`` of each side, for the shorter side's length;
- extended ULD: both sides' completion-relative byte offsets are walked together and a group closes wherever both
  tokenizers end a token at the same byte; what is left at the end is one last group, dropped when a side of it is
  empty.

Each side's distribution of a group is merged from its tokens' distributions ``p_j = softmax(logits_j / T)``
(``T``: the side's ``uld_*_temperature``). ``"observed"`` reads the logits at the answer tokens' own positions and
takes ``p_first * prod_{j > first} max(p_j[y_j], 1e-8)``; ``"bayesian"`` reads them one position earlier (the
prediction of each answer token) and takes ``p_last * prod_{j < last} max(p_j[y_j], 1e-8)``, after dropping the
answer's first group on both sides when either answer starts at index 0 (it has no predicting logits). ``y_j`` is the
token at position ``j``; under ``"observed"``, as in TRL, ``p_j`` is the distribution the model predicts for the token
after ``j``. With ``G`` groups, ``q_s``/``q_t`` the merged rows and ``sort`` descending with the shorter
vocabulary padded with zeros:

    row loss = sum_g sum_v |sort(q_s[g])_v - sort(q_t[g])_v| / G

or, with ``uld_use_hybrid_loss``, ``w_m * matched + w_u * unmatched`` where ``matched`` is the generalized JSD of
the columns of tokens spelled the same in both vocabularies (``log max(q, 1e-8)``, summed and divided by ``G``),
``unmatched`` the sorted L1 above on the other columns, and ``(w_m, w_u)`` the configured weights or
``(M / V_t, 1 - M / V_t)`` (``M`` matched tokens, ``V_t`` the teacher logits' vocabulary). The loss is::

    uld_crossentropy_weight * CE + uld_distillation_weight * mean over all B rows of the row loss

with ``CE`` the student's mean next-token cross-entropy over its labelled tokens (untempered logits). TRL keeps the
hybrid's ``matched``/``unmatched`` of the last row that ran it (``last_matched_loss``/``last_unmatched_loss``);
:class:`ULDLossOutput` returns the same.

The plan (:func:`prepare_uld_alignment`) turns every row's groups into fixed-shape index arrays (:class:`ULDAlignment`),
so one compiled program serves every micro-batch of the same widths; the hybrid's vocabulary split
(:func:`hybrid_vocabulary`) is fixed by the two tokenizers and computed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .settings import LossSettings, check_choice

__all__ = ["HybridVocabulary", "MergePlan", "ULDAlignment", "ULDLossOutput", "ULDLossSettings", "align_by_byte_offsets",
           "alignment_columns", "alignment_from_columns", "alignment_sizes", "hybrid_vocabulary",
           "prepare_uld_alignment", "probability_jsd_terms", "uld_loss"]

#: TRL's ignore index of the labels.
IGNORE_INDEX = -100
#: TRL's floor on a merged token's scalar probability and on the hybrid JSD's probabilities.
EPSILON = 1e-8
MERGE_STRATEGIES = ("observed", "bayesian")


@dataclass(frozen=True)
class ULDLossSettings(LossSettings):
    """The settings of GOLD's ULD loss, named as their ``GOLDConfig`` fields (:meth:`from_config`); hashable, so the
    record can be a static argument of ``jax.jit``.

    Args:
        uld_crossentropy_weight: weight of the student's cross-entropy (0: not computed).
        uld_distillation_weight: weight of the distillation term.
        uld_student_temperature, uld_teacher_temperature: each side's logits are divided by it.
        uld_skip_student_eos, uld_skip_teacher_eos: drop the last labelled token of that side's answer.
        use_extended_uld: align by byte offsets (else by position).
        uld_token_merge_strategy: ``"observed"`` or ``"bayesian"``.
        uld_use_hybrid_loss: JSD on the shared vocabulary, sorted L1 on the rest.
        uld_hybrid_matched_weight, uld_hybrid_unmatched_weight: the hybrid's fixed weights, or both ``None``
            (adaptive).
        beta: the hybrid JSD's interpolation (0: forward KL, 1: reverse KL).
    """

    uld_crossentropy_weight: float = 0.0
    uld_distillation_weight: float = 1.0
    uld_student_temperature: float = 1.0
    uld_teacher_temperature: float = 1.0
    uld_skip_student_eos: bool = True
    uld_skip_teacher_eos: bool = True
    use_extended_uld: bool = True
    uld_token_merge_strategy: str = "observed"
    uld_use_hybrid_loss: bool = False
    uld_hybrid_matched_weight: float | None = None
    uld_hybrid_unmatched_weight: float | None = None
    beta: float = 0.5

    def __post_init__(self) -> None:
        check_choice("uld_token_merge_strategy", self.uld_token_merge_strategy, MERGE_STRATEGIES)
        if (self.uld_hybrid_matched_weight is None) != (self.uld_hybrid_unmatched_weight is None):
            raise ValueError("uld_hybrid_matched_weight and uld_hybrid_unmatched_weight must both be None (adaptive "
                             f"weights) or both numbers; got {self.uld_hybrid_matched_weight} and "
                             f"{self.uld_hybrid_unmatched_weight}.")


class MergePlan(NamedTuple):
    """How one side's merged distribution of each aligned group is made (``G`` groups, ``K = group_width - 1``
    scalar slots), all ``int32`` / ``bool``.

    Attributes:
        base_positions: ``[B, G]`` the logits position whose whole distribution is the group's base (its first token
            for ``"observed"``, its last for ``"bayesian"``, already shifted one position earlier for
            ``"bayesian"``); 0 in padded groups.
        scalar_positions: ``[B, G, K]`` the logits positions of the group's other tokens.
        scalar_token_ids: ``[B, G, K]`` the actual token at each scalar slot, whose probability multiplies the base.
        scalar_mask: ``[B, G, K]`` True at the slots in use.
    """

    base_positions: np.ndarray
    scalar_positions: np.ndarray
    scalar_token_ids: np.ndarray
    scalar_mask: np.ndarray


class ULDAlignment(NamedTuple):
    """The host-side plan of one micro-batch (:func:`prepare_uld_alignment`); a pytree of NumPy arrays.

    Attributes:
        student_labels: ``[B, W_s]`` ``int32`` the student's labels (``-100`` where none), for the cross-entropy.
        student: the student side's :class:`MergePlan`.
        teacher: the teacher side's :class:`MergePlan`.
        group_mask: ``[B, G]`` True at a row's aligned groups (the first ``group_count`` of the row).
        row_valid: ``[B]`` True where the row's distillation loss runs (False: the row counts 0).
    """

    student_labels: np.ndarray
    student: MergePlan
    teacher: MergePlan
    group_mask: np.ndarray
    row_valid: np.ndarray


class HybridVocabulary(NamedTuple):
    """The hybrid loss's split of both logits vocabularies (:func:`hybrid_vocabulary`), ``int32`` index arrays.

    Attributes:
        teacher_matched_ids: ``[M]`` teacher ids whose token string the student's vocabulary also has, ascending.
        student_matched_ids: ``[M]`` the student id of each, in the same order.
        teacher_unmatched_ids: ``[V_t - M]`` the other teacher logits columns, ascending.
        student_unmatched_ids: ``[V_s - M]`` the other student logits columns, ascending.
    """

    teacher_matched_ids: np.ndarray
    student_matched_ids: np.ndarray
    teacher_unmatched_ids: np.ndarray
    student_unmatched_ids: np.ndarray


class ULDLossOutput(NamedTuple):
    """What TRL's ``ULDLoss`` returns and records, as float32 scalars.

    Attributes:
        loss: ``ULDLoss.__call__``'s value (differentiable in the student's logits).
        matched_loss: ``last_matched_loss``: the hybrid JSD of the last row that ran the hybrid loss (0 if none).
        unmatched_loss: ``last_unmatched_loss``: that row's sorted L1 on the unmatched vocabulary (0 if none).
        has_hybrid_components: True when some row ran the hybrid loss; otherwise TRL leaves ``last_*_loss`` as an
            earlier call set them.
    """

    loss: jax.Array
    matched_loss: jax.Array
    unmatched_loss: jax.Array
    has_hybrid_components: jax.Array


class _Span(NamedTuple):
    """One side's answer in a row: its first position and token count."""

    start: int
    size: int


def _answer_span(labels: np.ndarray) -> _Span:
    """TRL's ``_get_start_and_size_answers`` for one row: the first labelled index and the number of labels (which
    TRL takes as contiguous), ``(0, 0)`` without labels."""
    labelled = np.flatnonzero(labels != IGNORE_INDEX)
    return _Span(int(labelled[0]), len(labelled)) if len(labelled) else _Span(0, 0)


def align_by_byte_offsets(student_offsets: Sequence[Sequence[int]], teacher_offsets: Sequence[Sequence[int]]
                          ) -> tuple[list[list[int]], list[list[int]]]:
    """TRL's ``_align_by_byte_offsets``: the aligned groups of two answers' ``(start, end)`` byte offsets.

    Both lists are walked together, advancing the side whose token ends earlier; a group closes where both end at
    the same byte. Tokens left over on either side form one last group (one of its sides may be empty).

    Returns:
        ``(student groups, teacher groups)``: lists of answer-relative token indices, pairwise.
    """
    student_groups: list[list[int]] = []
    teacher_groups: list[list[int]] = []
    student_start = teacher_start = s = t = 0
    while s < len(student_offsets) and t < len(teacher_offsets):
        student_end, teacher_end = student_offsets[s][1], teacher_offsets[t][1]
        if student_end < teacher_end:
            s += 1
        elif student_end > teacher_end:
            t += 1
        else:
            s += 1
            t += 1
            student_groups.append(list(range(student_start, s)))
            teacher_groups.append(list(range(teacher_start, t)))
            student_start, teacher_start = s, t
    if s < len(student_offsets) or t < len(teacher_offsets):
        student_groups.append(list(range(student_start, len(student_offsets))))
        teacher_groups.append(list(range(teacher_start, len(teacher_offsets))))
    return student_groups, teacher_groups


def _row_groups(row: int, student: _Span, teacher: _Span, student_byte_offsets: np.ndarray | None,
                teacher_byte_offsets: np.ndarray | None, settings: ULDLossSettings
                ) -> tuple[_Span, _Span, list[list[int]], list[list[int]]] | None:
    """One row's ``(student answer, teacher answer, student groups, teacher groups)`` (groups of answer-relative
    indices), or ``None`` where TRL skips the row; the spans are given after the EOS skips."""
    if student.size <= 0 or teacher.size <= 0:
        return None

    def byte_groups(student: _Span, teacher: _Span) -> tuple[list[list[int]], list[list[int]]]:
        if student_byte_offsets is None or teacher_byte_offsets is None:
            raise ValueError("Byte offsets are required when `use_extended_uld=True`: pass student_byte_offsets and "
                             "teacher_byte_offsets ([B, W, 2], completion-relative).")
        return align_by_byte_offsets(student_byte_offsets[row, student.start:student.start + student.size].tolist(),
                                     teacher_byte_offsets[row, teacher.start:teacher.start + teacher.size].tolist())

    if settings.uld_token_merge_strategy == "bayesian" and (student.start == 0 or teacher.start == 0):
        # The first answer token has no predicting logits: drop the first aligned group on both sides.
        if settings.use_extended_uld:
            student_groups, teacher_groups = byte_groups(student, teacher)
            student_drop, teacher_drop = len(student_groups[0]), len(teacher_groups[0])
        else:
            student_drop = teacher_drop = 1
        student = _Span(student.start + student_drop, student.size - student_drop)
        teacher = _Span(teacher.start + teacher_drop, teacher.size - teacher_drop)
        if student.size <= 0 or teacher.size <= 0:
            return None
    if settings.use_extended_uld:
        paired = [(s, t) for s, t in zip(*byte_groups(student, teacher), strict=True) if s and t]
        return student, teacher, [s for s, _ in paired], [t for _, t in paired]
    positions = [[k] for k in range(min(student.size, teacher.size))]
    return student, teacher, positions, positions


def _fill_side(plan: MergePlan, row: int, start: int, groups: list[list[int]], input_ids: np.ndarray,
               bayesian: bool, side: str) -> None:
    """Writes one row's groups of one side into ``plan``'s arrays (answer-relative indices from ``start``)."""
    shift = -1 if bayesian else 0
    slots = plan.scalar_mask.shape[-1]
    for index, group in enumerate(groups):
        if len(group) - 1 > slots:
            raise ValueError(f"Row {row} has an aligned group of {len(group)} {side} tokens; group_width is "
                             f"{slots + 1}. Pass a larger group_width (the widest group of the batch; the answer "
                             "length always suffices).")
        base, scalars = (group[-1], group[:-1]) if bayesian else (group[0], group[1:])
        plan.base_positions[row, index] = start + base + shift
        for slot, position in enumerate(scalars):
            plan.scalar_positions[row, index, slot] = start + position + shift
            plan.scalar_token_ids[row, index, slot] = input_ids[row, start + position]
            plan.scalar_mask[row, index, slot] = True


def _empty_plan(batch: int, num_groups: int, group_width: int) -> MergePlan:
    slots = (batch, num_groups, group_width - 1)
    return MergePlan(np.zeros((batch, num_groups), np.int32), np.zeros(slots, np.int32), np.zeros(slots, np.int32),
                     np.zeros(slots, bool))


def prepare_uld_alignment(student_labels: np.ndarray, teacher_labels: np.ndarray, student_input_ids: np.ndarray,
                          teacher_input_ids: np.ndarray, settings: ULDLossSettings, *, num_groups: int,
                          group_width: int, student_byte_offsets: np.ndarray | None = None,
                          teacher_byte_offsets: np.ndarray | None = None) -> ULDAlignment:
    """The host-side half of TRL's ``ULDLoss._compute_distillation_loss``: answer spans, EOS skips, the
    ``"bayesian"`` leading-group skip, the alignment (byte offsets or positions), the empty-pair filter and the merge
    plan of each group, as fixed-shape arrays.

    Args:
        student_labels: ``[B, W_s]`` the student's labels (``-100`` where none), as given to the student's model.
        teacher_labels: ``[B, W_t]`` the teacher's (``build_teacher_inputs_from_texts``).
        student_input_ids, teacher_input_ids: ``[B, W_s]`` / ``[B, W_t]`` each side's input ids.
        settings: the loss's settings (the alignment reads the EOS skips, ``use_extended_uld`` and the merge
            strategy).
        num_groups: ``G``, the most aligned groups a row may have (static; ``min(W_s, W_t)`` always suffices).
        group_width: the most tokens one side of a group may hold (static; 1 suffices for positional ULD).
        student_byte_offsets, teacher_byte_offsets: ``[B, W, 2]`` completion-relative UTF-8 ``(start, end)`` of each
            token; required with ``use_extended_uld``.

    Returns:
        :class:`ULDAlignment` with ``G = num_groups`` and ``K = group_width - 1``.

    Raises:
        ValueError: a row needs more than ``num_groups`` groups or a group is wider than ``group_width`` (pass
            larger sizes), or byte offsets are missing with ``use_extended_uld``.
    """
    student_labels, teacher_labels = np.asarray(student_labels), np.asarray(teacher_labels)
    student_input_ids, teacher_input_ids = np.asarray(student_input_ids), np.asarray(teacher_input_ids)
    student_byte_offsets, teacher_byte_offsets = (None if offsets is None else np.asarray(offsets)
                                                  for offsets in (student_byte_offsets, teacher_byte_offsets))
    batch = student_labels.shape[0]
    student, teacher = _empty_plan(batch, num_groups, group_width), _empty_plan(batch, num_groups, group_width)
    group_mask = np.zeros((batch, num_groups), bool)
    row_valid = np.zeros(batch, bool)
    bayesian = settings.uld_token_merge_strategy == "bayesian"
    for row in range(batch):
        student_answer, teacher_answer = _answer_span(student_labels[row]), _answer_span(teacher_labels[row])
        groups = _row_groups(row, _Span(student_answer.start, student_answer.size - settings.uld_skip_student_eos),
                             _Span(teacher_answer.start, teacher_answer.size - settings.uld_skip_teacher_eos),
                             student_byte_offsets, teacher_byte_offsets, settings)
        if groups is None:
            continue
        student_answer, teacher_answer, student_groups, teacher_groups = groups
        if len(student_groups) > num_groups:
            raise ValueError(f"Row {row} aligns into {len(student_groups)} groups; num_groups is {num_groups}. Pass "
                             "a larger num_groups (min of the two sequence widths always suffices).")
        _fill_side(student, row, student_answer.start, student_groups, student_input_ids, bayesian, "student")
        _fill_side(teacher, row, teacher_answer.start, teacher_groups, teacher_input_ids, bayesian, "teacher")
        group_mask[row, :len(student_groups)] = True
        row_valid[row] = True
    return ULDAlignment(student_labels.astype(np.int32), student, teacher, group_mask, row_valid)


def alignment_sizes(alignment: ULDAlignment) -> tuple[int, int]:
    """``(groups, slots)``: the most aligned groups of a row and the most scalar slots of a group the plan uses."""
    slots = max(int(plan.scalar_mask.sum(-1).max(initial=0)) for plan in (alignment.student, alignment.teacher))
    return int(alignment.group_mask.sum(-1).max(initial=0)), slots


def alignment_columns(alignment: ULDAlignment, groups: int, slots: int) -> dict[str, np.ndarray]:
    """The plan as a micro-batch's step columns (``uld_*``, ``int32``, batch first), cut to ``groups`` groups and
    ``slots`` scalar slots (at least :func:`alignment_sizes`: a step's micro-batches share one shape)."""
    columns = {"uld_student_labels": alignment.student_labels, "uld_group_mask": alignment.group_mask[:, :groups],
               "uld_row_valid": alignment.row_valid}
    for side in ("student", "teacher"):
        plan = getattr(alignment, side)
        columns[f"uld_{side}_base_positions"] = plan.base_positions[:, :groups]
        for name in ("scalar_positions", "scalar_token_ids", "scalar_mask"):
            columns[f"uld_{side}_{name}"] = getattr(plan, name)[:, :groups, :slots]
    return {name: np.asarray(value, np.int32) for name, value in columns.items()}


def alignment_from_columns(batch: Mapping[str, jax.Array]) -> ULDAlignment:
    """The :class:`ULDAlignment` of a micro-batch's ``uld_*`` columns (:func:`alignment_columns`)."""
    def plan(side: str) -> MergePlan:
        return MergePlan(batch[f"uld_{side}_base_positions"], batch[f"uld_{side}_scalar_positions"],
                         batch[f"uld_{side}_scalar_token_ids"], batch[f"uld_{side}_scalar_mask"] != 0)

    return ULDAlignment(batch["uld_student_labels"], plan("student"), plan("teacher"), batch["uld_group_mask"] != 0,
                        batch["uld_row_valid"] != 0)


def hybrid_vocabulary(student_vocab: Mapping[str, int], teacher_vocab: Mapping[str, int], student_vocab_size: int,
                      teacher_vocab_size: int) -> HybridVocabulary:
    """TRL's ``_initialize_vocabulary_mapping``: the teacher tokens whose string the student's vocabulary also has,
    paired with the student's id, and the other columns of each side's logits.

    Args:
        student_vocab, teacher_vocab: each tokenizer's ``get_vocab()`` (token string -> id).
        student_vocab_size, teacher_vocab_size: the last dimension of each model's logits.

    Returns:
        :class:`HybridVocabulary`.

    Raises:
        ValueError: no token is shared (TRL fails there too), or a tokenizer id is outside its logits' vocabulary.
    """
    pairs = sorted((teacher_id, student_vocab[token]) for token, teacher_id in teacher_vocab.items()
                   if token in student_vocab)
    if not pairs:
        raise ValueError("The hybrid ULD loss needs tokens spelled the same in both vocabularies; these tokenizers "
                         "share none. Set uld_use_hybrid_loss=False.")
    teacher_matched, student_matched = (np.array(ids, np.int32) for ids in zip(*pairs, strict=True))
    for side, ids, size in (("teacher", teacher_matched, teacher_vocab_size),
                            ("student", student_matched, student_vocab_size)):
        if ids.max() >= size:
            raise ValueError(f"The {side} tokenizer has id {int(ids.max())} but the {side} logits have {size} "
                             "entries; pass the logits' last dimension as the vocabulary size.")
    return HybridVocabulary(teacher_matched, student_matched,
                            np.setdiff1d(np.arange(teacher_vocab_size), teacher_matched).astype(np.int32),
                            np.setdiff1d(np.arange(student_vocab_size), student_matched).astype(np.int32))


def _merged_probabilities(logits: jax.Array, plan: MergePlan, temperature: float) -> jax.Array:
    """``[B, G, V]`` TRL's ``_merge_probabilities_with_alignment_groups``: each group's base distribution times the
    clamped probabilities of its scalar tokens, multiplied in order. A scalar's probability is read from its
    position's log-normaliser, so no ``[B, G, K, V]`` gather is made."""
    rows = jnp.arange(logits.shape[0])[:, None]
    probs = jax.nn.softmax(logits[rows, plan.base_positions] / temperature, axis=-1)
    log_normalisers = jax.nn.logsumexp(logits / temperature, axis=-1)
    rows = rows[..., None]
    chosen = logits[rows, plan.scalar_positions, plan.scalar_token_ids] / temperature
    scalars = jnp.maximum(jnp.exp(chosen - log_normalisers[rows, plan.scalar_positions]), EPSILON)
    product = jnp.ones(probs.shape[:-1], probs.dtype)
    for slot in range(plan.scalar_mask.shape[-1]):
        product = product * jnp.where(plan.scalar_mask[..., slot], scalars[..., slot], 1.0)
    return probs * product[..., None]


def _sorted_l1(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """``[B, G]`` the L1 distance of the two ``[B, G, *]`` rows sorted descending, the narrower padded with zeros."""
    width = max(student.shape[-1], teacher.shape[-1])

    def sorted_padded(values: jax.Array) -> jax.Array:
        descending = -jnp.sort(-values, axis=-1)
        return jnp.pad(descending, [(0, 0)] * (values.ndim - 1) + [(0, width - values.shape[-1])])

    return jnp.abs(sorted_padded(student) - sorted_padded(teacher)).sum(-1)


def probability_jsd_terms(student_probs: jax.Array, teacher_probs: jax.Array, beta: float) -> jax.Array:
    """The per-entry terms of TRL's ``GOLDTrainer.generalized_jsd_loss`` with ``logits_are_probs=True``: on
    ``log max(p, 1e-8)`` of both sides, ``KL(t || s)`` (``beta`` 0), ``KL(s || t)`` (1), or ``beta KL(t || m) +
    (1 - beta) KL(s || m)`` with ``m = (1 - beta) s + beta t``."""
    log_s, log_t = jnp.log(jnp.maximum(student_probs, EPSILON)), jnp.log(jnp.maximum(teacher_probs, EPSILON))

    def kl(target: jax.Array, reference: jax.Array) -> jax.Array:
        return jnp.exp(target) * (target - reference)

    if beta == 0:
        return kl(log_t, log_s)
    if beta == 1:
        return kl(log_s, log_t)
    weight = jnp.float32(beta)
    mixture = jnp.logaddexp(log_s + jnp.log1p(-weight), log_t + jnp.log(weight))
    return weight * kl(log_t, mixture) + (1 - weight) * kl(log_s, mixture)


def _cross_entropy(student_logits: jax.Array, labels: jax.Array) -> jax.Array:
    """torch's ``CrossEntropyLoss(ignore_index=-100)`` of the shifted logits and labels: the mean over the labelled
    tokens (NaN with none, as torch)."""
    logits, targets = student_logits[:, :-1], labels[:, 1:]
    labelled = targets != IGNORE_INDEX
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(log_probs, jnp.where(labelled, targets, 0)[..., None], axis=-1)[..., 0]
    return -jnp.where(labelled, chosen, 0.0).sum() / labelled.sum()


def uld_loss(student_logits: jax.Array, teacher_logits: jax.Array, alignment: ULDAlignment,
             settings: ULDLossSettings, vocabulary: HybridVocabulary | None = None,
             row_count: jax.Array | None = None) -> ULDLossOutput:
    """TRL's ``ULDLoss.__call__`` on a prepared micro-batch (see the module docstring); pure and jittable with
    ``settings`` static. The teacher's logits pass through ``stop_gradient``; both are computed in float32.

    Args:
        student_logits: ``[B, W_s, V_s]`` the student's logits over its whole input.
        teacher_logits: ``[B, W_t, V_t]`` the teacher's over its own input.
        alignment: :func:`prepare_uld_alignment`'s plan of the micro-batch.
        settings: the loss's settings.
        vocabulary: :func:`hybrid_vocabulary` of the two tokenizers; required with ``uld_use_hybrid_loss``.
        row_count: the micro-batch's rows the mean is over (default ``B``): a fixed-shape batch's padding rows,
            after them, count nothing.

    Returns:
        :class:`ULDLossOutput`.

    Raises:
        ValueError: ``uld_use_hybrid_loss`` without ``vocabulary``, or ``alignment`` made for other widths.
    """
    if settings.uld_use_hybrid_loss and vocabulary is None:
        raise ValueError("uld_use_hybrid_loss=True needs the vocabulary split: pass vocabulary=hybrid_vocabulary("
                         "student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab(), V_s, V_t).")
    if alignment.student_labels.shape != student_logits.shape[:2]:
        raise ValueError(f"The alignment's student labels are {alignment.student_labels.shape}; the student logits "
                         f"are {student_logits.shape[:2]} [B, W_s]. Prepare the alignment from this micro-batch.")
    student_logits = jnp.asarray(student_logits, jnp.float32)
    teacher_logits = jax.lax.stop_gradient(jnp.asarray(teacher_logits, jnp.float32))
    student = _merged_probabilities(student_logits, alignment.student, settings.uld_student_temperature)
    teacher = _merged_probabilities(teacher_logits, alignment.teacher, settings.uld_teacher_temperature)
    groups = alignment.group_mask
    group_counts = jnp.maximum(groups.sum(-1), 1).astype(jnp.float32)

    def per_row(values: jax.Array) -> jax.Array:
        return jnp.where(groups, values, 0.0).sum(-1) / group_counts

    matched = unmatched = jnp.zeros(groups.shape[0], jnp.float32)
    if not settings.uld_use_hybrid_loss:
        row_losses = per_row(_sorted_l1(student, teacher))
    else:
        matched = per_row(probability_jsd_terms(student[..., vocabulary.student_matched_ids],
                                                teacher[..., vocabulary.teacher_matched_ids], settings.beta).sum(-1))
        if len(vocabulary.student_unmatched_ids) and len(vocabulary.teacher_unmatched_ids):
            unmatched = per_row(_sorted_l1(student[..., vocabulary.student_unmatched_ids],
                                           teacher[..., vocabulary.teacher_unmatched_ids]))
        if settings.uld_hybrid_matched_weight is None:
            matched_weight = len(vocabulary.teacher_matched_ids) / max(1, teacher_logits.shape[-1])
            unmatched_weight = 1.0 - matched_weight
        else:
            matched_weight, unmatched_weight = settings.uld_hybrid_matched_weight, settings.uld_hybrid_unmatched_weight
        row_losses = matched_weight * matched + unmatched_weight * unmatched
    valid = alignment.row_valid
    rows = valid.shape[0] if row_count is None else row_count
    distillation = settings.uld_distillation_weight * jnp.where(valid, row_losses, 0.0).sum() / rows
    loss = distillation
    if settings.uld_crossentropy_weight > 0:
        loss = settings.uld_crossentropy_weight * _cross_entropy(student_logits, alignment.student_labels) + loss
    # TRL overwrites last_matched_loss / last_unmatched_loss row by row: the last row that ran the hybrid loss wins.
    last = jnp.max(jnp.where(valid, jnp.arange(valid.shape[0]), 0))
    ran = jnp.asarray(settings.uld_use_hybrid_loss) & valid.any()
    return ULDLossOutput(loss, jnp.where(ran, matched[last], 0.0), jnp.where(ran, unmatched[last], 0.0), ran)
