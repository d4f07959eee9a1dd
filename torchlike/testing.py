"""Tiny random Hugging Face checkpoints built on the spot, for tests, examples and benchmarks (no downloads).

One home for each kind of builder:

- :func:`tiny_config`: a ``transformers`` config of a supported family, hidden 64 and 2 layers unless overridden;
- :func:`random_model`: a ``transformers`` model with random weights from a seed, ready for ``save_pretrained``;
- :func:`build_tokenizer`: a byte-level BPE tokenizer trained deterministically on a small corpus, and
  :func:`build_word_tokenizer`: one word ``t<id>`` per id, for data made of random ids.

``transformers``, ``tokenizers`` and ``torch`` are imported when a builder runs, so importing this module is cheap.

Example::

    from torchlike.testing import build_tokenizer, random_model, tiny_config

    random_model(tiny_config("llama3", num_hidden_layers=4)).save_pretrained("tiny")
    build_tokenizer("tiny")
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import transformers

VOCAB_SIZE = 128
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0 (pad), 1 (bos), 2 (eos), 3 (unk)
TOKENIZER_CORPUS = ("the quick brown fox jumps over the lazy dog", "one two three four five six seven eight nine ten",
                    "hello world, this is a tiny tokenizer for tests")

_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Per family: the config class and what sets it apart from the shared tiny shape.
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=False)),
    # Llama 3.2: Llama 3's scaled rope and tied embeddings.
    "llama32": ("LlamaConfig", dict(rope_parameters=LLAMA32_ROPE, tie_word_embeddings=True)),
    # Gemma 3 text: sliding and full attention layers taking turns, a window (8) shorter than a typical test
    # row, and a linear-scaled global rope as the 4B+ checkpoints have.
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=8, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        })),
    # Gemma 2: sliding and full attention layers taking turns (transformers' default layer_types), a window (4)
    # shorter than a typical test row, attention and final soft-caps small enough to bind on random weights, and
    # queries scaled by a query_pre_attn_scalar other than head_dim (as Gemma 2 27B is).
    "gemma2": ("Gemma2Config", dict(
        sliding_window=4, tie_word_embeddings=True, attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
        query_pre_attn_scalar=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Gemma 4 text: sliding and full attention layers taking turns, a window (8) shorter than a typical test row,
    # full layers with their own head size (32) and proportional rope on a quarter of it, a binding final soft-cap,
    # no per-layer inputs (transformers' default has them).
    "gemma4": ("Gemma4TextConfig", dict(
        sliding_window=8, tie_word_embeddings=True, global_head_dim=32, final_logit_softcapping=5.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB_SIZE,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        })),
    # Qwen3 MoE: 3 layers, the first dense (mlp_only_layers), the others 4 experts of 32 with 2 chosen per token and
    # their weights renormalised; the dense layer's MLP keeps the tiny intermediate size (128).
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        rope_theta=10000.0, tie_word_embeddings=False, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
}
FAMILIES = tuple(_FAMILIES)


def tiny_config(family: str = "qwen2", **overrides: Any) -> Any:
    """A ``transformers`` config of ``family``: the tiny shape, the family's own settings, then ``overrides``.

    The tiny shape: vocabulary 128, hidden 64, intermediate 128, 2 layers, 4 attention heads and 2 key/value heads
    of ``hidden_size // num_attention_heads``, 128 positions, pad/bos/eos ids 0/1/2 (those of
    :func:`build_tokenizer`). Gemma 3's ``query_pre_attn_scalar`` follows the head size, and Gemma 3's and Gemma
    4's ``layer_types`` alternate sliding and full attention over the layers.

    Args:
        family: one of :data:`FAMILIES` (``llama32`` is Llama 3.2: Llama 3 with its rope scaling, tied).
        overrides: any config field, e.g. ``hidden_size=256, num_hidden_layers=4`` for a larger model.

    Returns:
        A ``Qwen2Config``, ``Qwen3Config``, ``LlamaConfig``, ``Gemma2Config``, ``Gemma3TextConfig``,
        ``Gemma4TextConfig`` or ``Qwen3MoeConfig``.
    """
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"tiny_config: unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
    class_name, settings = _FAMILIES[family]
    fields = {**_SHAPE, **settings, **overrides}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if family == "gemma3":
        fields.setdefault("query_pre_attn_scalar", fields["head_dim"])
    if family in ("gemma3", "gemma4"):
        fields.setdefault("layer_types", [("sliding_attention", "full_attention")[layer % 2]
                                          for layer in range(fields["num_hidden_layers"])])
    return getattr(transformers, class_name)(**fields)


def random_model(config: transformers.PretrainedConfig, seed: int = 0, dtype: str | torch.dtype = "float32",
                 every_parameter: bool = False,
                 attn_implementation: str | None = None) -> transformers.PreTrainedModel:
    """A ``transformers`` causal LM for ``config`` with random weights, in eval mode.

    Args:
        config: a ``transformers`` config, e.g. from :func:`tiny_config`.
        seed: ``torch.manual_seed`` before ``transformers`` initialises the weights.
        dtype: the weights' dtype, a name (``"bfloat16"``) or a ``torch.dtype``.
        every_parameter: draw every parameter again from a generator seeded with ``seed``: norms
            ``1 + N(0, 0.2²)``, the rest (biases included) ``N(0, 0.08²)``, so that no weight-mapping error hides
            behind the zeros and ones ``transformers`` starts biases and norms from.
        attn_implementation: passed to ``from_config`` (``"eager"`` for reference logits; ``None``: the default).

    Returns:
        The model; ``model.save_pretrained(directory)`` writes the checkpoint.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if every_parameter:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.copy_(1.0 + 0.2 * torch.randn(parameter.shape, generator=generator))
                else:
                    parameter.copy_(0.08 * torch.randn(parameter.shape, generator=generator))
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval()


