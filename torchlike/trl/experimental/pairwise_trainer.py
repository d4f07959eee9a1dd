"""``PairwisePreferenceTrainer``: what TRL 1.16's reference-free experimental preference trainers (ORPO, CPO) share,
on torchlike's offline loop (:class:`~torchlike.trl.trainer.offline_trainer.OfflineTrainer`).

Their constructor (``model, args, data_collator, train_dataset, eval_dataset, processing_class, model_init,
callbacks, optimizers, preprocess_logits_for_metrics, peft_config, compute_metrics``) and checks in TRL's order and
words, their tokenisation (:mod:`torchlike.trl.experimental.pairwise_data`), fixed-shape pair batches
(``dpo_data.collate_preference_batch``), the router loss switched on by the model config's
``output_router_logits`` (as these trainers read it), and TRL's metrics logged as means over the micro-batches since
the last log. There is no reference model. The trainer class here is only that constructor; the tokenisation,
padding, step loss and ``compute_metrics`` inputs are :class:`PairwiseAlgorithm`'s hooks on the offline loop, and
what ORPO and CPO change is each one's subclass of it (its checks, padding, pad token and loss), in its
``<name>_trainer.py`` beside a trainer class that sets ``algorithm_class`` and redefines none of the loop's
methods.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...type_aliases import (
    DatasetLike,
    EvalDatasetLike,
    ModelLike,
    PeftConfigLike,
    ProcessingClass,
    RowsLike,
    Tokenizer,
    TRLArgs,
)
from ..data.dpo_data import collate_preference_batch, padded_length
from ..trainer.base_config import TRLConfig
from ..trainer.offline_trainer import OfflineTrainer, ReferenceFreePreference
from .pairwise_data import prepare_pairwise_examples

if TYPE_CHECKING:
    from ...adapters.families.base import Family
    from ...modeling import CausalLM

__all__ = ["PairwiseAlgorithm", "PairwisePreferenceTrainer"]


class PairwiseAlgorithm(ReferenceFreePreference):
    """What one reference-free pairwise preference algorithm decides on the offline loop (its trainer on
    :class:`PairwisePreferenceTrainer`): TRL's checks, the tokenizer, the padding value and the loss. A subclass
    implements :meth:`loss` and overrides what else it changes."""

    @staticmethod
    def check(args: TRLArgs) -> None:
        """TRL's checks of ``args`` (warnings and errors), before the model is loaded."""

    @staticmethod
    def prepare_tokenizer(tokenizer: Tokenizer) -> None:
        """Sets what the algorithm changes on the tokenizer before its pad token is read (TRL's rule then: the
        tokenizer's pad token, else its eos token)."""

    @staticmethod
    def padding_value(args: TRLArgs, pad_token_id: int) -> int:
        """The token id that pads ``input_ids``: the pad token."""
        return pad_token_id

    @staticmethod
    def loss(family: Family, args: TRLArgs, router_aux_loss_coef: float) -> Callable:
        """The jitted step's loss, ``loss(module, batch, num_items_in_batch) -> (value, weight, metrics)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop's hooks
    def tokenize(self, dataset: RowsLike, tokenizer: ProcessingClass, args: TRLArgs, model: CausalLM) -> list[dict]:
        """Prepared examples of ``dataset``, checked against the model's vocabulary."""
        trainer = self.trainer
        examples = prepare_pairwise_examples(dataset, tokenizer, max_length=trainer.max_length,
                                             num_proc=args.dataset_num_proc)
        largest = max([trainer.padding_value, *(max(e[key], default=0) for e in examples for key in e)])
        trainer._check_token_ids(largest, tokenizer, {"model": model})
        return examples

    def padded_length(self, examples: list[dict]) -> int:
        """The longest sequence plus one column: the last real position's logits enter CPO's ``logits/*`` metrics,
        and a position's logits are computed only where a next token follows."""
        return padded_length(examples, None) + 1

    def step_loss(self) -> tuple[Callable, None]:
        """:meth:`loss` with the config's settings and the router loss weight."""
        trainer = self.trainer
        return self.loss(trainer.model.family, trainer.args, trainer._router_loss_weight()), None

    def found_for_metrics(self) -> Callable:
        """What TRL's ``prediction_step`` of these trainers hands ``compute_metrics`` for a batch: the batch's
        ``[logits/chosen, logits/rejected]`` metrics as its "logits" and two zeros as its labels."""
        import jax.numpy as jnp

        loss = self.step_loss()[0]

        def found(module, batch):
            _, _, metrics = loss(module, batch)
            return {"predictions": jnp.stack([metrics["logits/chosen"], metrics["logits/rejected"]]),
                    "labels": jnp.zeros(2, jnp.float32)}

        return found

    def host_found(self, found: dict, rows: int) -> tuple[dict, int]:
        """Both values of a full batch; of a short last batch the first ``rows`` of them (accelerate's
        ``gather_for_metrics`` cuts the two-value tensor to the examples left)."""
        from ...adapters.distributed import mesh as mesh_lib

        trainer = self.trainer
        full = trainer.args.per_device_eval_batch_size * mesh_lib.data_parallel_size(trainer.mesh)
        return found, 2 if rows >= full else min(rows, 2)


