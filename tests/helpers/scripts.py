"""TRL's own ``trl/scripts/*.py`` ported to torchlike (only their ``from trl`` lines rewritten), run in this process,
with the model directories, datasets and command lines of a tiny run."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import transformers

TRL_SCRIPTS = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "scripts"
WORDS = "the quick brown fox jumps over the lazy dog one two three four five six seven eight nine ten".split()
# Settings that keep a script run tiny (two optimizer steps, no checkpoint or report); the rest are TRL's defaults.
TINY_RUN = ["--max_steps", "2", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]
TRL_IMPORT = re.compile(r"^(\s*)from trl(?=[.\s])")


def build_script_model_dir(checkpoint: Path, tokenizer_dir: Path, destination: Path) -> Path:
    """A model directory as TRL scripts expect one: weights and config plus the tokenizer (with a pad token the
    model knows, so no ``<|endoftext|>`` beyond the vocabulary is added)."""
    shutil.copytree(checkpoint, destination)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = "<pad>"
    tokenizer.save_pretrained(destination)
    return destination


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt_completion_rows(count: int = 8) -> list[dict]:
    return [{"prompt": " ".join(WORDS[i:i + 3]), "completion": " " + " ".join(WORDS[i + 3:i + 5])}
            for i in range(count)]


def preference_rows(count: int = 8) -> list[dict]:
    return [{"prompt": " ".join(WORDS[i:i + 3]), "chosen": " " + WORDS[i + 3], "rejected": " " + WORDS[i + 5]}
            for i in range(count)]


def port_trl_script(name: str, destination: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Copy TRL's installed ``scripts/<name>.py``, rewriting ``from trl`` to ``from torchlike.trl``.

    Returns:
        The ported script and the ``(original, rewritten)`` lines that differ.
    """
    original = (TRL_SCRIPTS / f"{name}.py").read_text().splitlines(keepends=True)
    ported = [TRL_IMPORT.sub(r"\1from torchlike.trl", line) for line in original]
    path = destination / f"{name}.py"
    path.write_text("".join(ported))
    changed = [(old, new) for old, new in zip(original, ported, strict=True) if old != new]
    return path, changed


def run_script(path: Path, arguments: list[str], monkeypatch) -> None:
    """Run a script as ``python <path> <arguments>`` would, in this process (the imports are already paid)."""
    monkeypatch.setattr(sys, "argv", [str(path), *arguments])
    monkeypatch.setattr(sys, "path", [*sys.path])  # grpo.py puts the working directory on it
    runpy.run_path(str(path), run_name="__main__")


def assert_hf_loadable(output_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(output_dir)
    assert model.config.vocab_size == 128
    assert transformers.AutoTokenizer.from_pretrained(output_dir).pad_token == "<pad>"


def script_arguments(name: str, model_dir: Path, tmp_path: Path) -> list[str]:
    """A tiny ``sft``/``grpo``/``dpo`` run's command line: dataset written under ``tmp_path``, output in
    ``tmp_path/out``."""
    if name == "sft":
        dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", prompt_completion_rows()).parent
        specific = ["--per_device_train_batch_size", "2", "--max_length", "32"]
    elif name == "dpo":
        dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", preference_rows()).parent
        specific = ["--per_device_train_batch_size", "2", "--max_length", "32"]
    else:
        rows = [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(8)]
        dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl", rows).parent
        specific = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
                    "--reward_funcs", "tests.script_rewards.completion_length_reward", "think_format_reward"]
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(dataset_dir),
            "--output_dir", str(tmp_path / "out"), *specific, *TINY_RUN]
