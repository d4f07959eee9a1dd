"""Resolve a hub id or local path to a checkpoint directory, and upload folders, via ``huggingface_hub``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..distributed import multihost

_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFoundError(OSError):
    """Neither a local directory nor a reachable hub repository."""


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or not _REPO_ID.match(name)


def resolve_model_dir(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local directory holding the checkpoint named by ``name_or_path``.

    A path that exists is used as is. Otherwise ``name_or_path`` is taken as a hub repo id
    and fetched (config, safetensors, tokenizer files; ``.bin`` only when there are no
    safetensors) with ``huggingface_hub.snapshot_download``, which also serves the local
    cache when offline (``HF_HUB_OFFLINE=1``).

    Raises:
        ModelNotFoundError: not a local directory and not available from the hub; the
            message says how to pass a path instead.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists():
        raise ModelNotFoundError(f"{name} is a file; pass the directory that holds config.json and the weights.")
    if _looks_like_local_path(name):
        raise ModelNotFoundError(f"Directory {name} does not exist. Pass the directory that holds config.json "
                                 "and the weights (e.g. one written by save_pretrained).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    kwargs = dict(repo_id=name, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    try:
        folder = Path(snapshot_download(allow_patterns=_CHECKPOINT_PATTERNS, **kwargs))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(allow_patterns=_CHECKPOINT_PATTERNS + ["*.bin"], **kwargs))
        return folder
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") or local_files_only
        reason = ("the Hugging Face Hub is offline (HF_HUB_OFFLINE=1 or local_files_only=True) and it is not in "
                  "the local cache") if offline else f"it could not be fetched from the Hugging Face Hub ({error})"
        raise ModelNotFoundError(
            f"{name!r} is not a local directory and {reason}. Pass the path of a directory that holds "
            f"config.json and the weights, or download it first (`hf download {name} --local-dir DIR`)."
        ) from None


def upload_folder(
    folder: str | os.PathLike,
    repo_id: str,
    commit_message: str = "Upload model",
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Creates ``repo_id`` if needed and uploads ``folder`` in one commit; returns the commit URL.

    With several JAX processes, process 0 uploads while the others wait; they return ``""``.
    """
    from huggingface_hub import HfApi

    def upload() -> str:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                                 revision=revision, create_pr=create_pr, repo_type="model")
        return str(getattr(info, "commit_url", info))

    return multihost.on_primary(upload, f"upload {folder} to {repo_id}") or ""
