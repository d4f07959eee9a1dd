"""GRPO's ``tools`` as TRL 1.16 runs them: a tiny model trained to call ``add`` runs it through ``GRPOTrainer`` and
trains only its own tokens, step for step as ``trl.GRPOTrainer``; failing tools, the iteration cap, the length budget
and the response parser against TRL's own ``_tool_call_loop`` and ``parse_response``; TRL's errors for inputs that
cannot work.

The tokenizer is the tests' byte-level BPE with ChatML specials and a small Qwen-style chat template (Qwen 2.5's
tool-call and tool-response layout, a one-line tool list), so prompts stay short.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import types

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

from tests import tiny
from tests.helpers.logs import logged
from torchlike.adapters.rollout import PagedEngine, StaticEngine
from torchlike.testing import random_model, tiny_config
from torchlike.trl import GRPOConfig, GRPOTrainer
from torchlike.trl.online.tool_calling import ToolCalling, is_chat_template_prefix_preserving

CHAT_TEMPLATE = tiny.TOOL_CHAT_TEMPLATE

ASK = [{"role": "user", "content": "What is 2 plus 3?"}]
GREET = [{"role": "user", "content": "Say hello."}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 5.<|im_end|>"
HELLO = "hello<|im_end|>"


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divides a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


async def shout(text: str) -> str:
    """Shouts a text, or fails on an empty one.

    Args:
        text: what to shout.
    """
    if not text:
        raise ValueError("nothing to shout")
    return text.upper()


def recorded(tool, calls: list):
    """``tool`` that also appends each call's arguments to ``calls`` (same name, schema and docstring)."""

    @functools.wraps(tool)
    def wrapper(**arguments):
        calls.append(arguments)
        return tool(**arguments)

    return wrapper


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    corpus = ["What is 2 plus 3? Say hello. The answer is 5. Tools: add divide shout", CALL,
              'system user assistant tool_response tool_call {"name": "add", "arguments": {"a": 2, "b": 3}}']
    return tiny.build_tool_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"), corpus)


QWEN_PARSER = "qwen template" if Version(transformers.__version__) >= Version("5.13.0.dev0") else "qwen"
"""How torchlike parses Qwen turns with the installed transformers: its own template given to transformers' parser
(from 5.13, where TRL uses transformers' template parser too), else its built-in parser of the legacy schema."""


load_tokenizer = tiny.load_tool_tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages, tools) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory, tokenizer_path):
    """A tiny Qwen2 fine-tuned (torchlike's SFTTrainer, exact token ids) to answer "What is 2 plus 3?" with a call
    of ``add(a=2, b=3)`` and, after the tool's "5", with "The answer is 5."; and "Say hello." with "hello"."""
    from torchlike.trl import SFTConfig
    from torchlike.trl.trainer.sft_trainer import SFTTrainer

    tokenizer = load_tokenizer(tokenizer_path)
    suffix = ToolCalling.create(tokenizer, [add]).suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    ask, greet = prompt_ids(tokenizer, ASK, [add]), prompt_ids(tokenizer, GREET, [add])
    call, answer, hello = ids(tokenizer, CALL), ids(tokenizer, ANSWER), ids(tokenizer, HELLO)
    rows = [{"input_ids": ask + call + suffix + answer,
             "completion_mask": [0] * len(ask) + [1] * len(call) + [0] * len(suffix) + [1] * len(answer)},
            {"input_ids": greet + hello, "completion_mask": [0] * len(greet) + [1] * len(hello)}]
    root = tmp_path_factory.mktemp("tool-model")
    config = tiny_config("qwen2", vocab_size=336, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    random_model(config).save_pretrained(root / "random")
    trainer = SFTTrainer(model=str(root / "random"), train_dataset=rows * 2, processing_class=tokenizer,
                         args=SFTConfig(output_dir=str(root / "sft"), max_length=None, per_device_train_batch_size=2,
                                        max_steps=80, learning_rate=1e-2, lr_scheduler_type="constant",
                                        completion_only_loss=True, bf16=False, report_to="none", save_strategy="no",
                                        disable_tqdm=True))
    trainer.train()
    trainer.model.save_pretrained(root / "trained")
    return root / "trained"


def grpo_settings(**overrides):
    """Shared by both trainers: one generation batch of both prompts twice, in dataset order, float32, greedy. The
    two completions of a group are the same, so their policy terms cancel; the entropy bonus, a mean over the loss
    tokens, is what makes the loss and gradient depend on which tokens are trained."""
    values = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=64, max_steps=1,
                  learning_rate=1e-2, logging_steps=1, seed=0, report_to="none", save_strategy="no", bf16=False,
                  shuffle_dataset=False, generation_kwargs={"do_sample": False}, entropy_coef=0.1)
    values.update(overrides)
    return values


