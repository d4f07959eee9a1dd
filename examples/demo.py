"""torchlike end to end on an embedded default: load a Hugging Face checkpoint into JAX, score text,
save it back in HF format and reload the export with transformers.

With no arguments it builds a tiny random Qwen2 and a tokenizer on the spot (no downloads).
Pass ``--model DIR_OR_HUB_ID`` to run the same steps on a real checkpoint.

    python examples/demo.py [--model Qwen/Qwen2.5-0.5B] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import torchlike

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny test"]


def build_embedded_default(directory: Path) -> Path:
    """Writes a tiny random Qwen2 (hidden 64, 2 layers) and a freshly trained BPE tokenizer to ``directory``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 50, trainer)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                        unk_token="<unk>", pad_token="<pad>")
    config = transformers.Qwen2Config(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    return directory


def sequence_log_likelihood(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sum of log p(token_t | tokens_<t) over the real tokens of each row."""
    logits = logits.astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(log_probs[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    return (picked * mask[:, 1:]).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory or hub id (default: a tiny model built here)")
    parser.add_argument("--out", help="where to write the HF export (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        source = args.model or build_embedded_default(Path(scratch) / "tiny-qwen2")
        out = Path(args.out or Path(scratch) / "export")

        start = time.perf_counter()
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        model = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        load_seconds = time.perf_counter() - start
        print(model)

        batch = tokenizer(TEXTS, padding=True, return_tensors="np")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        scores = sequence_log_likelihood(np.asarray(model(ids, attention_mask=mask).logits), ids, mask)

        model.save_pretrained(out, tokenizer=tokenizer)

        import torch
        import transformers

        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            position_ids = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
            reference = reloaded(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                 position_ids=position_ids).logits.numpy()
        reference_scores = sequence_log_likelihood(reference, ids, mask)

        print("\nsummary")
        print(f"  model             {source} ({model.num_parameters():,} parameters, {model.dtype})")
        print(f"  load into JAX     {load_seconds:.2f} s")
        for text, ours, theirs in zip(TEXTS, scores, reference_scores, strict=True):
            print(f"  log p({text[:24]!r}...)  torchlike {ours:9.4f}   transformers(export) {theirs:9.4f}")
        difference = float(np.abs(scores - reference_scores).max())
        print(f"  export            {out} -> {sorted(p.name for p in out.iterdir())}")
        print(f"  max |Δ log p|     {difference:.2e}  ({'OK' if difference < 1e-3 else 'MISMATCH'})")
        if difference >= 1e-3:
            raise SystemExit("the transformers reload of the export disagrees with torchlike")


if __name__ == "__main__":
    main()
