"""``ORPOTrainer``: TRL 1.16's ``trl.experimental.orpo.ORPOTrainer`` and constructor on torchlike's ``Trainer``.

Odds Ratio Preference Optimization trains without a reference model: each step scores the chosen and rejected
sequences of a batch in one forward pass and minimises the chosen NLL minus ``beta`` times the log-sigmoid of the
log odds ratio (``torchlike.adapters.losses.orpo``), logging TRL's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ....adapters.losses.orpo import ORPOLossSettings, orpo_step_loss
from ....type_aliases import DatasetLike, EvalDatasetLike, ModelLike, PeftConfigLike, ProcessingClass
from ..pairwise_trainer import PairwiseAlgorithm, PairwisePreferenceTrainer
from .orpo_config import ORPOConfig

if TYPE_CHECKING:
    from ....adapters.families.base import Family

__all__ = ["ORPO", "ORPOTrainer"]


class ORPO(PairwiseAlgorithm):
    """TRL 1.16's ORPO on the pairwise loop: ``args.padding_value`` pads when set; the loss is
    :func:`adapters.losses.orpo.orpo_step_loss`."""

    @staticmethod
    def padding_value(args: ORPOConfig, pad_token_id: int) -> int:
        """``args.padding_value``, else the pad token (TRL's ``padding_value``)."""
        return pad_token_id if args.padding_value is None else args.padding_value

    @staticmethod
    def loss(family: Family, args: ORPOConfig, router_aux_loss_coef: float) -> Callable:
        """TRL's ORPO loss with the config's settings."""
        return orpo_step_loss(family, ORPOLossSettings.from_config(args, router_aux_loss_coef=router_aux_loss_coef))


class ORPOTrainer(PairwisePreferenceTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``).
        args: :class:`ORPOConfig` (default: one with ``output_dir="<model>-ORPO"``).
        data_collator: replaces the fixed-shape pair collator; it receives prepared examples (``prompt_ids``,
            ``chosen_prompt_ids``, ``chosen_ids``, ``rejected_prompt_ids``, ``rejected_ids``) and must return
            ``collate_preference_batch``'s columns.
        train_dataset, eval_dataset: ``datasets.Dataset`` or lists of dicts with ``prompt``/``chosen``/``rejected``
            (or an implicit prompt), strings or message lists; ``train_dataset`` is required, ``eval_dataset`` may
            be a dict of datasets.
        processing_class: the tokenizer (default: loaded from the model's path).
        model_init: refused (pass the model).
        compute_metrics: ``EvalPrediction -> dict``, receiving what TRL's ``prediction_step`` gives it: each eval
            batch's ``[logits/chosen, logits/rejected]`` metrics concatenated as ``predictions``, zeros as
            ``label_ids``.
        preprocess_logits_for_metrics: applied to each batch's two values first, as transformers does.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.

    Example:

    ```python
    >>> from torchlike.trl.experimental.orpo import ORPOConfig, ORPOTrainer
    >>> data = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}] * 64
    >>> trainer = ORPOTrainer(model="path/to/qwen2", args=ORPOConfig("out", beta=0.1), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = ORPO
    _config_class = ORPOConfig
    _output_suffix = "ORPO"
    _tag_names = ["trl", "orpo"]

    def __init__(self, model: ModelLike | None = None, args: ORPOConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 model_init: Callable | None = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None,
                 compute_metrics: Callable | None = None):
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                         callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config,
                         compute_metrics=compute_metrics)
        self.beta = self.args.beta