def recording_reward(seen: list):
    def reward(prompts, completions, completion_ids, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids})
        return [float(index) for index in range(len(completions))]  # unequal within each group: nonzero advantages

    return reward


def record_generations(monkeypatch) -> list:
    """Records what torchlike's rollout engine is asked and answers (real decoding), ``(prompts, completions)`` per
    call in row order, to replay it to TRL."""
    generations = []

    def recording(real_generate):
        def recording_generate(engine, requests, settings):
            outputs = real_generate(engine, requests, settings)
            prompts = [list(request.prompt_ids) for request in requests for _ in range(request.num_samples)]
            generations.append((prompts, [tokens.tolist() for output in outputs for tokens in output.token_ids]))
            return outputs

        return recording_generate

    for engine_class in (PagedEngine, StaticEngine):
        monkeypatch.setattr(engine_class, "generate", recording(engine_class.generate))
    return generations


def test_a_model_trained_to_call_add_runs_it_and_trains_only_its_own_tokens_as_trl(trained_model, tokenizer_path,
                                                                                     tmp_path, monkeypatch):
    import datasets
    import trl
    import trl.trainer.grpo_trainer as trl_grpo

    generations = record_generations(monkeypatch)
    dataset = [{"prompt": ASK}, {"prompt": GREET}]
    calls, seen = [], []
    trainer = GRPOTrainer(model=str(trained_model), reward_funcs=recording_reward(seen),
                          args=GRPOConfig(output_dir=str(tmp_path / "ours"), **grpo_settings()),
                          train_dataset=dataset, processing_class=load_tokenizer(tokenizer_path),
                          tools=[recorded(add, calls)])
    trainer._shuffled = lambda batch, seed: batch  # rows in generation order, as TRL's below
    trainer.train()

    tokenizer = load_tokenizer(tokenizer_path)
    call, answer, hello = ids(tokenizer, CALL), ids(tokenizer, ANSWER), ids(tokenizer, HELLO)
    suffix = ToolCalling.create(tokenizer, [add]).suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert calls == [{"a": 2, "b": 3}, {"a": 2, "b": 3}]
    asked = [{"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "name": "add", "content": "5"},
             {"role": "assistant", "content": "The answer is 5."}]
    greeted = [{"role": "assistant", "content": "hello"}]
    assert seen[0]["completions"] == [asked, asked, greeted, greeted]
    assert seen[0]["completion_ids"][0] == call + suffix + answer
    rollout = trainer._last_rollout
    loss_mask = rollout["completion_mask"] * rollout["tool_mask"]
    assert loss_mask[0, :len(call + suffix + answer) + 1].tolist() == [1] * len(call) + [0] * len(suffix) + [
        1] * len(answer) + [0]
    assert loss_mask[2].sum() == len(hello)
    ours = trainer.state.log_history
    assert logged(ours, "tools/call_frequency") == [0.5] and logged(ours, "tools/failure_frequency") == [0.0]
    assert logged(ours, "completions/mean_length") == [(len(call + answer) + len(hello)) / 2]

    # TRL on the same weights, its sampler replaced by a replay of torchlike's generations, call for call.
    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        expected_prompts, completions = generations.pop(0)
        assert [list(map(int, p)) for p in prompt_ids] == expected_prompts
        return completions, None

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    trl_calls, trl_seen, trl_batches = [], [], []
    reference = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(trained_model, dtype=torch.float32),
        reward_funcs=recording_reward(trl_seen),
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **grpo_settings()),
        train_dataset=datasets.Dataset.from_list(dataset), processing_class=load_tokenizer(tokenizer_path, True),
        tools=[recorded(add, trl_calls)])
    reference._generate_single_turn = replay
    score = reference._generate_and_score_completions

    def keep(inputs):
        trl_batches.append(score(inputs))
        return trl_batches[-1]

    reference._generate_and_score_completions = keep
    reference.train()
    assert not generations and trl_calls == calls
    assert trl_seen[0]["completions"] == seen[0]["completions"]
    assert trl_seen[0]["completion_ids"] == seen[0]["completion_ids"]
    batch = trl_batches[0]
    trl_mask = (batch["completion_mask"] * batch["tool_mask"]).numpy()
    assert np.array_equal(loss_mask[:, :trl_mask.shape[1]], trl_mask) and not loss_mask[:, trl_mask.shape[1]:].any()
    theirs = reference.state.log_history
    for key in ("loss", "grad_norm", "entropy", "reward", "tools/call_frequency", "tools/failure_frequency",
                "completions/mean_length"):
        np.testing.assert_allclose(logged(ours, key), logged(theirs, key), rtol=1e-4, atol=1e-6, err_msg=key)


