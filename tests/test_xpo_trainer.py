"""torchlike.trl.experimental.xpo: TRL 1.0.0's XPO trainer step for step against the real
``trl.experimental.xpo.XPOTrainer`` (TRL 1.0.0, run in a child process: TRL 1.16 no longer ships it) on the same
scripted completions and judge, and TRL 1.0.0's config fields and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

import torchlike
from tests import tiny
from tests.helpers.legacy_trl import LongerCompletionJudge, require_legacy_trl, run_legacy_trl, scripted_completion
from tests.helpers.logs import assert_online_preference_run_matches, logged
from torchlike.trl.experimental.xpo import XPOConfig, XPOTrainer
from torchlike.trl.experimental.xpo.xpo_trainer import XPO

MAX_NEW_TOKENS = 6
#: Every metric TRL 1.0.0's XPOTrainer logs with a judge, beside loss, grad_norm and learning_rate.
METRICS = ("loss/dpo", "loss/xpo", "objective/kl", "objective/entropy", "rewards/chosen", "rewards/rejected",
           "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/model_contain_eos_token",
           "val/ref_contain_eos_token", "alpha", "beta")
SETTINGS = dict(per_device_train_batch_size=4, max_new_tokens=MAX_NEW_TOKENS, max_steps=3, learning_rate=1e-2,
                weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False,
                report_to="none", save_strategy="no", train_sampling_strategy="sequential", beta=0.2, alpha=0.05)
"""Both trainers' settings: a decaying learning rate, weight decay, clipping, an Adam epsilon above float noise, the
prompts in dataset order, float32, and an ``alpha`` large enough to move the gradient."""

#: TRL 1.0.0's side: trains on the scripted completions (the policy's copy 0, the reference's copy 1) and writes its
#: log history and final weights.
TRL_SCRIPT = """
import json, sys
import numpy as np, torch, datasets, transformers
from trl.experimental.xpo import XPOConfig, XPOTrainer
from tests.helpers.legacy_trl import LongerCompletionJudge, scripted_generate

arguments = json.loads(sys.argv[1])
tokenizer = transformers.AutoTokenizer.from_pretrained(arguments["tokenizer"])

trainer = XPOTrainer(
    model=transformers.AutoModelForCausalLM.from_pretrained(arguments["model"], dtype=torch.float32),
    judge=LongerCompletionJudge(),
    args=XPOConfig(output_dir=arguments["output_dir"], use_cpu=True, **arguments["settings"]),
    train_dataset=datasets.Dataset.from_dict({"prompt": arguments["prompts"]}), processing_class=tokenizer)
trainer.model.generate = scripted_generate(tokenizer, 0, arguments["script"])
trainer.ref_model.generate = scripted_generate(tokenizer, 1, arguments["script"])
trainer.train()
json.dump(trainer.state.log_history, open(arguments["output_dir"] + "/log_history.json", "w"))
np.savez(arguments["output_dir"] + "/weights.npz",
         **{name: value.detach().numpy() for name, value in trainer.model.state_dict().items()})
"""


def script_arguments() -> tuple[int, int, int]:
    return MAX_NEW_TOKENS, tiny.VOCAB, tiny.EOS


@pytest.fixture(scope="module")
def trl_run(tiny_checkpoints, pad_tokenizer_dir, tmp_path_factory):
    """TRL 1.0.0's log history and final weights on :data:`SETTINGS`."""
    require_legacy_trl()
    output_dir = tmp_path_factory.mktemp("trl_xpo")
    run_legacy_trl(TRL_SCRIPT, {"model": str(tiny_checkpoints.path("qwen2")), "tokenizer": str(pad_tokenizer_dir),
                                "output_dir": str(output_dir), "settings": SETTINGS, "prompts": tiny.PROMPTS,
                                "script": script_arguments()})
    history = json.loads((output_dir / "log_history.json").read_text())
    with np.load(output_dir / "weights.npz") as weights:
        return history, dict(weights)


def run_torchlike(path, tokenizer_path, output_dir, settings) -> tuple[list[dict], dict]:
    """torchlike's log history and final parameters as exported, on the same scripted completions."""
    from safetensors.numpy import load_file

    trainer = XPOTrainer(model=str(path), judge=LongerCompletionJudge(),
                         args=XPOConfig(output_dir=str(output_dir), **settings),
                         train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))

    def scripted_turn(prompt_ids, seed, worker=None):
        copy = int(worker is not None and worker is trainer.algorithm.reference_worker)
        return [scripted_completion(ids, copy, *script_arguments()) for ids in prompt_ids], None

    trainer._generate_single_turn = scripted_turn
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


# --- step for step against trl.experimental.xpo.XPOTrainer (TRL 1.0.0) ----------------------------------------------

def test_losses_metrics_and_weights_match_trl_1_0_step_for_step(trl_run, tiny_checkpoints, pad_tokenizer_dir,
                                                                 tmp_path):
    expected_history, expected_params = trl_run
    history, params = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path, SETTINGS)
    assert_online_preference_run_matches(history, expected_history, params, expected_params, METRICS)


