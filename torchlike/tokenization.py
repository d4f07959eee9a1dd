"""``AutoTokenizer``: the ``transformers`` tokenizer itself, with the pad-token fallback users expect."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["AutoTokenizer"]


class AutoTokenizer:
    """Returns the real ``transformers`` tokenizer (nothing is reimplemented)."""

    def __init__(self, *args, **kwargs):
        raise OSError("Use AutoTokenizer.from_pretrained(...).")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        """Loads a tokenizer with ``transformers.AutoTokenizer.from_pretrained``.

        A tokenizer without a pad token gets ``pad_token = eos_token``, so batches can be
        padded as ``transformers`` and TRL users expect.

        Args:
            pretrained_model_name_or_path: a directory or hub id.
            kwargs: passed to ``transformers.AutoTokenizer.from_pretrained`` (``trust_remote_code`` too: a
                tokenizer's own code is Python that runs as it does under ``transformers``).

        Returns:
            A ``transformers.PreTrainedTokenizerBase``.
        """
        from transformers import AutoTokenizer as HFAutoTokenizer

        from .adapters.checkpoint.hf_hub import resolve_model_dir

        source = resolve_model_dir(pretrained_model_name_or_path, revision=kwargs.pop("revision", None),
                                   cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"),
                                   local_files_only=kwargs.get("local_files_only", False))
        tokenizer = HFAutoTokenizer.from_pretrained(source, *args, **kwargs)
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
