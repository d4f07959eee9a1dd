"""torchlike.trl.experimental.nash_md: TRL 1.0.0's Nash-MD trainer step for step against the real
``trl.experimental.nash_md.NashMDTrainer`` (TRL 1.0.0, run in a child process: TRL 1.16 no longer ships it) on the same
scripted completions and judge; sampling from the policy/reference geometric mixture on the rollout engines; TRL
1.0.0's config fields and errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import transformers

import torchlike
from tests import tiny
from tests.helpers.legacy_trl import (
    LongerCompletionScoreJudge,
    require_legacy_trl,
    run_legacy_trl,
    scripted_completion,
)
from tests.helpers.logs import assert_online_preference_run_matches, logged
from torchlike.adapters.rollout import PagedEngine, PagedEngineConfig, RolloutRequest
from torchlike.adapters.rollout.mixture import GeometricMixture
from torchlike.adapters.rollout.sampling_settings import SamplingSettings
from torchlike.trl.experimental.nash_md import NashMDConfig, NashMDTrainer

MAX_NEW_TOKENS = 6
#: Every metric TRL 1.0.0's NashMDTrainer logs with a judge, beside loss, grad_norm and learning_rate.
METRICS = ("loss/kl", "objective/entropy", "loss/score", "rewards/probabilities", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected", "val/model_contain_eos_token",
           "val/ref_contain_eos_token", "beta", "mixture_coef")
SETTINGS = dict(per_device_train_batch_size=4, max_new_tokens=MAX_NEW_TOKENS, max_steps=3, learning_rate=2e-2,
                weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False,
                report_to="none", save_strategy="no", train_sampling_strategy="sequential", beta=0.2,
                mixture_coef=0.3)
"""Both trainers' settings: a decaying learning rate large enough that the policy leaves the reference by step 2 (the
logged KL, a difference of two sums of log-probabilities, is then well above their float noise), weight decay,
clipping, an Adam epsilon above float noise, the prompts in dataset order, float32, and a ``beta`` and a
``mixture_coef`` other than the defaults."""
#: The NashMDConfig fields whose defaults are compared with TRL 1.0.0's.
DEFAULTS = ("mixture_coef", "beta", "loss_type", "max_new_tokens", "judge", "use_transformers_paged", "learning_rate",
            "temperature", "missing_eos_penalty")

#: TRL 1.0.0's side: trains on the scripted completions (the policy's copy 0, the mixture's copy 1) and writes its
#: log history and final weights, then NashMDConfig's fields and the defaults of :data:`DEFAULTS`.
TRL_SCRIPT = """
import dataclasses, json, sys
import numpy as np, torch, datasets, transformers
from trl.experimental.nash_md import NashMDConfig, NashMDTrainer, nash_md_trainer
from tests.helpers.legacy_trl import LongerCompletionScoreJudge, scripted_generate

arguments = json.loads(sys.argv[1])
tokenizer = transformers.AutoTokenizer.from_pretrained(arguments["tokenizer"])

trainer = NashMDTrainer(
    model=transformers.AutoModelForCausalLM.from_pretrained(arguments["model"], dtype=torch.float32),
    judge=LongerCompletionScoreJudge(),
    args=NashMDConfig(output_dir=arguments["output_dir"], use_cpu=True, **arguments["settings"]),
    train_dataset=datasets.Dataset.from_dict({"prompt": arguments["prompts"]}), processing_class=tokenizer)
trainer.model.generate = scripted_generate(tokenizer, 0, arguments["script"])
mixture_generate = scripted_generate(tokenizer, 1, arguments["script"])
nash_md_trainer.GeometricMixtureWrapper.generate = lambda self, **kwargs: mixture_generate(**kwargs)
trainer.train()
json.dump(trainer.state.log_history, open(arguments["output_dir"] + "/log_history.json", "w"))
defaults = NashMDConfig(output_dir=arguments["output_dir"], use_cpu=True)
json.dump({"fields": [item.name for item in dataclasses.fields(NashMDConfig)],
           "values": {name: repr(getattr(defaults, name)) for name in arguments["defaults"]}},
          open(arguments["output_dir"] + "/fields.json", "w"))
