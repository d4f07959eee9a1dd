"""Running a script against an older TRL release (TRL 1.0.0, which still ships ``trl.experimental.xpo``) in a child
process, and what both sides of a comparison with it share.

The release is an unpacked wheel at ``$TORCHLIKE_TRL_LEGACY`` (default ``~/.cache/torchlike/trl-1.0.0``). The first
test that needs it fetches it from PyPI with this interpreter's pip (the wheel's sha256 is pinned) and unpacks it
there; when that cannot be done the test fails saying why and how to provide it, so no comparison with TRL 1.0.0 is
skipped silently. The child puts it first on ``PYTHONPATH``, so it shadows the installed TRL while using the
installed transformers and torch; the repository root follows, so the child can import ``tests.helpers``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
LEGACY_TRL_VERSION = "1.0.0"
LEGACY_TRL_SHA256 = "c45700cb6aa8723e5db1dd8773297f642715accab1ca7754b56e6d50a37dfb1d"  # PyPI's trl-1.0.0-py3-none-any
LEGACY_TRL = Path(os.environ.get("TORCHLIKE_TRL_LEGACY") or
                  Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchlike" / "trl-1.0.0")


def _unpacked(folder: Path) -> bool:
    return (folder / "trl" / "__init__.py").is_file()


def _fetch_legacy_trl(target: Path) -> None:
    """Downloads TRL 1.0.0's wheel (hash-checked) and unpacks it at ``target`` atomically: a sibling folder renamed
    into place, so an interrupted fetch leaves nothing half-written."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(f"trl=={LEGACY_TRL_VERSION} --hash=sha256:{LEGACY_TRL_SHA256}\n")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--require-hashes", "-r", str(requirements), "-d", str(Path(scratch) / "wheel")],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"pip download failed: {(done.stderr or done.stdout).strip()[-1500:]}")
        (wheel,) = (Path(scratch) / "wheel").glob("trl-*.whl")
        unpacked = Path(scratch) / "unpacked"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(unpacked)
        os.replace(unpacked, target)


def require_legacy_trl() -> Path:
    """The unpacked TRL 1.0.0, fetched on first use (see the module docstring).

    Returns:
        The folder to put first on ``PYTHONPATH``.

    Raises:
        pytest.fail: it is not there and could not be fetched; the message says why and how to provide it.
    """
    if _unpacked(LEGACY_TRL):
        return LEGACY_TRL
    how = (f"run: pip download trl=={LEGACY_TRL_VERSION} --no-deps -d DIR && python -m zipfile -e "
           f"DIR/trl-{LEGACY_TRL_VERSION}-py3-none-any.whl {LEGACY_TRL} (or point "
           "TORCHLIKE_TRL_LEGACY at such a folder)")
    try:
        LEGACY_TRL.parent.mkdir(parents=True, exist_ok=True)
        with open(LEGACY_TRL.parent / f".{LEGACY_TRL.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other pytest worker may be fetching it too
            if not _unpacked(LEGACY_TRL):
                _fetch_legacy_trl(LEGACY_TRL)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired, zipfile.BadZipFile) as error:
        pytest.fail(f"TRL {LEGACY_TRL_VERSION}, the reference of this comparison, is not at {LEGACY_TRL} and could "
                    f"not be fetched from PyPI ({error}); {how}", pytrace=False)
    return LEGACY_TRL


def run_legacy_trl(script: str, arguments: dict[str, Any], timeout: float = 300) -> None:
    """Runs ``script`` (Python source) in a child process with TRL 1.0.0 first on the path; the script reads its
    ``arguments`` as JSON from ``sys.argv[1]``.

    Raises:
        AssertionError: the child failed; the message holds its standard error.
    """
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(require_legacy_trl()), str(ROOT)]),
                   "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(arguments)], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"the TRL {LEGACY_TRL_VERSION} script failed:\n{done.stderr[-6000:]}"


def scripted_completion(prompt_ids: list[int], copy: int, max_new_tokens: int, vocab_size: int,
                        eos_token_id: int) -> list[int]:
    """A fixed completion per (prompt, sampler: 0 the policy, 1 the reference): 2 to ``max_new_tokens`` tokens, ending
    with ``eos_token_id`` when shorter than the limit, with or without it at the limit."""
    rng = np.random.default_rng([zlib.crc32(bytes(np.asarray(prompt_ids, np.uint8))), copy])
    length = int(rng.integers(2, max_new_tokens + 1))
    completion = rng.integers(3, vocab_size, size=length).tolist()
    if length < max_new_tokens or rng.random() < 0.5:
        completion[-1] = eos_token_id
    return completion


def scripted_generate(tokenizer: Any, copy: int, script: tuple[int, int, int]) -> Any:
    """A ``model.generate`` for TRL's side of a comparison: each prompt (its unmasked ids) followed by its
    :func:`scripted_completion` (``copy``; ``script`` its ``max_new_tokens, vocab_size, eos_token_id``), padded with
    the tokenizer's pad token, as ``generate`` returns prompt and completion ids."""
    import torch

    def generate(input_ids, attention_mask, generation_config=None, **kwargs):
        completions = [scripted_completion(ids[mask.bool()].tolist(), copy, *script)
                       for ids, mask in zip(input_ids, attention_mask, strict=True)]
        tokens = torch.full((len(completions), max(map(len, completions))), tokenizer.pad_token_id,
                            dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return torch.cat([input_ids, tokens], dim=1)

    return generate


class LongerCompletionJudge:
    """A pairwise judge (TRL's ``BasePairwiseJudge.judge``) preferring the longer text, the first on a tie."""

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        return [0 if len(first) >= len(second) else 1 for first, second in completions]


class LongerCompletionScoreJudge:
    """A pairwise judge that can score (TRL's ``judge(..., return_scores=True)``, as Nash-MD asks): the probability
    that the first text is better is the sigmoid of the length difference in units of 8 characters; without
    ``return_scores``, the rank of the likelier one."""

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True,
              return_scores: bool = False) -> list[float] | list[int]:
        scores = [1.0 / (1.0 + math.exp((len(second) - len(first)) / 8)) for first, second in completions]
        return scores if return_scores else [0 if score >= 0.5 else 1 for score in scores]
