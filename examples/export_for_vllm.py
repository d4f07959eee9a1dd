"""Export for vLLM, both ways: after LoRA fine-tuning, ``merge_and_unload().save_pretrained(...)`` writes a plain
Hugging Face checkpoint (``vllm serve DIR``), and ``save_pretrained`` on the adapted model writes a PEFT adapter
(``vllm serve BASE --enable-lora --lora-modules NAME=DIR``). Both are checked by loading them with ``transformers``
(and ``peft``, when installed) and comparing logits and greedy generations with torchlike's.

    python examples/export_for_vllm.py [--model Qwen/Qwen2.5-0.5B] [--max-steps 50] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import countdown
from embedded import ExampleParser, max_logit_difference, trainer_settings, workspace

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import SFTConfig, SFTTrainer


def compare_with_transformers(model: Any, reference: Any, tokenizer: Any, problems: list[dict]) -> dict[str, Any]:
    """Greedy answers and logits of a torchlike ``model`` against a ``transformers`` (or ``peft``) ``reference``
    on the problems' prompts: ``{"same_generations", "generations", "max_abs_logit_diff"}``."""
    ours = countdown.solve_greedily(model, tokenizer, problems)
    theirs = countdown.solve_greedily(reference, tokenizer, problems)
    batch = tokenizer([p["prompt"] for p in problems], return_tensors="pt", padding=True)
    return {"same_generations": sum(a == b for a, b in zip(ours, theirs, strict=True)), "generations": ours,
            "max_abs_logit_diff": max_logit_difference(model, reference.eval(), batch)}


def export(peft_model: Any, tokenizer: Any, out: Path) -> tuple[Any, Path, Path]:
    """Writes ``out/adapter`` (PEFT) and ``out/merged`` (full HF weights); returns ``(merged model, adapter dir,
    merged dir)``."""
    peft_model.save_pretrained(out / "adapter", tokenizer=tokenizer)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out / "merged", tokenizer=tokenizer)
    return merged, out / "adapter", out / "merged"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=50, learning_rates=(3e-3, 1e-4)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        import torch
        import transformers

        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        config = SFTConfig(output_dir=str(out / "sft"), max_length=48, per_device_train_batch_size=32,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = SFTTrainer(model=source, args=config, processing_class=tokenizer,
                             train_dataset=countdown.sft_examples(countdown.make_problems(2000, seed=10)),
                             peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainer.train()
        merged, adapter_dir, merged_dir = export(trainer.model, tokenizer, out)
        problems = countdown.make_problems(8, seed=99)

        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        merged_check = compare_with_transformers(merged, hf_merged, tokenizer, problems)
        try:
            import peft
        except ImportError:
            adapter_check = None
        else:
            hf_base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            hf_adapted = peft.PeftModel.from_pretrained(hf_base, adapter_dir)
            adapter_check = compare_with_transformers(trainer.model, hf_adapted, tokenizer, problems)
        files = {name: sorted(path.name for path in folder.iterdir())
                 for name, folder in (("adapter", adapter_dir), ("merged", merged_dir))}

    print("\nsummary")
    print(f"  model                {source}, LoRA r=16 trained {args.max_steps} steps")
    print(f"  merged               {merged_dir} -> {files['merged']}")
    print(f"  adapter              {adapter_dir} -> {files['adapter']}")
    print(f"  transformers(merged) same greedy answers {merged_check['same_generations']}/{len(problems)}, "
          f"max |Δ logits| {merged_check['max_abs_logit_diff']:.2e}")
    if adapter_check is None:
        print("  peft(adapter)        not checked: pip install peft to load the adapter with peft")
    else:
        print(f"  peft(adapter)        same greedy answers {adapter_check['same_generations']}/{len(problems)}, "
              f"max |Δ logits| {adapter_check['max_abs_logit_diff']:.2e}")
    print(f"  e.g.                 {problems[0]['prompt']!r} -> {merged_check['generations'][0]!r}")
    print(f"  serve merged         vllm serve {merged_dir}")
    print(f"  serve adapter        vllm serve {source} --enable-lora --lora-modules countdown={adapter_dir}")
    if args.out is None:
        print("  (written to a temporary directory, now removed: pass --out DIR to keep the exports)")
    return {"files": files, "merged": merged_check, "adapter": adapter_check, "problems": len(problems)}


if __name__ == "__main__":
    main()
