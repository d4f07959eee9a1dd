"""The upstream bugs and gaps torchlike works around: one row each, with the versions the workaround was checked on.

Each :class:`Workaround` names the distribution, the versions it was checked against (a PEP 440 specifier),
what upstream does or lacks, and where torchlike works around it. ``tests/test_upstream.py`` fails when an
installed version leaves a row's range, so whoever moves a pin in ``pyproject.toml`` re-checks that row: if
upstream fixed it, drop the workaround and the row; if not, widen the range. Docstrings elsewhere describe
the behaviour and point here instead of naming versions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    """One upstream bug or gap and the code that works around it.

    Args:
        package: the distribution name, as ``pip`` and ``importlib.metadata`` spell it.
        versions: the PEP 440 specifier of the versions the workaround was checked on (``"<=0.1.7"``).
        problem: what upstream does or lacks.
        where: ``"path/to/file.py:name"`` of each function, class or table that works around it.
    """

    package: str
    versions: str
    problem: str
    where: tuple[str, ...]


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "google-tunix", "<=0.1.7",
        "Qwen3 and Llama 3 attention hard-code rope_theta=1e6 (the config's value is ignored) and no decoder "
        "implements rope_scaling; the rope functions are swapped into unchanged copies of Tunix's methods.",
        ("adapters/model/rope.py:with_rope", "adapters/families/qwen2.py:build_model",
         "adapters/families/qwen3.py:build_model", "adapters/families/llama3.py:build_model",
         "adapters/families/qwen3_moe.py:build_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Qwen2/Qwen3 attention Einsum (and every Gemma4 Einsum) calls jnp.astype on its weight, which fails on "
        "Qwix's quantised WithAux: QLoRA keeps those projections in full precision.",
        ("adapters/families/qwen2.py:quantization_excluded", "adapters/families/qwen3.py:quantization_excluded",
         "adapters/families/qwen3_moe.py:quantization_excluded", "adapters/families/gemma4.py:quantization_excluded",
         "torchlike/peft/model.py:get_peft_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Gemma3 builds a fused qkv_einsum when num_kv_heads == num_heads and fixes the 5:1 sliding/global layer "
        "pattern; the layers are rebuilt to follow config.layer_types with separate q/kv weights.",
        ("adapters/families/base.py:split_fused_qkv", "adapters/families/gemma3.py:build_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Gemma (1/2) attention hard-codes rope_theta=10000, scales queries by head_dim**-0.5 (ignoring "
        "query_pre_attn_scalar), compares cache slots with token positions for the sliding window (wrong on "
        "left-padded rows and in the sampler's decode) and builds a fused qkv_einsum when num_kv_heads == "
        "num_heads; the attention is subclassed with the window on cache slots, the query scalar and "
        "adapters.model.rope, and the q/kv weights are split.",
        ("adapters/families/gemma2.py:Gemma2Attention", "adapters/families/gemma2.py:build_model",
         "adapters/families/base.py:split_fused_qkv"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Gemma4's MoE routes on its input after moe_pre_ffw_norm, where transformers routes on the un-normalised "
        "residual and normalises only the experts' input; the norm moves into a MoE subclass that applies it to "
        "the experts' input only.",
        ("adapters/families/gemma4.py:Gemma4MoE", "adapters/families/gemma4.py:build_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Gemma4 derives KV sharing from frac_shared_layers, assuming the last unshared layer is global and the one "
        "before it sliding (and widens the MLPs of the layers it shares), gives num_global_kv_heads to every global "
        "layer, and holds k_proj in a stacked kv_einsum or a k_einsum depending on the layer; the sharing follows "
        "config.layer_types and num_kv_shared_layers, and each layer gets separate key/value einsums.",
        ("adapters/families/gemma4.py:kv_sharing_pattern", "adapters/families/gemma4.py:Gemma4Attention",
         "adapters/families/gemma4.py:build_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Qwen3 with num_experts makes every layer sparse with one hidden size (no decoder_sparse_step, "
        "mlp_only_layers or separate moe_intermediate_size), always renormalises the top-k routing weights "
        "(norm_topk_prob), runs the TPU-only megablox kernel whenever a mesh is active off CPU, computes every "
        "expert for every token on CPU and keeps no router logits for the load-balancing loss; dense layers get "
        "Tunix's MLP and the MoE layer's call is transformers' routing on jax.lax.ragged_dot, sowing its logits.",
        ("adapters/families/qwen3_moe.py:build_model", "adapters/families/qwen3_moe.py:SparseMoeBlock"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "A multi-token call cannot continue a KV cache in every family: Gemma 4's prefill attends only to the call's "
        "own tokens (and writes them at slot 0), Gemma 3 places its sliding window relative to the call's first "
        "token; the paged engine's later prefill chunks feed their tokens one at a time through the decode step.",
        ("adapters/rollout/paged.py:_prefill_chunk_program",),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "The vanilla Sampler has no repetition penalty or min-p, needs a fixed kv_cache_size (its index wraps "
        "silently), reuses one PRNG key per rollout and returns NaN log-probs at temperature 0; generation "
        "runs its own decode loop on Tunix's KV cache.",
        ("adapters/rollout/sampling.py:generate_tokens",),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "PeftTrainer averages per-micro-batch means (optax.MultiSteps), restores on construction, checkpoints "
        "on a timer and does not save the data position; the step and the loop are torchlike's.",
        ("adapters/training/train_step.py:make_train_step", "torchlike/training/trainer.py:Trainer"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "A decoder's remat_config is fixed when the model is built, and nnx.remat inside the sampler's "
        "while_loop fails; DecoderLayer configs and Gemma's block remat_config are switched per traced train "
        "step.",
        ("adapters/training/train_step.py:rematerialised",),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "GRPO and DPO losses differ from TRL's (advantage epsilon, log-ratio clipping, missing loss types and "
        "normalisations, cDPO label smoothing); only Tunix's common ops are used.",
        ("adapters/losses/grpo.py:grpo_advantages", "adapters/losses/grpo.py:grpo_loss",
         "adapters/losses/dpo.py:dpo_loss"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "The models read the mesh from pxla.thread_resources (the `with mesh:` context), which jax.set_mesh "
        "does not set.",
        ("adapters/distributed/mesh.py:entered",),
    ),
    Workaround(
        "qwix", "<=0.1.8",
        "LoRA dropout is on in every pass, the adapter cannot be bypassed and adapted layers always run as "
        "three matmuls; a provider subclass overrides the private rule lookup and op hooks and reads "
        "qwix._src.utils.flax_util.",
        ("adapters/lora/runtime.py:ModeAwareLoraProvider",),
    ),
    Workaround(
        "jax", ">=0.10.2,<0.13",
        "jax.make_mesh defaults to Explicit axis types, which break the Tunix models' embedding gather, and "
        "deprecates the `with mesh:` context Tunix needs; meshes get Auto axes and the warning is silenced.",
        ("adapters/distributed/mesh.py:make_mesh", "adapters/distributed/mesh.py:entered"),
    ),
    Workaround(
        "jax", ">=0.10.2,<0.13",
        "The persistent compilation cache (jax._src.lru_cache.LRUCache.put) writes an entry in place with no lock "
        "unless eviction is on, so a process reading an entry another process is writing loads a truncated "
        "executable and crashes; torchlike writes each entry to a temporary file and renames it into place.",
        ("adapters/runtime/compilation.py:atomic_cache_writes",),
    ),
    Workaround(
        "jaxlib", ">=0.10.2,<0.13",
        "XLA:CPU segfaults now and then while compiling (jax's backend_compile_and_load) in a process that has "
        "compiled hundreds of programs: a core dump of one such crash shows the fault inside libgcc_s's unwinder "
        "(near _Unwind_Backtrace), called from libjax_common.so, with a corrupt chain of return addresses above it. "
        "XLA's CpuCompiler::RunBackend calls RecordCpuCompilerStacktrace (glibc backtrace, which runs that "
        "unwinder) on every compile, with no flag to turn it off. Calling backtrace 20 times before every compile "
        "of 178 tests (5 files the crash had hit) never crashed: the stack it walks is sound at rest. "
        "Seen on 0.10.2, about once per cold run of the suite, a different test each time, never when the test "
        "reran. The suite prints the crashed worker's stacks and reruns its test once on a replacement worker.",
        ("tests/helpers/crash_report.py:pytest_handlecrashitem",),
    ),
    Workaround(
        "jaxlib", ">=0.10.2,<0.13",
        "Two jax.distributed CPU processes (gloo) hung for good, both idle on a futex, one inside an XLA:CPU "
        "compile (a device_put building a GRPO trainer), in about one of six cold suite runs and in none of 11 "
        "runs of the same job alone or beside one other test file. The two-process test stops a job that runs "
        "past 600 s (about 90 s normally), reports every thread's Python and native (gdb) stacks, and starts it "
        "once more.",
        ("tests/test_mesh.py:two_processes",),
    ),
    Workaround(
        "jax", ">=0.10.2,<0.13",
        "A tracer's AttributeError message walks every equation traced so far (its origin); the private "
        "Tracer._origin_msg is blanked while torchlike traces.",
        ("adapters/runtime/tracing.py:fast_tracing",),
    ),
    Workaround(
        "jax", ">=0.10.2,<0.13",
        "No public way to ask whether the distributed runtime or a backend has started; jax._src.distributed "
        "and jax._src.xla_bridge are read.",
        ("adapters/distributed/mesh.py:initialize_distributed", "adapters/runtime/host_memory.py:cpu_only_reason"),
    ),
    Workaround(
        "jaxlib", ">=0.10.2,<0.13",
        "XLA:CPU's default concurrency-optimised scheduler hoists the recomputed forward of many decoder layers "
        "ahead of their backward passes, so rematerialisation saves almost no memory; torchlike turns it off "
        "through XLA_FLAGS, which aborts the process when XLA does not know the flag (checked on these versions).",
        ("adapters/runtime/xla_cpu.py:prefer_memory_scheduler", "adapters/runtime/xla_cpu.py:JAXLIB_VERSIONS"),
    ),
    Workaround(
        "flax", "==0.12.*",
        "Building a model probes value.sharding with getattr on tracers, so each probe pays the tracer "
        "AttributeError message above: O(N^2) in the number of layers under eval_shape.",
        ("adapters/runtime/tracing.py:fast_tracing", "adapters/model/tunix_model.py:build_abstract_model"),
    ),
    Workaround(
        "google-tunix", "<=0.1.7",
        "Gemma3's vision encoder cuts its output from the gradient (apply_stop_gradient), so full fine-tuning "
        "would never train the vision tower as transformers does, and its get_model_input (the call Qwix traces "
        "to apply LoRA) hard-codes 896 x 896 images whatever the config's size; the stop is lifted after building "
        "and the dummy images take the config's size.",
        ("adapters/families/gemma3_multimodal.py:build_model", "adapters/lora/runtime.py:model_input"),
    ),
    Workaround(
        "transformers", ">=5.12,<5.25",
        "TensorBoardCallback reads only $TENSORBOARD_LOGGING_DIR, not TrainingArguments.logging_dir; the "
        "callback is pointed at logging_dir.",
        ("torchlike/training/callbacks.py:point_tensorboard_at",),
    ),
    Workaround(
        "transformers", ">=5.12,<5.25",
        "NemotronH's (and Zamba2's) torch Mamba-2 path sums the chunk-to-chunk decays over the wrong axis (Mamba2's "
        "transposes them first), so its chunked outputs and final state are wrong wherever a state crosses a chunk "
        "boundary; the Mamba-2 mixer computes the recurrence exactly and its tests take transformers' cached step "
        "as the reference across chunks.",
        ("tests/test_nemotron_h.py:their_steps",),
    ),
)
