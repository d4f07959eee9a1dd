"""DPO with LoRA, TRL's way: ``DPOTrainer(model=..., peft_config=LoraConfig(...))`` on prompt/chosen/rejected rows
(for each arithmetic problem of ``countdown.py``, the right equation against the same numbers with wrong
operators). The reference is the base model with the adapter off, so the first loss is exactly ln 2 and the
preference margin grows from 0 as the adapter learns.

    python examples/dpo.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 100] [--out DIR]
"""

from __future__ import annotations

import math
from typing import Any

import countdown
from embedded import ExampleParser, logged, trainer_settings, workspace

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import DPOConfig, DPOTrainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=100, learning_rates=(3e-3, 5e-6)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        pairs = countdown.preference_pairs(countdown.make_problems(4000, seed=10))
        config = DPOConfig(output_dir=str(out / "adapter"), max_length=48, per_device_train_batch_size=32, beta=0.1,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = DPOTrainer(model=source, args=config, train_dataset=pairs, processing_class=tokenizer,
                             peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model()
        adapter_files = sorted(path.name for path in (out / "adapter").iterdir())

    losses = logged(trainer, "loss")
    margins = logged(trainer, "rewards/margins")
    accuracies = logged(trainer, "rewards/accuracies")
    print("\nsummary")
    print(f"  model                {source}")
    print(f"  DPO                  {args.max_steps} steps of {config.per_device_train_batch_size} pairs, beta "
          f"{config.beta}, LoRA r=16, learning rate {args.learning_rate:g}")
    print(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f}   (at step 1 policy = reference: "
          f"ln 2 = {math.log(2):.4f})")
    print(f"  reward margin        {margins[0]:.4f} -> {margins[-1]:.4f}   (beta x log-ratio, chosen - rejected)")
    print(f"  preference accuracy  {accuracies[0]:.3f} -> {accuracies[-1]:.3f}")
    print(f"  adapter              {out / 'adapter'} -> {adapter_files}")
    return {"losses": losses, "margins": margins, "accuracies": accuracies, "adapter_files": adapter_files,
            "logging_steps": config.logging_steps}


if __name__ == "__main__":
    main()
