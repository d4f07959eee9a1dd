"""DistillationTrainer: TRL 1.16's generalized JSD, TRL's numbers step for step on the same completions, on-policy
sampling from the student, the teacher's checks, and DistillationConfig's TRL defaults and checks."""

from __future__ import annotations

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl
from flax import nnx

import torchlike
from tests import tiny
from tests.helpers.config_fields import quiet
from tests.helpers.models import with_config
from tests.helpers.tokenizers import tokenizer_for
from tests.tiny import COMPLETION_LENGTH, EOS, PROMPTS
from torchlike.adapters.losses import distillation as distillation_loss
from torchlike.adapters.model import nnx_state
from torchlike.adapters.rollout import PagedEngine
from torchlike.field_support import check_unsupported
from torchlike.testing import tiny_config
from torchlike.trl import DistillationConfig, DistillationTrainer

# --- (a) the generalized JSD against TRL's loss function ------------------------------------------------------------

def trl_divergence_loss(student_logits, teacher_logits, mask, beta, temperature, num_items_in_batch):
    """TRL's ``_chunked_divergence_loss`` on given logits: identity output heads (``H = V``) make the hidden states
    the logits. Returns the loss, entropy sum, valid count and the loss's gradient with respect to the student's
    logits."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    student = torch.tensor(student_logits, requires_grad=True)
    head = torch.eye(student_logits.shape[-1])
    loss, entropy, count = _chunked_divergence_loss(student, torch.tensor(teacher_logits), head, head,
                                                    torch.tensor(mask), beta, num_items_in_batch=num_items_in_batch,
                                                    temperature=temperature)
    loss.backward()
    return loss.item(), entropy.item(), count.item(), student.grad.numpy()


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("num_items_in_batch", [None, 17])
def test_generalized_jsd_loss_equals_trls_on_the_same_logits(beta, temperature, num_items_in_batch):
    rng = np.random.default_rng([int(beta * 100), int(temperature * 10)])
    student = (3 * rng.normal(size=(3, 6, 41))).astype(np.float32)
    teacher = (3 * rng.normal(size=(3, 6, 41))).astype(np.float32)
    mask = (rng.random((3, 6)) > 0.3).astype(np.int64)
    mask[2] = 0  # a row without completion tokens
    expected_loss, expected_entropy, expected_count, expected_grad = trl_divergence_loss(
        student, teacher, mask, beta, temperature, num_items_in_batch)

    def loss(logits):
        return distillation_loss.generalized_jsd_loss(logits, jnp.asarray(teacher), jnp.asarray(mask), beta,
                                                      temperature, num_items_in_batch)

    value, entropy, count = loss(jnp.asarray(student))
    grad = jax.grad(lambda logits: loss(logits)[0])(jnp.asarray(student))
    np.testing.assert_allclose(float(value), expected_loss, rtol=1e-6)
    np.testing.assert_allclose(float(entropy), expected_entropy, rtol=1e-6)
    assert float(count) == expected_count
    # TRL's gradient is its closed form, ours autodiff of the divergence: both float32, equal to float noise.
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-4 * np.abs(expected_grad).max())


def test_beta_selects_forward_kl_reverse_kl_and_the_symmetric_jsd():
    rng = np.random.default_rng(0)
    student, teacher = jnp.asarray(rng.normal(size=(2, 9))), jnp.asarray(rng.normal(size=(2, 9)))
    ps, pt = jax.nn.softmax(student), jax.nn.softmax(teacher)

    def kl(p, q):
        return (p * (jnp.log(p) - jnp.log(q))).sum(-1)

    m = (ps + pt) / 2
    for beta, expected in ((0.0, kl(pt, ps)), (1.0, kl(ps, pt)), (0.5, (kl(pt, m) + kl(ps, m)) / 2)):
        np.testing.assert_allclose(distillation_loss.generalized_jsd(student, teacher, beta).divergence, expected,
                                   rtol=1e-5)


def test_the_blockwise_divergence_equals_the_whole_sequence_one():
    rng = np.random.default_rng(1)
    student_hidden = jnp.asarray(rng.normal(size=(2, 11, 8)), jnp.float32)
    teacher_hidden = jnp.asarray(rng.normal(size=(2, 11, 12)), jnp.float32)  # a wider teacher
    student_head = jnp.asarray(rng.normal(size=(8, 30)), jnp.float32)
    teacher_head = jnp.asarray(rng.normal(size=(12, 30)), jnp.float32)

    def total(hidden, block_size):
        values = distillation_loss.blockwise_divergences(hidden, teacher_hidden, lambda h: h @ student_head,
                                                         lambda h: h @ teacher_head, 0.3, 0.9, block_size)
        return values.divergence.sum(), values

    (whole, whole_values), whole_grad = jax.value_and_grad(total, has_aux=True)(student_hidden, None)
    (blocks, block_values), block_grad = jax.value_and_grad(total, has_aux=True)(student_hidden, 4)
    np.testing.assert_allclose(block_values.divergence, whole_values.divergence, rtol=1e-6)
    np.testing.assert_allclose(block_values.entropy, whole_values.entropy, rtol=1e-6)
    np.testing.assert_allclose(block_grad, whole_grad, rtol=1e-5, atol=1e-7)


# --- (b) step for step against trl.DistillationTrainer --------------------------------------------------------------

def scripted_completions(prompt_ids, *args, **kwargs):
    """The completion each trainer trains on, in place of sampling (TRL's ``_generate_single_turn``; torchlike's also
    returns the sampler's log-probs): fixed per prompt, of varying length, some ending with EOS, some cut at
    ``max_completion_length``."""
    completions = []
    for ids in prompt_ids:
        rng = np.random.default_rng(zlib.crc32(bytes(np.asarray(ids, np.uint8))))
        length = int(rng.integers(2, COMPLETION_LENGTH + 1))
        completion = rng.integers(3, tiny.VOCAB, size=length).tolist()
        if rng.random() < 0.5 and length < COMPLETION_LENGTH:
            completion[-1] = EOS
        completions.append(completion)
    return completions


def comparison_settings(**case) -> dict:
    """Settings both trainers get: gradient accumulation (one generation batch of 8 prompts per step, split in two),
    a warmup, weight decay and clipping (max_grad_norm below every step's norm), prompts in dataset order.

    bf16 off: TRL's bf16 is torch autocast (matmuls in bf16, weights and the rest in float32) while torchlike casts the
    weights to bf16 for the step; both are valid mixed precision, but their roundings differ at bf16 precision, far
    above the tolerance compared here, so the comparison is in float32 on both sides (gradient checkpointing stays on,
    its default). The learning rate is large enough that each step moves the weights clearly, and Adam's epsilon lies
    above float noise, so entries whose gradient is ~0 do not take lr-sized steps of either sign.
    """
    values = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_completion_length=COMPLETION_LENGTH, max_steps=10, learning_rate=1e-2, warmup_steps=2,
                  weight_decay=0.1, max_grad_norm=0.02, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False,
                  shuffle_dataset=False, report_to="none", save_strategy="no")
    return {**values, **case}


def scripted_turn(prompt_ids, seed):
    """:func:`scripted_completions` as torchlike's ``_generate_single_turn`` returns them: with no log-probs."""
    return scripted_completions(prompt_ids), None


def recording(sample, sampled: list):
    """``sample`` (a trainer's own ``_generate_single_turn``), appending each batch of completions it returns to
    ``sampled`` (torchlike's returns them with their log-probs)."""

    def record(prompt_ids, *args, **kwargs):
        result = sample(prompt_ids, *args, **kwargs)
        sampled.append(result[0] if isinstance(result, tuple) else result)
        return result

    return record


def run_trl_distillation(student, teacher, tokenizer_path, output_dir, settings, monkeypatch, sampled=None):
    """``trl.DistillationTrainer`` training on the scripted completions, or, given a ``sampled`` list, on its own
    samples (recorded there): its log history and final parameters as saved (HF names)."""
    import datasets
    import transformers
    import trl.trainer.distillation_trainer as trl_distillation

    # TRL shuffles each generation batch before splitting it into micro-batches; the loss and gradient are sums over
    # the whole batch either way, but the logged entropy is a mean of micro-batch means, so both keep the order.
    monkeypatch.setattr(trl_distillation, "shuffle_sequence_dict", lambda batch: batch)
    trainer = trl.DistillationTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=str(teacher),
        args=trl.DistillationConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._generate_single_turn = (scripted_completions if sampled is None
                                     else recording(trainer._generate_single_turn, sampled))
    trainer.train()
    return trainer.state.log_history, tiny.saved_hf_params(trainer.model, output_dir / "model")


def run_torchlike_distillation(student, teacher, tokenizer_path, output_dir, settings, sampled=None):
    """torchlike's DistillationTrainer as :func:`run_trl_distillation`: log history and exported parameters."""
    from safetensors.numpy import load_file

    trainer = DistillationTrainer(model=str(student), teacher_model=str(teacher),
                                  args=DistillationConfig(output_dir=str(output_dir), **settings),
                                  train_dataset=[{"prompt": prompt} for prompt in PROMPTS],
                                  processing_class=tokenizer_for(tokenizer_path))
    trainer._generate_single_turn = (scripted_turn if sampled is None
                                     else recording(trainer._generate_single_turn, sampled))
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


#: Each case: its settings over comparison_settings; ``student`` (default Qwen2) and ``student_config`` (changes to
#: its config) choose the student.
COMPARISON_CASES = {
    "beta 0 (forward KL)": dict(beta=0.0),
    "beta 0.5, temperature 0.7": dict(beta=0.5, temperature=0.7),
    "beta 1 (reverse KL)": dict(beta=1.0),
    # TRL's loss reads the student's backbone hidden states: it never adds a mixture-of-experts student's router loss,
    # even when the student's config asks for it (output_router_logits), and neither does torchlike.
    "beta 0.5, a Qwen3-MoE student asking for its router loss, which TRL does not add": dict(
        beta=0.5, max_steps=4, student="qwen3_moe",
        student_config=dict(output_router_logits=True, router_aux_loss_coef=0.5)),
}
COMPARED_METRICS = ("loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "completions/mean_length",
                    "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                    "completions/mean_terminated_length", "completions/min_terminated_length",
                    "completions/max_terminated_length")


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_losses_metrics_and_weights_match_trl_step_for_step(tiny_checkpoints, tokenizer_dir, tmp_path, monkeypatch,
                                                            case):
    """The student (Qwen2 unless the case says) learns from a teacher of another family (Llama 3) with the same
    vocabulary."""
    options = dict(COMPARISON_CASES[case])
    student, teacher = tiny_checkpoints.path(options.pop("student", "qwen2")), tiny_checkpoints.path("llama3")
    if "student_config" in options:
        student = with_config(student, tmp_path / "student", **options.pop("student_config"))
    settings = comparison_settings(**options)
    expected_history, expected_params = run_trl_distillation(student, teacher, tokenizer_dir, tmp_path / "trl",
                                                             settings, monkeypatch)
    history, params = run_torchlike_distillation(student, teacher, tokenizer_dir, tmp_path / "ours", settings)
    expected = {entry["step"]: entry for entry in expected_history if "loss" in entry}
    ours = {entry["step"]: entry for entry in history if "loss" in entry}

    assert list(ours) == list(expected) == list(range(1, settings["max_steps"] + 1))
    assert all(set(ours[step]) == set(expected[step]) - {"step_time"} for step in ours)  # TRL's metrics, but timing
    assert all(entry["grad_norm"] > settings["max_grad_norm"] for entry in expected.values())  # clipping is on
    for key in COMPARED_METRICS:
        np.testing.assert_allclose([ours[step][key] for step in ours], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-7, err_msg=key)
    assert set(params) == set(expected_params)
    # atol for entries near 0 (the float noise of a run is ~1e-6 there); weight decay alone moves entries by ~1e-3.
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)


# --- (c) on-policy training -----------------------------------------------------------------------------------------

def test_on_policy_training_samples_from_the_student_and_moves_only_the_student(tiny_checkpoints, tokenizer_dir,
                                                                                tmp_path):
    student = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    teacher = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("llama3"))
    student_before = {key: np.asarray(value) for key, value in student.state_dict().items()}
    teacher_before = {key: np.asarray(value) for key, value in teacher.state_dict().items()}
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher,
        args=DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=6,
                                max_steps=3, learning_rate=1e-2, temperature=0.9, top_k=20, beta=0.5, logging_steps=1,
                                report_to="none", save_strategy="no"),
        train_dataset=[{"prompt": prompt} for prompt in PROMPTS], processing_class=tokenizer_for(tokenizer_dir))
    sampled = []
    trainer._generate_single_turn = recording(trainer._generate_single_turn, sampled)
    trainer.train()

    assert isinstance(trainer.rollout_engine, PagedEngine)  # the CPU's default engine (DistillationConfig has none)
    assert len(sampled) == 3 and all(len(batch) == 4 for batch in sampled)  # one generation batch per step
    assert all(1 <= len(ids) <= 6 for batch in sampled for ids in batch)
    assert all(EOS not in ids[:-1] for batch in sampled for ids in batch)  # cut after the first end token
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and np.all(np.isfinite(losses)) and all(loss > 0 for loss in losses)
    student_after = student.state_dict()
    assert any(not np.array_equal(np.asarray(student_after[key]), value) for key, value in student_before.items())
    assert all(np.array_equal(np.asarray(value), teacher_before[key]) for key, value in teacher.state_dict().items())
    optimised = nnx_state.flat_variables(trainer.optimizer, nnx.OptState)
    assert optimised and not any("teacher" in name for name in optimised)


