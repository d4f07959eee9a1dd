"""torchlike.trl.experimental.online_dpo: TRL 1.16's Online DPO trainer step for step against the real
``trl.experimental.online_dpo.OnlineDPOTrainer`` on the same scripted completions, TRL's errors and config
behaviour, and a beta list taken per epoch."""

from __future__ import annotations

import importlib
import os
import warnings
import zlib

import datasets
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from tests.helpers.logs import assert_online_preference_run_matches, logged
from tests.helpers.models import hf_classifier
from tests.helpers.scripts import TINY_RUN, WORDS, assert_hf_loadable, write_jsonl
from torchlike import cli
from torchlike.trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_online_dpo = importlib.import_module("trl.experimental.online_dpo")

MAX_NEW_TOKENS = 6
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '</s>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
#: Every metric TRL 1.16's OnlineDPOTrainer logs with reward functions, beside loss, grad_norm and learning_rate.
METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
           "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "rewards/accuracies", "logps/chosen", "logps/rejected", "val/contain_eos_token", "beta")


@pytest.fixture(scope="module")
def pad_tokenizer_dir(tmp_path_factory):
    """The tests' tokenizer with ``<pad>`` as its pad token (TRL would pad with the eos token otherwise) and a chat
    template."""
    path = tiny.build_tokenizer(tmp_path_factory.mktemp("pad_tokenizer"), pad_token="<pad>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE  # for the conversational prompts
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward_model_dir(pad_tokenizer_dir, tmp_path_factory):
    """A tiny random Qwen2 reward model (one label) with the tests' tokenizer, as a path."""
    path = tmp_path_factory.mktemp("reward_model")
    model = hf_classifier("qwen2", num_labels=1, seed=3)
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(pad_tokenizer_dir).save_pretrained(path)
    return path


# --- the same completions on both sides ------------------------------------------------------------------------------

def scripted_completion(prompt_ids, copy: int) -> list[int]:
    """A fixed completion per (prompt, which of its two samples): 2 to MAX_NEW_TOKENS tokens, ending with EOS when
    shorter than the limit (where generation stops), with or without it at the limit."""
    rng = np.random.default_rng([zlib.crc32(bytes(np.asarray(prompt_ids, np.uint8))), copy])
    length = int(rng.integers(2, MAX_NEW_TOKENS + 1))
    completion = rng.integers(3, tiny.VOCAB, size=length).tolist()
    if length < MAX_NEW_TOKENS or rng.random() < 0.5:
        completion[-1] = tiny.EOS
    return completion


def scripted_generate(pad_token_id: int):
    """``model.generate`` as TRL's ``_generate`` calls it (each prompt twice: rows ``i`` and ``i + B``): the prompts
    followed by the scripted completions, padded to the longest as transformers pads finished rows."""

    def generate(input_ids, attention_mask, generation_config, **kwargs):
        half = len(input_ids) // 2
        completions = [scripted_completion(ids[mask.bool()].tolist(), row // half)
                       for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True))]
        tokens = torch.full((len(completions), max(map(len, completions))), pad_token_id, dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return torch.cat([input_ids, tokens], dim=1)

    return generate


def scripted_turn(prompt_ids, seed):
    """torchlike's ``_generate_single_turn`` giving the same completions."""
    half = len(prompt_ids) // 2
    return [scripted_completion(ids, row // half) for row, ids in enumerate(prompt_ids)], None


def token_reward(completion_ids, **kwargs):
    return [float((sum(ids) * 7919) % 13) / 13 for ids in completion_ids]


def text_length_reward(completions, **kwargs):
    """The completion text's length / 10 (a conversational completion is one assistant message)."""
    texts = [completion if isinstance(completion, str) else completion[0]["content"] for completion in completions]
    return [len(text) / 10 for text in texts]


def comparison_settings(**case) -> dict:
    """Both trainers' settings: a decaying learning rate, weight decay, clipping below every step's norm, an Adam
    epsilon above float noise, 16 prompts in dataset order (torch's RandomSampler draws from torch's global
    generator), gradient checkpointing on (TRL's default), float32 (TRL's bf16 is autocast, torchlike's casts the
    weights: equal only to bf16 precision)."""
    return dict(per_device_train_batch_size=4, max_new_tokens=MAX_NEW_TOKENS, max_steps=3, learning_rate=1e-2,
                weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0,
                bf16=False, report_to="none", save_strategy="no", train_sampling_strategy="sequential",
                reward_weights=[1.0, 0.5], **case)


def prompt_rows(conversational: bool) -> list[dict]:
    """:data:`tiny.PROMPTS` as text, or as one user message each."""
    return [{"prompt": [{"role": "user", "content": prompt}] if conversational else prompt} for prompt in tiny.PROMPTS]


def trl_trainer(path, tokenizer_path, output_dir, settings, reward_funcs=(token_reward, text_length_reward),
                conversational=False):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    trainer = trl_online_dpo.OnlineDPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=list(reward_funcs),
        args=trl_online_dpo.OnlineDPOConfig(output_dir=str(output_dir), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(prompt_rows(conversational)), processing_class=tokenizer)
    trainer.model.generate = scripted_generate(tokenizer.pad_token_id)
    return trainer


def torchlike_trainer(path, tokenizer_path, output_dir, settings, reward_funcs=(token_reward, text_length_reward),
                      conversational=False) -> OnlineDPOTrainer:
    trainer = OnlineDPOTrainer(model=str(path), reward_funcs=list(reward_funcs),
                               args=OnlineDPOConfig(output_dir=str(output_dir), **settings),
                               train_dataset=prompt_rows(conversational),
                               processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    trainer._generate_single_turn = scripted_turn
    return trainer


def run_trl(path, tokenizer_path, output_dir, settings, **data):
    """TRL's log history and final parameters (``data``: the reward functions, conversational prompts)."""
    trainer = trl_trainer(path, tokenizer_path, output_dir, settings, **data)
    trainer.train()
    params = {name: value.detach().numpy() for name, value in trainer.model.state_dict().items()}
    return trainer.state.log_history, params


def run_torchlike(path, tokenizer_path, output_dir, settings, **data):
    """torchlike's log history and final parameters as exported."""
    from safetensors.numpy import load_file

    trainer = torchlike_trainer(path, tokenizer_path, output_dir, settings, **data)
    trainer.train()
    trainer.model.save_pretrained(output_dir / "model")
    return trainer.state.log_history, load_file(output_dir / "model" / "model.safetensors")


# --- step for step against trl.experimental.online_dpo.OnlineDPOTrainer ----------------------------------------------

COMPARISON_CASES = {
    "sigmoid, beta 0.2, two weighted rewards, missing-EOS penalty": dict(beta=0.2, missing_eos_penalty=0.3),
    # 2 micro-batches per step (TRL sums their gradients); prompts lose their leftmost tokens to max_length (8 <
    # prompt + completion); a second epoch.
    "ipo, accumulation 2, prompts cut by max_length": dict(loss_type="ipo", beta=0.5, gradient_accumulation_steps=2,
                                                           max_length=8),
    # A reward model (by path, its tokenizer loaded from there) scoring the rendered conversation, beside a function
    # that reads the completions as assistant messages.
    "sigmoid, conversational prompts, a reward model and a reward function": dict(reward_model=True,
                                                                                  conversational=True, beta=0.1),
}


@pytest.mark.parametrize("case", list(COMPARISON_CASES))
def test_losses_metrics_and_weights_match_trl_step_for_step(tiny_checkpoints, pad_tokenizer_dir, reward_model_dir,
                                                            tmp_path, case):
    case = dict(COMPARISON_CASES[case])
    data = {"conversational": case.pop("conversational", False)}
    if case.pop("reward_model", False):
        data["reward_funcs"] = (str(reward_model_dir), text_length_reward)
    settings = comparison_settings(**case)
    path = tiny_checkpoints.path("qwen2")
    expected_history, expected_params = run_trl(path, pad_tokenizer_dir, tmp_path / "trl", settings, **data)
    history, params = run_torchlike(path, pad_tokenizer_dir, tmp_path / "ours", settings, **data)
    assert all(grad_norm > settings["max_grad_norm"] for grad_norm in logged(expected_history, "grad_norm"))  # clips
    assert_online_preference_run_matches(history, expected_history, params, expected_params, METRICS)


def test_ignoring_beta_fails_the_comparison(tiny_checkpoints, pad_tokenizer_dir, tmp_path, monkeypatch):
    """The comparison above is sharp: a trainer that ignores ``beta`` (always TRL's default 0.1) is caught."""
    settings = {**comparison_settings(beta=0.2), "max_steps": 2}
    path = tiny_checkpoints.path("qwen2")
    expected_history, _ = run_trl(path, pad_tokenizer_dir, tmp_path / "trl", settings)
    monkeypatch.setattr(OnlineDPOTrainer, "_beta_of", lambda self, epoch: 0.1)
    history, _ = run_torchlike(path, pad_tokenizer_dir, tmp_path / "ours", settings)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(logged(history, "grad_norm"), logged(expected_history, "grad_norm"), rtol=1e-4)


def test_a_beta_list_gives_each_epoch_its_beta_where_trl_fails_after_the_first_step(tiny_checkpoints,
                                                                                   pad_tokenizer_dir, tmp_path):
    """TRL documents a list as one beta per epoch, but TRL 1.16 indexes it with the fractional ``state.epoch`` and
    raises ``TypeError`` at its second step; torchlike takes the epoch's entry (4 steps per epoch here)."""
    settings = {**comparison_settings(beta=[0.1, 0.3]), "max_steps": 5}
    trainer = trl_trainer(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path / "trl", settings)
    with pytest.raises(TypeError, match="list indices must be integers"):
        trainer.train()
    history, _ = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path / "ours", settings)
    assert logged(history, "beta") == pytest.approx([0.1] * 4 + [0.3])
    assert logged(history, "beta")[0] == pytest.approx(logged(trainer.state.log_history, "beta")[0])


# --- TRL's errors and config ----------------------------------------------------------------------------------------

def trl_error(path, tokenizer_path, tmp_path, error=ValueError, **arguments) -> str:
    values = dict(model=transformers.AutoModelForCausalLM.from_pretrained(path), reward_funcs=token_reward,
                  args=trl_online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                  train_dataset=datasets.Dataset.from_dict({"prompt": tiny.PROMPTS}),
                  processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path))
    with pytest.raises(error) as caught:
        trl_online_dpo.OnlineDPOTrainer(**{**values, **arguments})
    return str(caught.value)


def torchlike_error(path, tokenizer_path, tmp_path, error=ValueError, **arguments) -> str:
    values = dict(model=torchlike.AutoModelForCausalLM.from_pretrained(path), reward_funcs=token_reward,
                  args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none"),
                  train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS],
                  processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path))
    with pytest.raises(error) as caught:
        OnlineDPOTrainer(**{**values, **arguments})
    return str(caught.value)


