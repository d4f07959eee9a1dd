"""Scripted completions for step-for-step comparisons of online trainers with TRL: the same completions on both sides,
whatever each samples with."""

from __future__ import annotations

import types
import zlib

import numpy as np

from tests import tiny

#: The most tokens of a scripted completion (the comparisons' ``max_completion_length``).
MAX_NEW_TOKENS = 6


def scripted_completion(prompt_ids, *key: int) -> list[int]:
    """A fixed completion per (prompt, ``key``): 1 to MAX_NEW_TOKENS tokens, ending with EOS when shorter than the
    limit (where sampling stops), with or without it at the limit."""
    rng = np.random.default_rng([zlib.crc32(bytes(np.asarray(prompt_ids, np.uint8))), *key])
    length = int(rng.integers(1, MAX_NEW_TOKENS + 1))
    completion = rng.integers(3, tiny.VOCAB, size=length).tolist()
    if length < MAX_NEW_TOKENS or rng.random() < 0.5:
        completion[-1] = tiny.EOS
    return completion


def scripted_trl_generate(trainer):
    """TRL's self-distillation trainers' ``_generate``: a prompt's rows are consecutive (``num_generations`` of them,
    as in evaluation)."""
    def generate(prompt_ids):
        groups = trainer.num_generations
        return prompt_ids, [scripted_completion(ids, row % groups) for row, ids in enumerate(prompt_ids)]

    return generate


def scripted_turn(trainer):
    """torchlike's ``_generate_single_turn`` giving the same completions."""
    def turn(prompt_ids, seed, vision=None, worker=None):
        groups = trainer.num_generations
        return [scripted_completion(ids, row % groups) for row, ids in enumerate(prompt_ids)], None

    return turn


def scripted_hf_generate(pad_token_id: int, generations: int):
    """``model.generate`` as TRL's GOLD and IW-OPD trainers call it: the prompts followed by the scripted completions
    (row ``r`` is generation ``r % generations`` of its prompt), padded to the longest as transformers pads finished
    rows."""
    import torch

    def generate(input_ids, attention_mask, generation_config, return_dict_in_generate, **kwargs):
        completions = [scripted_completion(ids[mask.bool()].tolist(), row % generations)
                       for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True))]
        tokens = torch.full((len(completions), max(map(len, completions))), pad_token_id, dtype=input_ids.dtype)
        for row, completion in enumerate(completions):
            tokens[row, :len(completion)] = torch.tensor(completion)
        return types.SimpleNamespace(sequences=torch.cat([input_ids, tokens], dim=1))

    return generate