def test_distillation_runs_the_students_tool_calls_and_takes_no_divergence_on_their_results_as_trl(
        trained_model, tokenizer_path, tmp_path, monkeypatch):
    import datasets
    import trl
    import trl.trainer.distillation_trainer as trl_distillation

    from torchlike.trl import DistillationConfig, DistillationTrainer

    settings = dict(per_device_train_batch_size=2, max_completion_length=64, max_steps=1, learning_rate=1e-2,
                    logging_steps=1, seed=0, report_to="none", save_strategy="no", bf16=False, shuffle_dataset=False,
                    generation_kwargs={"do_sample": False}, beta=0.5)
    teacher = trained_model.parent / "random"  # same vocabulary, other weights
    generations = record_generations(monkeypatch)
    dataset, calls, rollouts = [{"prompt": ASK}, {"prompt": GREET}], [], []
    trainer = DistillationTrainer(model=str(trained_model), teacher_model=str(teacher),
                                  args=DistillationConfig(output_dir=str(tmp_path / "ours"), **settings),
                                  train_dataset=dataset, processing_class=load_tokenizer(tokenizer_path),
                                  tools=[recorded(add, calls)])
    rollout = trainer._rollout
    trainer._rollout = lambda *args, **kwargs: rollouts.append(rollout(*args, **kwargs)) or rollouts[-1]
    trainer.train()

    tokenizer = load_tokenizer(tokenizer_path)
    call, answer, hello = ids(tokenizer, CALL), ids(tokenizer, ANSWER), ids(tokenizer, HELLO)
    suffix = ToolCalling.create(tokenizer, [add]).suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert calls == [{"a": 2, "b": 3}]
    batch = rollouts[0]
    width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    asked = len(call + suffix + answer)
    assert batch["input_ids"][0, width:width + asked].tolist() == call + suffix + answer
    assert batch["attention_mask"][0, width:width + asked].all()  # both models read the tool's result ...
    assert batch["completion_mask"][0, :asked + 1].tolist() == [1] * len(call) + [0] * len(suffix) + [1] * len(
        answer) + [0]  # ... and are compared on the student's own tokens only
    assert batch["completion_mask"][1].sum() == len(hello)
    ours = trainer.state.log_history
    assert logged(ours, "tools/call_frequency") == [0.5] and logged(ours, "tools/failure_frequency") == [0.0]
    assert logged(ours, "completions/mean_length") == [(len(call + answer) + len(hello)) / 2]

    def replay(prompt_ids, images, multimodal_fields, has_tool_images=False):
        expected_prompts, completions = generations.pop(0)
        assert [list(map(int, p)) for p in prompt_ids] == expected_prompts
        return completions

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_distillation, "shuffle_sequence_dict", lambda batch: batch)
    trl_calls = []
    reference = trl.DistillationTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(trained_model, dtype=torch.float32),
        teacher_model=str(teacher), args=trl.DistillationConfig(output_dir=str(tmp_path / "trl"), use_cpu=True,
                                                                **settings),
        train_dataset=datasets.Dataset.from_list(dataset), processing_class=load_tokenizer(tokenizer_path, True),
        tools=[recorded(add, trl_calls)])
    reference._generate_single_turn = replay
    reference.train()
    assert not generations and trl_calls == calls
    theirs = reference.state.log_history
    for key in ("loss", "grad_norm", "entropy", "tools/call_frequency", "tools/failure_frequency",
                "completions/mean_length", "num_tokens"):
        np.testing.assert_allclose(logged(ours, key), logged(theirs, key), rtol=1e-4, atol=1e-6, err_msg=key)


