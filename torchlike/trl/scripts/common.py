"""What every training script does around its trainer, as TRL 1.16's scripts do: the model loading arguments,
the dataset (a mixture from ``--config`` or ``--dataset_name``), then train, save and push."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlike.trl.script_utils import (
    DatasetMixtureConfig,
    ModelConfig,
    ScriptArguments,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)

if TYPE_CHECKING:
    from datasets import DatasetDict, IterableDatasetDict

    from torchlike.trl.trainer.base_config import TRLConfig
    from torchlike.trl.trainer.base_trainer import TRLTrainer

__all__ = ["REMOTE_JUDGES", "load_script_dataset", "refuse_remote_judge", "run_ranked_online_script",
           "run_training_script"]

logger = logging.getLogger(__name__)

#: ``datasets`` builder for a single local data file, by suffix.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                 ".arrow": "arrow"}


def load_script_dataset(script_args: ScriptArguments,
                        dataset_args: DatasetMixtureConfig) -> DatasetDict | IterableDatasetDict:
    """The training data as TRL's scripts choose it: the ``datasets`` mixture when given, else ``dataset_name``.

    ``dataset_name`` may be a hub id, a local directory (``datasets`` finds ``train.jsonl``, ``test.jsonl``... in
    it), or, beyond TRL, one local data file (``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.txt``, ``.arrow``),
    loaded as the ``train`` split.

    Args:
        script_args: ``dataset_name``, ``dataset_config``, ``dataset_streaming``.
        dataset_args: the mixture from the config file's ``datasets:`` section.

    Returns:
        A ``DatasetDict`` (``IterableDatasetDict`` when streaming).

    Raises:
        ValueError: neither a mixture nor ``dataset_name``, or a file of unknown type.
        FileNotFoundError: ``dataset_name`` is not local and the Hub could not provide it (offline, or no such
            dataset); says what to pass instead.
    """
    import datasets

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning("Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to "
                           "load the dataset and `dataset_name` will be ignored.")
        return get_dataset(dataset_args)
    name = script_args.dataset_name
    if not name:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")
    path = Path(name).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"--dataset_name {name}: cannot tell the format of a '{path.suffix}' file; use one of "
                             f"{sorted(FILE_BUILDERS)} or a directory of such files.")
        return datasets.load_dataset(builder, data_files={"train": str(path)},
                                     streaming=script_args.dataset_streaming)
    try:
        return datasets.load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    except (ConnectionError, FileNotFoundError) as error:
        if path.exists():
            raise
        raise FileNotFoundError(
            f"--dataset_name {name!r} is not a local file or directory, and the Hub could not provide it ({error}). "
            f"Pass a local data file ({', '.join(sorted(FILE_BUILDERS))}), a directory holding train.jsonl (and "
            "test.jsonl...), or a Hub dataset id with network access or a cached copy.") from error


def run_training_script(trainer_class: type[TRLTrainer], script_args: ScriptArguments, training_args: TRLConfig,
                        model_args: ModelConfig, dataset_args: DatasetMixtureConfig,
                        trust_remote_code: bool | None = None,
                        prepare_dataset: Callable[[DatasetDict | IterableDatasetDict],
                                                  DatasetDict | IterableDatasetDict] | None = None,
                        final_evaluation: bool = False,
                        **trainer_kwargs: Any) -> TRLTrainer:
    """TRL's ``main`` of a training script: build the trainer from the parsed arguments, train, save, push.

    ``training_args.model_init_kwargs`` gets the model's revision, ``trust_remote_code``, attention implementation
    and dtype, with the user's own ``model_init_kwargs`` winning, as in TRL.

    Args:
        trainer_class: ``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``...
        script_args: the dataset arguments.
        training_args: the trainer's config (``SFTConfig``...).
        model_args: the model, LoRA and quantisation arguments.
        dataset_args: the dataset mixture.
        trust_remote_code: for a config without that field (``BCOConfig``, whose script reads it elsewhere);
            default ``training_args.trust_remote_code``.
        prepare_dataset: the script's own dataset preparation, ``DatasetDict -> DatasetDict``, run after loading.
        final_evaluation: evaluate after training when ``eval_strategy`` is not ``"no"``, printing and saving the
            metrics (``eval_results.json``), as TRL's TPO script does.
        **trainer_kwargs: further trainer arguments (``reward_funcs`` for GRPO).

    Returns:
        The trained trainer.

    Raises:
        ValueError: ``--load_in_4bit``/``--load_in_8bit`` for a trainer that takes no ``quantization_config``
            (ORPO, CPO).
    """
    if trust_remote_code is None:
        trust_remote_code = training_args.trust_remote_code
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    quantization_config = get_quantization_config(model_args)
    if "quantization_config" in inspect.signature(trainer_class).parameters:
        trainer_kwargs["quantization_config"] = quantization_config
    elif quantization_config is not None:
        raise ValueError(f"--load_in_4bit/--load_in_8bit: {trainer_class.__name__} takes no quantization_config (as "
                         "in TRL), so it cannot train a quantised model; drop the flag.")
    dataset = load_script_dataset(script_args, dataset_args)
    if prepare_dataset is not None:
        dataset = prepare_dataset(dataset)
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    if final_evaluation and training_args.eval_strategy != "no":
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    trainer.end()
    return trainer


#: The ``--judge`` names of TRL 1.0.0's ``examples/scripts/xpo.py`` and ``nash_md.py`` (their ``JUDGES``), each with
#: what keeps it from running here.
REMOTE_JUDGES = {
    "pair_rm": "TRL's PairRMJudge needs the llm-blender package and downloads the llm-blender/PairRM model",
    "openai": "TRL's OpenAIPairwiseJudge asks OpenAI's API",
    "hf": "TRL's HfPairwiseJudge asks the Hugging Face Inference API",
}


def refuse_remote_judge(judge: str | None) -> None:
    """Refuses ``--judge``: every judge TRL's scripts name needs a network service or a package torchlike does not
    have.

    Args:
        judge: the config's ``judge`` (``None``: nothing to refuse).

    Raises:
        ValueError: any ``judge``, with what it would need and the option to use instead.
    """
    if judge is None:
        return
    reason = REMOTE_JUDGES.get(judge, f"TRL's scripts name no such judge (theirs: {', '.join(REMOTE_JUDGES)})")
    raise ValueError(f"--judge {judge}: {reason}, which torchlike's command does not run. Rank the completions with a "
                     "reward instead: --reward_model_path (a sequence-classification model) or --reward_funcs. In "
                     "Python, the trainer's `judge` argument takes any local judge object.")


def run_ranked_online_script(trainer_class: type[TRLTrainer], script_args: ScriptArguments,
                             training_args: TRLConfig, model_args: ModelConfig, dataset_args: DatasetMixtureConfig,
                             reward_funcs: list[Any]) -> TRLTrainer:
    """The ``main`` of TRL 1.0.0's XPO and Nash-MD scripts: one reward ranks the sampled completions (``--judge`` is
    refused, see :func:`refuse_remote_judge`); the tokenizer is the model's.

    Args:
        trainer_class: ``XPOTrainer`` or ``NashMDTrainer``.
        script_args: the dataset arguments.
        training_args: the trainer's config (``judge`` among its fields).
        model_args: the model, LoRA and quantisation arguments.
        dataset_args: the dataset mixture.
        reward_funcs: the reward of ``--reward_model_path`` and ``--reward_funcs``
            (``torchlike.trl.scripts.grpo.load_reward_funcs``).

    Returns:
        The trained trainer.

    Raises:
        ValueError: a ``--judge``, no reward, or more than one (these trainers rank with exactly one).
    """
    from torchlike import AutoTokenizer

    refuse_remote_judge(training_args.judge)
    if len(reward_funcs) != 1:
        raise ValueError(f"{trainer_class.__name__} ranks its completions with one reward, got {len(reward_funcs)}: "
                         "set either `--reward_model_path` or one `--reward_funcs`.")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=training_args.trust_remote_code)
    return run_training_script(trainer_class, script_args, training_args, model_args, dataset_args,
                               reward_funcs=reward_funcs, processing_class=tokenizer)