np.savez(arguments["output_dir"] + "/weights.npz",
         **{name: value.detach().numpy() for name, value in trainer.model.state_dict().items()})
"""


def script_arguments() -> tuple[int, int, int]:
    return MAX_NEW_TOKENS, tiny.VOCAB, tiny.EOS


@pytest.fixture(scope="module")
def trl_run(tiny_checkpoints, pad_tokenizer_dir, tmp_path_factory):
    """TRL 1.0.0's log history and final weights on :data:`SETTINGS`, and its config's fields and defaults."""
    require_legacy_trl()
    output_dir = tmp_path_factory.mktemp("trl_nash_md")
    run_legacy_trl(TRL_SCRIPT, {"model": str(tiny_checkpoints.path("qwen2")), "tokenizer": str(pad_tokenizer_dir),
                                "output_dir": str(output_dir), "settings": SETTINGS, "prompts": tiny.PROMPTS,
                                "script": script_arguments(), "defaults": DEFAULTS})
    history = json.loads((output_dir / "log_history.json").read_text())
    with np.load(output_dir / "weights.npz") as weights:
        return history, dict(weights), json.loads((output_dir / "fields.json").read_text())


def run_torchlike(path, tokenizer_path, output_dir, settings) -> tuple[list[dict], dict]:
    """torchlike's log history and final parameters as exported, on the same scripted completions."""
    from safetensors.numpy import load_file

    trainer = NashMDTrainer(model=str(path), judge=LongerCompletionScoreJudge(),
                            args=NashMDConfig(output_dir=str(output_dir), **settings),
                            train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))

    def scripted_turn(prompt_ids, seed, worker=None):
        copy = int(isinstance((worker or trainer.rollout_worker).model(), GeometricMixture))
        return [scripted_completion(ids, copy, *script_arguments()) for ids in prompt_ids], None

    trainer._generate_single_turn = scripted_turn
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


# --- step for step against trl.experimental.nash_md.NashMDTrainer (TRL 1.0.0) ---------------------------------------

def test_losses_metrics_and_weights_match_trl_1_0_step_for_step(trl_run, tiny_checkpoints, pad_tokenizer_dir,
                                                                 tmp_path):
    expected_history, expected_params, _ = trl_run
    history, params = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path, SETTINGS)
    assert_online_preference_run_matches(history, expected_history, params, expected_params, METRICS)


def test_ignoring_beta_fails_the_comparison(trl_run, tiny_checkpoints, pad_tokenizer_dir, tmp_path, monkeypatch):
    """The comparison above is sharp: a trainer that ignores ``beta`` (always TRL's default 0.1) is caught by the
    gradient norm once the policy has moved from the reference (step 2)."""
    expected_history, _, _ = trl_run
    monkeypatch.setattr(NashMDTrainer, "_beta_of", lambda self, epoch: 0.1)
    history, _ = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path,
                               {**SETTINGS, "max_steps": 2})
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(logged(history, "grad_norm"), logged(expected_history, "grad_norm")[:2],
                                   rtol=1e-4)


