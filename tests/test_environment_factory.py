"""GRPO's ``environment_factory`` as TRL 1.16 runs it: environments shaped like TRL's examples (a class with a
``reset``, tool methods and a ``get_reward``) train through torchlike's GRPOTrainer step for step as through
``trl.GRPOTrainer``, with one environment, several routed by an ``environment`` column, and one that owns the data;
and the same errors, in TRL's words, for what cannot work.

Both trainers sample from one scripted policy (a function of the prompt's tokens standing in for each trainer's
sampler, tool-call continuations included) and keep a generation batch's rows in order, so the comparison is free of
sampling noise: the prompts the environments' observations make, the tool calls each instance receives, what the
reward functions see, and the logged loss, grad norm, rewards and tool metrics must agree.
"""

from __future__ import annotations

import itertools
import re

import datasets
import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests import tiny
from torchlike.testing import random_model, tiny_config
from torchlike.trl import GRPOConfig, GRPOTrainer


class CounterEnv:
    """A counter the model moves with its ``increment`` tool; the reward is how close it ends to the row's target.
    Each instance starts elsewhere (its ``number`` in the pool, how often it was reset), so the rollouts of a prompt
    differ and which instance serves which rollout shows."""

    def __init__(self, number: int):
        self.number = number
        self.resets = 0
        self.calls: list[int] = []

    def reset(self, target: int = 3, **kwargs) -> str:
        self.resets += 1
        self.target = target
        self.counter = (self.number + self.resets) % 3
        return f" Count to {target}. The counter is at {self.counter}."

    def increment(self, step: int) -> int:
        """Adds to the counter.

        Args:
            step: the amount to add.
        """
        self.calls.append(step)
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return -abs(self.target - self.counter)


class EchoEnv:
    """Repeats what the model says; it owns no reward."""

    def reset(self, **kwargs) -> str:
        self.heard: list[str] = []
        return " Say hi."

    def echo(self, text: str) -> str:
        """Repeats a text.

        Args:
            text: what to repeat.
        """
        self.heard.append(text)
        return text


def wait(seconds: int) -> str:
    """Waits (a standalone tool, offered beside every environment's methods).

    Args:
        seconds: how long.
    """
    return "waited"


def counter_factory():
    """A factory numbering its instances (a fresh count for each trainer)."""
    numbers = itertools.count()
    return lambda: CounterEnv(next(numbers))


def calls_reward(environments, **kwargs):
    """A reward function reading the environments: how many tool calls each rollout's instance received."""
    return [float(len(environment.calls if isinstance(environment, CounterEnv) else environment.heard))
            for environment in environments]


def recording(seen: list):
    def reward(prompts, completions, environments, **kwargs):
        seen.append({"prompts": prompts, "completions": completions,
                     "environments": [(type(e).__name__, getattr(e, "number", None), getattr(e, "counter", None))
                                      for e in environments]})
        return [index / 2 for index in range(len(completions))]  # unequal within every group

    return reward


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


def scripted_policy(tokenizer, tool_lists: set):
    """The policy both trainers sample from: after a tool's answer, "Done."; for the echo environment's prompt a call
    of ``echo``; for the counter's, ``increment(step=1)`` unless the counter is at 2 (then "Done." at once). Adds the
    tool list of each prompt it reads to ``tool_lists``."""

    def complete(prompt_ids: list[int]) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        tool_list = text.split("<|im_end|>")[0]
        tool_lists.add(tool_list.removeprefix("<|im_start|>system\n"))
        last_turn = text.rsplit("<|im_start|>", 2)[-2]
        if "<tool_response>" in last_turn:
            answer = "Done.<|im_end|>"
        elif " echo" in tool_list:
            answer = CALL.format(name="echo", arguments='{"text": "hi"}')
        elif re.search(r"counter is at 2", text):
            answer = "Done.<|im_end|>"
        else:
            answer = CALL.format(name="increment", arguments='{"step": 1}')
        return tokenizer(answer, add_special_tokens=False)["input_ids"]

    return complete


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    corpus = ["Go. Count to 3. The counter is at 1. Say hi. Done. Tools: increment echo",
              CALL.format(name="increment", arguments='{"step": 1}'), CALL.format(name="echo", arguments='{"text": 1}'),
              "system user assistant tool_response tool_call"]
    return tiny.build_tool_tokenizer(tmp_path_factory.mktemp("environment-tokenizer"), corpus)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tool_tokenizer):
    tokenizer = tiny.load_tool_tokenizer(tool_tokenizer)
    config = tiny_config("qwen2", vocab_size=336, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("environment-model")
    random_model(config).save_pretrained(path)
    return path


def settings(**overrides):
    """Both trainers': two prompts of two rollouts per step, rows in dataset order, float32; an Adam epsilon above
    float noise, so entries whose gradient is ~0 do not take learning-rate-sized steps of either sign."""
    values = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=48, max_steps=2,
                  learning_rate=1e-2, adam_epsilon=1e-4, logging_steps=1, seed=0, report_to="none", save_strategy="no",
                  bf16=False, shuffle_dataset=False)
    values.update(overrides)
    return values


