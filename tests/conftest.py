"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot (no downloads)."""

from __future__ import annotations

import os
import tempfile
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread for torch (the references' runs): the README's command runs two workers on two cores, and two
# spinning OpenMP threads per worker slowed the TRL comparisons by 10-20% (tests/test_native_families_vs_trl.py and
# tests/test_grpo_vs_trl.py side by side: 139.6 + 88.5 s of tests with the default, 125.1 + 71.5 s with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Workers of this suite live through hundreds of tests; XLA:CPU segfaulted compiling in such workers (about once a
# cold run) once the code of the programs they had compiled filled the kernel's mapping limit
# (tests/helpers/memory_maps.py drops them before that; tests/helpers/crash_report.py prints the stacks of any other
# crash and reruns the test on a new worker). glibc's allocator is left as the
# environment sets it here (torchlike's tuning, adapters/runtime/host_memory.py, keeps freed buffers in one heap);
# tests/test_host_memory.py checks that tuning in its own processes.
os.environ.setdefault("TORCHLIKE_HOST_MALLOC", "0")
# JAX's persistent compilation cache: one folder for the session, shared by its workers and every child process
# (JAX_COMPILATION_CACHE_DIR; one already set in the environment is used as it is and kept), made empty when the
# session starts and removed when it ends. The run starts cold, and a
# program compiled again in it is read back instead: an identical trainer in another test, the programs of a file
# after tests/helpers/memory_maps.py dropped the compiled ones, a multi-process job run a second time (a third of the
# suite's compiles are such repeats, tests/TIMING.md). TORCHLIKE_TEST_COMPILATION_CACHE=keep keeps one folder across
# runs instead (faster local reruns), =0 turns the cache off. It was off before: XLA:CPU crashed serialising or
# deserialising executables in long-lived workers, and both causes found since are handled (a reader loaded an entry
# another process was still writing: adapters/runtime/compilation.py's atomic writes; the code mappings reached the
# kernel's limit: tests/helpers/memory_maps.py).
# Only programs that take MIN_CACHED_COMPILE_SECONDS or more to compile are written: a 2-layer train step compiles
# in 1.2-1.7 s and reads back in 0.21-0.25 s, but the suite's 12,000 eager ops compile in about 15 ms each, and writing
# every one cost more than reading the repeated ones back saved (a run that cached all of them: 31.7 minutes against
# 28.3 without the cache, tests/TIMING.md).
MIN_CACHED_COMPILE_SECONDS = 0.2
CACHE_MODE = os.environ.get("TORCHLIKE_TEST_COMPILATION_CACHE", "").strip().lower() or "session"
COMPILATION_CACHE = CACHE_MODE not in ("0", "off", "false", "no")
if not COMPILATION_CACHE:
    os.environ["TORCHLIKE_COMPILATION_CACHE"] = "0"
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
elif CACHE_MODE == "session" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # The session's first process (xdist's controller) makes the folder; its workers and their children inherit it.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchlike-test-xla-")
    os.environ["TORCHLIKE_TEST_COMPILATION_CACHE_OWNER"] = str(os.getpid())
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
import shutil  # noqa: E402

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
        os.environ["TORCHLIKE_COMPILATION_CACHE"] = cache_dir  # what the children's torchlike turns on
        compilation.enable_compilation_cache(cache_dir)  # decided once per process: from_pretrained keeps it
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)
    torch.manual_seed(0)
    skip_the_references_full_collections()
    # What the imports made lives as long as the worker; frozen, Python's own full collections no longer walk it
    # (torch, transformers, TRL and JAX make about 550,000 objects: 0.25 s a full collection on them alone). Tracing
    # makes and drops objects by the million, and at Python's default threshold (700) the full collections that
    # followed cost 8.2 s (24 of them) in the seven files above; at 10,000, 1.0 s (7).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def pytest_unconfigure(config):
    """The session's own compilation cache folder goes with the session (only the process that made it removes it:
    the workers end before the controller)."""
    if COMPILATION_CACHE and os.environ.get("TORCHLIKE_TEST_COMPILATION_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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
