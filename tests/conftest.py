"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests import tiny  # noqa: E402
from torchlike.adapters.runtime import compilation  # noqa: E402


def pytest_configure(config):
    import jax

    cache_dir = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                      os.path.join(tiny.CACHE_ROOT, compilation.cache_folder_name()))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Saved tiny HF checkpoints by case name (built lazily, once per session)."""
    return tiny.CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def padded_batch():
    return tiny.padded_batch()


def valid_positions(mask: np.ndarray) -> np.ndarray:
    return mask.astype(bool)