def run_trl(model_path, tokenizer_path, output_dir, monkeypatch, *, reward_funcs, train_dataset, environment_factory,
            tools, tool_lists, **overrides) -> list[dict]:
    import trl
    import trl.trainer.grpo_trainer as trl_grpo

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    trainer = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=reward_funcs, train_dataset=train_dataset, environment_factory=environment_factory, tools=tools,
        args=trl.GRPOConfig(output_dir=str(output_dir), use_cpu=True, **settings(**overrides)),
        processing_class=tiny.load_tool_tokenizer(tokenizer_path, for_trl=True))
    policy = scripted_policy(trainer.processing_class, tool_lists)
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: ([policy(list(ids)) for ids in prompt_ids],
                                                                          None)
    trainer.train()
    return trainer.state.log_history


def run_torchlike(model_path, tokenizer_path, output_dir, *, reward_funcs, train_dataset, environment_factory,
                  tools, tool_lists, **overrides) -> list[dict]:
    tokenizer = tiny.load_tool_tokenizer(tokenizer_path)
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=reward_funcs,
                          args=GRPOConfig(output_dir=str(output_dir), **settings(**overrides)),
                          train_dataset=train_dataset, processing_class=tokenizer,
                          environment_factory=environment_factory, tools=tools)
    policy = scripted_policy(tokenizer, tool_lists)

    def sample(prompt_ids, prompt_mask, max_new_tokens, seed, vision=None):
        tokens = np.full((len(prompt_ids), max_new_tokens), tokenizer.pad_token_id, np.int32)
        for row, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            completion = policy(ids[mask.astype(bool)].tolist())[:max_new_tokens]
            tokens[row, :len(completion)] = completion
        return tokens, np.zeros(tokens.shape, np.float32)

    trainer.rollout_worker.sample = sample  # the policy's completions, tool turns included
    trainer._shuffled = lambda batch, seed: batch
    trainer.train()
    return trainer.state.log_history


def training_logs(history: list[dict]) -> list[dict]:
    return [entry for entry in history if "loss" in entry]


COMPARED = ("loss", "grad_norm", "entropy", "reward", "reward_std", "frac_reward_zero_std", "num_tokens",
            "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "tools/call_frequency",
            "tools/failure_frequency")


def assert_same_logs(ours: list[dict], theirs: list[dict], reward_names: list[str]) -> None:
    ours, theirs = training_logs(ours), training_logs(theirs)
    assert len(ours) == len(theirs) == 2
    keys = [*COMPARED, *(f"rewards/{name}/{stat}" for name in reward_names for stat in ("mean", "std"))]
    for key in keys:
        assert all(key in entry for entry in theirs), key
        np.testing.assert_allclose([entry[key] for entry in ours], [entry[key] for entry in theirs], rtol=1e-4,
                                   atol=1e-6, err_msg=key)
    assert all(entry["grad_norm"] > 1e-3 for entry in theirs)  # every step moves the policy


