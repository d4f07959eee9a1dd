"""Checks that need 8 (simulated) devices, run together in one subprocess by tests/test_mesh.py.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m tests.mesh_checks OUT.json TOKENIZER_DIR CASE=DIR ...
Writes a JSON dict of measurements; the parent test asserts on them.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from safetensors.torch import load_file

import torchlike
from tests import distributed_worker, tiny
from torchlike.testing import tiny_config

MOE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""LoRA on the MoE model's attention (PEFT adapts its experts only through target_parameters)."""


def check_load_on_mesh(checkpoint: Path) -> dict:
    mesh = torchlike.make_mesh((4, 2))
    model = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32").eval()
    ids, mask, positions = tiny.padded_batch()
    ids, mask, positions = (np.concatenate([a, a[:1]]) for a in (ids, mask, positions))  # batch 4 divides fsdp
    expected = tiny.hf_logits(reference, ids, mask, positions)
    logits = np.asarray(model(ids, attention_mask=mask).logits)
    valid = mask.astype(bool)
    shardings = {name: {**array_placement(array), "devices": len(array.sharding.device_set)}
                 for name, array in model.named_parameters()}
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        original, saved = load_file(checkpoint / "model.safetensors"), load_file(Path(out) / "model.safetensors")
        export_equal = saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    return {"max_abs_diff": float(np.abs(logits[valid] - expected[valid]).max()), "shardings": shardings,
            "export_equal": bool(export_equal)}