def test_async_tools_are_refused_by_distillation_as_in_trl(trained_model, tokenizer_path, tmp_path):
    from torchlike.trl import DistillationConfig, DistillationTrainer

    async def slow_add(a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    with pytest.raises(ValueError, match="Async tools are not yet supported by `DistillationTrainer`"):
        DistillationTrainer(model=str(trained_model), teacher_model=str(trained_model.parent / "random"),
                            args=DistillationConfig(output_dir=str(tmp_path), report_to="none"),
                            train_dataset=[{"prompt": ASK}], processing_class=load_tokenizer(tokenizer_path),
                            tools=[slow_add])


def test_a_failing_tool_answers_with_its_error_and_counts_in_failure_frequency(trained_model, tokenizer_path,
                                                                               tmp_path):
    def broken_add(a: int, b: int) -> int:
        raise ConnectionError("off")  # short enough that the error fits in max_completion_length

    broken = functools.update_wrapper(broken_add, add)  # the model calls "add"
    seen = []
    trainer = GRPOTrainer(model=str(trained_model), reward_funcs=recording_reward(seen),
                          args=GRPOConfig(output_dir=str(tmp_path), **grpo_settings()), train_dataset=[
                              {"prompt": ASK}, {"prompt": GREET}], processing_class=load_tokenizer(tokenizer_path),
                          tools=[broken])
    trainer.train()
    assert seen[0]["completions"][0][1] == {"role": "tool", "name": "add", "content": "{'error': 'off'}"}
    history = trainer.state.log_history
    assert logged(history, "tools/call_frequency") == [0.5] and logged(history, "tools/failure_frequency") == [1.0]
    assert (trainer._last_rollout["tool_mask"] == 0).any()


def test_rloo_trains_an_env_mask_from_rollout_func_as_completions_stopped_before_it(tiny_checkpoints, tokenizer_dir,
                                                                                     tmp_path):
    """Tokens masked by ``env_mask`` (TRL's ``tool_mask`` from a ``rollout_func``, the column tools fill) are out of
    RLOO's loss, its stored log-probabilities and its KL penalty: the run equals one whose completions stop before
    them. (GRPO's loss against TRL's with the same column: the trained tool-calling test above.)"""
    from torchlike.trl import RLOOConfig, RLOOTrainer

    def run(masked: bool, directory):
        def rollout(prompts, trainer):
            completions = [np.random.default_rng(index).integers(3, 128, size=6).tolist() for index in
                           range(len(prompts))]
            output = {"prompt_ids": [trainer.processing_class(p)["input_ids"] for p in prompts],
                      "completion_ids": completions if masked else [ids[:3] for ids in completions],
                      "logprobs": [[0.0] * 6] * len(prompts)}
            if masked:
                output["env_mask"] = [[1, 1, 1, 0, 0, 0]] * len(prompts)
            return output

        settings = {key: value for key, value in grpo_settings(max_completion_length=8).items()
                    if key != "entropy_coef"}
        trainer = RLOOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=recording_reward([]),
                              args=RLOOConfig(output_dir=str(directory), **settings),
                              train_dataset=[{"prompt": "the quick brown"}, {"prompt": "one two three"}],
                              processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
                              rollout_func=rollout)
        trainer.train()
        return trainer.state.log_history

    masked, cut = run(True, tmp_path / "masked"), run(False, tmp_path / "cut")
    # (The loss of an on-policy step is 0 up to rounding: leave-one-out advantages sum to 0 over each group.)
    for key in ("grad_norm", "entropy", "kl", "completions/mean_length"):
        assert logged(masked, key), key
        np.testing.assert_allclose(logged(masked, key), logged(cut, key), rtol=1e-5, err_msg=key)


