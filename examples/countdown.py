"""The verifiable arithmetic task the examples train on, in the spirit of TinyZero's countdown: given some numbers
and a target, write an equation that uses each number once and equals the target, as ``<answer>3*5-2</answer>``.

Problems, their prompts, worked answers (SFT), preference pairs (DPO) and the two reward functions (GRPO) live
here. Answers are checked by parsing them with ``ast`` and evaluating only numbers, ``+ - * /`` and parentheses
with exact fractions: no code from a completion is ever run.
"""

from __future__ import annotations

import ast
import itertools
import operator
import random
import re
from fractions import Fraction
from typing import Any

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ONLY_ANSWER = re.compile(r"\s*<answer>[^<]*</answer>\s*")


def make_problems(count: int, numbers_per_problem: int = 2, largest: int = 9, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` solvable problems ``{"prompt", "numbers", "target", "solution"}``.

    Each is built backwards from a random equation over ``numbers_per_problem`` numbers in ``[1, largest]``
    joined left to right by ``+ - *``, so at least one answer (``solution``) exists.
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        numbers = [rng.randint(1, largest) for _ in range(numbers_per_problem)]
        solution = str(numbers[0])
        for number in numbers[1:]:
            solution = f"{solution}{rng.choice('+-*')}{number}"
        target = evaluate(solution)
        problems.append({"prompt": prompt_for(numbers, target), "numbers": numbers, "target": int(target),
                         "solution": solution})
    return problems


def prompt_for(numbers: list[int], target: int) -> str:
    """The question text, e.g. ``Using the numbers [3, 5], make 8.``"""
    return f"Using the numbers {numbers}, make {target}."


def answer_text(equation: str) -> str:
    """A completion that states ``equation`` as the answer."""
    return f" <answer>{equation}</answer>"


def sft_examples(problems: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Prompt/completion rows (TRL's format) whose completion is the worked solution."""
    return [{"prompt": p["prompt"], "completion": answer_text(p["solution"])} for p in problems]


def preference_pairs(problems: list[dict[str, Any]], seed: int = 0) -> list[dict[str, str]]:
    """Prompt/chosen/rejected rows (TRL's format): the solution against the same numbers joined by other
    operators that miss the target."""
    rng = random.Random(seed)
    pairs = []
    for problem in problems:
        numbers = [str(number) for number in problem["numbers"]]
        operators = list(itertools.product("+-*", repeat=len(numbers) - 1))
        rng.shuffle(operators)
        for chosen_operators in operators:
            equation = "".join(n + o for n, o in zip(numbers, chosen_operators, strict=False)) + numbers[-1]
            if evaluate(equation) != problem["target"]:
                pairs.append({"prompt": problem["prompt"], "chosen": answer_text(problem["solution"]),
                              "rejected": answer_text(equation)})
                break
    return pairs


def evaluate(expression: str) -> Fraction | None:
    """The exact value of an arithmetic expression, or ``None`` when it is anything else.

    Only integer literals, binary ``+ - * /``, unary minus and parentheses are accepted; division by zero,
    names, calls, powers and every other construct give ``None``.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not allowed in an answer: {ast.dump(node)[:40]}")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def extract_answer(completion: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, or ``None``."""
    found = ANSWER.findall(completion)
    return found[-1].strip() if found else None


def is_correct(completion: str, numbers: list[int], target: int) -> bool:
    """Whether the completion's answer uses exactly ``numbers`` (each once, any order) and equals ``target``."""
    answer = extract_answer(completion)
    if answer is None or evaluate(answer) != target:
        return False
    used = sorted(int(literal) for literal in re.findall(r"\d+", answer))
    return used == sorted(numbers)


def format_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion is one ``<answer>expression</answer>`` and nothing else, with an expression that
    evaluates; else 0. (Text after the answer is penalised, so the model learns to stop.)"""
    return [float(bool(ONLY_ANSWER.fullmatch(text)) and evaluate(extract_answer(text)) is not None)
            for text in completions]


def equation_reward(completions: list[str], numbers: list[list[int]], target: list[int], **kwargs: Any) -> list[float]:
    """1.0 when the answer uses each given number once and equals the target, else 0 (``numbers`` and
    ``target`` are the dataset columns, one entry per completion)."""
    return [float(is_correct(text, row_numbers, row_target))
            for text, row_numbers, row_target in zip(completions, numbers, target, strict=True)]


REWARD_FUNCS = [format_reward, equation_reward]
REWARD_WEIGHTS = [0.1, 1.0]
"""As TinyZero scores (0.1 for the format, 1 for a right answer): a well-formed answer earns 0.1, a right one 1.1."""


def solve_greedily(model: Any, tokenizer: Any, problems: list[dict[str, Any]], max_new_tokens: int = 16) -> list[str]:
    """The greedy completions of ``model`` (torchlike or transformers: the call is the same) for the problems'
    prompts, decoded without special tokens."""
    batch = tokenizer([p["prompt"] for p in problems], return_tensors="pt", padding=True, padding_side="left")
    sequences = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(sequences[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def greedy_accuracy(model: Any, tokenizer: Any, problems: list[dict[str, Any]], max_new_tokens: int = 16) -> float:
    """The fraction of ``problems`` that ``model``'s greedy completions solve."""
    completions = solve_greedily(model, tokenizer, problems, max_new_tokens)
    return sum(is_correct(text, p["numbers"], p["target"]) for text, p in zip(completions, problems, strict=True)) \
        / len(problems)