def check_restore_into_mesh_sharding(checkpoint: Path) -> dict:
    """torchlike.save of a sharded model's state_dict, then load_state_dict into a freshly sharded model."""
    mesh = torchlike.make_mesh((4, 2))
    source = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh)
    target = torchlike.AutoModelForCausalLM.from_config(source.config, mesh=mesh, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        torchlike.save(source.state_dict(), Path(folder) / "ckpt")
        result = target.load_state_dict(torchlike.load(Path(folder) / "ckpt"))
    restored, expected = target.state_dict(), source.state_dict()
    return {
        "all_matched": result.missing_keys == [] and result.unexpected_keys == [],
        "same_sharding": all(restored[k].sharding == expected[k].sharding for k in expected),
        "sharded_on_8": all(len(restored[k].sharding.device_set) == 8 for k in expected),
        "values_equal": all(np.array_equal(np.asarray(restored[k]), np.asarray(expected[k])) for k in expected),
    }


ROLLOUT_SETTINGS = {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3}


def rollout_tokens(checkpoint: Path, mesh=None) -> dict:
    """Sampled completions of the paged engine (fixed seeds, fewer slots than completions) on ``mesh`` or one
    device: the 8-device run and the test process's compare them. ``pool``: where the engine's KV pool lies after the
    run (each array's partition spec, shape and device shard shapes) and its bytes, whole and per device."""
    from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest
    from torchlike.adapters.rollout.sampling_settings import SamplingSettings

    model = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32", mesh=mesh)
    rng = np.random.default_rng(0)
    requests = [RolloutRequest(rng.integers(3, tiny.VOCAB, size=length).tolist(), 10, num_samples=3, seed=index)
                for index, length in enumerate((5, 17, 9, 30, 12))]
    engine = PagedEngine(model.module, PagedEngineConfig(max_num_seqs=8, page_size=4), eos_token_ids=[7], mesh=mesh)
    outputs = engine.generate(requests, SamplingSettings(**ROLLOUT_SETTINGS))
    arrays = {f"{layer}.{part}": array for layer, entry in engine.kv_pool.items() for part, array in entry.items()}
    pool = {"arrays": {name: array_placement(array) for name, array in arrays.items()},
            "bytes": engine.stats.kv_pool_bytes, "bytes_per_device": engine.stats.kv_pool_bytes_per_device}
    return {"tokens": [[row.tolist() for row in output.token_ids] for output in outputs],
            "logprobs": [[row.tolist() for row in output.logprobs] for output in outputs], "pool": pool}


def array_placement(array: jax.Array) -> dict:
    """An array's partition spec (``[]`` off a mesh), shape and the shapes of its device shards."""
    spec = getattr(array.sharding, "spec", ())
    return {"spec": [None if axis is None else str(axis) for axis in spec], "shape": list(array.shape),
            "shard_shapes": [list(shape) for shape in sorted({shard.data.shape for shard in array.addressable_shards})]}


def paged_engine_warnings_for_one_kv_head() -> list[str]:
    """The warnings of a paged engine on fsdp=4 x tp=2 for a model of 1 KV head (its weights stay on one device:
    the engine's choice of placement is what is checked)."""
    from torchlike.adapters.rollout import PagedEngine

    model = torchlike.AutoModelForCausalLM.from_config(tiny_config("qwen2", num_key_value_heads=1), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PagedEngine(model.module, mesh=torchlike.make_mesh((4, 2)))
    return [str(warning.message) for warning in caught if "KV pool" in str(warning.message)]


def check_paged_kernel_on_split_heads() -> dict:
    """One decode step of the GPU paged kernel (interpreted) on pages whose KV heads are split over ``tp``, as the
    paged engine's pool is on a mesh, against the same kernel on whole pages."""
    from torchlike.adapters.model import paged_attention

    mesh = torchlike.make_mesh((4, 2))
    rng = np.random.default_rng(0)
    rows, heads, kv_heads, dim, pages, page_size, width = 4, 4, 2, 16, 24, 4, 4
    lengths = rng.integers(1, width * page_size - 1, size=rows).astype(np.int32)  # tokens before the fed one
    page_table = rng.permutation(np.arange(1, pages))[:rows * width].reshape(rows, width).astype(np.int32)
    k_pages, v_pages = (rng.normal(size=(kv_heads, pages, page_size, dim)).astype(np.float32) for _ in range(2))
    q, k, v = (rng.normal(size=(rows, 1, n, dim)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    cache = {"k_pages": k_pages, "v_pages": v_pages, "page_table": page_table, "kv_lengths": lengths + 1,
             "write_page": page_table[np.arange(rows), lengths // page_size], "write_offset": lengths % page_size,
             "end_index": np.zeros(rows, np.int32)}
    attend = jax.jit(lambda q, k, v, cache: paged_attention.attend(q, k, v, cache, scale=0.5))
    with paged_attention.using("pallas_gpu", interpret=True):
        whole, _ = attend(q, k, v, cache)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp"))
    split_pages = {part: jax.device_put(cache[part], split) for part in ("k_pages", "v_pages")}
    with paged_attention.using("pallas_gpu", interpret=True, heads_mesh=mesh):
        out, written = attend(q, k, v, {**cache, **split_pages})
    return {"max_abs_diff": float(np.abs(np.asarray(out) - np.asarray(whole)).max()),
            "written_pages": array_placement(written["k_pages"])}


def check_grpo_lora_and_resume(checkpoint: Path, tokenizer_dir: Path, folder: Path) -> dict:
    """GRPO with LoRA on fsdp=4 x tp=2 (the 2-process test's reference); then a run resumed from checkpoint-2."""
    straight = distributed_worker.grpo_lora_run(checkpoint, tokenizer_dir, folder / "grpo_straight")
    resumed = distributed_worker.grpo_lora_run(checkpoint, tokenizer_dir, folder / "grpo_resumed",
                                               resume=str(folder / "grpo_straight" / "checkpoint-2"))
    ahead = distributed_worker.grpo_lora_run(checkpoint, tokenizer_dir, folder / "grpo_ahead", max_staleness=2)
    return {"straight": straight["losses"], "resumed": resumed["losses"],
            "scored_per_call": straight["scored_per_call"], "ahead": ahead["losses"]}


def main() -> None:
    out_path, tokenizer_dir, *cases = sys.argv[1:]
    results = {"device_count": jax.device_count()}
    for case in cases:
        name, directory = case.split("=", 1)
        results[name] = check_load_on_mesh(Path(directory))
    first = Path(cases[0].split("=", 1)[1])
    results["restore"] = check_restore_into_mesh_sharding(first)
    results["rollout"] = rollout_tokens(first, torchlike.make_mesh((4, 2)))
    results["paged_kernel"] = check_paged_kernel_on_split_heads()
    results["one_kv_head_warnings"] = paged_engine_warnings_for_one_kv_head()
    results["sft_output_dir"] = str(Path(out_path).parent / "sft_one_process")
    results["sft"] = distributed_worker.train_losses(first, distributed_worker.MESH_SHAPE, per_device=2,
                                             output_dir=results["sft_output_dir"])
    results["grpo_lora"] = check_grpo_lora_and_resume(first, Path(tokenizer_dir), Path(out_path).parent)
    results["sft_lora"] = distributed_worker.train_losses(first, distributed_worker.MESH_SHAPE, per_device=2, lora=True)
    moe = next(Path(case.split("=", 1)[1]) for case in cases if case.startswith("qwen3_moe="))
    results["moe_sft_lora"] = distributed_worker.train_losses(moe, distributed_worker.MESH_SHAPE, per_device=2,
                                                              lora=True, target_modules=MOE_LORA_TARGETS)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