def test_with_a_reward_function_the_probability_is_the_sigmoid_of_the_reward_difference(tiny_checkpoints,
                                                                                         pad_tokenizer_dir, tmp_path):
    """With one reward function, each completion's reward less ``missing_eos_penalty`` without an end token gives
    the probability that the policy's completion wins (the sigmoid of the difference) and ``rewards/chosen`` and
    ``rewards/rejected`` (the policy's and the mixture's means), as TRL 1.0.0's ``_compute_rewards``."""
    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    trainer = NashMDTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                            args=NashMDConfig(output_dir=str(tmp_path),
                                              **{**SETTINGS, "max_steps": 1, "missing_eos_penalty": 2.0}),
                            train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
    sampled = {}

    def scripted_turn(prompt_ids, seed, worker=None):
        copy = int(isinstance((worker or trainer.rollout_worker).model(), GeometricMixture))
        sampled[copy] = [scripted_completion(ids, copy, *script_arguments()) for ids in prompt_ids]
        return sampled[copy], None

    trainer._generate_single_turn = scripted_turn
    trainer.train()
    rewards = [np.array([len(ids) - 2.0 * (tiny.EOS not in ids) for ids in sampled[copy]]) for copy in (0, 1)]
    assert (rewards[0] != rewards[1]).any()
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["rewards/chosen"] == pytest.approx(rewards[0].mean(), rel=1e-6)
    assert log["rewards/rejected"] == pytest.approx(rewards[1].mean(), rel=1e-6)
    assert log["rewards/probabilities"] == pytest.approx((1 / (1 + np.exp(rewards[1] - rewards[0]))).mean(), rel=1e-6)


# --- sampling from the geometric mixture ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wandering_reference(tmp_path_factory):
    """A tiny Qwen2 reference with other weights than the policy (``tiny_checkpoints``' qwen2), same vocabulary."""
    _, model = tiny.wandering_model("qwen2", tmp_path_factory.mktemp("wandering_reference"))
    return model


def mixed_argmax(policy, reference, ids: list[int], mixture_coef: float) -> np.ndarray:
    """``[len(ids)]`` the argmax of ``c * reference + (1 - c) * policy`` logits at each position, from both models'
    full forward passes."""
    # Right-padded to one width (causal: the padding changes no earlier position), so each model compiles once.
    batch, mask = np.zeros((1, 32), np.int32), np.zeros((1, 32), np.int32)
    batch[0, :len(ids)], mask[0, :len(ids)] = ids, 1
    policy_logits = np.asarray(policy(batch, attention_mask=mask).logits, np.float32)[0, :len(ids)]
    reference_logits = np.asarray(reference(batch, attention_mask=mask).logits, np.float32)[0, :len(ids)]
    return (mixture_coef * reference_logits + (1 - mixture_coef) * policy_logits).argmax(-1)


def test_the_trainer_samples_greedily_from_the_mixture_of_policy_and_reference(tiny_checkpoints, pad_tokenizer_dir,
                                                                               wandering_reference, tmp_path):
    """``mixture_coef=0`` samples the policy's greedy completions, 1 the reference's, and 0.4 the argmax of the mixed
    logits at every step, as both models' full forward passes give them."""
    trainer = NashMDTrainer(model=str(tiny_checkpoints.path("qwen2")), ref_model=wandering_reference,
                            judge=LongerCompletionScoreJudge(),
                            args=NashMDConfig(output_dir=str(tmp_path), max_new_tokens=8, report_to="none",
                                              generation_kwargs={"do_sample": False}),
                            train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS[:3]],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
    rows = list(trainer.train_dataset)
    policy_greedy = trainer._generate(rows, seed=0).completion_ids
    sampled = {coef: trainer.algorithm.generate_with_mixture(rows, 0, coef).completion_ids for coef in (0.0, 1.0, 0.4)}
    assert sampled[0.0] == policy_greedy
    assert sampled[1.0] != policy_greedy
    for coef, completions in sampled.items():
        for row, completion in zip(rows, completions, strict=True):
            prompt = list(row["prompt_ids"])
            expected = mixed_argmax(trainer.model, wandering_reference, prompt + completion[:-1], coef)
            assert completion == expected[len(prompt) - 1:].tolist(), coef


