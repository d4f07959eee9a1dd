"""``save_model`` and ``push_to_hub``: the trained model written in Hugging Face format and uploaded to the Hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..modeling import CausalLM
    from ..type_aliases import Tokenizer

__all__ = ["export_model", "repo_id", "upload_output_dir"]


def export_model(model: CausalLM, output_dir: str | os.PathLike, tokenizer: Tokenizer | None) -> None:
    """Writes ``model`` with ``save_pretrained`` (full weights, or a PEFT adapter) and the tokenizer's files.

    The tokenizer's files go into the same staged folder, so the swap publishes model and tokenizer together.
    With several JAX processes every process calls this (as every process runs a script's last line,
    ``trainer.save_model()``): the tensors are gathered one at a time and process 0 writes.

    Raises:
        NotImplementedError: a plain NNX module (no Hugging Face format).
    """
    model.save_pretrained(output_dir, tokenizer=tokenizer)


def repo_id(args) -> str:
    """The Hub repository of a run: ``args.hub_model_id``, else the name of ``args.output_dir``."""
    return args.hub_model_id or Path(args.output_dir).name


def upload_output_dir(args, commit_message: str, token: str | None = None, revision: str | None = None) -> str:
    """Uploads ``args.output_dir`` to :func:`repo_id` (private per ``hub_private_repo``); ``token`` and ``revision``
    override ``args.hub_token`` / ``args.hub_revision``. Returns the commit URL."""
    from ..adapters.checkpoint.hf_hub import upload_folder

    return upload_folder(args.output_dir, repo_id(args), commit_message=commit_message,
                         private=args.hub_private_repo, token=token or args.hub_token,
                         revision=revision or args.hub_revision)
