"""The test cases: tiny random HF models by name (built with ``torchlike.testing``), a padded batch and padded
training examples."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from torchlike.testing import VOCAB_SIZE as VOCAB
from torchlike.testing import build_tokenizer as build_tokenizer  # the tests' tokenizer: tiny.build_tokenizer
from torchlike.testing import random_model, tiny_config

CACHE_ROOT = os.environ.get("TORCHLIKE_TEST_CACHE", os.path.join(tempfile.gettempdir(), "torchlike-test-cache"))

# gemma3: a window (8) shorter than padded_batch's rows (24), one layer of each type; gemma3_mha: Tunix fuses qkv.
# gemma2: a window of 4, both soft-caps binding, query_pre_attn_scalar != head_dim; gemma2_mha: Tunix fuses qkv.
# gemma4: a window of 8, full layers with their own head size and proportional rope; gemma4_moe: 4 experts, top 2,
# full layers whose keys are their values (one key head); gemma4_ple: per-layer inputs, one key head, and the last two
# layers sharing the keys and values of the first two, in a layer order Tunix's own sharing pattern gets wrong.
GEMMA4_PLE_LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CASES = {
    "qwen2": lambda: tiny_config("qwen2"),
    "qwen2_tied": lambda: tiny_config("qwen2", tie_word_embeddings=True),
    "qwen3": lambda: tiny_config("qwen3"),
    "qwen3_tied": lambda: tiny_config("qwen3", rope_theta=1000000.0, tie_word_embeddings=True),
    "llama3": lambda: tiny_config("llama3"),
    "llama32": lambda: tiny_config("llama32"),
    "gemma3": lambda: tiny_config("gemma3"),
    "gemma3_mha": lambda: tiny_config("gemma3", num_key_value_heads=4),
    "gemma2": lambda: tiny_config("gemma2"),
    "gemma2_mha": lambda: tiny_config("gemma2", num_key_value_heads=4),
    "gemma4": lambda: tiny_config("gemma4"),
    "gemma4_moe": lambda: tiny_config("gemma4", enable_moe_block=True, num_experts=4, top_k_experts=2,
                                      moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1),
    "gemma4_ple": lambda: tiny_config("gemma4", num_hidden_layers=4, layer_types=list(GEMMA4_PLE_LAYER_TYPES),
                                      hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                                      num_key_value_heads=1),
    "qwen3_moe": lambda: tiny_config("qwen3_moe"),
}


def build_hf_model(config, seed: int = 0, dtype=torch.float32) -> transformers.PreTrainedModel:
    """The reference model of a case: every parameter random (biases and norms too), eager attention."""
    return random_model(config, seed=seed, dtype=dtype, every_parameter=True, attn_implementation="eager")


class CheckpointFactory:
    """Builds and saves each case once per session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._built: dict[str, Path] = {}

    def path(self, case: str, dtype=torch.float32, **save_kwargs) -> Path:
        options = "".join(f"-{k}{v}" for k, v in sorted(save_kwargs.items()))
        key = f"{case}-{str(dtype).removeprefix('torch.')}{options}"
        if key not in self._built:
            model = build_hf_model(CASES[case](), dtype=dtype)
            model.save_pretrained(self.root / key, **save_kwargs)
            self._built[key] = self.root / key
        return self._built[key]


def wandering_model(case: str, path: Path):
    """A tiny ``case`` model whose weights (all but the norms) are scaled up (std 0.16) so greedy and sampled decoding
    wander instead of repeating one token, saved to ``path``: ``(transformers model, torchlike model)``, both
    float32."""
    import torchlike

    reference = build_hf_model(CASES[case](), seed=0)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" not in name:
                parameter.mul_(2.0)
    reference.save_pretrained(path)
    return reference, torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def wandering_qwen2(path: Path):
    """:func:`wandering_model` of Qwen2 with no default end token (so rows run to ``max_new_tokens`` unless a test
    passes one)."""
    reference, model = wandering_model("qwen2", path)
    reference.generation_config.eos_token_id = model.generation_config.eos_token_id = None
    return reference, model


def padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three rows of unequal length: right-padded, left-padded, full. Returns (ids, mask, position_ids)."""
    rng = np.random.default_rng(0)
    length = 24
    ids = rng.integers(3, VOCAB, size=(3, length))
    mask = np.ones((3, length), dtype=np.int64)
    mask[0, 15:] = 0  # right padding
    mask[1, :9] = 0  # left padding
    ids[mask == 0] = 0
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return ids, mask, positions


def hf_logits(model, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


EXAMPLE_LENGTH = 24


def padded_examples(count: int, seed: int = 0, full: bool = False) -> list[dict]:
    """Examples of unequal lengths, right-padded to EXAMPLE_LENGTH, loss on every real token."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(count):
        size = EXAMPLE_LENGTH if full else int(rng.integers(6, EXAMPLE_LENGTH + 1))
        ids = np.zeros(EXAMPLE_LENGTH, np.int32)
        ids[:size] = rng.integers(3, VOCAB, size)
        mask = (np.arange(EXAMPLE_LENGTH) < size).astype(np.int32)
        examples.append({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.copy()})
    return examples
