"""The types torchlike's public signatures share, spelled as transformers, TRL and PEFT spell them.

TRL's trainers take ``model: str | PreTrainedModel | PeftModel``, ``args: GRPOConfig | None``,
``train_dataset: Dataset | IterableDataset | None`` and so on; torchlike's take the same values, with its own model
classes in place of the torch ones. The aliases are strings evaluated only by type checkers, so importing this module
loads neither ``transformers`` nor ``datasets``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Mapping, Sequence

    import datasets
    import transformers

    from .modeling import CausalLM
    from .peft.config import LoraConfig
    from .peft.prompt_config import PromptLearningConfig
    from .trl.trainer.base_config import TRLConfig

__all__ = ["ChatMessages", "DatasetLike", "EvalDatasetLike", "EvalRowsLike", "ModelLike", "PairwiseJudge",
           "PeftConfigLike", "ProcessingClass", "Processor", "PromptLike", "QuantizationConfig", "RewardFunc",
           "RowsLike", "TRLArgs", "Tokenizer"]

#: A model to train: a local path or hub id, a torchlike model, or a ``transformers`` model (converted on entry).
ModelLike: TypeAlias = "str | os.PathLike[str] | CausalLM | transformers.PreTrainedModel"

#: A training dataset, as TRL takes it.
DatasetLike: TypeAlias = "datasets.Dataset | datasets.IterableDataset"

#: An evaluation dataset: one, or several by name (metrics then get the name as a prefix).
EvalDatasetLike: TypeAlias = "DatasetLike | dict[str, DatasetLike]"

#: A tokenizer, as transformers types it.
Tokenizer: TypeAlias = "transformers.PreTrainedTokenizerBase"

#: TRL's ``processing_class``: a tokenizer or a processor.
ProcessingClass: TypeAlias = "transformers.PreTrainedTokenizerBase | transformers.ProcessorMixin"

#: A PEFT configuration torchlike applies: LoRA or a prompt-learning method.
PeftConfigLike: TypeAlias = "LoraConfig | PromptLearningConfig"

#: transformers' ``BitsAndBytesConfig`` (or its dict) asking for a quantized base model.
QuantizationConfig: TypeAlias = "transformers.BitsAndBytesConfig | dict[str, object]"

#: One of TRL's ``reward_funcs``: a reward model (path, hub id or loaded model) or a function
#: ``(prompts, completions, **columns) -> list[float | None]``.
RewardFunc: TypeAlias = "str | CausalLM | transformers.PreTrainedModel | Callable[..., list[float | None]]"

#: Data as torchlike's trainers take it: TRL's datasets, or a list of rows (dicts of column values).
RowsLike: TypeAlias = "DatasetLike | Sequence[Mapping[str, object]]"

#: Evaluation data: rows, or several sets of rows by name.
EvalRowsLike: TypeAlias = "RowsLike | dict[str, RowsLike]"

#: A multimodal processor (a tokenizer plus an image processor), as transformers types it.
Processor: TypeAlias = "transformers.ProcessorMixin"

#: Chat messages: ``[{"role": ..., "content": ...}, ...]``.
ChatMessages: TypeAlias = "list[dict[str, object]]"

#: A prompt or completion cell of a TRL dataset: plain text, or chat messages.
PromptLike: TypeAlias = "str | ChatMessages"

#: The config of a TRL trainer (``GRPOConfig``, ``DPOConfig``, ...): each subclasses ``TRLConfig``.
TRLArgs: TypeAlias = "TRLConfig"


class PairwiseJudge(Protocol):
    """TRL's pairwise judge (``trl.experimental.judges.BasePairwiseJudge``): for each prompt, the index (0 or 1) of
    the better of its two completions."""

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        ...
