"""``CPOTrainer``: TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` and constructor on torchlike's ``Trainer``.

Contrastive Preference Optimization trains without a reference model: each step scores the chosen and rejected
sequences of a batch in one forward pass and minimises a preference loss on the policy's log-probabilities
(sigmoid, hinge, IPO, SimPO; AlphaPO rewards) plus ``cpo_alpha`` times the chosen responses' NLL
(``torchlike.adapters.losses.cpo``), logging TRL's metrics.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ....adapters.losses.cpo import LOSS_TYPES, CPOLossSettings, cpo_step_loss
from ....type_aliases import DatasetLike, EvalDatasetLike, ModelLike, PeftConfigLike, ProcessingClass, Tokenizer
from ..pairwise_trainer import PairwiseAlgorithm, PairwisePreferenceTrainer
from .cpo_config import CPOConfig

if TYPE_CHECKING:
    from ....adapters.families.base import Family

__all__ = ["CPO", "CPOTrainer"]


class CPO(PairwiseAlgorithm):
    """TRL 1.16's CPO on the pairwise loop: TRL's checks, the eos token as pad token when the tokenizer has none, and
    :func:`adapters.losses.cpo.cpo_step_loss`."""

    @staticmethod
    def check(args: CPOConfig) -> None:
        """TRL's checks (its warning and errors; TRL raises for an unknown loss type in the first step)."""
        if args.loss_type in ["hinge", "ipo"] and args.label_smoothing > 0:
            warnings.warn(f"You are using the {args.loss_type} loss type that does not support label smoothing. The "
                          "`label_smoothing` parameter will be ignored. Set `label_smoothing` to `0.0` to remove this "
                          "warning.", UserWarning, stacklevel=4)
        if args.loss_type == "kto_pair":
            raise ValueError("Support for kto_pair has been removed in CPOTrainer. Please use KTOTrainer.")
        if args.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {args.loss_type}. Should be one of ['sigmoid', 'hinge', 'ipo', "
                             "'simpo']")

    @staticmethod
    def prepare_tokenizer(tokenizer: Tokenizer) -> None:
        """TRL's CPO sets the tokenizer's pad token to its eos token when it has none (and the trainer mirrors it onto
        the model's configs)."""
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    @staticmethod
    def loss(family: Family, args: CPOConfig, router_aux_loss_coef: float) -> Callable:
        """TRL's CPO loss with the config's settings."""
        return cpo_step_loss(family, CPOLossSettings.from_config(args, router_aux_loss_coef=router_aux_loss_coef))


class CPOTrainer(PairwisePreferenceTrainer):
    """``trl.experimental.cpo.CPOTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with
            ``args.model_init_kwargs`` (float32 unless they set ``dtype``).
        args: :class:`CPOConfig` (default: one with ``output_dir="<model>-CPO"``).
        data_collator: replaces the fixed-shape pair collator; it receives prepared examples (``prompt_ids``,
            ``chosen_prompt_ids``, ``chosen_ids``, ``rejected_prompt_ids``, ``rejected_ids``) and must return
            ``collate_preference_batch``'s columns, padded one column past the longest row.
        train_dataset, eval_dataset: ``datasets.Dataset`` or lists of dicts with ``prompt``/``chosen``/``rejected``
            (or an implicit prompt), strings or message lists; ``train_dataset`` is required, ``eval_dataset`` may
            be a dict of datasets.
        processing_class: the tokenizer (default: loaded from the model's path); without a pad token its eos token
            pads, as in TRL.
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
    >>> from torchlike.trl.experimental.cpo import CPOConfig, CPOTrainer
    >>> data = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}] * 64
    >>> trainer = CPOTrainer(model="path/to/qwen2", args=CPOConfig("out", loss_type="simpo"), train_dataset=data)
    >>> trainer.train()
    ```
    """

    algorithm_class = CPO
    _config_class = CPOConfig
    _output_suffix = "CPO"
    _tag_names = ["trl", "cpo"]

    def __init__(self, model: ModelLike | None = None, args: CPOConfig | None = None,
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
        for config in (self.model.config, self.model.generation_config):
            config.pad_token_id = self.pad_token_id  # TRL mirrors the pad token onto the model
        args = self.args
        self.beta, self.label_smoothing, self.loss_type = args.beta, args.label_smoothing, args.loss_type
        self.cpo_alpha, self.alpha = args.cpo_alpha, args.alpha
        if args.loss_type == "simpo":
            self.simpo_gamma = args.simpo_gamma
