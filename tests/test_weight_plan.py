"""The weight plan: which slot each source key fills, the shape it must have there, and the value it becomes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import torchlike
from torchlike.adapters.checkpoint import hf_checkpoint
from torchlike.adapters.families.base import AS_IS, HEADS_FIRST_INPUT_PROJECTION
from torchlike.adapters.families.gemma3 import FAMILY as GEMMA3
from torchlike.adapters.model import tunix_model
from torchlike.adapters.model.weight_plan import Assembly, Target, place, plan, route

SHAPES = {  # one Gemma 3 layer: 2 query heads, 1 kv head of size 4, hidden size 8, a LoRA of rank 2 on kv_einsum
    "layers.0.attn.q_einsum.w": (2, 8, 4),
    "layers.0.attn.kv_einsum.w": (2, 1, 8, 4),
    "layers.0.attn.kv_einsum.w_lora_a": (8, 2),
    "layers.0.attn.kv_einsum.w_lora_b": (2, 2, 1, 4),
    "final_norm.scale": (8,),
}
K_PROJ, V_PROJ = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"


def hf_tensor(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_an_hf_key_of_a_stacked_weight_fills_its_part_in_the_hf_shape_of_that_part():
    source = route(GEMMA3, SHAPES, V_PROJ)
    assert (source.target, source.stack, source.route) == ("layers.0.attn.kv_einsum.w", (1, 2), "HF name translated")
    assert source.layout is HEADS_FIRST_INPUT_PROJECTION
    assert source.shape(SHAPES[source.target]) == (4, 8)  # (kv heads * head_dim, hidden)


def test_key_map_and_a_stripped_prefix_are_named_in_the_route():
    source = route(GEMMA3, SHAPES, "base_model.model.final.scale", key_map={r"final\.": "final_norm."})
    assert source.target == "final_norm.scale" and source.layout is AS_IS
    assert source.route == "key_map then prefix 'base_model.model.' stripped"


def test_keys_that_fill_no_slot_are_unexpected_and_slots_without_a_key_get_no_source():
    result = plan(GEMMA3, SHAPES, [(key, key) for key in (K_PROJ, "model.layers.9.mlp.up_proj.weight", "rotary")])
    assert list(result.targets) == ["layers.0.attn.kv_einsum.w"]
    assert result.unexpected == ["model.layers.9.mlp.up_proj.weight", "rotary"]


def test_the_parts_of_a_stack_are_distinct_places_but_two_keys_for_one_part_are_refused():
    assert len(plan(GEMMA3, SHAPES, [(K_PROJ, K_PROJ), (V_PROJ, V_PROJ)]).targets["layers.0.attn.kv_einsum.w"]) == 2
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' \(HF name translated\) and "
                                         r"'module\.model\.layers.*\(prefix 'module\.' stripped then HF name "
                                         r"translated\) both map to 'layers\.0\.attn\.kv_einsum\.w'"):
        plan(GEMMA3, SHAPES, [(K_PROJ, K_PROJ), ("module." + K_PROJ, "module." + K_PROJ)])


def test_a_stacked_slot_is_made_once_its_last_part_arrives_in_the_target_dtype():
    k, v = hf_tensor((4, 8), 0), hf_tensor((4, 8), 1)
    target = Target(SHAPES["layers.0.attn.kv_einsum.w"], ml_dtypes.bfloat16)
    assembly = Assembly()
    assert assembly.add(route(GEMMA3, SHAPES, V_PROJ), v, target) is None  # parts may come in any order
    value = assembly.add(route(GEMMA3, SHAPES, K_PROJ), k, target)
    assert value.shape == target.shape and value.dtype == np.dtype(ml_dtypes.bfloat16)
    for index, hf in enumerate((k, v)):
        back = HEADS_FIRST_INPUT_PROJECTION.to_hf(np.asarray(value[index], np.float32))
        np.testing.assert_array_equal(back, hf.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_the_shape_check_names_what_a_wrong_config_implies():
    source = route(GEMMA3, SHAPES, "model.layers.0.self_attn.q_proj.weight")
    assert source.shape(SHAPES[source.target]) == (8, 8)
    assert source.shape((3, 8, 4)) == (12, 8)  # a checkpoint with 3 query heads no longer fits


def test_peft_factors_of_a_fused_weight_share_lora_a_and_stack_lora_b_on_its_second_axis():
    a = route(GEMMA3, SHAPES, "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight")
    b = route(GEMMA3, SHAPES, "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")
    assert (a.target, a.axis, a.shape(SHAPES[a.target])) == ("layers.0.attn.kv_einsum.w_lora_a", None, (2, 8))
    assert (b.target, b.stack, b.axis, b.shape(SHAPES[b.target])) == ("layers.0.attn.kv_einsum.w_lora_b", (1, 2), 1,
                                                                      (4, 2))
    assert a.route == "prefix 'base_model.model.' stripped then PEFT name translated"
    assert plan(GEMMA3, SHAPES, [(key, key) for key in (a.key, a.key.replace("v_proj", "k_proj"))]).unexpected == []


def test_a_stack_finished_early_has_zeros_for_the_parts_that_never_came():
    b = route(GEMMA3, SHAPES, "model.layers.0.self_attn.v_proj.lora_B.weight")
    assembly = Assembly()
    lora_b = hf_tensor((4, 2), 2)
    assert assembly.add(b, lora_b, Target(SHAPES[b.target], np.float32)) is None
    value = np.asarray(assembly.finish(b.target))
    assert value.shape == (2, 2, 1, 4) and not value[:, 0].any()
    np.testing.assert_array_equal(value[:, 1], lora_b.T.reshape(2, 1, 4))


def test_an_nnx_lora_factor_of_a_weight_without_an_adapter_is_routed_beside_the_slots():
    slots = {"layers.0.attn.q_einsum.w": (2, 8, 4)}
    source = route(GEMMA3, slots, "model.layers.0.attn.q_einsum.w_lora_a")
    assert source.target == "layers.0.attn.q_einsum.w_lora_a" and source.target not in slots


def test_a_model_array_is_cast_where_it_lives_and_placed_in_the_target_sharding():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    value = place(AS_IS, jnp.ones((3,), jnp.float32), (3,), jnp.bfloat16, sharding)
    assert value.dtype == jnp.bfloat16 and value.sharding == sharding


def test_checkpoint_files_streamed_in_any_order_load_as_from_pretrained(tiny_checkpoints):
    path = tiny_checkpoints.path("gemma3")
    expected = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    tensors = list(hf_checkpoint.iter_checkpoint_tensors(hf_checkpoint.find_weight_files(path)))
    module = tunix_model.load_weights(expected.family, expected.config, reversed(tensors), jnp.bfloat16)
    for name, variable in tunix_model.flat_variables(module).items():
        assert variable.get_value().dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(expected.state_dict()[name]))


def test_a_fused_expert_tensor_fills_two_slots_and_clashes_with_the_per_expert_names():
    from transformers import Qwen3MoeConfig

    from torchlike.adapters.families.qwen3_moe import FAMILY as QWEN3_MOE

    family = QWEN3_MOE.for_config(Qwen3MoeConfig(num_experts=2, num_hidden_layers=1))
    slots = {"layers.0.mlp.gate_proj": (2, 8, 3), "layers.0.mlp.up_proj": (2, 8, 3)}
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    gate, up = plan(family, slots, [(fused, fused)]).targets.values()
    assert (gate[0].target, up[0].target) == ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")
    assert gate[0].shape((2, 8, 3)) == up[0].shape((2, 8, 3)) == (2, 6, 8)  # (experts, gate and up, hidden)
    hf = hf_tensor((2, 6, 8), 3)
    np.testing.assert_array_equal(np.asarray(place(up[0].layout, hf, (2, 8, 3), None, None)),
                                  hf[:, 3:, :].transpose(0, 2, 1))
    assert [name for name, _ in family.nnx_to_hf("layers.0.mlp.up_proj")] == [  # exports keep the on-disk names
        "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"]
    per_expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    with pytest.raises(ValueError, match="both map to 'layers.0.mlp.up_proj'"):
        plan(family, slots, [(fused, fused), (per_expert, per_expert)])


def test_expert_parts_from_the_host_stack_into_the_nnx_layout_in_one_transform_with_zeros_for_missing_parts():
    from transformers import Qwen3MoeConfig

    from torchlike.adapters.families.qwen3_moe import FAMILY as QWEN3_MOE
    from torchlike.adapters.runtime import tracing

    family = QWEN3_MOE.for_config(Qwen3MoeConfig(num_experts=3, num_hidden_layers=1))
    slots = {"layers.0.mlp.down_proj": (3, 5, 8)}  # (experts, expert size, hidden)
    names = [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (2, 0)]  # any order; expert 1 never comes
    (sources,) = plan(family, slots, [(n, n) for n in names]).targets.values()
    parts = {name: hf_tensor((8, 5), seed) for seed, name in enumerate(names)}
    assembly, target = Assembly(), Target((3, 5, 8), ml_dtypes.bfloat16)
    traces = tracing.TRACE_COUNTS["weight_transform"]
    assert assembly.add(sources[0], parts[names[0]], target) is None
    assert assembly.add(sources[1], parts[names[1]], target) is None
    value = assembly.finish("layers.0.mlp.down_proj")
    assert value.dtype == ml_dtypes.bfloat16 and value.shape == (3, 5, 8)
    expected = np.stack([parts[names[1]].T, np.zeros((5, 8), np.float32), parts[names[0]].T]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(value), expected)
    assert tracing.TRACE_COUNTS["weight_transform"] - traces <= 1  # the whole stack, not a program per part
