"""GRPOTrainer end to end on a tiny Qwen2: rewards called TRL's way, learning, old-policy ratios, reference
model, evaluation, traces and bad inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.helpers.logs import logged
from torchlike.adapters.lora import runtime as lora_runtime
from torchlike.adapters.runtime import tracing
from torchlike.peft import LoraConfig
from torchlike.trl import GRPOConfig, GRPOTrainer

PROMPTS = ["the quick brown", "one two three", "hello world", "lazy dog", "four five", "tiny test", "seven eight",
           "the fox"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def length_reward(completions, **kwargs):
    """Completions near 20 characters score best."""
    return [-abs(len(completion) - 20) / 20 for completion in completions]


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=12, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True)
    values.update(overrides)
    return GRPOConfig(**values)


def make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=length_reward, dataset=None, **overrides):
    dataset = [{"prompt": p} for p in PROMPTS] if dataset is None else dataset
    return GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=reward_funcs,
                       args=config(tmp_path, **overrides), train_dataset=dataset, processing_class=tokenizer)


def test_the_mean_length_reward_improves_over_a_short_run(tiny_checkpoints, tokenizer, tmp_path):
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, per_device_train_batch_size=32, num_generations=8,
                           max_completion_length=16, max_steps=20, learning_rate=6e-3)
    trainer.train()
    rewards = logged(trainer.state.log_history, "reward")
    assert len(rewards) == 20
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.15, rewards


def test_reward_functions_get_trl_keyword_arguments_with_dataset_columns(tiny_checkpoints, tokenizer, tmp_path):
    seen = {}

    def recording_reward(prompts, completions, completion_ids, trainer_state, target, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, target=target,
                    state=trainer_state, extra=sorted(kwargs))
        return [float(len(ids)) for ids in completion_ids]

    dataset = [{"prompt": p, "target": index} for index, p in enumerate(PROMPTS)]
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=[recording_reward], dataset=dataset,
                           max_steps=1, shuffle_dataset=False)
    trainer.train()
    assert seen["prompts"] == [p for p in PROMPTS[:2] for _ in range(4)]
    assert seen["target"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert seen["state"] is trainer.state and {"log_metric", "log_extra"} <= set(seen["extra"])
    assert all(isinstance(c, str) for c in seen["completions"])
    assert seen["completions"] == tokenizer.batch_decode(seen["completion_ids"], skip_special_tokens=True)
    assert all(0 < len(ids) <= 12 for ids in seen["completion_ids"])
    assert logged(trainer.state.log_history, "rewards/recording_reward/mean") == [pytest.approx(np.mean(
        [len(ids) for ids in seen["completion_ids"]]))]


def test_conversational_prompts_use_the_chat_template_and_get_assistant_messages(tiny_checkpoints, tokenizer,
                                                                                  tmp_path):
    tokenizer.chat_template = CHAT_TEMPLATE
    seen = {}

    def reward(completions, **kwargs):
        seen["completions"] = completions
        return [1.0] * len(completions)

    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=reward,
                           dataset=[{"prompt": m} for m in messages], max_steps=1)
    expected = tokenizer.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert trainer.train_dataset[0]["prompt_ids"] == list(expected)
    assert expected.count(tokenizer.bos_token_id) == 1  # the template's own BOS, not doubled
    trainer.train()
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen["completions"])


def test_async_rewards_none_rewards_and_reward_weights(tiny_checkpoints, tokenizer, tmp_path):
    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def sometimes_none(completions, **kwargs):
        return [None if index % 2 else 2.0 for index in range(len(completions))]

    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=[async_reward, sometimes_none],
                           reward_weights=[1.0, 0.5], max_steps=1)
    trainer.train()
    assert logged(trainer.state.log_history, "rewards/async_reward/mean") == [1.0]
    assert logged(trainer.state.log_history, "rewards/sometimes_none/mean") == [2.0]
    # the nansum of the weighted rewards
    assert logged(trainer.state.log_history, "reward") == [pytest.approx((8 * 1.0 + 4 * 1.0) / 8)]


def test_later_steps_of_a_generation_batch_use_the_old_policy_log_probs(tiny_checkpoints, tokenizer, tmp_path):
    on_policy = make_trainer(tiny_checkpoints, tokenizer, tmp_path / "a", max_steps=1)
    on_policy.train()
    assert "old_logps" not in on_policy._last_rollout  # ratio is exactly 1, as TRL's shortcut

    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path / "b", max_steps=1, steps_per_generation=2,
                           learning_rate=1e-2)
    trainer.train()
    rollout = trainer._last_rollout
    current = trainer._log_probs(rollout, lora_runtime.EVAL, trainer._module)
    mask = rollout["completion_mask"].astype(bool)
    ratio = np.exp(current - rollout["old_logps"])[mask]
    assert np.abs(ratio - 1.0).max() > 1e-3  # the second step of this generation batch is off-policy


def test_kl_to_the_reference_is_zero_first_then_grows_with_lora_and_full_models(tiny_checkpoints, tokenizer,
                                                                                 tmp_path):
    for name, peft_config in (("lora", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")), ("full", None)):
        trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                              args=config(tmp_path / name, beta=0.1, max_steps=3, learning_rate=1e-2),
                              train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                              peft_config=peft_config)
        trainer.train()
        kl = logged(trainer.state.log_history, "kl")
        assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-5, (name, kl)


def test_evaluate_reports_rewards_of_sampled_completions(tiny_checkpoints, tokenizer, tmp_path):
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                          args=config(tmp_path), train_dataset=[{"prompt": p} for p in PROMPTS],
                          eval_dataset=[{"prompt": p} for p in PROMPTS[:4]], processing_class=tokenizer)
    metrics = trainer.evaluate()
    # length_reward is at most 0 and at least that of the longest text 12 tokens can decode to.
    longest = 12 * max(len(tokenizer.decode([token])) for token in range(len(tokenizer)))
    assert -abs(longest - 20) / 20 <= metrics["eval_reward"] <= 0.0 and metrics["eval_completions/mean_length"] > 0
    assert metrics["eval_rewards/length_reward/mean"] == pytest.approx(metrics["eval_reward"])


def test_two_eval_datasets_report_each_under_its_name_as_evaluating_each_alone(tiny_checkpoints, tokenizer,
                                                                               tmp_path):
    first, second = [{"prompt": p} for p in PROMPTS[:4]], [{"prompt": p} for p in PROMPTS[4:]]
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                          args=config(tmp_path), train_dataset=[{"prompt": p} for p in PROMPTS],
                          eval_dataset={"first": first, "second": second}, processing_class=tokenizer)
    both = trainer.evaluate()
    alone = {name: trainer.evaluate(eval_dataset=rows) for name, rows in (("first", first), ("second", second))}
    for name in ("first", "second"):
        assert both[f"eval_{name}_reward"] == pytest.approx(alone[name]["eval_reward"], rel=1e-6)
        assert both[f"eval_{name}_completions/mean_length"] == alone[name]["eval_completions/mean_length"]
    # A name picks one of the trainer's datasets; the prefix stays "eval", as in transformers.
    assert trainer.evaluate(eval_dataset="second")["eval_reward"] == both["eval_second_reward"]


def test_a_second_generation_batch_adds_no_trace(tiny_checkpoints, tokenizer, tmp_path):
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, max_steps=1)
    trainer.train()
    generate, train = tracing.TRACE_COUNTS["generate"], tracing.TRACE_COUNTS["train_step"]
    again = make_trainer(tiny_checkpoints, tokenizer, tmp_path, max_steps=3)
    again.train()
    assert tracing.TRACE_COUNTS["generate"] == generate
    assert tracing.TRACE_COUNTS["train_step"] - train == 1  # a new trainer compiles its step once


def test_log_completions_prints_prompts_completions_and_rewards(tiny_checkpoints, tokenizer, tmp_path, capsys):
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, max_steps=1, log_completions=True,
                           num_completions_to_print=3)
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  '")]
    assert len(printed) == 3


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"reward_funcs": lambda completions: [0.0] * len(completions)}, TypeError, "must accept \\*\\*kwargs"),
    # A reward model id is loaded (tests/test_reward_models.py); offline, a missing one names the fix.
    ({"reward_funcs": "OpenAssistant/reward-model"}, OSError, "Hugging Face Hub is offline"),
    ({"reward_funcs": None}, ValueError, "No reward source provided"),
    ({"dataset": [{"question": "q"}] * 8}, ValueError, "no 'prompt' column \\(found \\['question'\\]\\)"),
    ({"generation_kwargs": {"num_beams": 4}}, ValueError, "generation_kwargs \\['num_beams'\\]"),
    ({"reward_weights": [1.0, 2.0]}, ValueError, "reward_weights has 2 entries"),
])
def test_bad_inputs_are_refused_with_clear_messages(tiny_checkpoints, tokenizer, tmp_path, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        make_trainer(tiny_checkpoints, tokenizer, tmp_path, **kwargs)


def test_a_reward_of_the_wrong_length_is_refused(tiny_checkpoints, tokenizer, tmp_path):
    trainer = make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=lambda completions, **kw: [1.0])
    with pytest.raises(ValueError, match="returned 1 values for 8 completions"):
        trainer.train()


def test_remove_unused_columns_keeps_only_the_prompt_for_rewards(tiny_checkpoints, tokenizer, tmp_path):
    seen = {}

    def reward(completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    dataset = [{"prompt": p, "target": 1} for p in PROMPTS]
    make_trainer(tiny_checkpoints, tokenizer, tmp_path, reward_funcs=reward, dataset=dataset, max_steps=1,
                 remove_unused_columns=True).train()
    assert "target" not in seen and "prompts" in seen


def test_pad_to_multiple_of_widens_prompts_and_completions_without_changing_the_losses(tiny_checkpoints, tokenizer,
                                                                                      tmp_path):
    plain = make_trainer(tiny_checkpoints, tokenizer, tmp_path / "plain", max_steps=2)
    plain.train()
    padded = make_trainer(tiny_checkpoints, tokenizer, tmp_path / "padded", max_steps=2, pad_to_multiple_of=24)
    padded.train()
    rollout = padded._last_rollout
    assert rollout["completion_mask"].shape[1] == 24 and rollout["input_ids"].shape[1] % 24 == 0
    assert rollout["input_ids"].shape[1] > plain._last_rollout["input_ids"].shape[1]
    assert rollout["completion_mask"].sum() == plain._last_rollout["completion_mask"].sum()
    np.testing.assert_allclose(logged(padded.state.log_history, "loss"), logged(plain.state.log_history, "loss"),
                               rtol=1e-5, atol=1e-7)


def scripted(completion_ids, **extra):
    """A ``rollout_func`` returning ``completion_ids`` for every prompt, with ``extra`` fields."""

    def rollout(prompts, trainer):
        return {"prompt_ids": [trainer.processing_class(p)["input_ids"] for p in prompts],
                "completion_ids": [list(completion_ids)] * len(prompts), "logprobs": None, **extra}

    return rollout


def test_rollout_func_replaces_the_sampler_and_its_extra_fields_reach_the_rewards(tiny_checkpoints, tokenizer,
                                                                                  tmp_path):
    seen = {}

    def reward(completion_ids, source, **kwargs):
        seen.update(completion_ids=completion_ids, source=source)
        return [0.0] * len(completion_ids)

    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=reward, args=config(tmp_path),
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                          rollout_func=scripted([5, 6, 7, 2], source="scripted"))
    trainer.train()
    assert seen["completion_ids"] == [[5, 6, 7, 2]] * 8 and seen["source"] == ["scripted"] * 8
    assert logged(trainer.state.log_history, "completions/clipped_ratio") == [0.0, 0.0]  # each ends with EOS


@pytest.mark.parametrize(("rollout", "needle"), [
    (lambda prompts, trainer: {"prompt_ids": [], "completion_ids": []}, "must return keys \\['logprobs'\\]"),
    (scripted(list(range(3, 20))), "completion of 17 tokens, longer than max_completion_length=12"),
    (lambda prompts, trainer: {"prompt_ids": [[3]], "completion_ids": [[4]], "logprobs": None},
     "returned 1 prompt_ids for 8 prompts"),
])
def test_a_bad_rollout_func_result_is_refused(tiny_checkpoints, tokenizer, tmp_path, rollout, needle):
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                          args=config(tmp_path), train_dataset=[{"prompt": p} for p in PROMPTS],
                          processing_class=tokenizer, rollout_func=rollout)
    with pytest.raises(ValueError, match=needle):
        trainer.train()


def test_a_dataset_train_dataset_stays_a_dataset_with_its_columns(tiny_checkpoints, tokenizer, tmp_path):
    import datasets

    data = datasets.Dataset.from_list([{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)])
    trainer = GRPOTrainer(model=str(tiny_checkpoints.path("qwen2")), reward_funcs=length_reward,
                          args=config(tmp_path, max_steps=1), train_dataset=data, processing_class=tokenizer)
    assert isinstance(trainer.train_dataset, datasets.Dataset)
    assert trainer.train_dataset.column_names == ["prompt", "answer", "prompt_ids"]
    assert trainer.train_dataset["answer"] == data["answer"]
    assert trainer.train_dataset[0]["prompt_ids"] == tokenizer(PROMPTS[0])["input_ids"]
    trainer.train()
