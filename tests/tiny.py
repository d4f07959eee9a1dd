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


TOKENIZER_CORPUS = ["the quick brown fox jumps over the lazy dog", "one two three four five six seven eight nine ten",
                    "hello world, this is a tiny tokenizer for tests"]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def _byte_pair_merges(words: dict[str, int], alphabet: list[str], size: int) -> tuple[list[str], list[tuple]]:
    """Byte-pair encoding trained deterministically: the most frequent pair is merged first, ties broken by the
    pair's text (the ``tokenizers`` trainer breaks ties by hash order, so its vocabulary changes from run to run)."""
    vocab, merges = list(alphabet), []
    splits = {word: list(word) for word in words}
    while len(vocab) < size:
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(splits[word], splits[word][1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        left, right = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append((left, right))
        vocab.append(left + right)
        for word, parts in splits.items():
            merged, index = [], 0
            while index < len(parts):
                if parts[index] == left and index + 1 < len(parts) and parts[index + 1] == right:
                    merged.append(left + right)
                    index += 2
                else:
                    merged.append(parts[index])
                    index += 1
            splits[word] = merged
    return vocab, merges


def build_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE tokenizer (the same on every build), saved as a transformers fast tokenizer."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: dict[str, int] = {}
    for text in TOKENIZER_CORPUS:
        for word, _ in pre_tokenizer.pre_tokenize_str(text):
            words[word] = words.get(word, 0) + 1
    # Byte-level symbols of the corpus plus lowercase letters, digits and common punctuation, so other short texts
    # tokenise without <unk>.
    extra = "".join(symbol for symbol, _ in pre_tokenizer.pre_tokenize_str(
        string.ascii_lowercase + string.digits + ",.!?:;'-"))
    alphabet = sorted(set("".join(words)) | set(extra) | {pre_tokenizer.pre_tokenize_str(" a")[0][0][0]})
    vocab, merges = _byte_pair_merges(words, alphabet, VOCAB - len(SPECIAL_TOKENS))
    tokenizer = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(SPECIAL_TOKENS + vocab)},
                                     merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
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