def test_on_policy_steps_match_trl_when_sampling_is_deterministic(tiny_checkpoints, tokenizer_dir, tmp_path,
                                                                  monkeypatch):
    """With top_k=1 sampling keeps one candidate (the argmax), so TRL's transformers.generate and torchlike's sampler
    must draw the same completions from the same student, step after step, and the steps then agree."""
    settings = {**comparison_settings(beta=0.5, top_k=1), "max_steps": 4, "max_completion_length": 6}
    student, teacher = tiny_checkpoints.path("qwen2"), tiny_checkpoints.path("llama3")
    theirs, ours = [], []
    expected_history, _ = run_trl_distillation(student, teacher, tokenizer_dir, tmp_path / "trl", settings,
                                               monkeypatch, sampled=theirs)
    history, _ = run_torchlike_distillation(student, teacher, tokenizer_dir, tmp_path / "ours", settings,
                                            sampled=ours)

    assert len(theirs) == 4 and ours == theirs
    for key in ("loss", "grad_norm", "entropy", "completions/mean_length"):
        np.testing.assert_allclose([entry[key] for entry in history if "loss" in entry],
                                   [entry[key] for entry in expected_history if "loss" in entry], rtol=1e-4,
                                   err_msg=key)


def test_evaluation_samples_completions_and_reports_trls_metrics(tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = DistillationTrainer(
        model=str(tiny_checkpoints.path("qwen2")),
        args=DistillationConfig(output_dir=str(tmp_path), teacher_model_name_or_path=str(
            tiny_checkpoints.path("llama3")), per_device_eval_batch_size=4, max_completion_length=5,
            report_to="none"),
        train_dataset=[{"prompt": prompt} for prompt in PROMPTS], eval_dataset=[{"prompt": p} for p in PROMPTS[:6]],
        processing_class=tokenizer_for(tokenizer_dir))
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    assert {"eval_entropy", "eval_num_tokens", "eval_completions/mean_length",
            "eval_completions/clipped_ratio"} <= set(metrics)
    assert 1 <= metrics["eval_completions/mean_length"] <= 5


# --- (d) the teacher -------------------------------------------------------------------------------------------------

def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes(tiny_checkpoints, tokenizer_dir, tmp_path):
    teacher = torchlike.AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=160))
    with pytest.raises(ValueError, match=r"student model has vocab_size 128 but the teacher model has vocab_size 160"):
        DistillationTrainer(model=str(tiny_checkpoints.path("qwen2")), teacher_model=teacher,
                            args=DistillationConfig(output_dir=str(tmp_path)),
                            train_dataset=[{"prompt": "the"}], processing_class=tokenizer_for(tokenizer_dir))