def both(model_path, tokenizer_path, tmp_path, monkeypatch, *, rows, factory, reward_funcs, tools=None, **overrides):
    """Trains TRL and torchlike on the same rows (a fresh factory and fresh recorded reward inputs each); returns
    ``(ours, theirs)``: each ``(log history, what the recording reward saw, the tool lists the prompts rendered)``."""
    runs = []
    for name in ("trl", "ours"):
        seen, tool_lists = [], set()
        functions = [recording(seen), *reward_funcs]
        dataset = None if rows is None else datasets.Dataset.from_list(rows)
        kwargs = dict(reward_funcs=functions, train_dataset=dataset, environment_factory=factory(), tools=tools,
                      tool_lists=tool_lists, **overrides)
        if name == "trl":
            history = run_trl(model_path, tokenizer_path, tmp_path / name, monkeypatch, **kwargs)
        else:
            history = run_torchlike(model_path, tokenizer_path, tmp_path / name, **kwargs)
        runs.append((history, seen, tool_lists))
    theirs, ours = runs
    return ours, theirs


def test_an_environment_with_tools_and_a_reward_trains_as_trl(model_path, tool_tokenizer, tmp_path, monkeypatch):
    """One environment: each rollout's instance (pooled, reset with the row's columns) adds its observation to the
    prompt, runs that rollout's ``increment`` calls, and scores it by ``get_reward`` (logged as ``CounterEnv``,
    weight 1 after the given weights); reward functions read the instances as ``environments``."""
    rows = [{"prompt": [{"role": "user", "content": "Go."}], "target": target} for target in (3, 2, 2, 3)]
    (ours, seen, tool_lists), (theirs, trl_seen, trl_tool_lists) = both(
        model_path, tool_tokenizer, tmp_path, monkeypatch, rows=rows, factory=counter_factory,
        reward_funcs=[calls_reward], reward_weights=[0.5, 2.0])

    assert seen == trl_seen
    assert tool_lists == trl_tool_lists == {"Tools: increment"}
    first = seen[0]
    assert first["prompts"][0][-1]["content"] == "Go. Count to 3. The counter is at 1."
    assert [number for _, number, _ in first["environments"]] == [0, 1, 2, 3]  # the probe first, then the pool grows
    assert [number for _, number, _ in seen[1]["environments"]] == [0, 1, 2, 3]  # and is reused
    assert first["completions"][0][1] == {"role": "tool", "name": "increment", "content": "2"}
    assert_same_logs(ours, theirs, ["reward", "calls_reward", "CounterEnv"])


def test_environments_routed_by_the_environment_column_train_as_trl(model_path, tool_tokenizer, tmp_path,
                                                                     monkeypatch):
    """A dict of factories: each row's ``environment`` picks its environment, whose tools alone are rendered in its
    prompt and callable; the rows carry no ``prompt`` (``reset`` gives it); ``CounterEnv``'s reward is ``None`` on
    the echo rollouts."""
    rows = [{"environment": "counter", "target": 2}, {"environment": "echo", "target": None},
            {"environment": "echo", "target": None}, {"environment": "counter", "target": 3}]

    def factories():
        return {"counter": counter_factory(), "echo": EchoEnv}

    (ours, seen, tool_lists), (theirs, trl_seen, trl_tool_lists) = both(
        model_path, tool_tokenizer, tmp_path, monkeypatch, rows=rows, factory=factories, reward_funcs=[calls_reward],
        tools=[wait])

    assert seen == trl_seen
    assert tool_lists == trl_tool_lists == {"Tools: wait increment", "Tools: wait echo"}
    assert [kind for kind, _, _ in seen[0]["environments"]] == ["CounterEnv"] * 2 + ["EchoEnv"] * 2
    assert seen[0]["completions"][2][1] == {"role": "tool", "name": "echo", "content": "hi"}
    assert_same_logs(ours, theirs, ["reward", "calls_reward", "CounterEnv"])