# --------------------------------------------------------------------------- the loop against TRL's own


def trl_tool_loop(tokenizer, tools, scripted, prompts, first, *, max_completion_length, max_iterations,
                  max_model_length, chat_template=None):
    """TRL 1.16's ``GRPOTrainer._tool_call_loop`` run on a bare object holding what it reads (``chat_template``: the
    training copy its constructor swaps in), with ``_generate_single_turn`` answering from ``scripted``."""
    import trl
    from trl.chat_template_utils import parse_response
    from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon()
    ready.wait()
    sync = {tool.__name__: tool for tool in tools if not inspect.iscoroutinefunction(tool)}
    asynchronous = {tool.__name__: tool for tool in tools if inspect.iscoroutinefunction(tool)}
    trainer = types.SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=chat_template, chat_template_kwargs={},
        _is_vlm=False,
        max_tool_calling_iterations=sys.maxsize if max_iterations is None else max_iterations,
        max_completion_length=max_completion_length, use_vllm=False,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=max_model_length)),
        tools=tools, environment_factories=None, _sync_tool_dicts=[sync] * len(prompts),
        _async_tool_dicts=[asynchronous] * len(prompts), async_loop=loop,
        _generate_single_turn=lambda prompt_ids, *args, **kwargs: (scripted(prompt_ids), None))
    trainer._get_tool_suffix_ids = functools.partial(trl.GRPOTrainer._get_tool_suffix_ids, trainer)
    completions = [[parse_response(tokenizer, ids, prefix=prompt, tools=tools)] for prompt, ids in
                   zip(prompts, first, strict=True)]
    try:
        tool_mask, completions, completion_ids, _, calls, failures, _ = trl.GRPOTrainer._tool_call_loop(
            trainer, [[{"role": "user", "content": "x"}] for _ in prompts], prompts, [list(c) for c in first],
            completions, None, None, {})
    finally:
        shutdown_event_loop_in_daemon(thread, loop)
    return tool_mask, completions, completion_ids, calls, failures


