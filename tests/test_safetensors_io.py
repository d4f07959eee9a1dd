"""adapters.checkpoint.safetensors_io: tensors read into aligned buffers (huge-page mappings for big ones) round-trip
exactly."""

from __future__ import annotations

import mmap

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy

from torchlike.adapters.checkpoint import safetensors_io


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


def test_a_given_back_buffer_serves_the_next_tensor_of_at_least_half_its_size():
    buffers = safetensors_io.ReadBuffers()
    first = buffers.take((256, 256), np.float32)  # 256 KiB
    address = first.ctypes.data
    first[:] = 1
    kept = buffers.take((64, 64), np.float32)
    kept[:] = 7
    buffers.give_back(first)
    del first
    assert buffers.take((16, 16), np.float32).ctypes.data != address  # far smaller: a fresh buffer
    again = buffers.take((200, 256), ml_dtypes.bfloat16)  # 100 KiB: fresh too (under half)
    assert again.ctypes.data != address
    reused = buffers.take((128, 256), np.float32)  # half the size: the given-back buffer
    assert reused.ctypes.data == address and reused.shape == (128, 256) and reused.dtype == np.float32
    assert buffers.take((256, 256), np.float32).ctypes.data != address  # lent out, not lent twice
    assert np.all(kept == 7)  # never given back, never reused


def test_a_buffer_never_given_back_is_released_with_its_array():
    buffers = safetensors_io.ReadBuffers()
    array = buffers.take((1024, 1024), np.float32)
    assert len(buffers._lent) == 1
    del array
    assert not buffers._lent  # nothing keeps a dropped tensor's memory alive until the load ends
    buffers.give_back(np.zeros(4))  # not one of its buffers: ignored
    assert not buffers._free


def test_reads_host_tells_a_zero_copy_placement_from_a_copy():
    from torchlike.adapters.model.weight_plan import reads_host

    array = safetensors_io.aligned_empty((512, 256), np.float32)
    array[:] = 1
    adopted = jax.device_put(array)
    assert reads_host(adopted, array)  # the CPU backend adopts an aligned buffer without copying it
    assert not reads_host(jax.jit(lambda x: x.T)(adopted), array)
    assert not reads_host(adopted, np.ones(3)) and not reads_host(array, array)