def test_ignoring_alpha_fails_the_comparison(trl_run, tiny_checkpoints, pad_tokenizer_dir, tmp_path, monkeypatch):
    """The comparison above is sharp: a trainer that ignores ``alpha`` (always TRL's default 1e-5) is caught."""
    expected_history, _ = trl_run
    monkeypatch.setattr(XPO, "alpha_of", lambda self, epoch: 1e-5)
    history, _ = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path,
                               {**SETTINGS, "max_steps": 2})
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(logged(history, "grad_norm"), logged(expected_history, "grad_norm")[:2],
                                   rtol=1e-4)


def greedy_completions(model: transformers.PreTrainedModel, prompts: list[list[int]], eos_token_ids: list[int],
                       pad_token_id: int) -> list[list[int]]:
    """``model``'s greedy completion of each prompt (token ids, unpadded), cut after its first end token."""
    import torch

    completions = []
    for ids in prompts:
        with torch.no_grad():
            output = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos_token_ids,
                                    pad_token_id=pad_token_id)
        completion = output[0, len(ids):].tolist()
        ends = [index for index, token in enumerate(completion) if token in eos_token_ids]
        completions.append(completion[:ends[0] + 1] if ends else completion)
    return completions


def test_the_reference_model_samples_the_reference_completions(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    """TRL 1.0.0 samples one completion of each prompt with ``model.generate`` and one with ``ref_model.generate``:
    with top_k=1 sampling is greedy, so a reference whose weights differ from the policy's gives its own greedy
    completions, and the policy its own."""
    reference_model, ref_model = tiny.wandering_model("qwen2", tmp_path / "reference")  # other weights, completions
    trainer = XPOTrainer(model=str(tiny_checkpoints.path("qwen2")), ref_model=ref_model,
                         judge=LongerCompletionJudge(),
                         args=XPOConfig(output_dir=str(tmp_path / "out"), **{**SETTINGS, "max_steps": 1}, top_k=1),
                         train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                         processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
    sampled = {}
    generate = trainer._generate

    def recording(rows, seed, worker=None):
        record = generate(rows, seed, worker=worker)
        reference = worker is not None and worker is trainer.algorithm.reference_worker
        sampled["reference" if reference else "policy"] = record
        return record

    trainer._generate = recording
    trainer.train()

    prompts = [ids[mask.astype(bool)].tolist() for ids, mask in zip(sampled["reference"].prompt_ids,
                                                                       sampled["reference"].prompt_mask, strict=True)]
    ends = (trainer.eos_token_ids, trainer.pad_token_id)
    policy_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    expected_reference = greedy_completions(reference_model, prompts, *ends)
    expected_policy = greedy_completions(policy_model, prompts, *ends)
    assert all(ours != theirs for ours, theirs in zip(expected_reference, expected_policy, strict=True))
    assert sampled["reference"].completion_ids == expected_reference
    assert sampled["policy"].completion_ids == expected_policy


# --- TRL 1.0.0's config and errors ----------------------------------------------------------------------------------

FIELDS_SCRIPT = """
import dataclasses, json, sys
from trl.experimental.xpo import XPOConfig
arguments = json.loads(sys.argv[1])
config = XPOConfig(output_dir=arguments["output_dir"], use_cpu=True)
values = {name: repr(getattr(config, name)) for name in ("alpha", "beta", "loss_type", "max_new_tokens", "judge",
                                                         "use_transformers_paged", "learning_rate")}
json.dump({"fields": [item.name for item in dataclasses.fields(XPOConfig)], "values": values},
          open(arguments["output_dir"] + "/fields.json", "w"))
"""


def test_every_trl_1_0_xpo_config_field_exists_with_its_default(tmp_path):
    run_legacy_trl(FIELDS_SCRIPT, {"output_dir": str(tmp_path)})
    theirs = json.loads((tmp_path / "fields.json").read_text())
    ours = XPOConfig(output_dir=str(tmp_path))
    assert set(theirs["fields"]) <= {item.name for item in __import__("dataclasses").fields(XPOConfig)}
    assert {name: repr(getattr(ours, name)) for name in theirs["values"]} == theirs["values"]


@pytest.mark.parametrize("alpha", [[0.3], [0.1, 0.2], 0.5])
def test_a_one_element_alpha_list_becomes_its_value(tmp_path, alpha):
    assert XPOConfig(output_dir=str(tmp_path), alpha=alpha).alpha == (alpha[0] if alpha == [0.3] else alpha)


def test_neither_judge_nor_reward_funcs_is_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="One of `judge` or `reward_funcs` must be provided."):
        XPOTrainer(model=str(tiny_checkpoints.path("qwen2")), args=XPOConfig(output_dir=str(tmp_path)),
                   train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                   processing_class=transformers.AutoTokenizer.from_pretrained(pad_tokenizer_dir))


def test_more_than_one_reward_function_is_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="XPOTrainer only supports one reward function/model."):
        XPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=[reward, reward],
                   args=XPOConfig(output_dir=str(tmp_path)),
                   train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                   processing_class=transformers.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
