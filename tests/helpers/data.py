"""The small datasets several trainers' tests train on, in TRL's dataset formats."""

from __future__ import annotations

import numpy as np

from tests import tiny

#: Preference pairs of unequal lengths (prompt, chosen, rejected), 16 rows.
PREFERENCES = [
    {"prompt": "the quick brown", "chosen": " fox jumps over the lazy dog", "rejected": " dog"},
    {"prompt": "one two", "chosen": " three four five", "rejected": " hello world, this is a tiny tokenizer"},
    {"prompt": "hello world, this is", "chosen": " a tiny tokenizer", "rejected": " one two three four"},
    {"prompt": "seven eight", "chosen": " nine ten", "rejected": " the lazy fox"},
] * 4

#: The words the random text datasets draw from.
WORDS = "the quick brown fox jumps over the lazy dog one two three four five six seven eight nine ten hello world"


def prompt_completion_data(count: int, seed: int = 0) -> list[dict]:
    """Prompts of 1-6 words and completions of 1-10 words, so every batch is padded."""
    rng = np.random.default_rng(seed)
    words = WORDS.split()
    return [{"prompt": " ".join(rng.choice(words, int(rng.integers(1, 7)))),
             "completion": " " + " ".join(rng.choice(words, int(rng.integers(1, 11))))} for _ in range(count)]

#: Three preference pairs, six times over: what the default-config runs train DPO on.
SHORT_PREFERENCES = [{"prompt": "the quick brown", "chosen": " fox jumps over the lazy dog", "rejected": " dog"},
                     {"prompt": "one two", "chosen": " three four five", "rejected": " hello world"},
                     {"prompt": "seven eight", "chosen": " nine ten", "rejected": " the lazy fox"}] * 6
#: Eight prompt-only rows: what the default-config runs train GRPO on.
PROMPT_ROWS = [{"prompt": p} for p in ("the quick brown", "one two three", "hello world", "lazy dog", "four five",
                                       "tiny test", "seven eight", "the fox")]


def length_reward(completions: list[str], **kwargs) -> list[float]:
    """A GRPO reward function: completions near 12 characters score best."""
    return [-abs(len(completion) - 12) / 12 for completion in completions]


def message(role: str, text: str) -> dict:
    """A chat message, as conversational datasets hold them."""
    return {"role": role, "content": text}

#: Unpaired preference rows (KTO's and BCO's format), in micro-batches of 4 in order: mixed, mixed, desirable only
#: (TRL records no rewards/rejected for it), mixed.
UNPAIRED = [{"prompt": "the quick brown", "completion": " fox jumps over the lazy dog", "label": True},
        {"prompt": "one two", "completion": " hello world, this is a tiny tokenizer", "label": False},
        {"prompt": "hello world, this is", "completion": " a tiny tokenizer", "label": True},
        {"prompt": "seven eight", "completion": " the lazy fox", "label": False},
        {"prompt": "one two", "completion": " three four five", "label": False},
        {"prompt": "seven eight", "completion": " nine ten", "label": True},
        {"prompt": "the quick brown", "completion": " dog", "label": False},
        {"prompt": "hello world, this is", "completion": " one two three four", "label": False},
        {"prompt": "the lazy", "completion": " dog jumps over the quick brown fox", "label": True},
        {"prompt": "one", "completion": " two three four five six", "label": True},
        {"prompt": "this is", "completion": " a tiny world", "label": True},
        {"prompt": "seven", "completion": " eight nine ten", "label": True},
        {"prompt": "the quick", "completion": " brown fox", "label": False},
        {"prompt": "hello", "completion": " world, this is a tiny tokenizer", "label": True},
        {"prompt": "three four", "completion": " five six seven eight nine ten", "label": True},
        {"prompt": "the lazy dog", "completion": " jumps", "label": False}]


#: One conversation per :data:`tests.tiny.PROMPTS` prompt: the user's prompt and an assistant answer (GKD, IW-OPD).
CONVERSATIONS = [[{"role": "user", "content": prompt},
                  {"role": "assistant", "content": ["a tiny test", "the lazy dog", "one two", "hello",
                                                    "brown fox jumps", "this is the world", "nine",
                                                    "over the lazy dog"][index % 8]}]
                 for index, prompt in enumerate(tiny.PROMPTS)]