def test_an_environment_that_owns_the_data_trains_for_max_steps_as_trl(model_path, tool_tokenizer, tmp_path,
                                                                       monkeypatch):
    """No ``train_dataset``: one generation batch of empty prompts, each filled by ``reset``, for ``max_steps``;
    ``get_reward`` is the only reward source besides the recording function."""
    (ours, seen, tool_lists), (theirs, trl_seen, trl_tool_lists) = both(
        model_path, tool_tokenizer, tmp_path, monkeypatch, rows=None, factory=counter_factory, reward_funcs=[])

    assert seen == trl_seen and tool_lists == trl_tool_lists
    assert seen[0]["prompts"][0] == [{"role": "user", "content": " Count to 3. The counter is at 1."}]
    assert_same_logs(ours, theirs, ["reward", "CounterEnv"])


class NoResetEnv:
    def play(self, move: str) -> str:
        """Plays a move.

        Args:
            move: the move.
        """
        return move


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


ROUTED_ROWS = [{"prompt": [{"role": "user", "content": "Go."}], "environment": name}
               for name in ("counter", "maze", "counter", "maze")]

#: What TRL refuses, as ``(trainer arguments, config overrides, whether the error comes at the first batch)``.
ERRORS = {
    "no train_dataset and no environment": (dict(reward_funcs=constant_reward), {}, False),
    "no train_dataset for routed environments": (dict(environment_factory={"counter": counter_factory()}),
                                                 dict(max_steps=2), False),
    "no train_dataset and no max_steps": (dict(environment_factory=counter_factory()), dict(max_steps=-1), False),
    "an environment without reset": (dict(environment_factory=NoResetEnv, reward_funcs=constant_reward,
                                          train_dataset=ROUTED_ROWS), {}, False),
    "no reward source": (dict(environment_factory=EchoEnv, train_dataset=ROUTED_ROWS), {}, False),
    "a row naming an unknown environment": (dict(environment_factory={"counter": counter_factory()},
                                                 reward_funcs=constant_reward, train_dataset=ROUTED_ROWS), {}, True),
    "routing columns removed as unused": (dict(environment_factory={"counter": counter_factory()},
                                               reward_funcs=constant_reward, train_dataset=ROUTED_ROWS[::2] * 2),
                                          dict(remove_unused_columns=True), True),
}


def raised(make, train: bool) -> str:
    with pytest.raises(ValueError) as error:
        trainer = make()
        if train:
            trainer.train()
    return str(error.value)


@pytest.mark.parametrize("case", list(ERRORS))
def test_what_trl_refuses_is_refused_with_trls_message(model_path, tool_tokenizer, tmp_path, monkeypatch, case):
    import trl

    arguments, overrides, at_first_batch = ERRORS[case]
    arguments = dict(arguments)
    if "train_dataset" in arguments:
        arguments["train_dataset"] = datasets.Dataset.from_list(arguments["train_dataset"])
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    theirs = raised(lambda: trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **settings(**overrides)),
        processing_class=tiny.load_tool_tokenizer(tool_tokenizer, for_trl=True), **arguments), at_first_batch)
    ours = raised(lambda: GRPOTrainer(
        model=str(model_path), args=GRPOConfig(output_dir=str(tmp_path / "ours"), **settings(**overrides)),
        processing_class=tiny.load_tool_tokenizer(tool_tokenizer), **arguments), at_first_batch)
    assert ours == theirs


def test_a_chat_template_that_cannot_render_tools_is_refused_as_in_trl(tiny_checkpoints, tokenizer_dir, tmp_path):
    """Environments need a template that renders tool exchanges even when no environment has tools (TRL checks)."""
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match="The provided chat template does not support tool calling"):
        GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=constant_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), **settings()),
                    train_dataset=[{"prompt": [{"role": "user", "content": "Go."}]}] * 2, processing_class=tokenizer,
                    environment_factory=EchoEnv)


def test_rloo_which_takes_no_environments_keeps_trls_rloo_message_for_a_missing_dataset(tiny_checkpoints,
                                                                                       tokenizer_dir, tmp_path):
    from torchlike.trl import RLOOConfig, RLOOTrainer

    with pytest.raises(ValueError, match=r"^`train_dataset` is required$"):
        RLOOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=constant_reward,
                    args=RLOOConfig(output_dir=str(tmp_path), report_to="none"),
                    processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir))
