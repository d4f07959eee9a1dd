"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot (no downloads)."""

from __future__ import annotations

import os
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread for torch (the references' runs): the README's command runs two workers on two cores, and two
# spinning OpenMP threads per worker slowed the TRL comparisons by 10-20% (tests/test_native_families_vs_trl.py and
# tests/test_grpo_vs_trl.py side by side: 139.6 + 88.5 s of tests with the default, 125.1 + 71.5 s with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The persistent compilation cache is off in the suite and its subprocesses unless TORCHLIKE_TEST_COMPILATION_CACHE=1
# (faster local reruns): with it, XLA:CPU crashed (a segmentation fault in a worker that had run hundreds of tests)
# serialising or deserialising a cached executable, in 3 of the last 4 cold runs, and pytest-xdist then waits for the
# dead worker's file forever. A cold run compiles each program about once anyway.
# Workers of this suite live through hundreds of tests; XLA:CPU segfaulted compiling in such workers (about once a
# cold run) once the code of the programs they had compiled filled the kernel's mapping limit
# (tests/helpers/memory_maps.py drops them before that; tests/helpers/crash_report.py prints the stacks of any other
# crash and reruns the test on a new worker). glibc's allocator is left as the
# environment sets it here (torchlike's tuning, adapters/runtime/host_memory.py, keeps freed buffers in one heap);
# tests/test_host_memory.py checks that tuning in its own processes.
os.environ.setdefault("TORCHLIKE_HOST_MALLOC", "0")
COMPILATION_CACHE = os.environ.get("TORCHLIKE_TEST_COMPILATION_CACHE", "").strip().lower() in ("1", "true", "on")
if not COMPILATION_CACHE:
    os.environ["TORCHLIKE_COMPILATION_CACHE"] = "0"
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# Tiny shapes make XLA's compile time most of the suite's time. The suite compiles with XLA:CPU's cheapest settings
# (the programs compute the same values; the skipped work is what makes big kernels fast), set here so that every
# subprocess inherits them. A flag already in XLA_FLAGS is left as set.
XLA_COMPILE_FLAGS = ["xla_backend_optimization_level=0", "xla_llvm_disable_expensive_passes=true"]
if metadata.version("jaxlib").startswith("0.10."):
    # jaxlib 0.10's XLA compiles each fusion through its MLIR emitters; its classic emitters compile a train step in
    # about half the time. XLA aborts on an unknown flag, and jaxlib 0.12 has no such flag, so it is set only on the
    # line checked.
    XLA_COMPILE_FLAGS.append("xla_cpu_use_fusion_emitters=false")
for flag in XLA_COMPILE_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}".strip()

import functools  # noqa: E402
import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests import tiny  # noqa: E402
from tests.helpers.scripts import build_script_model_dir  # noqa: E402
from tests.helpers.tokenizers import tokenizer_for  # noqa: E402
from torchlike.adapters.runtime import compilation  # noqa: E402

pytest_plugins = ["pytester", "tests.helpers.skip_policy", "tests.helpers.crash_report", "tests.helpers.memory_maps"]


def pytest_configure(config):
    import jax

    if COMPILATION_CACHE:  # one folder for the workers and their subprocesses
        cache_dir = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                          os.path.join(tiny.CACHE_ROOT, compilation.cache_folder_name()))
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        compilation.atomic_cache_writes()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    torch.manual_seed(0)
    skip_the_references_full_collections()
    # What the imports made lives as long as the worker; frozen, Python's own full collections no longer walk it
    # (torch, transformers, TRL and JAX make about 550,000 objects: 0.25 s a full collection on them alone). Tracing
    # makes and drops objects by the million, and at Python's default threshold (700) the full collections that
    # followed cost 8.2 s (24 of them) in the seven files above; at 10,000, 1.0 s (7).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def skip_the_references_full_collections() -> None:
    """The reference runs (transformers' and TRL's ``Trainer.train``) end with accelerate's ``free_memory``, whose
    ``clear_device_cache(garbage_collection=True)`` runs a full ``gc.collect()`` to hand freed CUDA memory back. On CPU
    it frees nothing a later test needs, and in a worker that holds the objects of hundreds of tests it cost 0.9 s a
    call: 68 calls, 58 s of a 281 s run of seven TRL comparison files (tests/test_dpo_trainer.py and six more). The
    suite keeps the rest of that function (the device cache) and Python's own collector; the references compute the
    same values."""
    from accelerate.utils import memory

    clear = memory.clear_device_cache
    if getattr(clear, "collects", True) is False:
        return

    @functools.wraps(clear)
    def clear_device_cache(garbage_collection: bool = False) -> None:
        clear(garbage_collection=False)

    clear_device_cache.collects = False
    memory.clear_device_cache = clear_device_cache


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Saved tiny HF checkpoints by case name (built lazily, once per session)."""
    return tiny.CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def pad_tokenizer_dir(tmp_path_factory):
    """The tests' tokenizer with ``<pad>`` as its pad token (TRL pads with the eos token otherwise); its BOS is
    ``<s>``."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("pad_tokenizer"), pad_token="<pad>")


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    """The tests' tokenizer with ``<pad>`` as its pad token and a chat template whose turns end with EOS
    (``TURN_EOS_CHAT_TEMPLATE`` in ``tests/helpers/tokenizers.py``)."""
    import transformers

    from tests.helpers.tokenizers import TURN_EOS_CHAT_TEMPLATE

    path = tiny.build_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), pad_token="<pad>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TURN_EOS_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def teacher_path(tmp_path_factory):
    """A tiny Qwen2 teacher with other weights than the student's (``tiny_checkpoints.path("qwen2")``)."""
    path = tmp_path_factory.mktemp("teacher")
    tiny.build_hf_model(tiny.CASES["qwen2"](), seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def job_compilation_cache(tmp_path_factory) -> dict[str, str]:
    """The environment that gives the processes of the tests' multi-process jobs one persistent compilation cache:
    a job run again (resumed after a preemption, or the run without it to compare with) loads what the first run
    compiled instead of compiling it again. The worker itself keeps the cache off (see above)."""
    if COMPILATION_CACHE:
        return {"TORCHLIKE_COMPILATION_CACHE": os.environ["JAX_COMPILATION_CACHE_DIR"]}
    return {"TORCHLIKE_COMPILATION_CACHE": str(tmp_path_factory.mktemp("job-xla-cache"))}


@pytest.fixture
def tokenizer(tokenizer_dir):
    """torchlike's tokenizer of ``tokenizer_dir``, a fresh one per test."""
    return tokenizer_for(tokenizer_dir)


@pytest.fixture(scope="module")
def script_model(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """A tiny Qwen2 model directory as TRL's scripts expect one (weights, config and tokenizer)."""
    return build_script_model_dir(tiny_checkpoints.path("qwen2"), tokenizer_dir,
                                  tmp_path_factory.mktemp("script-model") / "qwen2")


@pytest.fixture
def rematerialised_modules(monkeypatch):
    """The type names of the modules the train step rematerialises, appended as each is entered (clear the list
    between runs)."""
    from torchlike.adapters.training import train_step

    entered = []
    rematerialised = train_step.rematerialised

    def recording(module):
        entered.append(type(module).__name__)
        return rematerialised(module)

    monkeypatch.setattr(train_step, "rematerialised", recording)
    return entered


@pytest.fixture
def padded_batch():
    return tiny.padded_batch()


def valid_positions(mask: np.ndarray) -> np.ndarray:
    return mask.astype(bool)
