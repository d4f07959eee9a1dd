"""``torchlike sdft``: SDFT from the command line, as TRL's ``examples/scripts/sdft.py`` runs
``trl.experimental.sdft`` (TRL 1.16's ``trl`` command has no ``sdft``).

Each row needs a ``prompt`` and either a privileged context (``--privileged_context_column``) or a demonstration
(``--golden_response_column``), which ``--demonstration_template`` turns into the privileged context (``$output_text``
the demonstration, ``$orig_content`` the prompt's text), as TRL's script does. ``--dataset_path`` loads a
``save_to_disk`` folder instead of ``--dataset_name``. With an ``eval_strategy`` and a test split that has those
columns, the test split is evaluated after training (``eval_results.json``), and ``--eval_num_prompts`` completions
are logged during evaluation (``LogCompletionsCallback``). A test split with a ``golden_answer`` column (ReAct-style
``Action`` / ``Action_Input``) is also scored before and after training with greedy completions, as the script's
tool-use evaluation: ``tool_eval_before/*``, ``tool_eval_after/*`` and ``tool_eval_delta/*``.

Example:
    ```bash
    torchlike sdft --model_name_or_path Qwen/Qwen3.5-0.8B --dataset_name your-org/your-dataset \\
        --output_dir outputs/sdft --per_device_train_batch_size 1 --gradient_accumulation_steps 16 \\
        --teacher_model_kind ema --teacher_update_rate 0.01
    ```
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from string import Template
from typing import TYPE_CHECKING, Any

from torchlike.trl.experimental.sdft.sdft_config import SDFTConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

if TYPE_CHECKING:
    from datasets import Dataset

    from torchlike.trl.experimental.sdft.sdft_trainer import SDFTTrainer

#: The script's default ``--demonstration_template``.
DEFAULT_DEMONSTRATION_TEMPLATE = "Example response: $output_text"


@dataclass
class SDFTScriptArguments(ScriptArguments):
    """TRL's SDFT script arguments: where the privileged context comes from and the tool-use evaluation's size.

    Args:
        dataset_path: a ``save_to_disk`` folder, loaded instead of ``dataset_name``.
        privileged_context_column: the column holding the privileged context.
        golden_response_column: the column of demonstrations the privileged context is built from otherwise.
        eval_num_prompts: completions logged per evaluation (0: none).
        demonstration_template: ``string.Template`` of the privileged context built from a demonstration.
        tool_eval_num_examples: test rows the tool-use evaluation scores (default all).
        tool_eval_max_new_tokens: the tool-use evaluation's completion length.
    """

    dataset_path: str | None = field(
        default=None,
        metadata={"help": "Optional local dataset path to load with `load_from_disk`. Overrides `dataset_name`."})
    privileged_context_column: str = field(
        default="privileged_context", metadata={"help": "Column containing precomputed privileged context for SDFT."})
    golden_response_column: str = field(
        default="golden_response",
        metadata={"help": "Column containing demonstration responses used to build privileged context."})
    eval_num_prompts: int | None = field(
        default=8,
        metadata={"help": "Number of prompts to log during evaluation. Set to 0 to disable completion logging."})
    demonstration_template: str = field(
        default=DEFAULT_DEMONSTRATION_TEMPLATE,
        metadata={"help": "Template used to build privileged context from demonstration content."})
    tool_eval_num_examples: int | None = field(
        default=None,
        metadata={"help": "Optional number of eval examples to score for tool-use metrics. Defaults to the full eval "
                          "split."})
    tool_eval_max_new_tokens: int = field(
        default=256, metadata={"help": "Maximum completion length for task evaluation generation."})


def make_parser(prog: str | None = None) -> TrlParser:
    """The SDFT script's parser: ``SDFTScriptArguments``, ``SDFTConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((SDFTScriptArguments, SDFTConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt's text: itself, or the last user message's text of a conversation."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, list):
                return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
            return content
    return str(prompt)


def response_text(response: Any) -> str:  # Any: a demonstration as the dataset holds it
    """A demonstration as text (a list of them one per line)."""
    if isinstance(response, list):
        return "\n".join(response_text(item) for item in response)
    return response if isinstance(response, str) else str(response)