def test_a_missing_teacher_and_init_kwargs_for_a_loaded_teacher_are_refused(tiny_checkpoints, tokenizer_dir,
                                                                            tmp_path):
    common = dict(model=str(tiny_checkpoints.path("qwen2")), train_dataset=[{"prompt": "the"}],
                  processing_class=tokenizer_for(tokenizer_dir))
    with pytest.raises(ValueError, match="A teacher model is required"):
        DistillationTrainer(args=DistillationConfig(output_dir=str(tmp_path)), **common)
    teacher = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("llama3"))
    with pytest.raises(ValueError, match="teacher_model_init_kwargs.*already instantiated"):
        DistillationTrainer(teacher_model=teacher, args=DistillationConfig(
            output_dir=str(tmp_path), teacher_model_init_kwargs={"dtype": "bfloat16"}), **common)


def test_a_teacher_path_is_loaded_with_teacher_model_init_kwargs(tiny_checkpoints, tokenizer_dir, tmp_path):
    trainer = DistillationTrainer(
        model=str(tiny_checkpoints.path("qwen2")), teacher_model=str(tiny_checkpoints.path("llama3")),
        args=DistillationConfig(output_dir=str(tmp_path), teacher_model_init_kwargs={"dtype": "bfloat16"}),
        train_dataset=[{"prompt": "the"}], processing_class=tokenizer_for(tokenizer_dir))
    assert trainer.teacher_model.config.model_type == "llama"
    assert {value.dtype for value in trainer.teacher_model.state_dict().values()} == {jnp.dtype(jnp.bfloat16)}
    assert trainer.teacher_model.mesh is trainer.mesh


# --- (e) DistillationConfig (its field walk: test_config_parity.py) ------------------------------------------------

def test_trl_default_changes_and_beta_range_are_trls():
    config = DistillationConfig()
    assert (config.learning_rate, config.logging_steps, config.gradient_checkpointing, config.bf16,
            config.remove_unused_columns, config.beta) == (1e-6, 10, True, True, False, 1.0)
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\], got 1.5"):
        DistillationConfig(beta=1.5)


def test_vllm_server_fields_are_honoured_and_structured_outputs_are_refused():
    config = quiet(DistillationConfig, output_dir="out", use_vllm=True, vllm_mode="server")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_unsupported(config)
    assert [str(w.message) for w in caught] == []
    with pytest.raises(ValueError, match="vllm_structured_outputs_regex"):
        check_unsupported(quiet(DistillationConfig, output_dir="out", vllm_structured_outputs_regex="[a-z]+"))