def test_a_lora_policy_mixes_with_its_own_base_as_the_reference(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    """With ``peft_config`` the reference is the policy's module with its adapter off: ``mixture_coef=1`` samples the
    base model's greedy completions, 0 the adapted policy's."""
    path = tiny_checkpoints.path("qwen2")
    trainer = NashMDTrainer(model=str(path), judge=LongerCompletionScoreJudge(),
                            args=NashMDConfig(output_dir=str(tmp_path), max_new_tokens=8, report_to="none",
                                              generation_kwargs={"do_sample": False}),
                            train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS[:3]],
                            processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir),
                            peft_config=torchlike.peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj",
                                                                                                   "down_proj"]))
    rng = np.random.default_rng(0)
    trainer.model.load_state_dict({name: rng.normal(0, 2.0, value.shape).astype(np.float32)
                                   for name, value in trainer.model.state_dict().items()
                                   if name.endswith("lora_b")}, strict=False)
    base = torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    rows = list(trainer.train_dataset)
    sampled = {coef: trainer.algorithm.generate_with_mixture(rows, 0, coef).completion_ids for coef in (0.0, 1.0)}
    assert sampled[0.0] != sampled[1.0]
    for coef, completions in sampled.items():
        for row, completion in zip(rows, completions, strict=True):
            prompt = list(row["prompt_ids"])
            expected = mixed_argmax(trainer.model, base, prompt + completion[:-1], coef)
            assert completion == expected[len(prompt) - 1:].tolist(), coef


def test_the_paged_engine_samples_greedily_from_the_mixture(tiny_checkpoints, wandering_reference):
    """The paged engine takes the mixture as it takes one decoder (both models' layers paged side by side)."""
    policy = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    engine = PagedEngine(GeometricMixture(policy.module, wandering_reference.module, 0.4),
                         PagedEngineConfig(max_num_seqs=4, page_size=4, decode_steps=8),
                         eos_token_ids=[tiny.EOS])
    prompts = [[1, 17, 40, 9, 71], [1, 5, 88, 23, 64, 12, 30, 41, 7], [1, 99, 3]]
    outputs = engine.generate([RolloutRequest(prompt, 8) for prompt in prompts], SamplingSettings(do_sample=False))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.token_ids[0].tolist()
        expected = mixed_argmax(policy, wandering_reference, prompt + completion[:-1], 0.4)
        assert completion == expected[len(prompt) - 1:].tolist()


def test_a_reference_with_another_vocabulary_size_is_refused(tiny_checkpoints, tmp_path):
    policy = torchlike.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"), dtype="float32")
    config = tiny.CASES["qwen2"]()
    config.vocab_size += 8
    tiny.build_hf_model(config).save_pretrained(tmp_path / "wider")
    wider = torchlike.AutoModelForCausalLM.from_pretrained(tmp_path / "wider", dtype="float32")
    with pytest.raises(ValueError, match="same vocabulary"):
        GeometricMixture(policy.module, wider.module, 0.5)


# --- TRL 1.0.0's config and errors ----------------------------------------------------------------------------------

def test_every_trl_1_0_nash_md_config_field_exists_with_its_default(trl_run, tmp_path):
    theirs = trl_run[2]
    ours = NashMDConfig(output_dir=str(tmp_path))
    assert set(theirs["fields"]) <= {item.name for item in dataclasses.fields(NashMDConfig)}
    assert {name: repr(getattr(ours, name)) for name in theirs["values"]} == theirs["values"]


@pytest.mark.parametrize("mixture_coef", [[0.3], [0.1, 0.2], 0.5])
def test_a_one_element_mixture_coef_list_becomes_its_value(tmp_path, mixture_coef):
    expected = mixture_coef[0] if mixture_coef == [0.3] else mixture_coef
    assert NashMDConfig(output_dir=str(tmp_path), mixture_coef=mixture_coef).mixture_coef == expected


def test_neither_judge_nor_reward_funcs_is_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="One of `judge` or `reward_funcs` must be provided."):
        NashMDTrainer(model=str(tiny_checkpoints.path("qwen2")), args=NashMDConfig(output_dir=str(tmp_path)),
                      train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                      processing_class=transformers.AutoTokenizer.from_pretrained(pad_tokenizer_dir))


def test_more_than_one_reward_function_is_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="NashMDTrainer only supports one reward function/model."):
        NashMDTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=[reward, reward],
                      args=NashMDConfig(output_dir=str(tmp_path)),
                      train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                      processing_class=transformers.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
