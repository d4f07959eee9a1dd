"""adapters.safetensors_io: tensors read into aligned buffers (huge-page mappings for big ones) round-trip exactly."""

from __future__ import annotations

import mmap

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy

from torchlike.adapters import safetensors_io


def test_small_and_huge_page_sized_tensors_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "small": rng.standard_normal((3, 5)).astype(np.float32),
        "big": rng.standard_normal((1024, 1536)).astype(ml_dtypes.bfloat16),  # 3 MiB: its own mapping
    }
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    with safetensors_io.SafetensorsReader(path) as reader:
        read = {name: reader.get(name) for name in reader.keys()}
    for name, expected in tensors.items():
        got = read[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.ctypes.data % 64 == 0 and got.flags.writeable
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(jax.device_put(got)).view(np.uint8), expected.view(np.uint8))
    base = read["big"]
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    assert isinstance(base, mmap.mmap) == hasattr(mmap, "MADV_HUGEPAGE")