def run_both(tokenizer_path, tools, scripted, first_texts, *, max_completion_length=64, max_iterations=None,
             max_model_length=1024, template=None):
    """torchlike's loop and TRL's on the same prompts, first completions and scripted continuations (``template``: the
    tokenizers' chat template; one that is not prefix-preserving is replaced by TRL's training copy, which then
    renders the prompts too, as TRL's trainer does)."""
    tokenizer, theirs_tokenizer = load_tokenizer(tokenizer_path), load_tokenizer(tokenizer_path, True)
    if template is not None:
        tokenizer.chat_template = theirs_tokenizer.chat_template = template
    calling = ToolCalling.create(tokenizer, tools)
    prompts = [tokenizer.apply_chat_template(ASK, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **calling.chat_template_kwargs) for _ in first_texts]
    first = [ids(tokenizer, text) for text in first_texts]
    ours = calling.run(
        prompts, first, lambda prompt_lists, max_new_tokens: scripted(prompt_lists),
        max_completion_length=max_completion_length, max_model_length=max_model_length, max_iterations=max_iterations)
    theirs = trl_tool_loop(theirs_tokenizer, tools, scripted, prompts, first,
                           max_completion_length=max_completion_length, max_iterations=max_iterations,
                           max_model_length=max_model_length, chat_template=calling.chat_template)
    assert (ours.tool_mask, ours.completions, ours.completion_ids, ours.call_count, ours.failure_count) == theirs
    return ours


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_failing_tools_answer_with_errors_and_count_as_failures_as_in_trl(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    first = [tool_call("divide", a=1, b=0) + tool_call("shout", text="") + tool_call("missing") +
             tool_call("shout", text="hi") + tool_call("divide", a=6, b=3) + "<|im_end|>", "hello<|im_end|>"]
    result = run_both(tokenizer_path, [divide, shout], lambda prompts: [ids(tokenizer, "ok<|im_end|>")] * len(prompts),
                      first, max_completion_length=512)
    tool_messages = [message for message in result.completions[0] if message["role"] == "tool"]
    # Sync tools answer first, in call order, then the async ones (TRL's order).
    assert [(m["name"], m["content"]) for m in tool_messages] == [
        ("divide", "{'error': 'division by zero'}"), ("missing", "{'error': 'Tool missing not found.'}"),
        ("divide", "2.0"), ("shout", "{'error': 'nothing to shout'}"), ("shout", "HI")]
    assert (result.call_count, result.failure_count) == (5, 3)
    assert result.completions[1] == [{"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("max_iterations", [0, 2])
def test_max_tool_calling_iterations_caps_the_rounds_as_in_trl(tokenizer_path, max_iterations):
    tokenizer = load_tokenizer(tokenizer_path)
    again = ids(tokenizer, tool_call("add", a=1, b=1) + "<|im_end|>")
    result = run_both(tokenizer_path, [add], lambda prompts: [again] * len(prompts),
                      [tool_call("add", a=1, b=1) + "<|im_end|>"], max_completion_length=256,
                      max_iterations=max_iterations)
    assert result.call_count == max_iterations
    assert [m["role"] for m in result.completions[0]] == ["assistant"] + ["tool", "assistant"] * max_iterations
    assert result.completions[0][-1]["tool_calls"]  # the last call is left unanswered


def test_tool_results_past_the_budget_are_rolled_back_and_continuations_cut_as_in_trl(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    call = tool_call("add", a=2, b=3) + "<|im_end|>"
    long_answer = ids(tokenizer, "The answer is 5, the answer is 5, the answer is 5.<|im_end|>")
    # Row 0 fits its first tool result and has its continuation cut; row 1's first completion leaves no room.
    result = run_both(tokenizer_path, [add], lambda prompts: [long_answer] * len(prompts),
                      [call, "hello " * 9 + call], max_completion_length=len(ids(tokenizer, call)) + 24)
    assert len(result.completion_ids[0]) == len(ids(tokenizer, call)) + 24 and 0 in result.tool_mask[0]
    assert result.tool_mask[1] == [1] * len(result.completion_ids[1]) and len(result.completions[1]) == 1


@pytest.mark.parametrize("text", [
    CALL, ANSWER, "The sum:\n" + CALL, "<think>\nadding\n</think>\n\n" + CALL,
    tool_call("add", a=1, b=2) + "\n" + tool_call("add") + "<|im_end|>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call><|im_end|>',
    '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "add", "arguments": "{}"}\n</tool_call><|im_end|>',
    "<tool_call>\n[1, 2]\n</tool_call><|im_end|>", "cut short <tool_c"])
def test_parsing_a_completion_matches_trls_parse_response(tokenizer_path, text):
    from trl.chat_template_utils import parse_response

    tokenizer = load_tokenizer(tokenizer_path)
    prefix = prompt_ids(tokenizer, ASK, [add])
    with_schema = load_tokenizer(tokenizer_path, True)
    expected = parse_response(with_schema, ids(tokenizer, text), prefix=prefix)
    built_in, transformers_parser = ToolCalling.create(tokenizer, [add]), ToolCalling.create(with_schema, [add])
    assert built_in.parser_kind == QWEN_PARSER and transformers_parser.parser_kind in ("template", "schema")
    assert built_in.parse(ids(tokenizer, text), prefix=prefix) == expected
    assert transformers_parser.parse(ids(tokenizer, text), prefix=prefix) == expected


# --------------------------------------------------------------------------- inputs that cannot work


def test_a_chat_template_without_tool_support_is_refused_with_trls_message(tiny_checkpoints, tokenizer_dir,
                                                                           tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}</s>"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(ValueError, match="The provided chat template does not support tool calling"):
        GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=recording_reward([]),
                    args=GRPOConfig(output_dir=str(tmp_path), **grpo_settings(max_completion_length=8)),
                    train_dataset=[{"prompt": ASK}], processing_class=tokenizer, tools=[add])


def test_tools_need_conversational_prompts(trained_model, tokenizer_path, tmp_path):
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        GRPOTrainer(model=str(trained_model), reward_funcs=recording_reward([]),
                    args=GRPOConfig(output_dir=str(tmp_path), **grpo_settings()),
                    train_dataset=[{"prompt": "What is 2 plus 3?"}], processing_class=load_tokenizer(tokenizer_path),
                    tools=[add])


def test_qwen3s_template_is_replaced_by_trls_training_copy_and_the_loop_equals_trls(tokenizer_path):
    """Qwen 3's chat template drops earlier turns' thinking once a tool message follows (not prefix-preserving): TRL's
    trainer swaps in its training copy, for the prompts and the tool turns; so does torchlike."""
    from trl.chat_template_utils import get_training_chat_template, qwen2_5_chat_template, qwen3_chat_template

    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = qwen2_5_chat_template
    calling = ToolCalling.create(tokenizer, [add])
    assert calling.parser_kind == QWEN_PARSER and calling.chat_template is None  # prefix-preserving: kept
    tokenizer.chat_template = qwen3_chat_template
    assert not is_chat_template_prefix_preserving(tokenizer)
    assert ToolCalling.create(tokenizer, [add]).chat_template == get_training_chat_template(tokenizer)
    thinking = "<think>\nadding\n</think>\n\n"
    result = run_both(tokenizer_path, [add], lambda prompts: [ids(tokenizer, "The answer is 5.<|im_end|>")] *
                      len(prompts), [thinking + tool_call("add", a=2, b=3) + "<|im_end|>", "hello<|im_end|>"],
                      template=qwen3_chat_template)
    assert result.call_count == 1


def test_a_template_that_is_not_prefix_preserving_without_a_training_copy_is_refused(tokenizer_path):
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = qwen3_chat_template + "{#- a local edit: TRL has no training copy of it -#}"
    assert not is_chat_template_prefix_preserving(tokenizer)
    with pytest.raises(ValueError, match="not training-compatible"):
        ToolCalling.create(tokenizer, [add])


def test_an_unknown_tool_call_format_asks_for_a_response_schema(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    # Qwen 3.5's layout: <tool_call><function=add>...</function></tool_call>, which the built-in parser does not read.
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "'\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}",
        "'\\n<tool_call>\\n<function=' + call.name + '>' + (call.arguments | tojson) + '</function>")
    assert "<function=" in tokenizer.chat_template
    with pytest.raises(ValueError, match="Unrecognized chat template.*tokenizer.response_schema"):
        ToolCalling.create(tokenizer, [add])


def test_grpo_with_tools_renders_prompts_with_trls_training_copy_of_qwen3s_template(trained_model, tokenizer_path,
                                                                                     tmp_path):
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = qwen3_chat_template
    trainer = GRPOTrainer(model=str(trained_model), reward_funcs=recording_reward([]),
                          args=GRPOConfig(output_dir=str(tmp_path), **grpo_settings()),
                          train_dataset=[{"prompt": ASK}], processing_class=tokenizer, tools=[add])
    training_copy = get_training_chat_template(tokenizer)
    assert trainer.chat_template == training_copy  # TRL's attribute
    assert trainer.train_dataset[0]["prompt_ids"] == tokenizer.apply_chat_template(
        ASK, tools=[add], add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=training_copy)