ERROR_CASES = {
    "no train_dataset": lambda config, model: {"train_dataset": None},
    "the model as ref_model": lambda config, model: {"model": model, "ref_model": model},
    "no reward_funcs": lambda config, model: {"reward_funcs": None},
    "reward processing classes not one per function": lambda config, model: {"reward_processing_classes": [None] * 2},
    "reward_weights not one per function": lambda config, model: {"args": config(reward_weights=[1.0, 2.0])},
    "no processing_class": lambda config, model: {"processing_class": None},
    "model_init_kwargs with a loaded model": lambda config, model: {"args": config(model_init_kwargs={"dtype":
                                                                                                     "float32"})},
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_arguments_are_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path, case):
    path = tiny_checkpoints.path("qwen2")

    def trl_config(**values):
        return trl_online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **values)

    def our_config(**values):
        return OnlineDPOConfig(output_dir=str(tmp_path), report_to="none", **values)

    expected = trl_error(path, pad_tokenizer_dir, tmp_path, **ERROR_CASES[case](
        trl_config, transformers.AutoModelForCausalLM.from_pretrained(path)))
    ours = torchlike_error(path, pad_tokenizer_dir, tmp_path, **ERROR_CASES[case](
        our_config, torchlike.AutoModelForCausalLM.from_pretrained(path)))
    assert ours == expected


