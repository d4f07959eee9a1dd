"""Tiny random HF models (hidden 64, 2 layers) and a tokenizer, built with transformers and tokenizers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

CACHE_ROOT = os.environ.get("TORCHLIKE_TEST_CACHE", os.path.join(tempfile.gettempdir(), "torchlike-test-cache"))
VOCAB = 128

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2_tied": lambda: transformers.Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3_tied": lambda: transformers.Qwen3Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True),
    "llama3": lambda: transformers.LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False),
    "llama32": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA32_ROPE, tie_word_embeddings=True),
    # Gemma 3 text: a window (8) shorter than padded_batch's rows (24), one layer of each type,
    # and a linear-scaled global rope as the 4B+ checkpoints have. gemma3_mha: Tunix fuses qkv.
    "gemma3": lambda kv_heads=2: transformers.Gemma3TextConfig(
        **{**COMMON, "num_key_value_heads": kv_heads}, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }),
    "gemma3_mha": lambda: CASES["gemma3"](kv_heads=4),
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (biases and norms too), so no mapping error can hide behind zeros or ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    return model


def build_hf_model(config, seed: int = 0, dtype=torch.float32) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model, seed)
    return model.to(dtype).eval()


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


def build_tokenizer(directory: Path) -> Path:
    """A small BPE tokenizer trained on the spot, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    corpus = ["the quick brown fox jumps over the lazy dog", "one two three four five six seven eight nine ten",
              "hello world, this is a tiny tokenizer for tests"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(directory)
    return Path(directory)


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
