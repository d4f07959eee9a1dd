"""SFT with LoRA, TRL's way: ``SFTTrainer(model=..., peft_config=LoraConfig(...))`` trains only the adapter on
prompt/completion rows (worked answers of the arithmetic task in ``countdown.py``), ``save_model`` writes a PEFT
adapter, and ``PeftModel.from_pretrained`` loads it back onto a fresh base with the same outputs.

On the embedded default the base weights are random and the (tied) embeddings stay frozen, so the logits stay small:
the adapter learns to pick the right tokens long before the loss gets low.

    python examples/sft_lora.py [--model Qwen/Qwen2.5-0.5B] [--max-steps 300] [--out DIR]
"""

from __future__ import annotations

from typing import Any

import countdown
from embedded import ExampleParser, logged, max_logit_difference, trainer_settings, workspace

import torchlike
from torchlike.peft import LoraConfig, PeftModel
from torchlike.trl import SFTConfig, SFTTrainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=300, learning_rates=(3e-3, 1e-4)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        problems = countdown.make_problems(4000, seed=10)
        evaluation = countdown.make_problems(128, seed=99)
        config = SFTConfig(output_dir=str(out / "adapter"), max_length=48, per_device_train_batch_size=32,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = SFTTrainer(model=source, args=config, train_dataset=countdown.sft_examples(problems),
                             processing_class=tokenizer,
                             peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainable, total = trainer.model.get_nb_trainable_parameters()
        accuracy_before = countdown.greedy_accuracy(trainer.model, tokenizer, evaluation)
        trainer.train()
        accuracy_after = countdown.greedy_accuracy(trainer.model, tokenizer, evaluation)
        trainer.save_model()
        adapter_files = sorted(path.name for path in (out / "adapter").iterdir())

        reloaded = PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32"),
                                             out / "adapter")
        batch = tokenizer([p["prompt"] for p in evaluation[:8]], return_tensors="pt", padding=True)
        reload_difference = max_logit_difference(trainer.model, reloaded, batch)
        samples = countdown.solve_greedily(reloaded, tokenizer, evaluation[:3])

    losses = logged(trainer, "loss")
    print("\nsummary")
    print(f"  model                {source}")
    print(f"  LoRA                 r=16 on all linear layers: {trainable:,} trainable of {total:,} parameters")
    print(f"  SFT                  {args.max_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"  correct (greedy)     {accuracy_before:.3f} -> {accuracy_after:.3f}   ({len(evaluation)} problems)")
    print(f"  adapter              {out / 'adapter'} -> {adapter_files}")
    print(f"  reloaded adapter     max |Δ logits| {reload_difference:.2e} against the trained model")
    for problem, completion in zip(evaluation, samples, strict=False):
        print(f"  {problem['prompt']!r} -> {completion!r}")
    return {"losses": losses, "trainable_parameters": trainable, "total_parameters": total,
            "accuracy_before": accuracy_before, "accuracy_after": accuracy_after, "adapter_files": adapter_files,
            "reload_max_abs_diff": reload_difference, "samples": samples}


if __name__ == "__main__":
    main()
