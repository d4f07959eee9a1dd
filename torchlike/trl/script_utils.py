"""What TRL's command-line scripts use around the trainers: ``TrlParser``, the argument dataclasses and their helpers.

``TrlParser`` is ``transformers.HfArgumentParser`` plus TRL 1.16's ``--config file.yaml`` (values from the file become
defaults that command-line flags override; an ``env:`` section sets environment variables) and its ``none``/``null``
spelling for optional numbers. ``ScriptArguments``, ``ModelConfig``, ``DatasetConfig`` and ``DatasetMixtureConfig``
have TRL 1.16's fields and defaults, so ``trl/scripts/sft.py``, ``grpo.py`` and ``dpo.py`` parse the same command
lines. ``get_peft_config`` builds a :class:`torchlike.peft.LoraConfig`; ``get_quantization_config`` a
``transformers.BitsAndBytesConfig`` that ``torchlike.AutoModelForCausalLM.from_pretrained`` turns into Qwix QLoRA.

Its length is TRL's own script surface (several argument dataclasses with their documented fields), kept in one
place so a ported script's imports resolve to one module.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

if TYPE_CHECKING:
    from datasets import DatasetDict
    from transformers import BitsAndBytesConfig

    from torchlike.peft import LoraConfig

__all__ = [
    "DatasetConfig",
    "DatasetMixtureConfig",
    "ModelConfig",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
    "init_zero_verbose",
]

@dataclass
class DatasetConfig:
    """One dataset of a mixture, with the arguments of ``datasets.load_dataset`` (TRL's ``DatasetConfig``).

    Args:
        path: a hub dataset id, a local directory, or a builder name (``"json"``) used with ``data_files``.
        name: the dataset configuration name.
        data_dir: the ``data_dir`` of the dataset configuration.
        data_files: path(s) to source data file(s).
        split: which split to load.
        columns: columns to keep (``None``: all).
        fraction: this dataset's target share of the mixture; set for every dataset of the mixture or none.
    """

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """A mixture of datasets, given in a YAML ``--config`` file as a ``datasets:`` list (TRL's class).

    Args:
        datasets: the datasets to concatenate; each a :class:`DatasetConfig` or a dict of its fields.
        streaming: load the datasets as ``IterableDataset``s.
        test_split_size: when set, ``train_test_split(test_size=...)`` of the mixture.

    Example:
        ```yaml
        datasets:
          - path: data/train.jsonl
            split: train
        test_split_size: 0.1
        ```
    """

    datasets: list[DatasetConfig] = field(
        default_factory=list,
        metadata={"help": "List of dataset configurations to include in the mixture."},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Whether to stream the datasets. If True, the datasets will be loaded in streaming mode."},
    )
    test_split_size: float | None = field(
        default=None,
        metadata={"help": "Size of the test split (the `test_size` of `datasets.train_test_split`). If None, the "
                          "dataset is not split."},
    )

    def __post_init__(self) -> None:
        # A YAML config gives each dataset as a mapping.
        self.datasets = [DatasetConfig(**item) if isinstance(item, dict) else item for item in self.datasets]


@dataclass
class ScriptArguments:
    """Arguments every TRL training script takes (TRL's ``ScriptArguments``).

    Args:
        dataset_name: path or hub name of the dataset, loaded with ``datasets.load_dataset`` (ignored when a
            ``datasets`` mixture is given).
        dataset_config: the dataset configuration name (``load_dataset(name=...)``).
        dataset_train_split: split to train on.
        dataset_test_split: split to evaluate on.
        dataset_streaming: load the dataset in streaming mode.
        ignore_bias_buffers: a torch DDP workaround, accepted for compatibility (nothing to do on JAX).
    """

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Path or name of the dataset to load. If `datasets` is provided, this will be ignored."},
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Dataset configuration name (the `name` argument of `datasets.load_dataset`). If "
                          "`datasets` is provided, this will be ignored."},
    )
    dataset_train_split: str = field(
        default="train",
        metadata={"help": "Dataset split to use for training. If `datasets` is provided, this will be ignored."},
    )
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "Dataset split to use for evaluation. If `datasets` is provided, this will be ignored."},
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "Whether to stream the dataset. If `datasets` is provided, this will be ignored."},
    )
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={"help": "torch DDP workaround for LM bias/mask buffers; accepted for compatibility, no effect on "
                          "JAX."},
    )


@dataclass
class ModelConfig:
    """How the scripts load the model and which LoRA / quantisation to apply (TRL 1.16's ``ModelConfig``).

    ``trust_remote_code`` is not here: as in TRL 1.16 it is a field of the trainer configs
    (``--trust_remote_code`` parses into ``SFTConfig``/``GRPOConfig``/``DPOConfig``).

    Args:
        model_name_or_path: a local checkpoint directory or a hub model id.
        model_revision: hub branch, tag or commit.
        dtype: ``"auto"`` (the checkpoint's), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        attn_implementation: accepted for compatibility; torchlike always runs the Tunix JAX attention.
        use_peft: train a LoRA adapter (see :func:`get_peft_config`).
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_dropout: LoRA dropout.
        lora_target_modules: HF module names to adapt (one name is kept as a string, as in TRL, so a regex or
            ``"all-linear"`` works).
        lora_target_parameters: PEFT's parameter targeting (refused by :func:`get_peft_config` when set).
        lora_modules_to_save: modules trained in full beside the adapter (refused by ``LoraConfig``).
        lora_task_type: PEFT task type; torchlike serves ``"CAUSAL_LM"``.
        use_rslora: scale by ``lora_alpha / sqrt(r)``.
        use_dora: DoRA (refused by ``LoraConfig``).
        load_in_8bit: QLoRA with int8 base weights.
        load_in_4bit: QLoRA with nf4 base weights.
        bnb_4bit_quant_type: ``"nf4"`` or ``"fp4"`` (Qwix has nf4 only; fp4 becomes nf4 with a warning).
        use_bnb_nested_quant: bitsandbytes double quantisation (recorded in the config).
        bnb_4bit_quant_storage: bitsandbytes storage dtype (recorded in the config).

    Raises:
        ValueError: ``load_in_8bit`` and ``load_in_4bit`` both set.
    """

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Model checkpoint for weights initialization."},
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "Specific model version to use. It can be a branch name, a tag name, or a commit id."},
    )
    dtype: str | None = field(
        default="float32",
        metadata={"help": "Load the model under this dtype ('auto': the checkpoint's). It defaults to 'float32'.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Accepted for compatibility; torchlike always uses the Tunix JAX attention."},
    )
    use_peft: bool = field(default=False, metadata={"help": "Whether to use PEFT (LoRA) for training."})
    lora_r: int = field(default=16, metadata={"help": "LoRA R value."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "LoRA target modules."})
    lora_target_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "List of target parameters for LoRA (not supported by torchlike)."},
    )
    lora_modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Model layers to unfreeze & train (not supported by torchlike)."},
    )
    lora_task_type: str = field(
        default="CAUSAL_LM",
        metadata={"help": "Task type to pass for LoRA (torchlike serves 'CAUSAL_LM')."},
    )
    use_rslora: bool = field(
        default=False,
        metadata={"help": "Whether to use Rank-Stabilized LoRA (scaling lora_alpha/sqrt(r) instead of lora_alpha/r)."},
    )
    use_dora: bool = field(
        default=False,
        metadata={"help": "Enable Weight-Decomposed Low-Rank Adaptation (DoRA; not supported by torchlike)."},
    )
    load_in_8bit: bool = field(
        default=False,
        metadata={"help": "Whether to use 8 bit precision for the base model. Works only with LoRA."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "Whether to use 4 bit precision for the base model. Works only with LoRA."},
    )
    bnb_4bit_quant_type: str = field(
        default="nf4",
        metadata={"help": "Quantization type.", "choices": ["fp4", "nf4"]},
    )
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Whether to use nested quantization."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "Quantization storage dtype"})

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("You can't use 8 bit and 4 bit precision at the same time")
        # TRL keeps a single target as a string so that "all-linear" or a regex reaches PEFT as such.
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


def _accept_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert`` that also reads ``none``/``null`` (any case) as ``None``, as TRL's parser does for ``X | None``."""

    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its error messages
    return parse


class TrlParser(HfArgumentParser):
    """``transformers.HfArgumentParser`` that also reads a YAML ``--config`` file, as TRL's ``TrlParser``.

    Values in the file replace the dataclass defaults and command-line flags override them. An ``env:`` mapping in
    the file sets environment variables. Optional numeric fields accept ``none``/``null`` on the command line
    (``--max_length none``).

    Args:
        dataclass_types: the dataclass type(s) to fill, in the order ``parse_args_and_config`` returns them.
        **kwargs: passed on to ``HfArgumentParser`` (``prog``, ...).

    Raises:
        ValueError: a dataclass has a field named ``config`` (reserved for the file path).

    Example:
        >>> parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
        >>> script_args, training_args, model_args = parser.parse_args_and_config()
    """

    def __init__(self, dataclass_types: type | Iterable[type] | None = None, **kwargs: Any):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        for dataclass_type in dataclass_types:
            if "config" in dataclass_type.__dataclass_fields__:
                raise ValueError(f"Dataclass {dataclass_type.__name__} has a field named 'config'. This field is "
                                 "reserved for the config file path and should not be used in the dataclass.")
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        optional = type(None) in get_args(field.type)
        HfArgumentParser._parse_dataclass_field(parser, field)
        if not optional:
            return
        action = next(a for a in reversed(parser._actions) if a.dest == field.name and a.option_strings)
        # Text fields keep "none" as text (report_to="none" means no integration); booleans, lists and choices
        # have their own parsing.
        if action.type not in (None, str, string_to_bool) and action.nargs is None and action.choices is None:
            action.type = _accept_none(action.type)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple[Any, ...]:
        """Fill the dataclasses from the command line and the optional ``--config`` YAML file.

        Args:
            args: the command line (default: ``sys.argv[1:]``).
            return_remaining_strings: also return the unparsed strings (file keys as ``--key value`` pairs first,
                then command-line strings) instead of raising on them.
            fail_with_unknown_args: raise on config-file keys no dataclass has; when ``False`` they are ignored
                with a warning (TRL ignores them silently). Unknown command-line flags always raise unless
                ``return_remaining_strings`` is set, as in TRL.
            separate_remaining_strings: with ``return_remaining_strings``, return the file's and the command
                line's remaining strings as two lists.

        Returns:
            One instance per dataclass type, then the remaining strings when asked for.

        Raises:
            ValueError: an unknown command-line flag, an unknown config key (with ``fail_with_unknown_args``), or a
                config file that is not a YAML mapping; the message names the closest known arguments.
        """
        args = list(args) if args is not None else sys.argv[1:]
        config_path = _pop_config_path(args)
        config_remaining = self._apply_config_file(config_path) if config_path is not None else []
        *dataclasses_out, cli_remaining = self.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        output = tuple(dataclasses_out)
        if return_remaining_strings:
            if separate_remaining_strings:
                return (*output, config_remaining, cli_remaining)
            return (*output, config_remaining + cli_remaining)
        if cli_remaining:
            flags = [text for text in cli_remaining if text.startswith("-")] or cli_remaining
            raise ValueError(f"Unknown command-line arguments: {cli_remaining}.{self._suggestions(flags)} Run with "
                             "--help for the accepted arguments.")
        if config_remaining:
            keys = config_remaining[::2]
            names = [key.lstrip("-") for key in keys]
            message = f"Unknown keys in config file {config_path}: {names}.{self._suggestions(keys)}"
            if fail_with_unknown_args:
                raise ValueError(f"{message} Please remove them, add them to the dataclass, or set "
                                 "`fail_with_unknown_args=False`.")
            warnings.warn(f"{message} They are ignored.", UserWarning, stacklevel=2)
        return output

    def _apply_config_file(self, config_path: str) -> list[str]:
        """Read the YAML file, export its ``env:`` section and make its values the defaults.

        Returns:
            ``["--key", "value", ...]`` for the keys no argument takes.
        """
        import yaml

        with open(config_path) as yaml_file:
            config = yaml.safe_load(yaml_file)
        if not isinstance(config, dict):
            raise ValueError(f"Config file {config_path} must contain a YAML mapping.")
        env_vars = config.pop("env", {})
        if not isinstance(env_vars, dict):
            raise ValueError("`env` field should be a dict in the YAML file.")
        for key, value in env_vars.items():
            os.environ[key] = str(value)
        return self.set_defaults_with_config(**config)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """Make ``kwargs`` the parser's defaults (arguments of subparsers included); a required argument given here
        becomes optional.

        Args:
            **kwargs: argument name -> value, as read from a config file.

        Returns:
            ``["--key", "value", ...]`` for the keys no argument takes.
        """

        def apply_defaults(parser: argparse.ArgumentParser) -> set[str]:
            used = set()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for subparser in action.choices.values():
                        used |= apply_defaults(subparser)
                elif action.dest in kwargs:
                    action.default = kwargs[action.dest]
                    action.required = False
                    used.add(action.dest)
            return used

        used = apply_defaults(self)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]

    def _suggestions(self, flags: list[str]) -> str:
        """`` Did you mean ...?`` for the misspelt flags that are close to a known argument."""
        known = [option.lstrip("-") for action in self._actions for option in action.option_strings]
        hints = []
        for flag in flags:
            name = flag.split("=", 1)[0].lstrip("-")
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                hints.append(f"{name!r} -> {close[0]!r}")
        return f" Did you mean: {', '.join(hints)}?" if hints else ""


def _pop_config_path(args: list[str]) -> str | None:
    """Remove ``--config PATH`` (or ``--config=PATH``) from ``args`` and return ``PATH``."""
    for index, text in enumerate(args):
        if text == "--config":
            if index + 1 >= len(args):
                raise ValueError("--config needs a path to a YAML file.")
            args.pop(index)
            return args.pop(index)
        if text.startswith("--config="):
            args.pop(index)
            return text.split("=", 1)[1]
    return None


def init_zero_verbose() -> None:
    """Quiet logging for command-line runs (TRL's ``init_zero_verbose``): errors only, warnings sent through
    ``logging`` so they appear once, formatted like the rest."""
    logging.basicConfig(format="%(message)s", datefmt="[%X]", level=logging.ERROR)

    def warning_handler(message, category, filename, lineno, file=None, line=None):
        logging.warning(f"{filename}:{lineno}: {category.__name__}: {message}")

    warnings.showwarning = warning_handler


def get_dataset(mixture_config: DatasetMixtureConfig) -> DatasetDict:
    """Load and concatenate the datasets of a mixture with ``datasets.load_dataset`` (TRL's ``get_dataset``).

    Args:
        mixture_config: the datasets, streaming flag and optional test split size.

    Returns:
        A ``datasets.DatasetDict`` with a ``"train"`` split, and a ``"test"`` split when ``test_split_size`` is set.

    Raises:
        ValueError: no datasets; ``fraction`` set for some datasets but not all, or with streaming.

    Example:
        >>> get_dataset(DatasetMixtureConfig(datasets=[DatasetConfig(path="json", data_files="train.jsonl")]))
    """
    import datasets

    loaded = []
    for config in mixture_config.datasets:
        dataset = datasets.load_dataset(path=config.path, name=config.name, data_dir=config.data_dir,
                                        data_files=config.data_files, split=config.split,
                                        streaming=mixture_config.streaming)
        if config.columns is not None:
            dataset = dataset.select_columns(config.columns)
        loaded.append(dataset)
    if not loaded:
        raise ValueError("No datasets were loaded from the mixture configuration")
    fractions = [config.fraction for config in mixture_config.datasets]
    if any(fraction is not None for fraction in fractions):
        if any(fraction is None for fraction in fractions):
            raise ValueError("`fraction` must be set for either all datasets in the mixture or none of them.")
        if mixture_config.streaming:
            raise ValueError("Using a dataset `fraction` is not supported with streaming datasets.")
        weights = [fraction / sum(fractions) for fraction in fractions]
        # The largest mixture in which no dataset has to give more rows than it has.
        total = min(len(dataset) / weight for dataset, weight in zip(loaded, weights, strict=True) if weight > 0)
        loaded = [dataset.select(range(round(weight * total))) for dataset, weight in zip(loaded, weights, strict=True)]
    combined = datasets.concatenate_datasets(loaded)
    if mixture_config.test_split_size is not None:
        return combined.train_test_split(test_size=mixture_config.test_split_size)
    return datasets.DatasetDict({"train": combined})


def get_peft_config(model_args: ModelConfig) -> LoraConfig | None:
    """The LoRA configuration the ``ModelConfig`` asks for (TRL's ``get_peft_config``).

    Args:
        model_args: the script's model arguments.

    Returns:
        A :class:`torchlike.peft.LoraConfig`, or ``None`` without ``use_peft``.

    Raises:
        ValueError: ``lora_target_parameters`` is set, or ``LoraConfig`` refuses an option (DoRA,
            ``modules_to_save``, a task type other than ``CAUSAL_LM``).
    """
    if not model_args.use_peft:
        return None
    if model_args.lora_target_parameters is not None:
        raise ValueError(f"lora_target_parameters={model_args.lora_target_parameters!r} is not supported: torchlike "
                         "adapts linear modules only; name them with --lora_target_modules.")
    from torchlike.peft import LoraConfig

    return LoraConfig(task_type=model_args.lora_task_type, r=model_args.lora_r,
                      target_modules=model_args.lora_target_modules, lora_alpha=model_args.lora_alpha,
                      lora_dropout=model_args.lora_dropout, bias="none", use_rslora=model_args.use_rslora,
                      use_dora=model_args.use_dora, modules_to_save=model_args.lora_modules_to_save)


def get_quantization_config(model_args: ModelConfig) -> BitsAndBytesConfig | None:
    """The bitsandbytes request the ``ModelConfig`` makes (TRL's ``get_quantization_config``).

    ``torchlike.AutoModelForCausalLM.from_pretrained(quantization_config=...)`` reads it and Qwix quantises the
    adapted base weights when the LoRA adapter is added (QLoRA); bitsandbytes itself is not needed.

    Args:
        model_args: the script's model arguments.

    Returns:
        A ``transformers.BitsAndBytesConfig`` for ``load_in_4bit`` / ``load_in_8bit``, else ``None``.
    """
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        # TRL computes in the load dtype; "auto" has no torch dtype, so bitsandbytes' default applies.
        compute_dtype = None if model_args.dtype == "auto" else model_args.dtype
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype,
                                  bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                                  bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                                  bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage)
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> None:
    """The ``device_map`` older TRL scripts pass when loading a quantised model: ``None``, because torchlike places
    parameters on its JAX mesh (``from_pretrained(mesh=...)``), not with ``device_map``.

    Returns:
        ``None``.
    """
    return None
