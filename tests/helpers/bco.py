"""What both sides of the BCO comparison with TRL 1.0.0 share (the child process imports it too): the unpaired
dataset and a deterministic prompt-embedding function for underlying distribution matching."""

from __future__ import annotations

from tests.helpers.data import UNPAIRED

#: KTO's comparison data (:data:`tests.helpers.data.UNPAIRED`); several completions are cut by max_length=12.
DATA = UNPAIRED

#: Evaluation data: a partial last batch (5 examples in batches of 4) and one batch without desirable examples.
EVAL_DATA = [{"prompt": "the lazy", "completion": " brown dog", "label": True},
             {"prompt": "one two three", "completion": " four", "label": False},
             {"prompt": "hello", "completion": " tiny world", "label": True},
             {"prompt": "seven eight nine", "completion": " ten", "label": False},
             {"prompt": "the quick", "completion": " fox jumps", "label": False}]


def prompt_features(input_ids, attention_mask):
    """A deterministic embedding of tokenised prompts, with TRL's ``embedding_func`` signature: torch ``[B, L]``
    ids and mask in, float32 ``[B, 3]`` out (each prompt's length, mean token id and mean of the ids' parities)."""
    import torch

    mask = attention_mask.to(torch.float32)
    length = mask.sum(-1)
    mean_id = (input_ids.to(torch.float32) * mask).sum(-1) / length / 100.0
    parity = ((input_ids % 2).to(torch.float32) * mask).sum(-1) / length
    return torch.stack([length / 4.0, mean_id, parity], dim=-1)