class PairwisePreferenceTrainer(OfflineTrainer):
    """The loop of torchlike's ``ORPOTrainer`` and ``CPOTrainer`` (see the module docstring): a trainer on it sets
    ``algorithm_class``, ``_config_class``, ``_output_suffix`` and ``_tag_names``.
    """

    algorithm_class: type[PairwiseAlgorithm]
    """The algorithm the loop trains with."""

    #: TRL's attribute: the weight of the router loss, read from the model config.
    aux_loss_coef: float = 0.0
    _evaluation_rows_key = "chosen_attention_mask"
    #: TRL's attribute: torchlike's model families are decoder-only.
    is_encoder_decoder: bool = False

    def __init__(self, model: ModelLike | None = None, args: TRLConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: DatasetLike | None = None,
                 eval_dataset: EvalDatasetLike | None = None, processing_class: ProcessingClass | None = None,
                 model_init: Callable | None = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 preprocess_logits_for_metrics: Callable | None = None, peft_config: PeftConfigLike | None = None,
                 compute_metrics: Callable | None = None):
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        args = self._trl_args(model, args)
        if args.model_init_kwargs is not None and not isinstance(model, str):
            raise ValueError(f"You passed model_kwargs to the {self._trainer_name}. But your model is already "
                             "instantiated.")
        if model_init is not None:
            raise NotImplementedError(f"{self._trainer_name}'s model_init is not supported in torchlike: pass the "
                                      "model (or its path) instead.")
        self.algorithm_class.check(args)
        model, processing_class = self._trl_model(model, args, processing_class, peft_config, None)
        self._setup_config_router_loss(model)
        if args.max_length is None:
            warnings.warn(f"`max_length` is not set in the {self._config_class.__name__}'s init it will default to "
                          "`512` by default, but you should do it yourself in the future.", UserWarning, stacklevel=3)
        self.max_length = 512 if args.max_length is None else args.max_length
        self.algorithm_class.prepare_tokenizer(processing_class)
        self.pad_token_id = self._pad_token_id(processing_class, None)
        self.padding_value = self.algorithm_class.padding_value(args, self.pad_token_id)
        train_examples, eval_examples = self._prepare_examples(train_dataset, eval_dataset, processing_class, model)
        collator = data_collator or (lambda rows: collate_preference_batch(rows, self.padding_value,
                                                                           self.padded_length))
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_examples,
                         eval_dataset=eval_examples, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, compute_metrics=compute_metrics,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._show_prepared_datasets(train_examples, eval_examples)

    # ------------------------------------------------------------------ model
    def _setup_config_router_loss(self, model: CausalLM) -> None:
        """TRL's rule in these trainers: the router loss is added, times the config's ``router_aux_loss_coef``,
        when the model config sets ``output_router_logits``."""
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.aux_loss_enabled = bool(getattr(text_config, "output_router_logits", False))
        self.aux_loss_coef = self.router_aux_loss_coef = getattr(text_config, "router_aux_loss_coef", 0.0)
        if self.aux_loss_enabled and self.aux_loss_coef == 0.0:
            warnings.warn("You set `output_router_logits` to `True` in the model config, but `router_aux_loss_coef` "
                          "is set to `0.0`, meaning the auxiliary loss will not be used. Either set "
                          "`router_aux_loss_coef` to a value greater than `0.0`, or set `output_router_logits` to "
                          "`False` if you don't want to use the auxiliary loss.", UserWarning, stacklevel=4)