def test_an_unknown_loss_type_is_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    """TRL raises at its first step; torchlike at construction, with the same error."""
    settings = {**comparison_settings(loss_type="hinge"), "max_steps": 1}
    trainer = trl_trainer(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path / "trl", settings)
    with pytest.raises(NotImplementedError) as expected:
        trainer.train()
    with pytest.raises(NotImplementedError) as ours:
        torchlike_trainer(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path / "ours", settings)
    assert str(ours.value) == str(expected.value) == "invalid loss type hinge"


def test_max_new_tokens_not_below_max_length_warns_in_trls_words(tmp_path):
    def caught(config_class, **values) -> list[str]:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            config_class(output_dir=str(tmp_path), max_new_tokens=64, max_length=64, **values)
        return [str(record.message) for record in records if "max_new_tokens" in str(record.message)]

    expected = caught(trl_online_dpo.OnlineDPOConfig, use_cpu=True)
    assert len(expected) == 1 and caught(OnlineDPOConfig) == expected


@pytest.mark.parametrize("beta", [[0.3], [0.1, 0.2], 0.5])
def test_a_one_element_beta_list_becomes_its_value_as_in_trl(tmp_path, beta):
    expected = trl_online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=beta).beta
    assert OnlineDPOConfig(output_dir=str(tmp_path), beta=beta).beta == expected