def _byte_pair_merges(words: dict[str, int], alphabet: list[str], size: int) -> tuple[list[str], list[tuple]]:
    """Byte-pair encoding trained deterministically: the most frequent pair is merged first, ties broken by the
    pair's text (the ``tokenizers`` trainer breaks ties by hash order, so its vocabulary changes from run to run)."""
    vocab, merges = list(alphabet), []
    splits = {word: list(word) for word in words}
    while len(vocab) < size:
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(splits[word], splits[word][1:], strict=False):
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


def build_tokenizer(directory: str | Path, corpus: Sequence[str] = TOKENIZER_CORPUS, vocab_size: int = VOCAB_SIZE,
                    any_text: bool = False, pad_token: str | None = None) -> Path:
    """Trains a byte-level BPE tokenizer on ``corpus`` (the same on every build) and saves it to ``directory`` as a
    ``transformers`` fast tokenizer; specials ``<pad>``, ``<s>`` (bos), ``</s>`` (eos), ``<unk>`` take ids 0-3.

    Args:
        directory: where ``tokenizer.json`` and its ``transformers`` files are written.
        corpus: the training texts.
        vocab_size: size of the vocabulary, specials included (fewer when the corpus runs out of pairs).
        any_text: start from all 256 byte symbols, so any text encodes, and decode ids back to text, as GPT-2-style
            tokenizers do. Otherwise the alphabet is the corpus's symbols plus lowercase letters, digits and common
            punctuation (a small vocabulary), and decoding gives the byte symbols themselves (``Ġ`` for a space).
        pad_token: the tokenizer's ``pad_token`` (e.g. ``"<pad>"``); ``None`` leaves it unset.

    Returns:
        ``directory``.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: dict[str, int] = {}
    for text in corpus:
        for word, _ in pre_tokenizer.pre_tokenize_str(text):
            words[word] = words.get(word, 0) + 1
    if any_text:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    else:
        extra = "".join(symbol for symbol, _ in pre_tokenizer.pre_tokenize_str(
            string.ascii_lowercase + string.digits + ",.!?:;'-"))
        alphabet = sorted(set("".join(words)) | set(extra) | {pre_tokenizer.pre_tokenize_str(" a")[0][0][0]})
    vocab, merges = _byte_pair_merges(words, alphabet, vocab_size - len(SPECIAL_TOKENS))
    tokenizer = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(vocab))},
                                     merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    if any_text:
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if pad_token is not None:  # passed as None, transformers would write "pad_token": null to the config
        specials["pad_token"] = pad_token
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    fast.save_pretrained(directory)
    return Path(directory)


def build_word_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Saves to ``directory`` a word-level tokenizer for data made of random ids: the specials take ids 0-3 as in
    :func:`build_tokenizer`, then id ``i`` is the word ``t<i>``. Text splits on whitespace and gets ``<s>``
    prepended, so every id decodes to one word and a text's ids are the same in every library.

    Returns:
        ``directory``.
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{index}": index for index in range(len(SPECIAL_TOKENS), vocab_size)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>",
                                                     bos_token="<s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    return Path(directory)
