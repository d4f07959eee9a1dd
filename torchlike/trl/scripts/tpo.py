"""``torchlike tpo``: TPO from the command line, as TRL's ``examples/scripts/tpo.py`` runs ``trl.experimental.tpo``
(TRL 1.16's ``trl`` command has no ``tpo``).

The dataset is a triple-preference one (``prompt``/``chosen``/``rejected``/``reference``), or raw UltraFeedback rows
(``instruction`` and scored ``completions``), which TRL's script turns into triples as the TPO paper does: the
highest-scored response becomes the gold ``reference``, the second-highest ``chosen`` and the lowest ``rejected``
(rows with fewer than three scored responses are dropped). Plain-string triples are wrapped into one-message
conversations so that the model's chat template applies, as TRL's script does. After training, with an
``eval_strategy``, the test split is evaluated and its metrics printed and saved (``eval_results.json``).

Example:
    ```bash
    torchlike tpo --model_name_or_path Qwen/Qwen3-0.6B \\
        --dataset_name tpo-alignment/triple-preference-ultrafeedback-40K --per_device_train_batch_size 2 \\
        --gradient_accumulation_steps 8 --beta 0.01 --tpo_alpha 1.0 --output_dir Qwen3-0.6B-TPO
    ```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchlike.trl.experimental.tpo.tpo_config import TPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script

if TYPE_CHECKING:
    from datasets import DatasetDict, IterableDatasetDict

#: The columns of a triple-preference example.
TRIPLE_COLUMNS = ("prompt", "reference", "chosen", "rejected")


def make_parser(prog: str | None = None) -> TrlParser:
    """The TPO script's parser: ``ScriptArguments``, ``TPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((ScriptArguments, TPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def triple_from_ultrafeedback(example: dict[str, Any]) -> dict[str, Any]:
    """A conversational triple from a raw UltraFeedback row (TRL's script's rule, from the TPO paper): of the
    completions with an ``overall_score`` and a ``response``, the best is ``reference``, the second ``chosen``, the
    worst ``rejected``; ``None`` in every column when fewer than three remain."""
    scored = [completion for completion in example["completions"]
              if completion.get("overall_score") is not None and completion.get("response")]
    if len(scored) < 3:
        return dict.fromkeys(TRIPLE_COLUMNS)
    scored.sort(key=lambda completion: completion["overall_score"], reverse=True)
    responses = {"reference": scored[0], "chosen": scored[1], "rejected": scored[-1]}
    return {"prompt": [{"role": "user", "content": example["instruction"]}],
            **{key: [{"role": "assistant", "content": value["response"]}] for key, value in responses.items()}}


def as_conversation(example: dict[str, Any]) -> dict[str, Any]:
    """A plain-string triple as one-message conversations (the prompt a user turn, each response an assistant
    turn)."""
    return {key: [{"role": "user" if key == "prompt" else "assistant", "content": example[key]}]
            for key in TRIPLE_COLUMNS}


def prepare_triples(dataset: DatasetDict | IterableDatasetDict,
                    train_split: str = "train") -> DatasetDict | IterableDatasetDict:
    """TRL's TPO script's dataset preparation of a ``DatasetDict``: UltraFeedback rows to triples (dropping those
    without three scored responses), then plain-string triples to conversations."""
    first = next(iter(dataset[train_split]))
    if "completions" in first and "instruction" in first:
        dataset = dataset.map(triple_from_ultrafeedback, remove_columns=list(first))
        dataset = dataset.filter(lambda example: example["reference"] is not None)
        first = next(iter(dataset[train_split]))
    if set(TRIPLE_COLUMNS) <= set(first) and isinstance(first["prompt"], str):
        dataset = dataset.map(as_conversation)
    return dataset


def main(script_args: ScriptArguments, training_args: TPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``TPOTrainer``, evaluate (with an ``eval_strategy``) and save the model to ``output_dir``; returns
    the trainer."""
    from torchlike.trl.experimental.tpo.tpo_trainer import TPOTrainer

    return run_training_script(TPOTrainer, script_args, training_args, model_args, dataset_args,
                               prepare_dataset=lambda dataset: prepare_triples(dataset,
                                                                               script_args.dataset_train_split),
                               final_evaluation=True)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