def with_privileged_context(example: dict, script_args: SDFTScriptArguments) -> dict:
    """``{"prompt", "privileged_context"}`` of a row, as TRL's script builds it: the privileged-context column, else
    the demonstration through the template.

    Raises:
        ValueError: neither column (TRL's words; a ``teacher_prompt`` column is named as the old format).
    """
    context = example.get(script_args.privileged_context_column)
    if context is None:
        if script_args.golden_response_column in example:
            context = Template(script_args.demonstration_template).safe_substitute(
                orig_content=prompt_text(example["prompt"]),
                output_text=response_text(example[script_args.golden_response_column]))
        elif "teacher_prompt" in example:
            raise ValueError("Datasets for `trl.experimental.sdft` should provide `privileged_context` or "
                             "`golden_response`, not `teacher_prompt`.")
        else:
            raise ValueError("Dataset must contain either `privileged_context` or `golden_response` alongside "
                             "`prompt`.")
    return {"prompt": example["prompt"], "privileged_context": context}


def prepared_split(dataset: Dataset, script_args: SDFTScriptArguments) -> Dataset:
    """A split with only ``prompt`` and ``privileged_context`` (:func:`with_privileged_context`)."""
    return dataset.map(lambda example: with_privileged_context(example, script_args),
                       remove_columns=dataset.column_names)


def action_and_input(text: str) -> tuple[str | None, str | None]:
    """The ``Action:`` and ``Action Input:`` of a ReAct-style completion."""
    action = re.search(r"Action:\s*([^\n]+)", text)
    action_input = re.search(r"Action Input:\s*(.*)", text, flags=re.DOTALL)
    return (action.group(1).strip() if action else None, action_input.group(1).strip() if action_input else None)


def parsed_json(text: str | None) -> tuple[bool, Any]:  # Any: whatever the JSON holds
    """``(valid, value)`` of a JSON object in ``text`` (a fenced code block allowed)."""
    if text is None:
        return False, None
    text = text.strip()
    if text.startswith("```"):
        text = re.sub(r"\s*```$", "", re.sub(r"^```(?:json)?\s*", "", text))
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def tool_use_metrics(trainer: SDFTTrainer, dataset: Dataset, max_new_tokens: int, num_examples: int | None,
                     prefix: str) -> dict[str, float]:
    """The script's tool-use evaluation: greedy completions of the split's prompts (rendered, truncated to
    ``max_prompt_length``), scored against each row's first ``golden_answer``: the rates of an ``Action`` present,
    of a JSON ``Action Input``, of the right action and of the right action with the right input; the first 20
    records go to ``output_dir/<prefix>_samples.json``."""
    from torchlike.trl.data_utils import maybe_apply_chat_template

    if num_examples is not None:
        dataset = dataset.select(range(min(num_examples, len(dataset))))
    tokenizer = trainer.processing_class
    texts = [maybe_apply_chat_template({"prompt": prompt}, tokenizer)["prompt"] for prompt in dataset["prompt"]]
    # TRL's script tokenises as its tokenizer truncates (max_prompt_length), left-padded.
    inputs = tokenizer(text=texts, return_tensors="np", padding=True, padding_side="left", truncation=True,
                       max_length=trainer.max_prompt_length, add_special_tokens=False)
    generated = trainer.model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completions = tokenizer.batch_decode([row[inputs["input_ids"].shape[1]:] for row in generated],
                                         skip_special_tokens=True)
    counts, records = dict.fromkeys(("present", "json", "action", "full"), 0), []
    for example, completion in zip(dataset, completions, strict=True):
        action, input_text = action_and_input(completion)
        valid, action_input = parsed_json(input_text)
        answers = example.get("golden_answer") or [{}]
        gold_action = answers[0].get("Action")
        gold_valid, gold_input = parsed_json(answers[0].get("Action_Input"))
        gold_input = gold_input if gold_valid else answers[0].get("Action_Input")
        right_action = gold_action is not None and action == gold_action
        full = right_action and valid and action_input == gold_input
        counts["present"] += action is not None
        counts["json"] += valid
        counts["action"] += right_action
        counts["full"] += full
        records.append({"prompt": prompt_text(example["prompt"]), "completion": completion, "pred_action": action,
                        "pred_action_input_text": input_text, "gold_action": gold_action,
                        "gold_action_input": gold_input, "action_correct": right_action, "json_valid": valid,
                        "full_match": full})
    total = max(len(dataset), 1)
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(os.path.join(trainer.args.output_dir, f"{prefix}_samples.json"), "w") as file:
        json.dump(records[:20], file, indent=2)
    return {f"{prefix}/action_present_rate": counts["present"] / total, f"{prefix}/valid_json_rate": counts["json"] /
            total, f"{prefix}/action_accuracy": counts["action"] / total,
            f"{prefix}/tool_call_accuracy": counts["full"] / total}