def test_online_dpo_defaults_are_trls(tmp_path):
    theirs = trl_online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True)
    ours = OnlineDPOConfig(output_dir=str(tmp_path))
    for name in ("beta", "loss_type", "max_new_tokens", "max_length", "temperature", "top_k", "learning_rate",
                 "remove_unused_columns", "logging_steps", "gradient_checkpointing", "bf16", "disable_dropout"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_vllm_server_mode_is_honoured_as_in_grpo(tmp_path):
    from torchlike.field_support import check_unsupported, field_table
    from torchlike.trl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unsupported(OnlineDPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server"))
    assert field_table(OnlineDPOConfig)["vllm_mode"] is field_table(GRPOConfig)["vllm_mode"]


def test_the_constructor_takes_trls_arguments_in_trls_order():
    import inspect

    theirs = list(inspect.signature(trl_online_dpo.OnlineDPOTrainer.__init__).parameters)
    ours = list(inspect.signature(OnlineDPOTrainer.__init__).parameters)
    assert ours[:len(theirs)] == theirs and ours[len(theirs):] == ["quantization_config"]


# --- the command line, sampling for real ----------------------------------------------------------------------------

def test_torchlike_online_dpo_command_samples_ranks_trains_and_saves(script_model, tmp_path, capsys):
    """``torchlike online_dpo`` with a reward function by import path: the policy's own samples (at most
    max_new_tokens each) are ranked and trained on, every step logs TRL's metrics, the model is saved."""
    dataset_dir = write_jsonl(tmp_path / "data" / "train.jsonl",
                              [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(8)]).parent
    assert cli.main(["online_dpo", "--model_name_or_path", str(script_model), "--dataset_name", str(dataset_dir),
                     "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "2",
                     "--max_new_tokens", "4", "--learning_rate", "1e-3", "--reward_funcs",
                     "tests.script_rewards.completion_length_reward", *TINY_RUN]) == 0
    out = capsys.readouterr().out
    assert "Training completed" in out and out.count("'objective/scores_margin'") == 2
    assert_hf_loadable(tmp_path / "out")


@pytest.mark.parametrize("trainer_class", ["OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer"])
def test_an_eval_dataset_is_kept_as_trl_keeps_it_and_evaluating_is_refused(tiny_checkpoints, pad_tokenizer_dir,
                                                                            tmp_path, trainer_class):
    package = {"OnlineDPOTrainer": "online_dpo", "XPOTrainer": "xpo", "NashMDTrainer": "nash_md"}[trainer_class]
    module = importlib.import_module(f"torchlike.trl.experimental.{package}")
    config_class = getattr(module, trainer_class.replace("Trainer", "Config"))
    held_out = [{"prompt": prompt} for prompt in tiny.PROMPTS[:2]]
    arguments = dict(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=token_reward,
                     train_dataset=[{"prompt": prompt} for prompt in tiny.PROMPTS], eval_dataset=held_out,
                     processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
    trainer = getattr(module, trainer_class)(args=config_class(output_dir=str(tmp_path), report_to="none"),
                                             **arguments)
    assert trainer.eval_dataset is held_out
    with pytest.raises(ValueError, match=f"{trainer_class}.evaluate\\(\\): TRL's OnlineDPOTrainer, XPOTrainer and "
                                         "NashMDTrainer have no evaluation loop"):
        trainer.evaluate()
    with pytest.raises(ValueError, match="eval_strategy='steps': TRL's OnlineDPOTrainer has no evaluation"):
        getattr(module, trainer_class)(args=config_class(output_dir=str(tmp_path), report_to="none",
                                                         eval_strategy="steps", eval_steps=1), **arguments)


@pytest.mark.parametrize("trainer_class", ["XPOTrainer", "NashMDTrainer"])
def test_xpo_and_nash_md_refuse_image_prompts_by_name(pad_tokenizer_dir, tmp_path, trainer_class):
    """TRL's XPO and Nash-MD have no vision path (Online DPO's is tested on Qwen2.5-VL): image rows are refused, not
    trained on their text."""
    from PIL import Image

    package = {"XPOTrainer": "xpo", "NashMDTrainer": "nash_md"}[trainer_class]
    module = importlib.import_module(f"torchlike.trl.experimental.{package}")
    config_class = getattr(module, trainer_class.replace("Trainer", "Config"))
    rows = [{"prompt": [{"role": "user", "content": "hello"}], "image": Image.new("RGB", (16, 16))}]
    with pytest.raises(ValueError, match=f"{trainer_class} trains on text prompts only .*'image'/'images' column"):
        getattr(module, trainer_class)(model="unused", reward_funcs=token_reward, train_dataset=rows,
                                       args=config_class(output_dir=str(tmp_path), report_to="none"),
                                       processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))


def test_image_prompts_for_a_text_only_model_are_refused_in_trls_words(tiny_checkpoints, pad_tokenizer_dir,
                                                                         tmp_path):
    from PIL import Image

    rows = [{"prompt": [{"role": "user", "content": "hello"}], "image": Image.new("RGB", (16, 16))}]
    with pytest.raises(ValueError, match="The model takes no images"):
        OnlineDPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=token_reward, train_dataset=rows,
                         args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none"),
                         processing_class=torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir))
