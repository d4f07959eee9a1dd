"""Child process for the export crash tests: overwrite an exported checkpoint with ``save_pretrained`` and die
with SIGKILL midway.

Usage: python tests/kill_during_export.py SOURCE OUT STAGE [--tokenizer DIR] [--max-shard-size SIZE]
       [--adapter-rank R]

Loads the HF checkpoint SOURCE with torchlike and saves it to OUT (with the tokenizer in DIR, in
shards of SIZE). With ``--adapter-rank`` it saves a fresh LoRA adapter of that rank instead, after
writing the same adapter untouched to ``OUT.reference`` for the parent to compare with. STAGE is one
of ``hf_checkpoint.EXPORT_STAGES`` (the process kills itself when the save reaches it) or ``none``
(the save runs to the end; the parent may kill it from outside at any moment).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("stage")
    parser.add_argument("--tokenizer")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--adapter-rank", type=int)
    args = parser.parse_args()

    import torchlike
    from torchlike.adapters.checkpoint import hf_checkpoint
    from torchlike.peft import LoraConfig, get_peft_model

    if args.stage != "none" and args.stage not in hf_checkpoint.EXPORT_STAGES:
        raise SystemExit(f"unknown stage {args.stage!r}; expected one of {hf_checkpoint.EXPORT_STAGES}")
    model = torchlike.AutoModelForCausalLM.from_pretrained(args.source)
    tokenizer = torchlike.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    if args.adapter_rank is not None:
        model = get_peft_model(model, LoraConfig(r=args.adapter_rank, target_modules=["q_proj", "v_proj"]))
        model.save_pretrained(args.out + ".reference")
    if args.stage != "none":
        hf_checkpoint._crash_test_hook = lambda reached: _die() if reached == args.stage else None
    print("saving", flush=True)  # the parent's external kill waits for this line
    if args.adapter_rank is not None:
        model.save_pretrained(args.out, tokenizer=tokenizer)
    else:
        model.save_pretrained(args.out, max_shard_size=args.max_shard_size, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