def main(script_args: SDFTScriptArguments, training_args: SDFTConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> SDFTTrainer:
    """Train with ``SDFTTrainer`` as TRL's script does (the tool-use evaluation before and after, the final evaluation)
    and save the model to ``output_dir``; returns the trainer."""
    import datasets

    from torchlike import AutoTokenizer
    from torchlike.trl.experimental.sdft.sdft_trainer import SDFTTrainer
    from torchlike.trl.script_utils import get_peft_config
    from torchlike.trl.scripts.common import load_script_dataset
    from torchlike.trl.trainer.callbacks import LogCompletionsCallback

    if model_args.model_name_or_path is None:
        raise ValueError("`model_name_or_path` is required.")
    training_args.model_init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype,
                                       "attn_implementation": model_args.attn_implementation,
                                       **(training_args.model_init_kwargs or {})}
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = (datasets.load_from_disk(script_args.dataset_path) if script_args.dataset_path is not None
               else load_script_dataset(script_args, dataset_args))
    if not isinstance(dataset, datasets.DatasetDict):
        raise ValueError("SDFT example expects a dataset with named splits.")
    train_dataset = prepared_split(dataset[script_args.dataset_train_split], script_args)
    raw_eval = dataset.get(script_args.dataset_test_split)
    eval_dataset = None
    preparable = raw_eval is not None and "prompt" in raw_eval.column_names and (
        script_args.privileged_context_column in raw_eval.column_names
        or script_args.golden_response_column in raw_eval.column_names)
    if training_args.eval_strategy != "no" and preparable:
        eval_dataset = prepared_split(raw_eval, script_args)
    trainer = SDFTTrainer(model=model_args.model_name_or_path, args=training_args, train_dataset=train_dataset,
                          eval_dataset=eval_dataset, processing_class=tokenizer,
                          peft_config=get_peft_config(model_args))
    if eval_dataset is not None and script_args.eval_num_prompts:
        from transformers import GenerationConfig

        generation_config = GenerationConfig(max_new_tokens=training_args.max_completion_length, do_sample=True,
                                             temperature=training_args.temperature)
        trainer.add_callback(LogCompletionsCallback(trainer, generation_config,
                                                    num_prompts=script_args.eval_num_prompts))
    scored = raw_eval is not None and "golden_answer" in raw_eval.column_names
    before = None
    if scored:
        before = tool_use_metrics(trainer, raw_eval, script_args.tool_eval_max_new_tokens,
                                  script_args.tool_eval_num_examples, "tool_eval_before")
        trainer.log(dict(before))
        trainer.log_metrics("eval", before)
        trainer.save_metrics("eval", before)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if scored:
        after = tool_use_metrics(trainer, raw_eval, script_args.tool_eval_max_new_tokens,
                                 script_args.tool_eval_num_examples, "tool_eval_after")
        for key, value in before.items():
            after_key = key.replace("tool_eval_before/", "tool_eval_after/")
            after[after_key.replace("tool_eval_after/", "tool_eval_delta/")] = after[after_key] - value
        trainer.log(dict(after))
        trainer.log_metrics("eval", after)
        trainer.save_metrics("eval", after)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name or script_args.dataset_path)
    trainer.end()
    return trainer


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
