"""What every example shares: the embedded default (a tiny random Qwen2 and a byte-level BPE tokenizer built on the
spot with ``torchlike.testing``, no downloads), the ``--model/--max-steps/--out`` command line, trainer settings for
short runs, and the comparison of two models' logits (torchlike or transformers, called the same way)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from countdown import answer_text, make_problems

import torchlike
from torchlike.testing import build_tokenizer, random_model, tiny_config

ENGLISH = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny model",
           "one two three four five six seven eight nine ten"]
TOKENIZER_SIZE = 320


_BUILT: dict[tuple[int, int], Path] = {}
"""The embedded defaults this process built, by shape: a second example run in the same process copies them."""


def build_embedded_default(directory: Path, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """Writes a tiny random Qwen2 (``hidden_size``, ``num_layers`` layers, tied embeddings) and its tokenizer to
    ``directory`` in Hugging Face format, and returns ``directory``.

    The tokenizer is a byte-level BPE (any text encodes) whose merges come from the arithmetic task and a little
    English; pad ``<pad>``, bos ``<s>``, eos ``</s>``. Both are deterministic, so a process builds each shape once
    (training the tokenizer takes seconds) and copies it for later runs.
    """
    built = _BUILT.get((hidden_size, num_layers))
    if built is not None and built.is_dir():
        shutil.copytree(built, directory, dirs_exist_ok=True)
        return directory
    _build(directory, hidden_size, num_layers)
    keep = Path(tempfile.mkdtemp(prefix="torchlike-embedded-"))
    atexit.register(shutil.rmtree, keep, True)
    shutil.copytree(directory, keep, dirs_exist_ok=True)
    _BUILT[(hidden_size, num_layers)] = keep
    return directory


def _build(directory: Path, hidden_size: int, num_layers: int) -> None:
    corpus = [p["prompt"] + answer_text(p["solution"]) for p in make_problems(400, seed=1)]
    corpus += [p["prompt"] + answer_text(p["solution"]) for p in make_problems(400, numbers_per_problem=3, seed=2)]
    build_tokenizer(directory, corpus + ENGLISH * 20, vocab_size=TOKENIZER_SIZE, any_text=True, pad_token="<pad>")
    config = tiny_config("qwen2", vocab_size=len(torchlike.AutoTokenizer.from_pretrained(directory)),
                         hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         tie_word_embeddings=True)
    random_model(config).save_pretrained(directory)


def trainer_settings(max_steps: int) -> dict[str, Any]:
    """Trainer arguments for short runs: ``max_steps``, no checkpoints, about 20 logs per run (one per step for runs
    of up to 20 steps); the rest, bf16 compute and gradient checkpointing included, are TRL's defaults."""
    return dict(max_steps=max_steps, logging_steps=max(1, max_steps // 20), report_to="none", save_strategy="no",
                seed=0)


class ExampleParser(argparse.ArgumentParser):
    """The command line every example takes: ``--model``, ``--max-steps``, ``--out``, and with
    ``learning_rates=(embedded, real)`` a ``--learning-rate`` whose default depends on whether ``--model`` is given
    (a random tiny model wants a much larger step than a pretrained one)."""

    def __init__(self, description: str, default_steps: int, learning_rates: tuple[float, float] | None = None):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.learning_rates = learning_rates
        self.add_argument("--model", help="checkpoint directory or hub id (default: a tiny model built on the spot)")
        self.add_argument("--max-steps", type=int, default=default_steps, help="optimizer steps (default: %(default)s)")
        self.add_argument("--out", help="output directory (default: a temporary directory, deleted at the end)")
        if learning_rates is not None:
            self.add_argument("--learning-rate", type=float, help=f"default: {learning_rates[0]:g} on the embedded "
                                                                   f"default, {learning_rates[1]:g} with --model")

    def parse_args(self, args: list[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        if self.learning_rates is not None and parsed.learning_rate is None:
            parsed.learning_rate = self.learning_rates[1 if parsed.model else 0]
        return parsed


@contextlib.contextmanager
def workspace(model: str | None, out: str | None,
              build: Callable[[Path], Path] | None = None) -> Iterator[tuple[str, Path]]:
    """``(model source, output directory)`` for one run.

    With no ``model`` the embedded default (``build``, by default :func:`build_embedded_default`) is built, inside
    ``out`` (as ``out/base``, so saved adapters keep a base to load onto) or in the temporary directory. With no
    ``out`` everything is written to a temporary directory removed on exit.
    """
    with tempfile.TemporaryDirectory(prefix="torchlike-example-") as scratch:
        directory = Path(out) if out else Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        yield model or str((build or build_embedded_default)(directory / "base")), directory


def logged(trainer: Any, key: str) -> list[float]:
    """The values of ``key`` in a trainer's training logs, one per logged step."""
    return [entry[key] for entry in trainer.state.log_history if key in entry and "loss" in entry]


def early_and_late(values: list[float]) -> tuple[float, float]:
    """Means of the first and of the last quarter of ``values`` (one value each for short runs): a trend that
    one noisy log cannot fake."""
    size = max(1, len(values) // 4)
    return float(np.mean(values[:size])), float(np.mean(values[-size:]))


def max_logit_difference(first: Any, second: Any, batch: Any) -> float:
    """Largest ``|Δ logits|`` between two models (torchlike or transformers: the call is the same) over the real
    tokens of a right-padded ``batch`` (``input_ids``, ``attention_mask`` as torch tensors)."""
    import torch

    def logits(model: Any) -> np.ndarray:
        with torch.no_grad():
            output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return np.asarray(output.float() if isinstance(output, torch.Tensor) else output)

    real = np.asarray(batch["attention_mask"]).astype(bool)
    return float(np.abs(logits(first) - logits(second))[real].max())
